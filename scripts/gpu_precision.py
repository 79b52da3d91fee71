#!/usr/bin/env python3
"""Where fp32 logits on a device part from transformers' (scripts/gpu_check.sh, step ``precision``).

The first GPU run (H100, 2026-11-27) passed every native-vs-transformers test but the five of the ``gemma2-capped``
tiny model (soft-caps 1.0 on attention scores and 0.5 on logits), at 1.1-1.3e-4 against a tolerance of 1e-4, while
transformers' own fp32 on the CPU is within 6.4e-7 of fp64 on that model. This prints, per tiny model of
``tests/test_native.py``, the error of each fp32 path against transformers in fp64 on the CPU (max |a - b| / max |b|
over the logits of four prompts): transformers on the CPU and on the device, our native runtime on the CPU, and on
the device with the PyTorch attention and with the Triton kernel. The column that moves names the cause.

``gpu_precision.py [--device cuda] [--models NAME ...]``; without a CUDA device only the CPU columns are filled.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny configurations of the native tests: one home for them

from test_native import _rel, _tiny_configs, save_tiny_checkpoint, tiny_prompts  # noqa: E402

from specinfer.models.interface import TreeForward  # noqa: E402
from specinfer.models.native import NativeBackend, NativeOptions  # noqa: E402

DEFAULT_MODELS = ("gemma2-capped", "gemma2", "llama-gqa", "qwen3", "gemma3")


def _hf_logits(model, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p], device=device)).logits[0] for p in prompts]


def _native_logits(path: Path, prompts: list[list[int]], device: str, attention: str) -> list[torch.Tensor]:
    native = NativeBackend.load(path, NativeOptions(kv_cache_bytes=1 << 24, attention=attention, device=device))
    return native.forward_tree(
        [TreeForward(f"r{i}", [], p, list(range(-1, len(p) - 1))) for i, p in enumerate(prompts)]
    )


def measure(name: str, device: str | None, workdir: Path) -> dict[str, float | None]:
    """The errors of one tiny model (the ``checkpoint`` fixture's of tests/test_native.py, on its prompts)."""
    path = workdir / name
    hf32 = save_tiny_checkpoint(name, path)
    prompts = tiny_prompts()
    oracle = _hf_logits(copy.deepcopy(hf32).double(), prompts, "cpu")

    def worst(outs: list[torch.Tensor]) -> float:
        return max(_rel(a, b) for a, b in zip(outs, oracle, strict=True))

    row: dict[str, float | None] = {
        "transformers cpu": worst(_hf_logits(hf32, prompts, "cpu")),
        "native cpu": worst(_native_logits(path, prompts, "cpu", "torch")),
        "transformers device": None,
        "native device torch": None,
        "native device triton": None,
    }
    if device is not None:
        row["transformers device"] = worst(_hf_logits(copy.deepcopy(hf32).to(device), prompts, device))
        row["native device torch"] = worst(_native_logits(path, prompts, device, "torch"))
        row["native device triton"] = worst(_native_logits(path, prompts, device, "triton"))
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else None)
    ap.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), choices=sorted(_tiny_configs()))
    args = ap.parse_args(argv)
    print(f"fp32 logits against transformers in fp64 on the CPU (max |a - b| / max |b|); device {args.device}")
    print(f"tf32 allowed in torch matmul: {torch.backends.cuda.matmul.allow_tf32}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: measure(name, args.device, Path(tmp)) for name in args.models}
    columns = list(next(iter(rows.values())))
    print("| model | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for name, row in rows.items():
        cells = ["-" if v is None else f"{v:.2e}" for v in row.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
