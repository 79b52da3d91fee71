"""The on-disk cache of calibrated step costs, shared by ``specinfer generate`` and the services.

Timing a 1B model's passes takes tens of seconds on 2 CPU cores (:mod:`specinfer.engine.calibrate`),
and what they cost changes only with what this cache keys them by, so it is measured once and read
back on every later start.

Terms.
- *Entry*: one JSON file holding a cost model (:class:`~specinfer.core.costs.StepCosts`, or one
  SSM's :class:`~specinfer.core.costs.CostTable`) and the key it was measured under.
- *Key* (:class:`CalibrationKey`): everything that changes what the models' passes cost: each
  checkpoint's files (:func:`checkpoint_digest`) and how it runs (:class:`ModelRuntime`: dtype,
  device, backend, kernels, offloading, quantization), the host (torch threads and version, the CPU or GPU, the
  instructions the products use), the code that measured it (:func:`code_digest`), what is cached with the
  calibration's own parameters, and :data:`FORMAT_VERSION`. The file is
  named by a digest of the key and repeats the key, so a file whose key or version differs from
  the one asked for is *stale*.
- *Folder* (:func:`cache_dir`): ``--calibration-cache DIR``, else ``SPECINFER_CALIBRATION_CACHE``,
  else ``$XDG_CACHE_HOME/specinfer/calibration``, else ``~/.cache/specinfer/calibration``;
  ``none`` or ``off``: no cache (nothing is read or written).

A missing entry is a miss. A corrupt, unreadable or stale one is ignored (logged once per file and
process) and replaced by the next write. Writes go to a temporary file in the same folder, renamed
over the entry: a reader never sees half a file, and of concurrent writers one whole entry stays.
A cache is only a cache: any failure to read or write it costs a calibration, never a start.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specinfer.core.costs import CostTable, StepCosts
from specinfer.engine.calibrate import ProbeConfig
from specinfer.kernels import cpu_qgemm
from specinfer.models.dtypes import resolve_dtype
from specinfer.models.native.backend import DEFAULT_GRAPH_TOKENS

log = logging.getLogger("specinfer.calibrate")

FORMAT_VERSION = 1  # bump when the entries' format or the calibration's method changes
ENV = "SPECINFER_CALIBRATION_CACHE"
DISABLED = ("none", "off")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
MAX_ENTRIES = 256  # a write past this many entries removes the oldest (test runs and model updates leave stale ones)


def cache_dir(setting: str, environ: Mapping[str, str]) -> Path | None:
    """The cache folder for ``setting`` (a ``--calibration-cache`` value; empty: not given), see
    the module docstring; None: caching is off."""
    value = setting.strip() or environ.get(ENV, "").strip()
    if value.lower() in DISABLED:
        return None
    if value:
        return Path(value).expanduser()
    xdg = environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "specinfer" / "calibration"


def checkpoint_digest(path: str | Path) -> str:
    """A digest of what in the checkpoint folder ``path`` decides its passes' cost: the bytes of
    ``config.json`` and of any weight index, and each weight file's name, size and modification
    time (hashing gigabytes of weights at every start would cost more than the calibration saved)."""
    digest = hashlib.sha256()
    for f in sorted(Path(path).iterdir()):
        if not f.is_file():
            continue
        if f.name == "config.json" or f.name.endswith(".index.json"):
            digest.update(f"{f.name}\0".encode() + f.read_bytes() + b"\0")
        elif f.suffix in WEIGHT_SUFFIXES:
            st = f.stat()
            digest.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelRuntime:
    """How a model is loaded and run, as far as it changes what its passes cost (the arguments of
    :func:`~specinfer.models.loading.load_backend`). ``dtype`` is stored resolved (``auto`` names
    a concrete type per device). Left out: the KV pool's size (``kv_cache_bytes``, ``max_seq_len``):
    a pass over the same tokens costs the same in a larger pool."""

    dtype: str
    device: str
    backend: str  # as asked: ``auto`` resolves the same way for the same checkpoint files
    attention: str
    kv_block_size: int = 0  # 0: contiguous KV slots, else paged KV blocks of that many tokens
    prefix_caching: bool = True
    offload: bool = False
    offload_reserve_bytes: int = 0
    cuda_graph_tokens: int = DEFAULT_GRAPH_TOKENS  # on CUDA, steps up to this many tokens replay CUDA graphs (0: none)
    quantize: str = "none"  # the decoder layers' projections: none, int8 or int4 (models.native.quant)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))


@dataclass(frozen=True)
class ModelIdentity:
    """One model of a key: its checkpoint's :func:`checkpoint_digest` and how it runs."""

    files: str
    runtime: ModelRuntime

    @staticmethod
    def of(path: str | Path, runtime: ModelRuntime) -> ModelIdentity:
        return ModelIdentity(checkpoint_digest(path), runtime)


