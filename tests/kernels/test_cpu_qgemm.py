"""Our CPU int4/int8 kernels (specinfer.kernels.cpu_qgemm) against their PyTorch reference, and the properties the
exactness of speculation rests on: a row's result is the same whatever the other rows and the thread count."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from specinfer.kernels import cpu_qgemm
from specinfer.models.native.quant import quantize_int4

pytestmark = pytest.mark.skipif(
    cpu_qgemm.unavailable_reason() is not None, reason=f"our CPU kernels: {cpu_qgemm.unavailable_reason()}"
)


def _weight(scheme: str, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``[n, k]`` weight in ``scheme``'s layout (inputs padded to whole blocks)."""
    w = torch.nn.functional.pad(torch.randn(n, k, generator=gen) * 0.05, (0, -k % cpu_qgemm.BLOCK))
    if scheme == "int4":
        return cpu_qgemm.pack_int4(*quantize_int4(w, cpu_qgemm.BLOCK))
    return cpu_qgemm.quantize_int8(w)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("n, k", [(48, 256), (100, 688), (17, 32), (40, 544)])  # 688, 544: a partial last group
@pytest.mark.parametrize("x_dtype, y_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_products_equal_the_reference(scheme, n, k, x_dtype, y_dtype):
    gen = torch.Generator().manual_seed(n * k)
    qs, scales = _weight(scheme, n, k, gen)
    for m in (1, 3, 8, 13):
        x = (torch.randn(m, k, generator=gen) * 3).to(x_dtype)
        x[0, : k // 2] = 0  # all-zero blocks: scale 0
        got = cpu_qgemm.linear(x, scheme, qs, scales, y_dtype)  # [m, n]
        want = cpu_qgemm.reference_linear(x, scheme, qs, scales)  # [m, n] float64
        assert got.shape == (m, n) and got.dtype == y_dtype
        tol = 1e-5 if y_dtype == torch.float32 else 8e-3  # bf16 output: rounded to 8 bits
        assert (got.double() - want).abs().max() <= tol * want.abs().max(), m


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_a_rows_result_is_independent_of_the_other_rows_and_the_threads(scheme):
    gen = torch.Generator().manual_seed(3)
    qs, scales = _weight(scheme, 300, 576, gen)
    x = torch.randn(11, 576, generator=gen).bfloat16()
    batch = cpu_qgemm.linear(x, scheme, qs, scales, torch.float32)
    rows = torch.cat([cpu_qgemm.linear(x[i : i + 1], scheme, qs, scales, torch.float32) for i in range(11)])
    assert torch.equal(batch, rows)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_qgemm.linear(x, scheme, qs, scales, torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one)


def test_the_reference_is_the_dequantized_product_up_to_the_activations_rounding():
    """Negative control for the reference: against F.linear on the dequantized weight it differs (the activations
    are rounded to int8), but by no more than that rounding allows."""
    gen = torch.Generator().manual_seed(4)
    qs, dm = _weight("int4", 64, 256, gen)
    x = torch.randn(5, 256, generator=gen)
    plain = torch.nn.functional.linear(x.double(), cpu_qgemm.unpack_int4(qs, dm).double())
    ref = cpu_qgemm.reference_linear(x, "int4", qs, dm)
    err = (ref - plain).abs().max() / plain.abs().max()
    assert 1e-5 < err < 2e-2


def test_one_openmp_runtime_in_the_process():
    """The library links the libgomp torch loaded, so its threads are the calling thread's one team (a second
    runtime would hold a second team: BENCHMARKS.md, "One OpenMP team per service")."""
    assert cpu_qgemm.library() is not None
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line.split()[-1]}
    assert len(gomp) == 1, gomp


def test_the_isa_cap_drops_amx_then_avx512(monkeypatch):
    """``SPECINFER_CPU_ISA`` caps the instructions the library is built for, each cap a subset of the one above it;
    a value outside the caps is refused naming the variable. (The flags are read once a process: cleared here.)"""
    native = set(cpu_qgemm.isa_flags())

    def capped(isa: str) -> tuple[str, ...]:
        monkeypatch.setenv(cpu_qgemm.ISA_ENV, isa)
        cpu_qgemm.isa_flags.cache_clear()
        return cpu_qgemm.isa_flags()

    try:
        avx512 = set(capped("avx512"))
        assert avx512 <= native and not avx512 & set(cpu_qgemm.AMX.values())
        assert cpu_qgemm.isa() == ("avx512" if avx512 else "avx2")
        assert capped("AVX2") == () and cpu_qgemm.isa() == "avx2"
        with pytest.raises(ValueError, match=cpu_qgemm.ISA_ENV):
            capped("sse4")
    finally:
        monkeypatch.undo()  # the variable as it was
        cpu_qgemm.isa_flags.cache_clear()
    assert set(cpu_qgemm.isa_flags()) == native


@pytest.mark.skipif(cpu_qgemm.isa() == "avx2", reason="the CPU has nothing above AVX2 to cap")
def test_a_capped_library_computes_what_the_native_one_does():
    """Built for the instructions one cap below this CPU's (another library file), the dense and int8 products give
    what the native library gives within rounding, and a capped AMX CPU's products leave the tiles."""
    cap = "avx512" if cpu_qgemm.isa() == "amx" else "avx2"
    script = (
        "import torch, sys\n"
        "from specinfer.kernels import cpu_layers, cpu_qgemm\n"
        "torch.manual_seed(0)\n"
        "w, x = torch.randn(48, 256).bfloat16(), torch.randn(3, 256).bfloat16().float()\n"
        "q, s = cpu_qgemm.quantize_int8(w.float())\n"
        "torch.save((cpu_layers.dense_linear(x, w), cpu_qgemm.linear(x, 'int8', q, s, torch.float32)), sys.argv[1])\n"
        "print(cpu_qgemm.isa(), cpu_layers.amx())\n"
    )
    outs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, isa in enumerate(("native", cap)):
            env = {**os.environ, cpu_qgemm.ISA_ENV: isa}
            done = subprocess.run(
                [sys.executable, "-c", script, f"{tmp}/{i}.pt"], env=env, capture_output=True, text=True, check=True
            )
            outs.append((done.stdout.split(), torch.load(f"{tmp}/{i}.pt")))
    (native_isa, _), (dense, int8) = outs[0]
    (capped_isa, amx), (dense_c, int8_c) = outs[1]
    assert native_isa == cpu_qgemm.isa() and capped_isa == cap and amx == "False"
    assert torch.allclose(dense, dense_c, rtol=1e-5, atol=1e-4) and torch.allclose(int8, int8_c, rtol=1e-5, atol=1e-4)
