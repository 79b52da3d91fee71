"""Where a step's time goes: the LLM's model time, and the host work around it, in process and through the services.

A *step* is one LLM verify round of a request (batch 1 here, so one step per round). For each mode it generates
``--count`` prompts of ``--new-tokens`` tokens, greedy, one request at a time, and prints milliseconds per step:

- in process (:class:`SpeculativeEngine`): the whole step; the LLM's model forward alone (``NativeModel.forward``,
  the packed step's tensors and attention metadata included, i.e. the runner's call); the LLM backend's
  bookkeeping around it (``forward_tree`` minus the model: cache sync, packing); the SSMs' backend calls; and the
  rest (the engine core: planning, verification maths, commits). ``products floor``: the same LLM's matrix products
  alone, every weight streamed once in model order (what a one-token step cannot go below on this machine);
- through the services (``specinfer up``'s processes, one of each, on free ports): the client's wall time per step;
  from the request manager's metrics its iteration, the verify round trip it waits for and the SSM workers' calls;
  from the verifier's metrics its Verify handler and the model call inside it. ``gRPC + network`` is the round trip
  minus the handler; ``manager host`` the iteration minus the calls it waits for; ``client + stream`` the client's
  step minus the iteration.

Modes: ``incremental`` (speculation off) and ``speculative`` (the default speculation: adaptive, the SSMs given).

    python bench/step_overhead.py --llm models/demo/llm --ssm models/demo/ssm --prompts models/demo/prompts.jsonl \\
        --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from common import Timed, delta, load_prompts, products_seconds, scrape, streamed_weights

from specinfer.client import Client
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.launcher import Stack, StackConfig
from specinfer.models.loading import eos_token_id, load_backend

REPO = Path(__file__).resolve().parents[1]
MODES = ("incremental", "speculative")
SPECULATE_COUNT = "specinfer_grpc_server_handling_seconds_count{code=OK,method=Speculate"  # the SSM worker's calls


def in_process(args, prompts: list[tuple[int, ...]]) -> dict[str, dict[str, float]]:
    torch.set_num_threads(args.threads)
    llm = load_backend(
        args.llm, "llm", args.dtype, backend="native", kv_block_size=args.kv_block_size, quantize=args.quantize
    )
    ssms = [load_backend(p, "ssm", args.dtype, backend="native", kv_block_size=args.kv_block_size) for p in args.ssm]
    engine = SpeculativeEngine(llm, ssms, EngineConfig(max_batch=1, eos_token_id=eos_token_id(args.llm)))
    if ssms:
        engine.adaptive  # noqa: B018 - calibrates the cost model now, outside the timed rows
    totals: Counter = Counter()
    Timed(totals, "llm model", llm.runner, "run")
    Timed(totals, "llm backend", llm, "forward_tree")
    for ssm in ssms:
        Timed(totals, "ssm calls", ssm, "forward_tree")
    rows = {}
    for mode in MODES:
        spec = None if mode == "incremental" else SpeculationConfig(None, tuple(range(len(ssms))))
        warm = GenerationRequest(f"{mode}-warm", prompts[0], 8, speculation=spec, ignore_eos=True)
        engine.generate([warm])
        totals.clear()
        steps, tokens, nodes, seconds = 0, 0, 0, 0.0
        for i, prompt in enumerate(prompts):
            request = GenerationRequest(f"{mode}-{i}", prompt, args.new_tokens, speculation=spec, ignore_eos=True)
            start = time.perf_counter()
            (result,) = engine.generate([request])
            seconds += time.perf_counter() - start
            steps += len(result.steps)
            nodes += sum(s.tree_size for s in result.steps)
            tokens += len(result.output_tokens)
        ms = {k: v / steps * 1e3 for k, v in totals.items()}
        rows[mode] = {
            "tokens per step": tokens / steps,
            "verified nodes per step": nodes / steps,
            "step": seconds / steps * 1e3,
            "LLM model (runner call)": ms["llm model"],
            "LLM backend bookkeeping": ms["llm backend"] - ms["llm model"],
            "SSM backend calls": ms.get("ssm calls", 0.0),
            "engine host (the rest)": seconds / steps * 1e3 - ms["llm backend"] - ms.get("ssm calls", 0.0),
        }
    model = llm.runner.model
    rows["floor"] = {"products floor": products_seconds(streamed_weights(model), model.linear, 5) * 1e3}
    return rows


def through_services(args, prompts: list[tuple[int, ...]]) -> dict[str, dict[str, float]]:
    cfg = StackConfig(
        llm=Path(args.llm),
        ssms=tuple(Path(p) for p in args.ssm),
        port=0,
        state_dir=Path(tempfile.mkdtemp()),
        backend="native",
        expansion="auto",
        threads=args.threads,
        ssm_threads=args.ssm_threads,
        extra_env=(
            ("SPECINFER_DTYPE", args.dtype),
            ("SPECINFER_QUANTIZE", args.quantize),
            ("SPECINFER_MODEL_CALLS", args.model_calls),
        ),
        rm_args=("--max-batch", "1"),
    )
    rows = {}
    with Stack(cfg) as stack, Client(stack.address, timeout=3600) as client:
        rm, verifier = stack.process("request-manager"), stack.process("llm-verifier")
        # without an SSM worker the request manager refuses speculation: incremental alone
        worker = stack.process("ssm-worker-0") if args.ssm else None

        def scrape_all() -> tuple[dict[str, float], ...]:
            return (scrape(rm.metrics_address), scrape(verifier.metrics_address)) + (
                (scrape(worker.metrics_address),) if worker is not None else ({},)
            )

        for mode in MODES if worker is not None else MODES[:1]:
            speculate = mode != "incremental"

            def request(prompt, tokens, speculate=speculate):
                return Client.request(prompt, tokens, speculation=speculate, adaptive=speculate, ignore_eos=True)

            client.generate(request(prompts[0], 8))  # warm-up
            rm0, vf0, sw0 = scrape_all()
            steps, tokens, seconds = 0, 0, 0.0
            for prompt in prompts:
                start = time.perf_counter()
                done = client.generate(request(prompt, args.new_tokens))
                seconds += time.perf_counter() - start
                steps += done.finished.usage.llm_steps
                tokens += len(done.token_ids)
            rm1, vf1, sw1 = scrape_all()
            iterations = delta(rm0, rm1, "specinfer_iteration_seconds_count")
            per = 1e3 / iterations  # ms per iteration of a sum in seconds
            iteration = delta(rm0, rm1, "specinfer_iteration_seconds_sum") * per
            verify = delta(rm0, rm1, "specinfer_verify_seconds_sum") * per
            speculate_ms = delta(rm0, rm1, "specinfer_speculate_seconds_sum") * per
            handler = delta(vf0, vf1, "specinfer_grpc_server_handling_seconds_sum{code=OK,method=Verify") * per
            model = delta(vf0, vf1, "specinfer_model_call_seconds_sum") * per
            drafting = delta(sw0, sw1, "specinfer_grpc_server_handling_seconds_sum{code=OK,method=Speculate") * per
            rows[mode] = {
                "tokens per step": tokens / steps,
                "verified nodes per step": delta(vf0, vf1, "specinfer_model_tree_nodes_total") / iterations,
                "drafted nodes per step": delta(sw0, sw1, "specinfer_model_tree_nodes_total") / iterations,
                "context misses per step": delta(sw0, sw1, "specinfer_context_cache_misses_total") / iterations,
                "step (client)": seconds / steps * 1e3,
                "manager iteration": iteration,
                "verify round trip": verify,
                "verifier handler": handler,
                "verifier model call": model,
                "gRPC + network (round trip - handler)": verify - handler,
                "SSM worker calls": speculate_ms,
                "SSM worker handlers": drafting,
                "SSM calls per step": delta(
                    sw0, sw1, "specinfer_grpc_server_handling_seconds_count{code=OK,method=Speculate"
                )
                / iterations,
                "manager host (iteration - calls)": iteration - verify - speculate_ms,
                "client + stream (step - iteration)": seconds / steps * 1e3 - iteration,
            }
    return rows


def print_table(title: str, rows: dict[str, dict[str, float]]) -> None:
    print(f"\n{title}\n| part | " + " | ".join(rows) + " |\n|---|" + "---:|" * len(rows))
    keys = list(dict.fromkeys(k for r in rows.values() for k in r))
    for key in keys:
        cells = [f"{r[key]:.2f}" if key in r else "" for r in rows.values()]
        print(f"| {key} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, default=REPO / "models/demo/llm")
    ap.add_argument(
        "--ssm",
        action="append",
        default=None,
        help="an SSM folder; repeat for several; none: no SSM (the default "
        "speculation then drafts from the request's own text)",
    )
    ap.add_argument("--quantize", default="none", help="the LLM's weights (none, int8, int4; SPECINFER_QUANTIZE)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ssm-threads", type=int, default=1, help="torch threads of the SSM worker (services)")
    ap.add_argument("--model-calls", default="inline", help="the model services' --model-calls: inline or thread")
    ap.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        help="in process: the KV pools' block size (0: contiguous; the services' default: 16)",
    )
    ap.add_argument(
        "--prompts", type=Path, default=REPO / "models/demo/prompts.jsonl", help="JSON lines, a text or prompt each"
    )
    ap.add_argument("--prompt-tokens", type=int, default=64, help="each prompt cut to its last this many tokens")
    ap.add_argument("--count", type=int, default=4, help="prompts (one request at a time)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--paths", default="in-process,services", help="in-process, services, or both (comma list)")
    args = ap.parse_args()
    args.ssm = [Path(p) for p in args.ssm if p != "none"] if args.ssm is not None else [REPO / "models/demo/ssm"]
    prompts = load_prompts(args.prompts, args.llm, args.count, args.prompt_tokens)
    paths = args.paths.split(",")
    print(
        f"LLM {args.llm} (quantize {args.quantize}), SSMs {[str(p) for p in args.ssm]}, {args.dtype}, "
        f"{args.threads} threads, batch 1, model calls {args.model_calls} (services), "
        f"{args.count} prompts x {args.new_tokens} new tokens, greedy; ms per LLM step"
    )
    if "in-process" in paths:
        print_table("In process", in_process(args, prompts))
    if "services" in paths:
        print_table("Through specinfer up", through_services(args, prompts))


if __name__ == "__main__":
    main()