def host_description(device: str) -> str:
    """What of the host changes step times beyond the thread count: torch's version, the CPU
    model (a home folder may be shared by machines) and, for a GPU, its name."""
    cpu = platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        try:
            names = [
                line.partition(":")[2].strip()
                for line in cpuinfo.read_text().splitlines()
                if line.startswith("model name")
            ]
        except OSError:
            names = []
        cpu = f"{cpu} {names[0]}" if names else cpu
    dev = torch.device(device)
    gpu = f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" and torch.cuda.is_available() else ""
    # the instructions the products use: PyTorch's kernels' and oneDNN's (capped by their environment variables) and
    # our C kernels' (SPECINFER_CPU_ISA): the same CPU capped runs as another CPU
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip()
    isa = f", {torch.backends.cpu.get_cpu_capability()}, kernels {cpu_qgemm.isa()}"
    isa += f", oneDNN {onednn}" if onednn else ""
    return f"torch {torch.__version__}, {cpu}{isa}{gpu}"


@functools.cache
def code_digest() -> str:
    """A digest of the code that runs the passes: specinfer's Python modules and the C kernels' sources, by path and
    content. Another release, or an edited checkout, prices steps its own way (a kernel, which path a step size takes),
    so an entry another code measured is stale: its costs would steer the planner by a machine that no longer runs."""
    package, kernels = Path(__file__).resolve().parents[1], Path(cpu_qgemm.__file__).resolve().parent
    digest = hashlib.sha256()
    for root in [package] if kernels.is_relative_to(package) else [package, kernels]:  # apart in an editable install
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c", ".h") and p.is_file()):
            digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class CalibrationKey:
    """What an entry was measured under (module docstring). ``kind``: what it holds (``engine``:
    ``specinfer generate``'s cost model of its LLM and SSMs; ``verifier``: the LLM verifier's;
    ``drafter``: one SSM of a worker); ``models``: LLM first; ``params``: the calibration's own
    parameters (name, value), e.g. its most tokens; ``threads``: torch's CPU threads."""

    kind: str
    models: tuple[ModelIdentity, ...]
    params: tuple[tuple[str, str], ...]
    threads: int
    host: str
    code: str = ""  # :func:`code_digest`: what code measured it
    version: int = FORMAT_VERSION

    @staticmethod
    def build(kind: str, models: Sequence[ModelIdentity], params: Mapping[str, object]) -> CalibrationKey:
        """The key of ``models`` on this host now (torch's thread count as it is set at this call:
        build it after loading, which sets the services' ``--torch-threads``)."""
        device = models[0].runtime.device if models else "cpu"
        return CalibrationKey(
            kind,
            tuple(models),
            tuple(sorted((k, str(v)) for k, v in params.items())),
            torch.get_num_threads(),
            host_description(device),
            code_digest(),
        )

    def as_json(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))  # tuples as lists, as a file holds them

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:32]
        return f"{self.kind}-{digest}.json"


# -- the JSON of cost models ------------------------------------------------------------------


def table_to_json(table: CostTable) -> dict:
    """A table's whole state (raw buckets, their seconds and samples), so a read-back table refines
    on exactly as the saved one would have."""
    return {
        "buckets": [int(b) for b in table.buckets],
        "seconds": [float(s) for s in table.seconds],
        "samples": [float(w) for w in table.samples],
    }


def table_from_json(data: Mapping) -> CostTable:
    """The table :func:`table_to_json` wrote; raises ValueError (or KeyError, TypeError) for anything else."""
    return CostTable.restore(data["buckets"], data["seconds"], data["samples"])


def costs_to_json(costs: StepCosts) -> dict:
    return {
        "verify": table_to_json(costs.verify_table),
        "per_context": float(costs.per_context),
        "drafts": {str(ssm): table_to_json(t) for ssm, t in sorted(costs.drafts.items())},
        "overhead": float(costs.overhead),
    }


def costs_from_json(data: Mapping) -> StepCosts:
    per_context, overhead = float(data["per_context"]), float(data["overhead"])
    if not (per_context >= 0 and overhead >= 0):  # also refuses NaN
        raise ValueError("per_context and overhead must be >= 0")
    drafts = {int(ssm): table_from_json(t) for ssm, t in data["drafts"].items()}
    return StepCosts(table_from_json(data["verify"]), per_context, drafts, overhead)


