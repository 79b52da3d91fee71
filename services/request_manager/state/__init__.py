"""Request state: the durable records in Redis (the store, its key layout and Lua scripts, its errors, riding out a
Redis failover, an embedded ``redis-server``), the mapping between a running request and its record, the
operations on requests that span both (start, reattach, cancel, recover) and the ownership leases by which
several request managers sharing one Redis divide the requests among themselves.
"""
