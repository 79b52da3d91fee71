"""Models inside a service: loading from the service settings, serialized blocking calls."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from specinfer.models.interface import CausalLM
from specinfer.models.loading import load_backend

T = TypeVar("T")


def load_model(path: str, field: str, settings: argparse.Namespace) -> CausalLM:
    """The model at ``path`` with the settings of :func:`specinfer.serving.config.add_model_settings`."""
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    return load_backend(path, field, settings.dtype, settings.device, settings.backend, settings.kv_cache_bytes, settings.attention)


class ModelRunner:
    """A model whose blocking calls run one at a time in a worker thread.

    The event loop stays free for other calls (health checks, other models) while a forward
    pass runs; the lock keeps the backend's per-request caches, which are not thread-safe,
    from being touched by two calls at once. The lock is FIFO, and servicers update their
    contexts and queue for it without awaiting in between, so a Release that arrives while a
    call for the same request waits or runs frees the cache that call leaves behind.
    """

    def __init__(self, name: str, model: CausalLM) -> None:
        self.name = name
        self.model = model
        self._lock = asyncio.Lock()
        # One long-lived thread per model, not the loop's shared pool: OpenMP keeps a thread team
        # (and its thread count) per calling thread, so hopping between pool threads cost the
        # forward pass ~20% on a CPU. The count set for the process applies to this thread too.
        threads = torch.get_num_threads()
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"model-{name}", initializer=torch.set_num_threads, initargs=(threads,))

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(model, *args)`` in the model's thread, after any call already running."""
        async with self._lock:
            return await asyncio.get_running_loop().run_in_executor(self._thread, fn, self.model, *args)

    async def release(self, request_ids: Iterable[str]) -> None:
        """Free the caches of ``request_ids`` (cheap: runs on the loop, under the lock)."""
        request_ids = list(request_ids)
        if not request_ids:
            return
        async with self._lock:
            for rid in request_ids:
                self.model.release(rid)
