"""``specinfer map-head``: carry a draft head over to an inflated copy of its LLM.

``/work/shared/tools/inflate_llm.py`` widens a small Llama from hidden ``h`` to ``H`` with the same logits: the
residual stream's first ``h`` dims carry the small model and the rest stay exactly zero, every RMSNorm's weight
is scaled by ``sqrt(h / H)`` and its eps by ``h / H``. So the inflated LLM's features (final-normed) and
embedding rows are the small one's, padded with zeros, and its LM head reads only their first ``h`` dims.

The mapped head (:func:`map_head`) computes the same predictions, padded with zeros, from those padded inputs:

- its input norms average over ``H`` dims of which ``h`` are non-zero: ``mean' = (h / H) mean``. With
  ``c = sqrt(h / H)``, eps ``eps * c^2`` and weights ``w * c`` they give the small head's normed inputs
  (``x / sqrt(c^2 (mean + eps)) * w * c``), padded with zeros;
- its one eps is shared by the norms of its own width (``hidden``, unchanged), so the residual stream there
  is scaled by ``c`` to match: ``fc``, ``o`` and ``down`` times ``c`` (norms are scale-free up to eps, and
  ``rms(c x, eps c^2) = rms(x, eps)``); q/k/v and gate/up read normed values and are kept;
- ``fc`` reads the padded inputs through zero columns, ``out`` writes zeros to the extra feature dims.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from specinfer.core import InvalidArgument
from specinfer.models.draft_head import DRAFT_VOCAB_FILE, DraftHead, llm_signature, load_head, save_head


def map_head(head: DraftHead, width: int, llm: str = "") -> DraftHead:
    """``head`` for an inflation of its LLM to feature width ``width`` (module docstring); ``llm``: its
    signature (:func:`llm_signature`)."""
    c = head.config
    h, big = c.feature_dim, width
    if big < h:
        raise InvalidArgument("llm", f"feature width {big} is below the head's {h}: not an inflation of its LLM")
    scale = math.sqrt(h / big)
    mapped = DraftHead(replace(c, feature_dim=big, norm_eps=c.norm_eps * h / big, llm=llm or c.llm))
    src = {k: v.detach().float() for k, v in head.state_dict().items()}
    state = {k: v.clone() for k, v in src.items()}
    for name in ("feature_norm", "embed_norm"):
        state[name] = torch.ones(big)
        state[name][:h] = src[name] * scale
    fc = torch.zeros(c.hidden, 2 * big)
    fc[:, :h] = src["fc.weight"][:, :h] * scale
    fc[:, big : big + h] = src["fc.weight"][:, h:] * scale
    state["fc.weight"] = fc
    state["o.weight"] = src["o.weight"] * scale
    state["down.weight"] = src["down.weight"] * scale
    out = torch.zeros(big, c.hidden)
    out[:h] = src["out.weight"]
    state["out.weight"] = out
    mapped.load_state_dict(state)
    return mapped.eval().requires_grad_(False)


def run_map_head(head_dir: Path, llm_dir: Path, out: Path) -> DraftHead:
    """Map the head in ``head_dir`` onto the inflated LLM in ``llm_dir``, written to ``out`` (same dtype)."""
    from safetensors import safe_open

    from specinfer.models.draft_head import is_head_dir

    if not is_head_dir(head_dir):
        raise InvalidArgument("head", f"{head_dir} is not a draft-head folder")
    try:
        raw = json.loads((llm_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument("llm", f"{llm_dir}: no readable config.json ({exc})") from None
    text = raw.get("text_config") or raw
    head = load_head(head_dir)
    if int(text.get("vocab_size", -1)) != head.config.vocab_size:
        raise InvalidArgument("llm", f"vocabulary {text.get('vocab_size')} is not the head's {head.config.vocab_size}")
    mapped = map_head(head, int(text["hidden_size"]), llm_signature(raw))
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        dtype = str(f.get_tensor(next(iter(f.keys()))).dtype).removeprefix("torch.")
    save_head(mapped, out, {"mapped_from": str(head_dir), "mapped_to": str(llm_dir)}, dtype=dtype)
    if (head_dir / DRAFT_VOCAB_FILE).is_file():  # the same vocabulary: the same draft vocabulary
        shutil.copyfile(head_dir / DRAFT_VOCAB_FILE, out / DRAFT_VOCAB_FILE)
    print(f"map-head: {out} (feature width {head.config.feature_dim} -> {mapped.config.feature_dim})")
    return mapped
