"""SSM worker: serves ``specinfer.v1.SsmWorker``, drafting token trees with small speculative models."""
