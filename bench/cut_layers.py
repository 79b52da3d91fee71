"""Make a weak draft model: a Hugging Face checkpoint cut to its first N decoder layers.

The result keeps the embeddings, the first ``--layers`` blocks, the final norm and the LM head of
the source (and its tokenizer), so it drafts in the same vocabulary at a fraction of the cost; the
fewer layers, the worse it agrees with the source. Issue 21 uses the shared pair's LLM cut to one
layer as the *weak SSM* of its benchmarks.

    python bench/cut_layers.py ../shared/models/pycode-a/llm /tmp/pycode-a-weak-ssm --layers 1
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file


def cut(src: Path, dst: Path, layers: int) -> None:
    config = json.loads((src / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']}]")
    config["num_hidden_layers"] = layers
    for key in ("layer_types",):  # per-layer lists some configs carry
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    weights = load_file(str(src / "model.safetensors"))
    keep = {}
    for name, tensor in weights.items():
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m is None or int(m.group(1)) < layers:
            keep[name] = tensor.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if (
            f.name not in ("config.json", "model.safetensors")
            and f.is_file()
            and not f.name.startswith("specinfer-tuning")
        ):
            shutil.copy(f, dst / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--layers", type=int, default=1)
    args = ap.parse_args()
    cut(args.src, args.dst, args.layers)
    print(f"wrote {args.dst} ({args.layers} layer(s) of {args.src})")


if __name__ == "__main__":
    main()
