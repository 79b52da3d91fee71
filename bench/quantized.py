"""Weight-only quantization (issue 51, item 2; docs/quantization.md): per scheme (none, int8, int4 at each group
size asked for), the bytes of the decoder layers' projections, incremental decoding's tokens per second at batch 1
and perplexity on held-out text, each scheme's perplexity also as a ratio of the unquantized model's in the same
dtype (the issue's targets: int8 within 1 %, int4 within 5 % of bf16).

*Perplexity*: exp of the mean negative log-likelihood of every token of the text but each window's first, given the
tokens before it in its window (windows of ``--window`` tokens, side by side, each one chain through the native
backend). The default text is this repository's own ``src/specinfer/core`` sources, held out for the bundled demo
LLM (trained on Python's standard library); name another with ``--text``.

    python bench/quantized.py --llm models/demo/llm --dtype float32
    python bench/quantized.py --llm /tmp/llm-1b --dtype bfloat16 --group-sizes 32,64,128
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from common import REPO, load_prompts

from specinfer.checkpoint import load_tokenizer
from specinfer.engine import EngineConfig, GenerationRequest, SpeculativeEngine
from specinfer.models.dtypes import DTYPE_CHOICES, DTYPES, resolve_dtype
from specinfer.models.interface import TreeForward
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.quant import DEFAULT_GROUP_SIZE, LAYER_MATRICES
from specinfer.models.native.weights import named_tensors

DEFAULT_TEXT = REPO / "src/specinfer/core"
PROMPT_TOKENS = 128  # each prompt's last tokens


def read_text(path: Path) -> str:
    """The text of a file, or of a folder's ``*.py`` files in name order."""
    if path.is_dir():
        return "\n".join(p.read_text() for p in sorted(path.rglob("*.py")))
    return path.read_text()


@torch.inference_mode()
def perplexity(backend: NativeBackend, tokens: list[int], window: int) -> float:
    """Perplexity of ``tokens`` under ``backend`` in windows of ``window`` tokens (module docstring)."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if len(chunk) < 2:
            break
        logits = backend.forward_tree([TreeForward("ppl", [], chunk, list(range(-1, len(chunk) - 1)))])[0]
        logp = torch.log_softmax(logits[:-1].double(), dim=-1)  # [n - 1, vocab]
        nll -= logp.gather(1, torch.tensor(chunk[1:], device=logp.device)[:, None]).sum().item()
        count += len(chunk) - 1
        backend.release("ppl")
    return math.exp(nll / count)


def incremental_tokens_per_second(backend: NativeBackend, prompts: list[tuple[int, ...]], new_tokens: int) -> float:
    """Tokens per second of greedy decoding without speculation, one request at a time (after one warm-up request)."""
    engine = SpeculativeEngine(backend, [], EngineConfig())
    engine.generate([GenerationRequest("warm-up", prompts[0], 4, ignore_eos=True)])
    start, tokens = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        tokens += len(engine.generate([GenerationRequest(f"r{i}", p, new_tokens, ignore_eos=True)])[0].output_tokens)
    return tokens / (time.perf_counter() - start)


def projection_bytes(backend: NativeBackend) -> int:
    """Bytes of every decoder layer's projections (packed values and scales when quantized)."""
    layers = backend.runner.model.w.layers
    return sum(
        t.numel() * t.element_size()
        for layer in layers
        for name, t in named_tensors(layer).items()
        if name.partition(".")[0] in LAYER_MATRICES
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", type=Path, default=REPO / "models/demo/llm")
    ap.add_argument("--prompts", type=Path, default=REPO / "models/demo/prompts.jsonl")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="held-out text: a file, or a folder's *.py files")
    ap.add_argument("--tokens", type=int, default=8192, help="most tokens of the text scored (0: all)")
    ap.add_argument("--window", type=int, default=256, help="tokens per perplexity window")
    ap.add_argument("--requests", type=int, default=4, help="prompts decoded one at a time for tokens per second")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--schemes", default="none,int8,int4", help="comma-separated: none, int8, int4")
    ap.add_argument(
        "--group-sizes", default=str(DEFAULT_GROUP_SIZE), help="int4's inputs per scale, comma-separated (one row each)"
    )
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 27)
    args = ap.parse_args()
    dtype = resolve_dtype(args.dtype, args.device)
    tokens = load_tokenizer(args.llm).encode(read_text(args.text)).ids
    tokens = tokens[: args.tokens] if args.tokens else tokens
    prompts = load_prompts(args.prompts, args.llm, args.requests, PROMPT_TOKENS)
    rows = []
    for scheme in args.schemes.split(","):
        groups = [int(g) for g in args.group_sizes.split(",")] if scheme == "int4" else [DEFAULT_GROUP_SIZE]
        for group in groups:
            options = NativeOptions(
                DTYPES[dtype],
                args.device,
                args.kv_cache_bytes,
                max_seq_len=max(args.window, PROMPT_TOKENS + args.new_tokens),
                quantize=scheme,
                quantize_group_size=group,
            )
            backend = NativeBackend.load(args.llm, options)
            name = f"{scheme} (groups of {group})" if scheme == "int4" else scheme
            ppl = perplexity(backend, tokens, args.window)
            rate = incremental_tokens_per_second(backend, prompts, args.new_tokens) if args.new_tokens else math.nan
            rows.append((scheme, name, projection_bytes(backend), rate, ppl))
    base = next((r for r in rows if r[0] == "none"), None)
    print(
        f"{args.llm}, {dtype} activations on {args.device}, torch threads {torch.get_num_threads()}: perplexity of "
        f"{len(tokens)} tokens of {args.text} in windows of {args.window}; incremental decoding of {args.requests} "
        f"prompts x {args.new_tokens} new tokens, batch 1"
    )
    print("| weights | projection bytes | incremental tokens/s | x none | perplexity | x none |")
    print("| --- " * 6 + "|")
    for _, name, size, rate, ppl in rows:
        speed = f"{rate / base[3]:.2f}" if base else "-"
        quality = f"{ppl / base[4]:.4f}" if base else "-"
        print(f"| {name} | {size:,} | {rate:.1f} | {speed} | {ppl:.4f} | {quality} |")


if __name__ == "__main__":
    main()
