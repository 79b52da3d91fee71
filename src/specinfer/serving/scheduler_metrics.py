"""The request manager's Prometheus metrics (:class:`SchedulerMetrics`): its serving loop, the
workers and verifier replicas it calls, request-manager replicas and adaptive speculation.
Registered in the service's registry (:class:`specinfer.serving.metrics.ServiceMetrics`); names and
buckets as in :mod:`specinfer.serving.metrics`, docs/metrics.md lists them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specinfer.serving.metrics import ACCEPTED_BUCKETS, BATCH_BUCKETS, ERROR_BUCKETS, LATENCY_BUCKETS, TREE_BUCKETS


class SchedulerMetrics:
    """The request manager's serving loop: requests, tokens, steps, batches, queue."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._add_serving(registry)
        self._add_cluster(registry)
        self._add_planner(registry)

    def _add_serving(self, registry: CollectorRegistry) -> None:
        """Requests, tokens and the batched iterations: their steps, trees, batches, time and queue."""
        self.requests = Counter(
            "specinfer_requests", "Finished requests by outcome (finish reason)", ["outcome"], registry=registry
        )
        self.generated_tokens = Counter(
            "specinfer_generated_tokens", "Tokens committed to request outputs", registry=registry
        )
        self.admitted = Counter(
            "specinfer_requests_admitted",
            "Requests admitted to the queue (refusals: see the gRPC metrics' code)",
            registry=registry,
        )
        self.prompt_tokens = Counter("specinfer_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.llm_steps = Counter(
            "specinfer_llm_steps",
            "Per-request LLM verify steps (a batched call of B requests counts B)",
            registry=registry,
        )
        self.iterations = Counter(
            "specinfer_iterations", "Batched iterations (one verify call each)", registry=registry
        )
        self.accepted_tokens = Histogram(
            "specinfer_accepted_tokens_per_step",
            "Tree tokens accepted per request per step (no bonus)",
            buckets=ACCEPTED_BUCKETS,
            registry=registry,
        )
        self.tree_size = Histogram(
            "specinfer_tree_size",
            "Token tree nodes per request per step (root included)",
            buckets=TREE_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "specinfer_batch_size", "Running requests per iteration", buckets=BATCH_BUCKETS, registry=registry
        )
        self.iteration_seconds = Histogram(
            "specinfer_iteration_seconds",
            "Wall time of one iteration (drafting, verification, commit)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.speculate_seconds = Histogram(
            "specinfer_speculate_seconds", "Drafting part of an iteration", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.verify_seconds = Histogram(
            "specinfer_verify_seconds", "Verification part of an iteration", buckets=LATENCY_BUCKETS, registry=registry
        )
        self.queue_depth = Gauge("specinfer_queue_depth", "Requests waiting for a batch slot", registry=registry)
        self.running = Gauge("specinfer_running_requests", "Requests in the running batch", registry=registry)

    def _add_cluster(self, registry: CollectorRegistry) -> None:
        """The SSM workers and verifier replicas (failed calls, replicas in service, preemptions), and the
        request-manager replicas (ownership leases, adoption)."""
        self.ssm_failures = Counter(
            "specinfer_ssm_call_failures", "Failed drafting calls, by SSM", ["ssm"], registry=registry
        )
        self.verifier_failures = Counter(
            "specinfer_verifier_call_failures",
            "Verify rounds with a failed call (its requests retry, elsewhere if their replica is out)",
            registry=registry,
        )
        self.verifier_requests = Counter(
            "specinfer_verifier_requests",
            "Request steps verified, by LLM verifier replica (address)",
            ["replica"],
            registry=registry,
        )
        self.verifier_replicas_live = Gauge(
            "specinfer_verifier_replicas_live", "LLM verifier replicas in service", registry=registry
        )
        self.preemptions = Counter(
            "specinfer_preemptions",
            "Running requests put back at the head of the queue for lack of KV blocks (they resume later)",
            registry=registry,
        )
        # request-manager replicas (services/request_manager/state/ownership.py)
        self.adopted = Counter(
            "specinfer_requests_adopted",
            "Requests adopted from a request manager whose ownership lease lapsed",
            registry=registry,
        )
        self.taken_over = Counter(
            "specinfer_requests_taken_over",
            "Requests another request manager took over while this one's lease had lapsed: dropped here",
            registry=registry,
        )
        self.lease_held = Gauge(
            "specinfer_ownership_lease_held",
            "1 while this request manager holds its ownership lease, else 0",
            registry=registry,
        )
        self.ssm_workers_live = Gauge(
            "specinfer_ssm_workers_live",
            "Workers in service per SSM (0: its requests decode incrementally)",
            ["ssm"],
            registry=registry,
        )

    def _add_cost_model(self, registry: CollectorRegistry) -> None:
        """The planner's cost model: its tables, and its errors on verify calls and on whole iterations."""
        self.cost_model_verify_error = Histogram(
            "specinfer_cost_model_verify_error_ratio",
            "The cost model's error on a verify call: |predicted - measured| / measured seconds, predicted before it",
            buckets=ERROR_BUCKETS,
            registry=registry,
        )
        self.cost_model_step_error = Histogram(
            "specinfer_cost_model_step_error_ratio",
            "The cost model's error on a whole iteration (verify calls, draft passes and the overhead outside the "
            "models): |predicted - measured| / measured seconds, predicted before it",
            buckets=ERROR_BUCKETS,
            registry=registry,
        )
        self.cost_verify_seconds = Gauge(
            "specinfer_cost_model_verify_seconds",
            "The cost model's verify call seconds by tree tokens in the call",
            ["tokens"],
            registry=registry,
        )
        self.cost_draft_seconds = Gauge(
            "specinfer_cost_model_draft_seconds",
            "The cost model's SSM pass seconds by frontier tokens, per SSM",
            ["ssm", "tokens"],
            registry=registry,
        )

    def _add_planner(self, registry: CollectorRegistry) -> None:
        """Adaptive speculation: the planner's trees, predicted and realised acceptance, drafters, cost model."""
        # adaptive speculation (the planner; see services/request_manager/scheduling/adaptive.py)
        self._add_cost_model(registry)
        self.planned_tree_nodes = Histogram(
            "specinfer_planned_tree_nodes",
            "Tree nodes the planner gave an adaptive request per step (root included; 1: no speculation)",
            buckets=TREE_BUCKETS,
            registry=registry,
        )
        self.predicted_accepted_tokens = Counter(
            "specinfer_predicted_accepted_tokens",
            "Accepted tokens the planner expected of the steps it speculated for",
            registry=registry,
        )
        self.realised_accepted_tokens = Counter(
            "specinfer_realised_accepted_tokens",
            "Accepted tokens of the steps the planner speculated for (compare: predicted)",
            registry=registry,
        )
        self.position_accepted_tokens = Counter(
            "specinfer_accepted_tokens_by_position",
            "Accepted draft tokens by tree depth (1: the root's child)",
            ["position"],
            registry=registry,
        )
        self.cut_draft_nodes = Counter(
            "specinfer_cut_draft_nodes",
            "Drafted nodes cut before verification because they would not pay for their verify cost",
            registry=registry,
        )
        self.drafter_proposed_tokens = Counter(
            "specinfer_drafter_proposed_tokens",
            "Draft tokens a drafter's trees sent to verification (adaptive requests)",
            ["drafter"],
            registry=registry,
        )
        self.drafter_accepted_tokens = Counter(
            "specinfer_drafter_accepted_tokens",
            "Accepted tokens that were on a drafter's tree (adaptive requests)",
            ["drafter"],
            registry=registry,
        )
        self.drafter_steps = Counter(
            "specinfer_drafter_steps",
            "Verify steps of adaptive requests in which a drafter proposed a tree",
            ["drafter"],
            registry=registry,
        )
        self.kept_share = Gauge(
            "specinfer_draft_kept_share",
            "Moving average of the share of drafted value kept for verification, per SSM "
            "(scales the planner's node values)",
            ["ssm"],
            registry=registry,
        )
        self.speculation_gate_rate = Gauge(
            "specinfer_speculation_gate_tokens_per_second",
            "Committed tokens per second the speculation gate measured in steps of this batch-size bucket (its largest "
            "batch) with adaptive speculation on and off (decayed: the last few dozen steps of each arm)",
            ["batch", "arm"],
            registry=registry,
        )
