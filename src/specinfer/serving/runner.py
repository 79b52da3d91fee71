"""Models inside a service: loading from the service settings, serialized blocking calls."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch

from specinfer.core import InvalidArgument
from specinfer.core.costs import CostTable, StepCosts
from specinfer.engine.calibrate import REPEATS, calibrate_costs, calibrate_table, log_progress
from specinfer.engine.calibration_cache import CalibrationCache, CalibrationKey, CostEntry, ModelIdentity, ModelRuntime
from specinfer.kernels import cpu_team
from specinfer.models.interface import CausalLM
from specinfer.models.loading import load_backend

log = logging.getLogger("specinfer.calibrate")

T = TypeVar("T")


def load_model(
    path: str, field: str, settings: argparse.Namespace, offload: bool = False, offload_reserve_bytes: int = 0
) -> CausalLM:
    """The model at ``path`` with the settings of :func:`specinfer.serving.config.add_model_settings`;
    ``offload``, ``offload_reserve_bytes``: the LLM verifier's offloading settings (docs/offloading.md)."""
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    return load_backend(
        path,
        field,
        settings.dtype,
        settings.device,
        settings.backend,
        settings.kv_cache_bytes,
        settings.attention,
        settings.kv_block_size,
        settings.max_seq_len,
        offload,
        offload_reserve_bytes,
        settings.prefix_caching,
        settings.cuda_graph_tokens,
        settings.cuda_graph_warmup_seconds,
        settings.quantize,
    )


def model_identity(
    path: str, settings: argparse.Namespace, offload: bool = False, offload_reserve_bytes: int = 0
) -> ModelIdentity:
    """What a calibration cache key says of the model :func:`load_model` loads with the same arguments."""
    runtime = ModelRuntime(
        settings.dtype,
        settings.device,
        settings.backend,
        settings.attention,
        settings.kv_block_size,
        settings.prefix_caching,
        offload,
        offload_reserve_bytes,
        settings.cuda_graph_tokens,
        settings.quantize,
    )
    return ModelIdentity.of(path, runtime)


def calibration_cache(settings: argparse.Namespace) -> CalibrationCache:
    """The cache of the ``--calibration-cache`` setting (:mod:`specinfer.engine.calibration_cache`)."""
    return CalibrationCache.from_setting(settings.calibration_cache, os.environ)


def calibrate_verifier(llm: CausalLM, max_tokens: int, cache: CostEntry | None = None) -> StepCosts | None:
    """The LLM's verify cost model measured at start-up (tree calls of up to ``max_tokens`` nodes), which
    GetInfo reports to the request manager's planner; None when ``max_tokens`` is 0 or the measurement fails.
    ``cache``: read from that entry when it holds one, else measured and written there."""
    if max_tokens <= 0:
        return None
    if cache is not None and (costs := cache.load_costs()) is not None:
        log.info("calibration read from the cache", extra={"path": str(cache.cache.path(cache.key))})
        return costs
    try:
        costs = calibrate_costs(llm, (), max_verify_tokens=max_tokens, progress=log_progress)
    except Exception:  # a service that cannot time its model still serves: the request manager measures instead
        log.exception("calibration failed; reporting no cost table")
        return None
    if cache is not None:
        cache.save_costs(costs)
    return costs


def verifier_cost_entry(
    settings: argparse.Namespace, identity: ModelIdentity, parallel: tuple[int, int] = (1, 1)
) -> CostEntry:
    """The cache entry of the LLM verifier's calibration: the model ``identity``, the
    ``--calibrate-tokens`` and, for a parallel verifier, its (tensor, pipeline) ranks."""
    params = {
        "max_tokens": settings.calibrate_tokens,
        "repeats": REPEATS,
        "tensor_parallel": parallel[0],
        "pipeline_parallel": parallel[1],
    }
    return CostEntry(calibration_cache(settings), CalibrationKey.build("verifier", (identity,), params))


def calibrate_drafters(
    ssms: Mapping[str, CausalLM], max_tokens: int, cache: Mapping[str, CostEntry] | None = None
) -> dict[str, CostTable]:
    """Each SSM's draft pass seconds by frontier tokens (up to ``max_tokens``), which ListModels reports;
    empty when ``max_tokens`` is 0 or the measurement fails. ``cache``: each SSM's entry by name, read
    when it holds a table, else measured and written there."""
    if max_tokens <= 0:
        return {}
    tables = {}
    try:
        for name, m in ssms.items():
            entry = cache.get(name) if cache is not None else None
            table = entry.load_table() if entry is not None else None
            if table is None:
                table = calibrate_table(m, max_tokens, REPEATS, log_progress, f"ssm {name}")
                if entry is not None:
                    entry.save_table(table)
            else:
                log.info(
                    "calibration read from the cache", extra={"ssm": name, "path": str(entry.cache.path(entry.key))}
                )
            tables[name] = table
    except Exception:
        log.exception("calibration failed; reporting no cost table")
        return {}
    return tables


