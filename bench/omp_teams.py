"""What a second OpenMP team costs a process: incremental decoding on the main thread, before and after another thread
has run some torch work (the reason each service model does all its torch work in one thread,
:class:`specinfer.serving.runner.ModelThread`).

PyTorch runs the parallel part of a CPU operation on an OpenMP team of the calling thread. Each row below starts a
fresh process (``--llm``, ``--dtype``, ``--quantize``, ``--threads`` torch threads), times greedy decoding of
``--new-tokens`` tokens after a 64-token prompt on the main thread (best of ``--rounds``), runs the row's work once in
a second thread, waits half a second, and times the main thread again while that thread is still alive (a thread
that exits takes its OpenMP team with it; a service's threads live as long as it does):

- ``nothing``: a second thread that runs no torch work (the control);
- ``parallel sum``: a sum of 4 M floats in a second thread with ``--threads`` torch threads (runs in parallel);
- ``small sum``: a sum of 100 floats there (too small to run in parallel);
- ``decoding, 1 thread`` / ``decoding, N threads``: the same decoding in the second thread with 1 or ``--threads``
  torch threads (the services' layout before ModelThread: a model loaded on the main thread, called from another).

    python bench/omp_teams.py --llm ~/.cache/specinfer/gguf/SmolLM2-135M-Instruct.Q4_1-<hash> --dtype bfloat16 \\
        --quantize int4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK = ("nothing", "parallel sum", "small sum", "decoding, 1 thread", "decoding, N threads")


def one_row(args: argparse.Namespace, work: str) -> dict[str, float]:
    """In this process (a fresh one per row): the main thread's ms a token before and after ``work``."""
    import torch

    from specinfer.engine import EngineConfig, GenerationRequest, SpeculativeEngine
    from specinfer.models.loading import load_backend

    torch.set_num_threads(args.threads)
    llm = load_backend(args.llm, "llm", args.dtype, backend="native", kv_block_size=16, quantize=args.quantize)
    engine = SpeculativeEngine(llm, [], EngineConfig(max_batch=1, eos_token_id=None))
    prompt = tuple((i * 7919) % 4000 + 5 for i in range(64))  # ids every vocabulary here has
    count = iter(range(1 << 30))

    def decode() -> float:
        best = float("inf")
        for _ in range(args.rounds):
            start = time.perf_counter()
            engine.generate([GenerationRequest(f"r{next(count)}", prompt, args.new_tokens, ignore_eos=True)])
            best = min(best, (time.perf_counter() - start) / args.new_tokens * 1e3)
        return best

    decode()  # warm-up
    before = decode()
    threads = 1 if work == "decoding, 1 thread" else args.threads
    # the second thread stays alive while the main thread is timed again, as a service's threads do: a thread that
    # exits takes its OpenMP team with it
    pool = concurrent.futures.ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,))
    jobs = {
        "nothing": lambda: None,
        "parallel sum": lambda: torch.ones(4_000_000).sum().item(),
        "small sum": lambda: torch.ones(100).sum().item(),
    }
    pool.submit(jobs.get(work, decode)).result()
    time.sleep(0.5)
    after = decode()
    pool.shutdown()
    return {"before": before, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default=str(REPO / "models/demo/llm"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantize", default="none")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--row", choices=WORK, help=argparse.SUPPRESS)  # a child process's one row
    args = ap.parse_args()
    if args.row:
        print(json.dumps(one_row(args, args.row)))
        return
    print(
        f"{args.llm}, {args.dtype}, quantize {args.quantize}, {args.threads} torch threads, ms a token (best of "
        f"{args.rounds} x {args.new_tokens} tokens)"
    )
    print("| work in a second thread | main thread before | main thread after | after / before |\n|---|---:|---:|---:|")
    for work in WORK:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", work]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        row = json.loads(out)
        name = work.replace("N threads", f"{args.threads} threads")
        print(f"| {name} | {row['before']:.2f} | {row['after']:.2f} | {row['after'] / row['before']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
