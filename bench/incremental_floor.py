"""How close our incremental (one-token) step is to the machine's weight-streaming floor.

Prints, for one LLM on the native backend: the decode time per token of a request without speculation
(in process, batch 1, the prompt's prefill left out), and the time of the step's matrix products alone
(every decoder layer's and the LM head's weights, one row each, in model order) in each form the runtime
can choose (``specinfer.models.native.gemm``: ``F.linear``, the transposed GEMM, the matrix-vector
product) and in the plan measured at load. The products stream all the weights once, so their time is
the floor a one-token step can reach; the difference to the decode time is everything else (attention,
norms, RoPE, sampling, Python).

    python bench/incremental_floor.py --llm /tmp/pycode-a-llm-1b --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import products_seconds, streamed_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, required=True, help="checkpoint folder (a native-backend family)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per row")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from specinfer.core import SamplingParams
    from specinfer.engine import EngineConfig, GenerationRequest, SpeculativeEngine
    from specinfer.models.loading import load_backend
    from specinfer.models.native.gemm import gemv_linear, transposed_linear

    torch.set_num_threads(args.threads)
    llm = load_backend(args.llm, "llm", args.dtype, backend="native")
    engine = SpeculativeEngine(llm, [], EngineConfig(max_batch=1))
    prompt = tuple(range(5, 45))
    runs = iter(range(10**6))

    def generate(tokens: int) -> float:
        request = GenerationRequest(f"r{next(runs)}", prompt, tokens, SamplingParams(), None, ignore_eos=True)
        start = time.perf_counter()
        engine.generate([request])
        return time.perf_counter() - start

    generate(8)  # warm-up
    first = min(generate(1) for _ in range(args.repeats))
    whole = min(generate(1 + args.new_tokens) for _ in range(args.repeats))
    decode = (whole - first) / args.new_tokens
    if decode <= 0:  # the prompt's timing moved by more than the decode steps took
        raise SystemExit(f"the decode steps ({whole - first:.4f} s) drowned in timing noise: raise --new-tokens")

    model = llm.runner.model
    weights = streamed_weights(model)
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    print(f"LLM {args.llm}, {args.dtype}, {args.threads} threads; weights streamed per token: {nbytes / 1e9:.2f} GB")
    print("| row | ms per token | weights GB/s |")
    print("|---|---:|---:|")
    print(f"| decode, no speculation (whole step) | {decode * 1e3:.1f} | {nbytes / decode / 1e9:.1f} |")
    forms = [
        ("products alone: F.linear", F.linear),
        ("products alone: transposed (w @ x.T)", transposed_linear),
        ("products alone: matrix-vector (torch.mv)", gemv_linear),
        ("products alone: the plan measured at load", model.linear),
    ]
    for name, form in forms:
        seconds = products_seconds(weights, form, args.repeats + 2)
        print(f"| {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
