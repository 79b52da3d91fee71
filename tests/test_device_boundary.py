"""Model outputs leave the model's device only through specinfer.models.on_device.to_host, once per call.

The models here are real native backends behind a wrapper whose logits are :class:`DeviceOnly`
tensors: every way of reading values on the host (``.numpy()``, ``.tolist()``, ``.item()``,
``.cpu()``, ``.to("cpu")``, ``float()``, ``int()``, ``bool()``, indexing a list, ``np.asarray``)
raises, except inside ``to_host``; tensors computed from them are ``DeviceOnly`` too. On a GPU each
of those would be a device-to-host copy and a wait, so the in-process engine (greedy and sampling,
static and adaptive trees) and the SSM worker's and LLM verifier's servicers must run with exactly
one crossing after each model call, and give the outputs they give on plain tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from specinfer import wire, wire_jobs
from specinfer.core import ExpansionConfig, SamplingParams
from specinfer.core.costs import CostTable, StepCosts
from specinfer.core.iteration import DraftSpec, VerifySpec, draft_stream
from specinfer.core.planner import PlannerConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.llm_verifier.servicer import LlmVerifierServicer
from specinfer.models import on_device
from specinfer.models.drafting import draft_trees
from specinfer.models.interface import TreeForward
from specinfer.models.loading import load_backend
from specinfer.models.verification import verify_trees
from specinfer.serving.metrics import ModelMetrics
from specinfer.ssm_worker.servicer import SsmWorkerServicer
from specinfer.v1 import internal_pb2

# Tensor methods that read values into host memory (or into Python scalars).
HOST_READS = frozenset(
    {"numpy", "tolist", "item", "cpu", "__array__", "__float__", "__int__", "__index__", "__bool__", "__complex__"}
)


class HostRead(AssertionError):
    """A model output was read on the host outside the device boundary."""


def _to_host_device(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to(...)`` call names the CPU as its target."""
    targets = (*args[1:], *kwargs.values())
    return any(
        (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu")
        for a in targets
    )


def _caller_is_boundary() -> bool:
    """Whether the first frame outside torch and this module is ``on_device.to_host``."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_globals.get("__name__", "").startswith("torch") or frame.f_code.co_filename == __file__
    ):
        frame = frame.f_back
    return frame is not None and frame.f_code is on_device.to_host.__code__


class DeviceOnly(torch.Tensor):
    """A model output that behaves as if it lived on an accelerator (see the module docstring).
    ``events`` logs ``"F"`` for each model call (by :class:`Guarded`) and ``"X"`` for each crossing."""

    events: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reads = name in HOST_READS or (name == "to" and _to_host_device(args, kwargs))
        if reads:
            if not _caller_is_boundary():
                raise HostRead(f"{name}() on a model output outside on_device.to_host")
            if name != "numpy":  # to_host moves it, then views it as an array: one crossing
                cls.events.append("X")
        return super().__torch_function__(func, types, args, kwargs)


class Guarded:
    """A CausalLM whose logits are :class:`DeviceOnly`; everything else is the wrapped model's."""

    def __init__(self, inner) -> None:
        self.inner = inner

    vocab_size = property(lambda self: self.inner.vocab_size)
    max_positions = property(lambda self: self.inner.max_positions)
    max_requests = property(lambda self: self.inner.max_requests)
    kv_budget = property(lambda self: self.inner.kv_budget)
    kv_blocks_free = property(lambda self: self.inner.kv_blocks_free)
    prefix_cache_stats = property(lambda self: self.inner.prefix_cache_stats)
    graph_stats = property(lambda self: self.inner.graph_stats)

    def prefix_hits(self, request_id: str) -> int:
        return self.inner.prefix_hits(request_id)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)

    def cached_requests(self) -> list[str]:
        return self.inner.cached_requests()

    def forward_tree(self, batch: Sequence[TreeForward]) -> list[torch.Tensor]:
        DeviceOnly.events.append("F")
        return [t.as_subclass(DeviceOnly) for t in self.inner.forward_tree(batch)]


def test_the_guard_catches_host_reads():
    """The negative control: each way of reading a DeviceOnly tensor on the host raises."""
    t = torch.arange(4.0).as_subclass(DeviceOnly)
    reads = [
        lambda: t.numpy(),
        lambda: t.tolist(),
        lambda: t[0].item(),
        lambda: t.cpu(),
        lambda: t.to("cpu"),
        lambda: float(t[1]),
        lambda: int(t.argmax()),
        lambda: bool(t[1] > 0),
        lambda: [0, 1, 2, 3][t.argmax()],
        lambda: np.asarray(t),
        lambda: (t * 2).argmax(dim=-1).numpy(),
    ]
    for read in reads:
        with pytest.raises(HostRead):
            read()
    DeviceOnly.events.clear()
    assert on_device.to_host(t * 2).tolist() == [0.0, 2.0, 4.0, 6.0] and DeviceOnly.events == ["X"]


@pytest.fixture(scope="module")
def models(model_pair):
    """The pair as native backends (paged KV, as the services run them)."""
    llm = load_backend(model_pair.llm, "llm", "float32", backend="native", kv_cache_bytes=64 << 20, kv_block_size=16)
    ssm = load_backend(model_pair.ssm, "ssm", "float32", backend="native", kv_cache_bytes=32 << 20, kv_block_size=16)
    return llm, ssm