def drafter_cost_entry(settings: argparse.Namespace, identity: ModelIdentity, vocabulary: str) -> CostEntry:
    """The cache entry of one SSM's draft calibration in a worker: the model ``identity``, the
    ``--calibrate-tokens`` and how it drafts in the LLM's vocabulary (``vocabulary``: a
    :func:`~specinfer.models.cross_vocab.vocabulary_method`; a mapped SSM's passes do more work)."""
    params = {"max_tokens": settings.calibrate_tokens, "repeats": REPEATS, "vocabulary": vocabulary}
    return CostEntry(calibration_cache(settings), CalibrationKey.build("drafter", (identity,), params))


MODEL_CALLS = ("inline", "thread")  # the --model-calls choices (ModelThread)


class ModelThread:
    """The one thread that does a model's torch work in a service: its loading and start-up calibration
    (:meth:`run`), then every call (:class:`ModelRunner`).

    PyTorch runs the parallel part of a CPU operation on an OpenMP thread team of the thread that calls it. Once a
    second thread of a process has launched parallel work, the parallel regions of both are slower for as long as the
    process lives: on the 2-core EPYC, SmolLM2 (int4, bf16) decoded at 24 ms a token in one thread, and at 42 ms
    after a single parallel sum in another thread (BENCHMARKS.md, "One OpenMP team per service"). A service that loaded
    its model on its main thread and called it from another paid that on every step. ``threads``: its torch threads
    (0: the process's count).

    ``inline`` (``--model-calls inline``): that thread is the caller's, the service's main thread, which then runs
    the event loop; every call runs on the loop itself. A call then costs no hand-off between threads (a wake-up of
    the model's thread and one of the loop's: 0.3-0.5 ms a call on a 2-core VM, BENCHMARKS.md "Model calls on the
    event loop"), but while it runs the service answers nothing else: health checks and GetInfo wait for it, as every
    other model call already does. ``thread`` keeps the loop free during calls, for long ones (long prompts on a CPU
    past a liveness probe's window)."""

    def __init__(self, name: str, threads: int = 0, inline: bool = False) -> None:
        threads = threads if threads > 0 else torch.get_num_threads()
        if inline:
            torch.set_num_threads(threads)
            self.executor: concurrent.futures.ThreadPoolExecutor | None = None  # None: calls run in the caller's
        else:
            self.executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"model-{name}", initializer=torch.set_num_threads, initargs=(threads,)
            )

    @classmethod
    def from_settings(cls, name: str, settings: argparse.Namespace) -> ModelThread:
        """The thread of ``--model-calls`` and ``--torch-threads``; raises :class:`InvalidArgument` naming the
        setting when ``--model-calls`` is not one of :data:`MODEL_CALLS`."""
        if settings.model_calls not in MODEL_CALLS:
            raise InvalidArgument(
                "model-calls", f"must be one of {', '.join(MODEL_CALLS)}, got {settings.model_calls!r}"
            )
        return cls(name, settings.torch_threads, settings.model_calls == "inline")

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the thread, waited for: start-up work, before the event loop serves."""
        if self.executor is None:
            return fn(*args)
        return self.executor.submit(fn, *args).result()


class ModelRunner:
    """A model whose blocking calls run one at a time in a worker thread.

    The event loop stays free for other calls (health checks, other models) while a forward
    pass runs; the lock keeps the backend's per-request caches, which are not thread-safe,
    from being touched by two calls at once. The lock is FIFO, and servicers update their
    contexts and queue for it without awaiting in between, so a Release that arrives while a
    call for the same request waits or runs frees the cache that call leaves behind.
    """

    def __init__(self, name: str, model: CausalLM, thread: ModelThread | None = None) -> None:
        """``thread``: the one that loaded ``model`` (:class:`ModelThread`); None: a new one."""
        self.name = name
        self.model = model
        self._lock = asyncio.Lock()
        # One long-lived thread per model, not the loop's shared pool: OpenMP keeps a thread team
        # (and its thread count) per calling thread, so hopping between pool threads cost the
        # forward pass ~20% on a CPU; and the thread that loaded it: one team a process (ModelThread). None: inline,
        # on the loop's thread, which loaded it.
        self._thread = (thread or ModelThread(name)).executor

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(model, *args)`` in the model's thread, after any call already running. The CPU kernels' workers are
        woken as it starts and sent to sleep after it (:mod:`specinfer.kernels.cpu_team`: a service's next call
        is a round trip away)."""
        cpu_team.wake()
        try:
            async with self._lock:
                if self._thread is None:
                    return fn(self.model, *args)
                return await asyncio.get_running_loop().run_in_executor(self._thread, fn, self.model, *args)
        finally:
            cpu_team.rest()

    async def release(self, request_ids: Iterable[str], forget: Callable[[str], None] | None = None) -> None:
        """Free the caches of ``request_ids`` (cheap: runs on the loop, under the lock), and ``forget`` each: state
        kept beside the model that its calls use (a drafter's grammar states), so never while a call runs."""
        request_ids = list(request_ids)
        if not request_ids:
            return
        async with self._lock:
            for rid in request_ids:
                self.model.release(rid)
                if forget is not None:
                    forget(rid)
