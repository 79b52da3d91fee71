"""The request manager's public API: the gRPC ``specinfer.v1.SpecInfer`` servicer and the OpenAI-compatible HTTP
front door (endpoints, transport, JSON conversion, chat templates), the admission rules both share (what a request
may ask for, validated into a running request) and the output text clients receive (incremental detokenization,
stop strings). The front doors translate and validate only; the operations on requests are
:mod:`specinfer.request_manager.state`'s.
"""
