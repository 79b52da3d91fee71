"""Facts read from a Hugging Face checkpoint folder without loading weights (no torch), so the
request manager can use them too."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The checkpoint's ``tokenizer.json``, or None when it ships none."""
    f = Path(path) / "tokenizer.json"
    return Tokenizer.from_file(str(f)) if f.is_file() else None


def eos_token_id(path: str | Path) -> int | None:
    """EOS from generation_config.json, else config.json (the first one if a list)."""
    for name in ("generation_config.json", "config.json"):
        f = Path(path) / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None
