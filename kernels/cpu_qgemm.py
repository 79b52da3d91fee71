"""Weight-only int4 and int8 products on an x86-64 CPU with AVX2: our C kernels (``cpu_qgemm.c``), their weight
layouts, and their plain PyTorch reference.

Why our own: PyTorch's CPU kernels for weight-only products (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) unpack every weight to a float and multiply in floats; on an AVX2 CPU they read about
5 GB/s of int4 weights, where llama.cpp's kernels read 12 (BENCHMARKS.md, "SmolLM2-135M-Instruct beside llama.cpp"),
and they are fast only with bf16 activations. These kernels use llama.cpp's scheme instead: each row of the
activations is quantized on the fly to int8 in *blocks* of 32 inputs (scale ``xd = max|x| / 127``), so that a
block's dot product is integer multiply-adds (``vpmaddubsw``), then one float multiply by the two scales. Terms:

- *int4 layout*: ``qs`` uint8 ``[N, K / 2]``, per block of 32 inputs 16 bytes, byte ``j`` holding value ``j`` in
  its low nibble and value ``j + 16`` in its high one (values ``q`` in [0, 15], llama.cpp's Q4_1 order); ``dm``
  float16 ``[N, 2, K / 32]``, each row's block scales ``d`` then its block offsets ``m``: the weight is
  ``q * d + m``.
- *int8 layout*: ``qs`` int8 ``[N, K]``, values in [-127, 127]; ``d`` float16 ``[N, K / 32]``, each block's scale
  (llama.cpp's Q8_0): the weight is ``q * d`` (:func:`quantize_int8`).
- ``K`` is the inputs padded to whole blocks (zero weights); the activations are padded inside the kernel.

A row's result depends on that row and the weight alone (threads split the output rows, never the inputs), so the
rows of a verify step equal one-row steps bit for bit: the exactness of speculation against incremental decoding
holds on these kernels as on any other. :func:`reference_linear` is the arithmetic in PyTorch (float64 sums), what
tests/kernels/test_cpu_qgemm.py holds the kernels to.

The C source is compiled on first use with the system's C compiler (``$CC``, else ``cc``) into
``~/.cache/specinfer/kernels`` and loaded with ctypes. A kernel runs on the threads of the code around it: these
products and the row-by-row attention, called inside PyTorch's per-operation forward, on OpenMP's team (the
``libgomp.so.1`` torch has loaded: one runtime, the calling thread's one team); the fused layers' steps (the layers,
the final logits, drafting's rows, the KV pool's row moves) on our own team (``cpu_team.c``), whose workers sleep
between a service's steps. Where the kernels cannot run (another architecture, a CPU without AVX2/FMA/F16C, no
compiler, or ``SPECINFER_CPU_QGEMM=0``), :func:`library` is None and quantized weights use PyTorch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_qgemm.c")
# built into the same library: the row-by-row CPU tree attention (specinfer.kernels.cpu_attention), the fused
# CPU decoder stack (specinfer.kernels.cpu_layers), drafting's logit-row tables (specinfer.kernels.cpu_rows), the
# KV pool's row moves (specinfer.kernels.cpu_pool) and the thread team they run on (cpu_team.c); the header holds what
# they share
NAMES = ("attention", "layers", "amx", "rows", "team", "pool")
SOURCES = (SOURCE, *(SOURCE.with_name(f"cpu_{name}.c") for name in NAMES))
HEADER = SOURCE.with_name("cpu_kernels.h")
BLOCK = 32  # inputs per activation block (and per int4 weight block)
ENV = "SPECINFER_CPU_QGEMM"  # "0": never use these kernels
# the most of the CPU's instructions the kernels are built for: native (all it lists), avx512 (no AMX), avx2 (neither
# AVX-512 nor AMX). To run, on a CPU with AMX, as a CPU without it runs (with ONEDNN_MAX_CPU_ISA for PyTorch's GEMMs)
ISA_ENV = "SPECINFER_CPU_ISA"
ISA_CAPS = ("native", "avx512", "avx2")
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-pthread", "-fPIC", "-shared")
# where the CPU has them, the dense products' AVX-512 tiles (and AVX512-BF16's pair products for bf16 weights)
AVX512 = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl"}
AVX512_BF16 = {"avx512_bf16": "-mavx512bf16"}
# and AVX512-VNNI's byte products for the int4/int8 weights (vpdpbusd: 64 a instruction, where AVX2 takes 32 in two)
AVX512_VNNI = {"avx512_vnni": "-mavx512vnni"}
AMX = {"amx_tile": "-mamx-tile", "amx_bf16": "-mamx-bf16"}  # both or neither: the fused layers' bf16 products
_ARGS = [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_ARGS += [ctypes.c_int, ctypes.c_int]


def unavailable_reason() -> str | None:
    """Why these kernels cannot run here, or None where they can (the library is then built or loaded)."""
    return _gate() or (None if library() is not None else "the C kernels did not build (see the log)")


def _gate() -> str | None:
    """Why this machine or setting rules the kernels out before any build, or None."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.system()} {platform.machine()} (the kernels are for x86-64 Linux)"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch's capability: {torch.backends.cpu.get_cpu_capability()})"
    if not _compiler():
        return "no C compiler ($CC or cc)"
    return None


