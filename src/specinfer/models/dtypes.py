"""Which floating-point type a model runs in: the names users give, and what ``auto`` means on a device.

``auto`` is bfloat16 where the hardware computes in it natively: NVIDIA GPUs of compute capability 8.0
(A100) and newer, and CPUs with AVX512-BF16 or AMX-BF16 instructions. Older GPUs get float16. Other CPUs get
float32: without those instructions a bf16 matrix product is converted to fp32 as it goes, and on a
2-core AVX2 machine (measured, see BENCHMARKS.md) a 16-node bf16 verify step of a 1B model then costs
2-3x an fp32 one, while one-token steps are only about 1.6x faster. float32 is always the exactness oracle of the tests.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specinfer.core.errors import InvalidArgument

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo names of native bf16 arithmetic


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in a ``/proc/cpuinfo`` text (empty when it names none)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def auto_dtype(device_type: str, cuda_capability: tuple[int, int] | None, flags: frozenset[str]) -> str:
    """The name ``auto`` stands for on a device: ``device_type`` ``cuda`` with its compute capability,
    or ``cpu`` with its feature ``flags``."""
    if device_type == "cuda":
        return "bfloat16" if cuda_capability is not None and cuda_capability >= (8, 0) else "float16"
    return "bfloat16" if flags & CPU_BF16_FLAGS else "float32"


def _this_cpu_flags() -> frozenset[str]:
    path = Path("/proc/cpuinfo")
    return cpu_flags(path.read_text()) if path.is_file() else frozenset()


def check_device(device: str) -> str:
    """``device`` when this machine has it (``cpu``, ``cuda``, ``cuda:N``); else :class:`InvalidArgument` naming the
    ``device`` field and a device that is there."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None  # not a device name at all
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise InvalidArgument("device", f"must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidArgument("device", f"{device!r}: torch {torch.__version__} sees no CUDA device here, e.g. cpu")
        if dev.index is not None and dev.index >= count:
            raise InvalidArgument("device", f"{device!r}: this machine has {count} CUDA device(s), e.g. cuda:0")
    return device


def resolve_dtype(name: str, device: str) -> str:
    """``name`` (one of :data:`DTYPE_CHOICES`) as a concrete dtype name for ``device``; raises
    :class:`InvalidArgument` naming the ``dtype`` field for anything else, or the ``device`` field for a device this
    machine lacks (:func:`check_device`)."""
    check_device(device)
    if name in DTYPES:
        return name
    if name != "auto":
        raise InvalidArgument("dtype", f"must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    dev = torch.device(device)
    if dev.type == "cuda":
        return auto_dtype("cuda", torch.cuda.get_device_capability(dev), frozenset())
    return auto_dtype(dev.type, None, _this_cpu_flags())
