"""Request manager service: public API, scheduling and the request state kept in Redis."""
