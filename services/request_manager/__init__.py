"""Request manager service, in four parts: ``api`` (the gRPC and OpenAI-compatible HTTP front doors and admission),
``scheduling`` (the serving loop over the remote models), ``cluster`` (the clients of the SSM workers and verifier
replicas) and ``state`` (request state in Redis); ``config`` and ``__main__`` put them together."""
