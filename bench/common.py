"""Helpers that more than one bench script uses; the scripts import them from here (``from common import ...``:
a script's own folder is on its import path), never from one another.

- prompts: :func:`load_prompts` (a JSON-lines prompt file, tokenized, each cut to its last tokens) and
  :func:`prompt_windows` (the prompts' tokens concatenated and cut into windows of one length);
- KV memory: :func:`kv_bytes` (an LLM KV budget with room for a batch of full-length requests);
- the weight-streaming floor: :func:`streamed_weights` (the matrices a one-token step reads) and
  :func:`products_seconds` (their one-row products alone, in a given form);
- load against a running stack: :data:`DEFAULT_PAIR`, :class:`Totals`, :func:`stream_loop` (gRPC streams back to
  back) and :func:`pct` (a percentile of unsorted values).
"""

from __future__ import annotations

import collections
import json
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from prometheus_client.parser import text_string_to_metric_families

from specinfer.checkpoint import load_tokenizer
from specinfer.client import Client

if TYPE_CHECKING:
    import torch

    from specinfer.models.interface import CausalLM

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PAIR = REPO.parent / "shared/models/pycode-a"


def load_prompts(path: Path, tokenizer_dir: Path, count: int, max_tokens: int) -> list[tuple[int, ...]]:
    """The first ``count`` prompts of a JSON-lines file (a ``text`` or ``prompt`` field each), tokenized with
    ``tokenizer_dir``'s tokenizer, each cut to its last ``max_tokens`` tokens (0: whole)."""
    tok = load_tokenizer(tokenizer_dir)
    rows = [json.loads(line) for line in path.read_text().splitlines()[:count]]
    prompts = [tuple(tok.encode(row["text"] if "text" in row else row["prompt"]).ids) for row in rows]
    return [p[-max_tokens:] for p in prompts] if max_tokens > 0 else prompts


def prompt_windows(llm: Path, prompts: Path, count: int, length: int) -> list[tuple[int, ...]]:
    """``count`` prompts of exactly ``length`` tokens: the prompt file's texts, tokenized and
    concatenated, cut into windows (each request a different window)."""
    tok = load_tokenizer(llm)
    stream: list[int] = []
    for line in prompts.read_text().splitlines():
        stream += tok.encode(json.loads(line)["text"]).ids
    if len(stream) < length + count:
        raise SystemExit(f"{prompts} holds {len(stream)} tokens, too few for {count} prompts of {length}")
    step = max(1, (len(stream) - length) // count)
    return [tuple(stream[i * step : i * step + length]) for i in range(count)]


def kv_bytes(llm_dir: Path, batch: int, dtype: torch.dtype) -> int:
    """A KV budget with ``batch`` slots (untouched pool pages cost no memory: see KVPool)."""
    from specinfer.models.native import ModelSpec
    from specinfer.models.native.kv_pool import KVPool

    spec = ModelSpec.from_dir(llm_dir)
    return KVPool.bytes_per_token(spec, dtype) * (spec.positions_limit + 256) * batch


def streamed_weights(model) -> list[torch.Tensor]:
    """The matrices a one-token step of a native model reads, in model order: each decoder layer's qkv, o, up and
    down projections, then the LM head."""
    weights = [w for layer in model.w.layers for w in (layer.qkv_w, layer.o_w, layer.up_w, layer.down_w)]
    return [*weights, model.w.lm_head]


def products_seconds(weights: list[torch.Tensor], form, runs: int) -> float:
    """Best of ``runs`` passes of one-row products ``form(x, w)`` over every weight in order: every weight streamed
    once, the floor a one-token step cannot go below."""
    import torch

    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}  # [1, in]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(runs):
            start = time.perf_counter()
            for w in weights:
                form(rows[w.shape[1]], w)
            best = min(best, time.perf_counter() - start)
    return best


@dataclass
class Totals:
    """What the client threads of a load run count (under ``lock``): finished requests, tokens, errors by
    status, per-token latencies and times to first token (seconds)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    tokens: int = 0
    errors: collections.Counter = field(default_factory=collections.Counter)
    per_token: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)


def stream_loop(address: str, prompts: list[list[int]], index: int, args, stop_at: float, totals: Totals) -> None:
    """One client thread: greedy requests through gRPC ``Generate`` streams back to back until ``stop_at``
    (prompts ``index``, ``index + args.streams``, ...), counted in ``totals``."""
    with Client(address, timeout=args.request_timeout) as client:
        k = index
        while time.monotonic() < stop_at:
            prompt = prompts[k % len(prompts)]
            k += args.streams
            request = Client.request(prompt, args.new_tokens, ignore_eos=True)
            started = last = time.monotonic()
            lat, first, count = [], None, 0
            try:
                for msg in client.stream(request):
                    now = time.monotonic()
                    if msg.token_ids:
                        if first is None:
                            first = now - started
                        lat += [(now - last) / len(msg.token_ids)] * len(msg.token_ids)
                        count += len(msg.token_ids)
                        last = now
            except grpc.RpcError as exc:
                with totals.lock:
                    totals.errors[exc.code().name] += 1
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    time.sleep(args.retry_pause)
                continue
            with totals.lock:
                totals.requests += 1
                totals.tokens += count
                totals.per_token += lat[1:]  # the first token's wait is time to first token, below
                if first is not None:
                    totals.first_token.append(first)


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (unsorted), NaN when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def timed_load(load: Callable[[], CausalLM]) -> CausalLM:
    """``load()``'s model, printing how long the load took (a GPU's CUDA-graph warm-up included) and what the graphs
    captured."""
    started = time.perf_counter()
    model = load()
    print(f"LLM loaded in {time.perf_counter() - started:.1f} s; CUDA graphs: {model.graph_stats}")
    return model


class Timed:
    """Wraps one method of an object so that its calls' seconds add up in ``totals[key]``."""

    def __init__(self, totals: collections.Counter, key: str, target: object, name: str) -> None:
        inner = getattr(target, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[key] += time.perf_counter() - start

        setattr(target, name, timed)


def scrape(address: str) -> dict[str, float]:
    """``{sample name + labels: value}`` of a process's /metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def delta(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    """Sum of the samples whose key starts with ``prefix``, after minus before."""
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))


def histogram_quantile(before: dict[str, float], after: dict[str, float], name: str, q: float) -> float | None:
    """The ``q`` quantile of histogram ``name``'s observations between two :func:`scrape` s, as Prometheus'
    ``histogram_quantile`` estimates it (linear within the bucket that holds it; None: no observation)."""
    buckets = []
    for key, value in after.items():
        if key.startswith(f"{name}_bucket{{"):
            bound = float(key.split("le=")[1].split(",")[0].rstrip("}"))
            buckets.append((bound, value - before.get(key, 0.0)))
    buckets.sort()
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, low, below = q * buckets[-1][1], 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return low
            return low + (bound - low) * ((rank - below) / (count - below) if count > below else 0.0)
        low, below = bound, count
    return low
