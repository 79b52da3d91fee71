"""Time to first token of requests sharing a long prompt prefix, with prefix caching on and off (issue 16).

The in-process engine runs ``--requests`` greedy requests whose prompts are one ``--prefix``-token
prefix followed by ``--suffix`` tokens of their own, on a paged KV pool (``--kv-block-size``), once
with prefix caching off and once on, in one run. The first request runs alone to its end (it
computes the prefix; with prefix caching its full blocks stay cached); then the others arrive
together. A request's *time to first token* (TTFT) runs from its arrival to the end of the engine
step that commits its first token. Reported per mode: the first request's TTFT, the later ones'
median and mean TTFT, their cached prompt tokens (``Usage.cached_prompt_tokens``), and how many
times lower the later ones' median TTFT is with prefix caching. Both modes must generate the same
tokens (prefix caching never changes the output), which the script checks.

    python bench/prefix_cache.py --llm /tmp/llm-1b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import prompt_windows

from specinfer.core import ExpansionConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.native import NativeBackend, NativeOptions


def first_token_seconds(
    engine: SpeculativeEngine, requests: list[GenerationRequest]
) -> tuple[dict[str, float], dict[str, list[int]], dict[str, int]]:
    """Add ``requests`` now and step the engine until all finish: each one's seconds from now to the
    end of the step that committed its first token, its output and its cached prompt tokens."""
    started = time.perf_counter()
    for r in requests:
        engine.add(r)
    ttft: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_work:
        finished = engine.step()
        now = time.perf_counter()
        for result in [*engine.running(), *finished]:
            if result.output_tokens and result.request_id not in ttft:
                ttft[result.request_id] = now - started
        for result in finished:
            outputs[result.request_id] = list(result.output_tokens)
            cached[result.request_id] = result.cached_prompt_tokens
    return ttft, outputs, cached


def run(args: argparse.Namespace, prefix_caching: bool, prompts: list[tuple[int, ...]]) -> dict:
    dtype = DTYPES[resolve_dtype(args.dtype, "cpu")]
    options = NativeOptions(
        dtype, "cpu", args.kv_cache_bytes, kv_block_size=args.kv_block_size, prefix_caching=prefix_caching
    )
    llm = NativeBackend.load(args.llm, options)
    ssms = []
    if args.speculation != "none":
        ssms = [
            NativeBackend.load(
                args.ssm,
                NativeOptions(
                    dtype, "cpu", args.kv_cache_bytes, kv_block_size=args.kv_block_size, prefix_caching=prefix_caching
                ),
            )
        ]
    engine = SpeculativeEngine(
        llm, ssms, EngineConfig(max_batch=len(prompts), max_prefill_tokens=args.max_prefill_tokens)
    )
    spec = (
        None
        if args.speculation == "none"
        else SpeculationConfig(None if args.speculation == "auto" else ExpansionConfig.parse(args.speculation))
    )
    if spec is not None and spec.expansion is None:
        engine.adaptive  # noqa: B018 (calibrate the cost model before the clock starts)
    requests = [
        GenerationRequest(f"r{i}", p, args.new_tokens, speculation=spec, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    first, first_out, _ = first_token_seconds(engine, requests[:1])
    later, outputs, cached = first_token_seconds(engine, requests[1:])
    seconds = [later[r.request_id] for r in requests[1:]]
    return {
        "prefix_caching": "on" if prefix_caching else "off",
        "first_ttft_s": round(first["r0"], 4),
        "later_ttft_median_s": round(statistics.median(seconds), 4),
        "later_ttft_mean_s": round(statistics.fmean(seconds), 4),
        "later_cached_prompt_tokens": round(statistics.fmean(cached.values()), 1),
        "outputs": [first_out["r0"], *(outputs[r.request_id] for r in requests[1:])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, required=True)
    ap.add_argument("--ssm", type=Path, default=Path("../shared/models/pycode-a/ssm"))
    ap.add_argument("--prompts", type=Path, default=Path("../shared/models/pycode-a/prompts.jsonl"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=512, help="tokens of the prompt prefix every request shares")
    ap.add_argument("--suffix", type=int, default=32, help="tokens of each request's own prompt after the prefix")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--kv-block-size", type=int, default=16)
    ap.add_argument(
        "--kv-cache-bytes", type=int, default=1 << 30, help="each model's KV pool (the services' default: 1 GiB)"
    )
    ap.add_argument("--speculation", default="none", help="none, auto or a static tree such as 1,1,3,1")
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=EngineConfig.max_prefill_tokens,
        help="admission's prefill cap per iteration (0: none)",
    )
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.requests < 2 or args.kv_block_size < 1:
        raise SystemExit("needs --requests >= 2 and --kv-block-size >= 1 (prefix caching is of paged KV pools)")
    torch.manual_seed(0)
    windows = prompt_windows(args.llm, args.prompts, args.requests + 1, max(args.prefix, args.suffix))
    prompts = [tuple(windows[0][: args.prefix] + w[: args.suffix]) for w in windows[1:]]
    rows = [run(args, caching, prompts) for caching in (False, True)]
    if rows[0]["outputs"] != rows[1]["outputs"]:
        raise SystemExit("prefix caching changed the generated tokens")
    speedup = rows[0]["later_ttft_median_s"] / rows[1]["later_ttft_median_s"]
    dtype = resolve_dtype(args.dtype, "cpu")
    print(
        f"{args.requests} requests: a {args.prefix}-token shared prefix + {args.suffix} tokens each, "
        f"{args.new_tokens} new tokens, speculation {args.speculation}, KV blocks of {args.kv_block_size}, {dtype}, "
        f"prefill cap {args.max_prefill_tokens or 'none'}"
    )
    print(
        "| prefix caching | TTFT first request (s) | TTFT later requests, median (s) | mean (s) "
        "| cached prompt tokens of later requests |"
    )
    print("| --- " * 5 + "|")
    for r in rows:
        print(
            f"| {r['prefix_caching']} | {r['first_ttft_s']} | {r['later_ttft_median_s']} | {r['later_ttft_mean_s']} "
            f"| {r['later_cached_prompt_tokens']} |"
        )
    print(f"later requests' median TTFT {speedup:.1f}x lower with prefix caching")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = [{k: v for k, v in r.items() if k != "outputs"} for r in rows]
        args.json.write_text(
            json.dumps(
                {"args": {k: str(v) for k, v in vars(args).items()}, "rows": summary, "speedup": round(speedup, 2)},
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