@functools.cache
def isa_flags() -> tuple[str, ...]:
    """The compiler flags for this CPU's instructions beyond AVX2 that the kernels use: AVX-512 (F, BW and VL: all
    three or none), then AVX512-BF16, AVX512-VNNI and AMX (tiles and bf16) on top; none where /proc/cpuinfo does not
    list them, or beyond ``SPECINFER_CPU_ISA``'s cap (:data:`ISA_CAPS`)."""
    cap = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if cap not in ISA_CAPS:
        raise ValueError(f"{ISA_ENV}={cap!r}: one of {', '.join(ISA_CAPS)}")
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    have = set(line.partition(":")[2].split())
    if cap == "avx2" or not set(AVX512) <= have:
        return ()
    amx = AMX.values() if set(AMX) <= have and cap == "native" else ()
    extra = (flag for name, flag in {**AVX512_BF16, **AVX512_VNNI}.items() if name in have)
    return (*AVX512.values(), *extra, *amx)


def isa() -> str:
    """The instruction set the kernels are built for here (:func:`isa_flags`): ``amx``, ``avx512`` or ``avx2``, or
    ``none`` where they cannot run (:func:`_gate`)."""
    if _gate() is not None:
        return "none"
    flags = isa_flags()
    return "amx" if AMX["amx_tile"] in flags else "avx512" if flags else "avx2"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "specinfer" / "kernels"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built once per source, compiler and flags, then loaded from the cache), or None where
    they cannot run here (the reason logged once)."""
    reason = _gate()
    if reason is not None:
        log.info("our int4/int8 CPU kernels do not run here (%s): PyTorch's kernels serve", reason)
        return None
    cc = _compiler()
    assert cc is not None
    text = b"".join(source.read_bytes() for source in (*SOURCES, HEADER))
    key = hashlib.sha256(text + cc.encode() + " ".join((*FLAGS, *isa_flags())).encode()).hexdigest()[:16]
    path = _cache_dir() / f"cpu_qgemm-{key}.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("our int4/int8 CPU kernels did not build or load, PyTorch's kernels serve instead: %s", exc)
        return None
    for name in ("q4_gemm", "q8_gemm"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = _ARGS, ctypes.c_int
    lib.tree_attend.argtypes = [ctypes.c_int] * 4 + [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2
    lib.tree_attend.argtypes += [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float]
    lib.tree_attend.argtypes += [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.tree_attend.restype = ctypes.c_int
    lib.decoder_layers.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3
    lib.decoder_layers.argtypes += [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    lib.decoder_layers.argtypes += [ctypes.c_void_p] + [ctypes.c_int] * 2
    lib.decoder_layers.restype = ctypes.c_int
    lib.dense_gemm.argtypes = [ctypes.c_int] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.dense_gemm.restype = None
    lib.rms_norm_rows.argtypes = (
        [ctypes.c_int] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    )
    lib.rms_norm_rows.restype = None
    lib.final_logits.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.final_logits.argtypes += [ctypes.c_void_p, ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.weight_gemm.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int]
    lib.weight_gemm.restype = ctypes.c_int
    lib.final_logits.restype = ctypes.c_int
    lib.row_top_k.argtypes = [ctypes.c_int] * 2 + [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_int] * 2
    lib.row_top_k.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.row_top_k.restype = None
    lib.pool_move.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    lib.pool_move.argtypes += [ctypes.c_void_p] * 2 + [ctypes.c_int]
    lib.pool_move.restype = ctypes.c_int
    lib.team_workers.restype, lib.team_cpu_seconds.restype = ctypes.c_int, ctypes.c_double
    lib.team_wake.restype = lib.team_rest.restype = None
    lib.amx_on.restype = lib.amx_enable.restype = ctypes.c_int
    if lib.amx_enable():  # asks the kernel for the tile state once, before any product (the answer holds)
        log.info("the fused layers' bf16 products run on AMX tiles")
    return lib


def loaded() -> ctypes.CDLL | None:
    """The kernels where this process has already loaded them (:func:`library`), else None: never builds them."""
    return library() if library.cache_info().currsize else None


def _build(cc: str, path: Path) -> None:
    """Compiles the C source into ``path`` (atomically: processes building at once each land a whole file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        command = [
            cc,
            *FLAGS,
            *isa_flags(),
            f"-I{SOURCE.parent}",
            *(str(source) for source in SOURCES),
            "-o",
            str(out),
            "-lm",
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise OSError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
        os.replace(out, path)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 layout of ``w = (q - 8) * scale + zero`` per block of 32 (:func:`quant.quantize_int4`'s form):
    ``q``  # [N, K] integers in [0, 15], K a multiple of 32; ``scales``, ``zeros``  # [N, K / 32].
    Returns ``(qs, dm)``  # [N, K / 2] uint8, [N, 2, K / 32] float16: ``d = scale``, ``m = zero - 8 * scale``, or
    for a block whose ``m`` float16 cannot hold and whose flip can, the same weights as ``q' = 15 - q``,
    ``d' = -d``, ``m' = m + 15 * d`` (a GGUF Q4_0 block with a negative scale: its minimum ``7 * d`` needs more
    bits than its maximum ``-8 * d``), so that a GGUF file's Q4_0 and Q4_1 blocks come back exactly."""
    n, k = q.shape
    d = scales.float()  # [N, blocks]
    m = zeros.float() - 8 * d
    flip = (m.half().float() != m) & ((m + 15 * d).half().float() == m + 15 * d)  # [N, blocks]
    d, m = torch.where(flip, -d, d), torch.where(flip, m + 15 * d, m)
    blocks = q.reshape(n, k // BLOCK, BLOCK)
    blocks = torch.where(flip[..., None], 15 - blocks, blocks).to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    qs = (blocks[:, :, 0] | blocks[:, :, 1] << 4).reshape(n, k // 2)  # byte j: value j | value j + 16 << 4
    dm = torch.stack([d, m], dim=1).to(torch.float16)  # [N, 2, blocks]
    return qs.contiguous(), dm.contiguous()


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w``  # [N, K], K a multiple of 32, in the int8 layout: per block of 32 inputs ``d = max|w| / 127`` stored in
    float16 and ``q = round(w / d)`` against the stored ``d``, as llama.cpp's Q8_0 (a Q8_0 file's dequantized blocks
    come back as it holds them). Returns ``(qs, d)``  # [N, K] int8, [N, K / 32] float16."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // BLOCK, BLOCK)
    d = (blocks.abs().amax(dim=-1) / 127).to(torch.float16)  # [N, blocks]
    inv = torch.where(d != 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k).contiguous(), d.contiguous()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """The int4 layout's values ``q``  # [N, blocks, 32] uint8, each block's inputs in order."""
    pairs = qs.reshape(qs.shape[0], -1, BLOCK // 2)  # [N, blocks, 16]
    return torch.cat([pairs & 0x0F, pairs >> 4], dim=-1)


def unpack_int4(qs: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """The weight ``[N, K]`` (float32) the int4 layout ``(qs, dm)`` stands for: ``q * d + m`` per block."""
    n = qs.shape[0]
    q = _nibbles(qs).float()  # [N, blocks, 32]
    d, m = dm.float().unbind(1)  # [N, blocks] each
    return (q * d[..., None] + m[..., None]).reshape(n, -1)


def quantize_activations(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernels multiply by for ``x``  # [M, K_x]: its rows zero-padded to ``k`` inputs and quantized per
    block of 32 as the C code does (``d = amax / 127``, ``q = round(x * (1 / d))``, half to even), all in fp32.
    Returns ``(q, d)``  # [M, k / 32, 32] float32 integers, [M, k / 32] float32."""
    xf = torch.nn.functional.pad(x.float(), (0, k - x.shape[1])).reshape(x.shape[0], k // BLOCK, BLOCK)
    d = xf.abs().amax(dim=-1) / 127  # [M, blocks]
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return torch.round(xf * inv[..., None]), d


def reference_linear(x: torch.Tensor, scheme: str, qs: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernels' product in PyTorch, sums in float64: ``x``  # [M, K_x] against a weight in the ``scheme``
    (``int4``: ``(qs, dm)``; ``int8``: ``(qs, d)``) layout.  # [M, N] float64"""
    k = qs.shape[1] * (2 if scheme == "int4" else 1)
    xq, xd = quantize_activations(x, k)  # [M, blocks, 32], [M, blocks]
    n = qs.shape[0]
    if scheme == "int4":
        q = _nibbles(qs).double()  # [N, blocks, 32]
        d, m = scales.double().unbind(1)  # [N, blocks]
        dots = torch.einsum("rbj,nbj->rnb", xq.double(), q)  # [M, N, blocks] integer sums
        xs = xd.double() * xq.double().sum(-1)  # [M, blocks]
        return (dots * (d[None] * xd.double()[:, None]) + m[None] * xs[:, None]).sum(-1)
    q = qs.reshape(n, -1, BLOCK).double()
    dots = torch.einsum("rbj,nbj->rnb", xq.double(), q)  # [M, N, blocks]
    return (dots * (scales.double()[None] * xd.double()[:, None])).sum(-1)


def linear(
    x: torch.Tensor, scheme: str, qs: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x``  # [M, K_x] (float32 or bfloat16, on the CPU) times the weight ``(qs, scales)`` in ``scheme``'s layout,
    transposed, by the C kernel.  # [M, N] in ``out_dtype`` (float32 or bfloat16)"""
    lib = library()
    assert lib is not None, "cpu_qgemm.linear without its library (check library() first)"
    x = x.contiguous()
    m, k_x = x.shape
    n = qs.shape[0]
    k = qs.shape[1] * (2 if scheme == "int4" else 1)
    y = torch.empty(m, n, dtype=out_dtype)
    fn = lib.q4_gemm if scheme == "int4" else lib.q8_gemm
    bf16_in, bf16_out = int(x.dtype == torch.bfloat16), int(out_dtype == torch.bfloat16)
    threads = torch.get_num_threads()
    if fn(m, n, k_x, k, x.data_ptr(), bf16_in, qs.data_ptr(), scales.data_ptr(), y.data_ptr(), bf16_out, threads):
        raise MemoryError(f"cpu_qgemm: no memory for {m} quantized activation rows of {k}")
    return y
