"""The other processes the request manager calls: gRPC clients of the SSM workers and the LLM verifier replicas,
their discovery (plain addresses and DNS names), membership, failover and health probes, stable placement of
requests onto workers, and the caller's side of the context protocol (send only the tokens a callee lacks). It
depends on no other part of the request manager.
"""
