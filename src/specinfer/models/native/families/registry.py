"""The family registry: which family (:mod:`.base`) runs each Hugging Face ``model_type``.

Adding a family: its module (config mapping, weight names, blocks), and its line in ``FAMILIES``.
"""

from __future__ import annotations

from types import MappingProxyType

from specinfer.models.native.families import gemma, llama, opt
from specinfer.models.native.families.base import Family
from specinfer.models.native.spec import UnsupportedModel

FAMILIES: MappingProxyType[str, Family] = MappingProxyType(
    {
        family.model_type: family
        for family in (
            llama.LLAMA,
            llama.MISTRAL,
            llama.QWEN2,
            llama.QWEN3,
            llama.PHI3,
            gemma.GEMMA2,
            gemma.GEMMA3_TEXT,
            gemma.GEMMA3,
            opt.OPT,
        )
    }
)
SUPPORTED = tuple(FAMILIES)  # every model_type the native runtime runs


def family_of(model_type: str | None) -> Family:
    """The family of ``model_type``; :class:`UnsupportedModel` naming it when no family runs it."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise UnsupportedModel(f"model_type {model_type!r} is not one of {SUPPORTED}")
    return family
