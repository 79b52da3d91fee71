"""Tree-configuration tuner: pick the static expansion with the highest expected tokens/s for a
model pair on this hardware (the paper leaves this choice to the user).

``specinfer tune`` measures (1) where the LLM's greedy tokens rank among the SSM's predictions,
which fixes the tokens per step of every expansion exactly (:mod:`specinfer.tuning.model`), and
(2) the time of verify and draft passes by tree size (:mod:`specinfer.tuning.measure`); it then
searches every expansion up to a depth, width and node budget. The result is a JSON file; with
``--install`` it is also written as ``specinfer-tuning.json`` into the SSM's checkpoint folder,
where ``--expansion tuned`` finds it: the pick becomes the pair's static tree. (The default,
``--expansion auto``, is adaptive speculation, which reads the file's ``top_k_agreement`` as its
prior: :func:`slot_prior`.)
Anywhere an expansion is read, ``@PATH`` names such a file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from specinfer.core import ExpansionConfig, InvalidArgument
from specinfer.core.acceptance import slot_prior_from_agreement
from specinfer.core.drafts import PAPER_EXPANSION

TUNING_FILE = "specinfer-tuning.json"


def read_pick(path: str | Path, field: str = "expansion") -> str:
    """The expansion a tuning file picked."""
    try:
        return str(json.loads(Path(path).read_text())["pick"]["expansion"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(field, f"cannot read a tuning result from {path}: {exc}") from exc


def resolve_expansion(text: str, ssm_dirs: Sequence[str | Path] = (), field: str = "expansion") -> str:
    """``tuned``: the pick of the first SSM folder's tuning file, else the paper's tree;
    ``@PATH``: the pick of that tuning file; anything else is returned as given."""
    text = text.strip()
    if text.startswith("@"):
        return read_pick(text[1:], field)
    if text.lower() == "tuned":
        for d in ssm_dirs:
            f = Path(d) / TUNING_FILE
            if f.is_file():
                return read_pick(f, field)
        return PAPER_EXPANSION
    return text


NO_STATIC_TREE = ("auto", "none", "off")  # --expansion keywords that name no static tree


def static_expansion(
    text: str, ssm_dirs: Sequence[str | Path] = (), field: str = "expansion"
) -> ExpansionConfig | None:
    """The static tree an ``--expansion`` value names (``tuned`` and ``@PATH`` resolved by :func:`resolve_expansion`),
    or None for ``auto`` (adaptive), ``none`` and ``off``; a value that does not parse is InvalidArgument."""
    if text.strip().lower() in NO_STATIC_TREE:
        return None
    return ExpansionConfig.parse(resolve_expansion(text, ssm_dirs, field))


def slot_prior(ssm_dir: str | Path) -> tuple[float, ...] | None:
    """The prior slot acceptance of adaptive speculation for the SSM in ``ssm_dir``, from its
    installed tuning file's ``acceptance.top_k_agreement``; None without a readable one (the
    callers then use :data:`~specinfer.core.acceptance.DEFAULT_SLOT_PRIOR`)."""
    f = Path(ssm_dir) / TUNING_FILE
    if not f.is_file():
        return None
    try:
        agreement = json.loads(f.read_text())["acceptance"]["top_k_agreement"]
        return slot_prior_from_agreement({int(k): float(v) for k, v in agreement.items()}) or None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
