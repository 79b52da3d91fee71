"""An in-process engine from checkpoint folders, as ``specinfer generate`` builds it: :func:`load_engine`.

*Models* (:class:`EngineModels`): the LLM's folder, the SSMs' folders (each drafting in the LLM's token IDs,
through a vocabulary map where its tokenizer differs: :mod:`specinfer.models.cross_vocab`), an optional draft head,
and how they run (dtype, device, backend, kernels, offloading, quantization). The engine gets:

- the LLM's end-of-sequence token and the SSMs' tuning files as adaptive speculation's priors;
- the *cost entry* of the calibration cache (:mod:`specinfer.engine.calibration_cache`, ``calibration_cache`` as
  ``--calibration-cache``: empty reads ``SPECINFER_CALIBRATION_CACHE``, then the user's cache folder; ``none``
  turns it off). The first adaptive request reads the cost model from it, or probes one in about a second on a
  miss, and :meth:`~specinfer.engine.SpeculativeEngine.generate` writes back what the steps refined: the Python API
  starts as fast as the command does, where an engine built without an entry calibrates for tens of seconds;
- the tokenizer's grammars, so requests with a :class:`~specinfer.core.constraints.Constraint` are served.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from specinfer.core.acceptance import DEFAULT_SLOT_PRIOR
from specinfer.core.constraints import grammars_for
from specinfer.core.errors import InvalidArgument
from specinfer.core.planner import OFFLOAD_PLANNER, PlannerConfig
from specinfer.engine.calibration_cache import (
    CalibrationCache,
    CostEntry,
    ModelIdentity,
    ModelRuntime,
    engine_cost_entry,
)
from specinfer.engine.engine import EngineConfig, SpeculativeEngine
from specinfer.models.interface import CausalLM

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True)
class EngineModels:
    """The checkpoints of an in-process engine and how they run (the settings of ``specinfer generate``'s flags of
    the same names; ``head``: a draft head of the LLM from ``specinfer train-head``)."""

    llm: Path
    ssms: tuple[Path, ...] = ()
    head: Path | None = None
    dtype: str = "auto"
    device: str = "cpu"  # torch device of the LLM and the SSMs (cpu, cuda, cuda:N)
    backend: str = "auto"
    attention: str = "auto"
    offload: bool = False  # the LLM's decoder layers in host memory, streamed layer by layer (docs/offloading.md)
    offload_reserve_bytes: int = 0
    quantize: str = "none"  # the decoder projections: none, int8 or int4 (docs/quantization.md)
    calibration_cache: str = ""  # the cost model's cache folder (empty: the environment's or the user's; none: off)

    def __post_init__(self) -> None:
        object.__setattr__(self, "llm", Path(self.llm))
        object.__setattr__(self, "ssms", tuple(Path(s) for s in self.ssms))
        if self.head is not None:
            object.__setattr__(self, "head", Path(self.head))

    def identity(self, path: Path, offload: bool) -> ModelIdentity:
        """What the calibration cache keys the checkpoint ``path`` by, run as these settings say."""
        reserve = self.offload_reserve_bytes if offload else 0
        runtime = ModelRuntime(
            self.dtype,
            self.device,
            self.backend,
            self.attention,
            offload=offload,
            offload_reserve_bytes=reserve,
            quantize=self.quantize,
        )
        return ModelIdentity.of(path, runtime)

    def cost_entry(self, vocabularies: Sequence[str]) -> CostEntry:
        """Where the engine's cost model is cached (after loading: the key holds the thread count)."""
        cache = CalibrationCache.from_setting(self.calibration_cache, os.environ)
        ssms = [self.identity(p, False) for p in self.ssms]
        return engine_cost_entry(cache, self.identity(self.llm, self.offload), ssms, vocabularies)


@dataclass(frozen=True)
class LoadedModels:
    """``llm`` (with its head, if any), ``ssms`` in the LLM's token IDs, and how each SSM drafts in the LLM's
    vocabulary (``vocabularies``, :func:`~specinfer.models.cross_vocab.vocabulary_method`)."""

    llm: CausalLM
    ssms: tuple[CausalLM, ...]
    vocabularies: tuple[str, ...]


def load_models(models: EngineModels, out: TextIO | None = None) -> LoadedModels:
    """The backends of ``models``; a note on ``out`` (default stderr) for each SSM with another tokenizer."""
    from specinfer.checkpoint import check_checkpoint
    from specinfer.models.cross_vocab import draft_vocabulary, in_llm_ids, vocabulary_method
    from specinfer.models.loading import load_backend

    llm = load_backend(
        models.llm,
        "llm",
        models.dtype,
        models.device,
        backend=models.backend,
        attention=models.attention,
        offload=models.offload,
        offload_reserve_bytes=models.offload_reserve_bytes,
        quantize=models.quantize,
    )
    if models.head is not None:
        from specinfer.models.head_drafter import with_head

        llm = with_head(llm, models.head, models.llm)
    ssms, vocabularies = [], []
    for i, path in enumerate(models.ssms):
        check_checkpoint(path, f"ssm[{i}]")
        vmap = draft_vocabulary(models.llm, path, f"ssm[{i}]")
        ssm = load_backend(
            path,
            f"ssm[{i}]",
            models.dtype,
            models.device,
            backend=models.backend,
            attention=models.attention,
            quantize=models.quantize,
        )
        if vmap is not None:  # another tokenizer: it drafts the tokens both vocabularies spell alike
            print(
                f"--- ssm[{i}] has another tokenizer: drafting the {vmap.shared} tokens of its {vmap.ssm_size} "
                "that the LLM's spells alike",
                file=out or sys.stderr,
            )
        ssms.append(in_llm_ids(ssm, vmap))
        vocabularies.append(vocabulary_method(vmap))
    return LoadedModels(llm, tuple(ssms), tuple(vocabularies))


def engine_of(
    models: EngineModels, loaded: LoadedModels, constraints: bool = True, tokenizer: Tokenizer | None = None
) -> SpeculativeEngine:
    """An engine over ``loaded`` (the backends of ``models``), with the cost entry of ``models``' calibration cache;
    ``constraints``: compile the tokenizer's grammars for constrained requests (False: such requests are refused);
    ``tokenizer``: the LLM's, where the caller has it loaded (None: read from its folder when constraints need it)."""
    from specinfer.models.loading import eos_token_id, load_tokenizer
    from specinfer.tuning import slot_prior

    priors = tuple(slot_prior(p) or DEFAULT_SLOT_PRIOR for p in models.ssms)  # adaptive speculation's prior
    # offloaded steps cost a transfer whatever their tokens: larger trees pay
    planner = OFFLOAD_PLANNER if models.offload else PlannerConfig()
    eos = eos_token_id(models.llm)
    config = EngineConfig(eos_token_id=eos, planner=planner, slot_priors=priors)
    grammars = None
    if constraints:
        tokenizer = tokenizer or load_tokenizer(models.llm)
        if tokenizer is None:
            raise InvalidArgument("llm", "has no tokenizer.json, so constraints cannot be compiled")
        grammars = grammars_for(tokenizer, loaded.llm.vocab_size, eos)
    entry = models.cost_entry(loaded.vocabularies)
    return SpeculativeEngine(loaded.llm, list(loaded.ssms), config, cost_entry=entry, grammars=grammars)


def load_engine(models: EngineModels, constraints: bool = True, out: TextIO | None = None) -> SpeculativeEngine:
    """The engine ``specinfer generate`` would build for ``models``: :func:`load_models`, then :func:`engine_of`."""
    return engine_of(models, load_models(models, out), constraints)
