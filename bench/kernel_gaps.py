"""What the CPU kernels' calls cost when steps come with gaps between them: one model's one-token steps or tree
verifies, each followed by a busy gap of G microseconds (the time a step spends elsewhere: Python, the network),
timing the fused layers' and final logits' C calls alone and the whole forward.

Why: the kernels' thread team (``kernels/cpu_team.c``) keeps its workers spinning about a millisecond after a call
and then lets them sleep; a worker woken from sleep joins a call late (on a virtual machine's idle CPU, tens to
hundreds of microseconds), so the calls that follow a long gap cost more than back-to-back ones. ``--torch-ops``
adds a softmax and an argmax over the step's logits after each forward (PyTorch operations big enough to run on
OpenMP's threads, whose worker then busy-waits beside the team's).

    python bench/kernel_gaps.py --llm models/demo/llm --dtype bfloat16 --nodes 1,19 --gaps 0,300,1000,3000
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specinfer.kernels import cpu_qgemm
from specinfer.models.interface import TreeForward
from specinfer.models.native import NativeBackend, NativeOptions

TIMED = ("decoder_layers", "final_logits")  # the library's calls a fused step makes


def timed_library(times: dict[str, list[int]]) -> None:
    """Wraps the library's step calls so that each appends its nanoseconds to ``times[name]``."""
    lib = cpu_qgemm.library()
    if lib is None:
        raise SystemExit(f"the C kernels do not run here: {cpu_qgemm.unavailable_reason()}")
    for name in TIMED:
        fn = getattr(lib, name)

        def wrapper(*args, _fn: Callable = fn, _name: str = name):
            start = time.perf_counter_ns()
            out = _fn(*args)
            times.setdefault(_name, []).append(time.perf_counter_ns() - start)
            return out

        setattr(lib, name, wrapper)


def busy(microseconds: int) -> None:
    end = time.perf_counter_ns() + microseconds * 1000
    while time.perf_counter_ns() < end:
        pass


def run(backend: NativeBackend, nodes: int, gap: int, steps: int, torch_ops: bool, times: dict) -> dict[str, float]:
    """Median microseconds of the calls and the forward over ``steps`` verifies of a ``nodes``-node tree (a binary
    tree; one node: a one-token step) behind a fixed 100-token context, the first sixth left out as warm-up."""
    tokens = [7 + i for i in range(nodes)]
    parents = [-1] + [i // 2 for i in range(nodes - 1)]
    context = list(range(5, 105))
    rid = f"n{nodes}-g{gap}"
    times.clear()
    forward: list[int] = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        logits = backend.forward_tree([TreeForward(rid, context, tokens, parents)])[0]
        if torch_ops:
            torch.softmax(logits.float(), -1).argmax(-1)
        forward.append(time.perf_counter_ns() - start)
        busy(gap)
    backend.release(rid)

    def median(values: list[int]) -> float:
        return statistics.median(values[len(values) // 6 :]) / 1000

    return {"layers": median(times["decoder_layers"]), "logits": median(times["final_logits"]), "step": median(forward)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm", default="models/demo/llm")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--nodes", default="1,19", help="tree sizes (comma list)")
    parser.add_argument("--gaps", default="0,300,1000,3000", help="busy microseconds after each step (comma list)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--torch-ops", action="store_true", help="a softmax and argmax of the logits after each step")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 28)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[int]] = {}
    timed_library(times)
    options = NativeOptions(
        dtype=getattr(torch, args.dtype),
        kv_cache_bytes=args.kv_cache_bytes,
        kv_block_size=16,
        quantize="none",
        gemm="linear",
        fused_layers=True,
        prefix_caching=False,
    )
    backend = NativeBackend.load(args.llm, options)
    print(f"{args.llm}, {args.dtype}, {args.threads} threads, {args.steps} steps a row; median us")
    print("| nodes | gap (us) | fused layers call | final logits call | forward |")
    print("|---:|---:|---:|---:|---:|")
    for nodes in (int(n) for n in args.nodes.split(",")):
        for gap in (int(g) for g in args.gaps.split(",")):
            row = run(backend, nodes, gap, args.steps, args.torch_ops, times)
            print(f"| {nodes} | {gap} | {row['layers']:.0f} | {row['logits']:.0f} | {row['step']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