def free_speculation() -> StepCosts:
    """Verify tokens and SSM passes almost free (frozen): adaptive plans speculate with dynamic trees."""
    buckets = (1, 64, 1024)
    return StepCosts(
        CostTable({b: 1.0 + 1e-9 * b for b in buckets}), 0.0, {0: CostTable({b: 1e-6 for b in buckets})}, frozen=True
    )


SPECS = {
    "static": SpeculationConfig(ExpansionConfig((2, 2, 1))),
    "adaptive": SpeculationConfig(None),
}
# every request is seeded: "mss" is named; a seed alone selects coupled verification
SAMPLINGS = {
    "greedy": SamplingParams(),
    "mss": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, verification="mss"),
    "coupled": SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
}


def _generate(llm, ssm, model_pair, spec: SpeculationConfig, sampling: SamplingParams):
    engine = SpeculativeEngine(
        llm, [ssm], EngineConfig(max_batch=8, planner=PlannerConfig(max_nodes=8, max_depth=3)), free_speculation()
    )
    prompts = model_pair.prompts[:2]
    requests = [
        GenerationRequest(f"b{i}", tuple(p), 8, dataclasses.replace(sampling, seed=i), spec, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    results = engine.generate(requests)
    for r in requests:
        llm.release(r.request_id)
        ssm.release(r.request_id)
    return [list(r.output_tokens) for r in results], engine


@pytest.mark.parametrize("tree", list(SPECS))
@pytest.mark.parametrize("mode", list(SAMPLINGS))
def test_engine_reads_model_outputs_only_at_the_boundary(models, model_pair, tree: str, mode: str):
    llm, ssm = models
    plain, _ = _generate(llm, ssm, model_pair, SPECS[tree], SAMPLINGS[mode])
    DeviceOnly.events.clear()
    guarded, engine = _generate(Guarded(llm), Guarded(ssm), model_pair, SPECS[tree], SAMPLINGS[mode])
    assert guarded == plain
    events = "".join(DeviceOnly.events)
    assert events == "FX" * (len(events) // 2) and len(events) > 2, events  # one crossing after each model call
    if tree == "adaptive":
        assert engine.adaptive.totals.speculative_steps > 0


def test_servicers_read_model_outputs_only_at_the_boundary(models, model_pair):
    """Speculate and Verify through the SSM worker's and the LLM verifier's servicers (no network:
    their handlers, their model threads, the wire translation), greedy, MSS and coupled items together."""
    llm, ssm = models
    worker = SsmWorkerServicer({"ssm": Guarded(ssm)}, ModelMetrics(CollectorRegistry(), "ssm_worker"))
    verifier = LlmVerifierServicer("llm", Guarded(llm), ModelMetrics(CollectorRegistry(), "llm_verifier"))
    prompts = model_pair.prompts[:4]
    params = [SAMPLINGS["greedy"], SAMPLINGS["mss"], dataclasses.replace(SAMPLINGS["coupled"], seed=7)]
    jobs = [
        DraftSpec(f"s{i}", list(p[:-1]), p[-1], ExpansionConfig((2, 2)), params[i % 3], 8, 100 + i, 0, draft_stream(0))
        for i, p in enumerate(prompts)
    ]
    context = [wire_jobs.context_to_proto(j.request_id, j.context_tokens, 0) for j in jobs]

    async def serve():
        speculated = await worker.Speculate(
            internal_pb2.SpeculateRequest(
                ssm="ssm", items=[wire_jobs.draft_job_to_proto(j, c) for j, c in zip(jobs, context, strict=True)]
            ),
            None,
        )
        drafts = [wire.draft_from_proto(r.tree) for r in speculated.results]
        items = [
            internal_pb2.VerifyItem(
                context=c, tree=wire.draft_to_proto(d), sampling=wire.sampling_to_proto(j.sampling), seed=j.seed, step=0
            )
            for j, c, d in zip(jobs, context, drafts, strict=True)
        ]
        verified = await verifier.Verify(internal_pb2.VerifyRequest(items=items), None)
        return drafts, verified

    DeviceOnly.events.clear()
    drafts, verified = asyncio.run(serve())
    events = "".join(DeviceOnly.events)
    assert events == "FX" * 3, events  # 2 SSM passes (the root, then depth 1), 1 verify step
    # the same work on plain tensors gives the same drafts and verdicts
    for j in jobs:
        llm.release(j.request_id)
        ssm.release(j.request_id)
    # q crossed the wire in float32, and the rerun's prompts hit the prefix cache: the rest of each is a chunk behind
    # cached blocks, computed as decode rows are (on an AVX2 CPU by the fused layers), not as a whole prompt: rounding
    for plain, sent in zip(draft_trees(ssm, jobs), drafts, strict=True):
        assert plain.tree == sent.tree and [(g.parent, g.children) for g in plain.groups] == [
            (g.parent, g.children) for g in sent.groups
        ]
        for a, b in zip(plain.groups, sent.groups, strict=True):
            assert (a.q is None) == (b.q is None)
            if a.q is not None:
                assert np.array_equal(a.q.tokens, b.q.tokens) and np.allclose(a.q.probs, b.q.probs, rtol=1e-5)
    verdicts = verify_trees(
        llm,
        [
            VerifySpec(j.request_id, j.context_tokens, d, j.sampling, j.seed, 0)
            for j, d in zip(jobs, drafts, strict=True)
        ],
    )
    assert [(list(v.accepted_tokens), v.bonus_token) for v in verdicts] == [
        (list(r.accepted_tokens), r.bonus_token) for r in verified.results
    ]
