"""The request manager's serving loop: continuous batching of the running requests (:class:`~.live.Live`) over the
remote SSM workers and verifier replicas, through the engine core's executor; which requests run each iteration
and on which verifier replica (KV-block placement); and adaptive speculation fed with what the remote calls
report. It calls the other processes through :mod:`specinfer.request_manager.cluster` and persists committed
tokens through :mod:`specinfer.request_manager.state`.
"""