# -- the folder --------------------------------------------------------------------------------


class CalibrationCache:
    """The entries in folder ``root`` (None: caching off, every read misses, writes do nothing)."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._reported: set[Path] = set()  # entries whose problem was logged (once per file and process)

    @staticmethod
    def from_setting(setting: str, environ: Mapping[str, str]) -> CalibrationCache:
        """The cache a ``--calibration-cache`` value names (:func:`cache_dir`)."""
        return CalibrationCache(cache_dir(setting, environ))

    def path(self, key: CalibrationKey) -> Path | None:
        return None if self.root is None else self.root / key.file_name()

    def report(self, path: Path, problem: str) -> None:
        """Log that the entry at ``path`` cannot be used, once per file and process."""
        if path not in self._reported:
            self._reported.add(path)
            log.warning("ignoring calibration cache entry", extra={"path": str(path), "problem": problem})

    def read(self, key: CalibrationKey) -> dict | None:
        """The payload of ``key``'s entry; None on a miss or an entry that cannot be used (logged once)."""
        path = self.path(key)
        if path is None or not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            self.report(path, f"unreadable: {exc}")
            return None
        if not isinstance(entry, dict) or not isinstance(entry.get("payload"), dict):
            self.report(path, "not a calibration entry")
            return None
        if entry.get("version") != FORMAT_VERSION or entry.get("key") != key.as_json():
            self.report(path, "stale: measured under another key or format version")
            return None
        return entry["payload"]

    def write(self, key: CalibrationKey, payload: Mapping) -> None:
        """Replace ``key``'s entry with ``payload`` atomically (a failure is logged, never raised)."""
        path = self.path(key)
        if path is None:
            return
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            text = json.dumps(
                {"version": FORMAT_VERSION, "key": key.as_json(), "payload": payload}, indent=1, allow_nan=False
            )
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            os.fchmod(fd, 0o644)  # readable like any cache file (mkstemp makes it private)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            tmp = None
            self._reported.discard(path)
            self._prune(path.parent)
        except (OSError, ValueError) as exc:
            log.warning("cannot write calibration cache entry", extra={"path": str(path), "error": str(exc)})
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    @staticmethod
    def _prune(folder: Path) -> None:
        """Remove the oldest entries past :data:`MAX_ENTRIES` (another process may remove them first)."""
        entries = []
        for p in folder.glob("*.json"):
            try:
                entries.append((p.stat().st_mtime_ns, p))
            except OSError:
                continue
        for _, p in sorted(entries)[: max(0, len(entries) - MAX_ENTRIES)]:
            p.unlink(missing_ok=True)


@dataclass(frozen=True)
class CostEntry:
    """One entry of a cache: where a cost model is read from and written back to."""

    cache: CalibrationCache
    key: CalibrationKey

    def load_costs(self) -> StepCosts | None:
        """The saved cost model; None on a miss or an unusable entry (logged once, rewritten by the next save)."""
        payload = self.cache.read(self.key)
        if payload is None:
            return None
        try:
            return costs_from_json(payload)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self.cache.report(self.cache.path(self.key), f"corrupt: {exc!r}")
            return None

    def save_costs(self, costs: StepCosts) -> None:
        self.cache.write(self.key, costs_to_json(costs))

    def load_table(self) -> CostTable | None:
        """The saved table (an entry of kind ``drafter``); None as :meth:`load_costs`."""
        payload = self.cache.read(self.key)
        if payload is None:
            return None
        try:
            return table_from_json(payload["table"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self.cache.report(self.cache.path(self.key), f"corrupt: {exc!r}")
            return None

    def save_table(self, table: CostTable) -> None:
        self.cache.write(self.key, {"table": table_to_json(table)})


def engine_cost_entry(
    cache: CalibrationCache, llm: ModelIdentity, ssms: Sequence[ModelIdentity], vocabularies: Sequence[str]
) -> CostEntry:
    """The entry of an in-process engine's cost model (``specinfer generate``): its LLM and SSMs in
    order, how each SSM drafts in the LLM's vocabulary (``vocabularies``, a mapped SSM's passes do
    more work) and the cold probe that seeds a new entry."""
    params = {"probe": repr(ProbeConfig()), "vocabularies": ",".join(vocabularies)}
    return CostEntry(cache, CalibrationKey.build("engine", (llm, *ssms), params))
