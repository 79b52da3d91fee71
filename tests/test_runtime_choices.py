"""The runtime's measured and hardware-dependent choices: matrix-product forms and ``--dtype auto``."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from specinfer.core import InvalidArgument
from specinfer.models.dtypes import auto_dtype, cpu_flags, resolve_dtype
from specinfer.models.native import gemm
from specinfer.models.native.gemm import (
    ROW_BUCKETS,
    GemmPlan,
    all_transposed,
    calibrate,
    choose,
    gemv_linear,
    measure,
    pack_weight,
    packing_available,
    plan_for,
    row_bucket,
)
from specinfer.models.native.weights import LayerWeights, ModelWeights

needs_packing = pytest.mark.skipif(not packing_available(torch.float32), reason="this CPU's oneDNN packs no fp32")


def test_row_buckets():
    assert [row_bucket(m) for m in (1, 2, 3, 5, 16, 17, 128)] == [1, 2, 4, 8, 16, 32, 128]
    assert row_bucket(129) is None


@pytest.mark.parametrize("rows", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_both_forms_compute_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 32, generator=gen)  # [out, in]
    b = torch.randn(48, generator=gen) if bias else None
    x = torch.randn(rows, 32, generator=gen)  # [rows, in]
    plan = all_transposed([w])
    out = plan.linear(x, w, b)
    assert out.shape == (rows, 48) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(GemmPlan().linear(x, w, b), F.linear(x, w, b))
    gemv = GemmPlan(gemv=frozenset({(48, 32)})).linear(x, w, b)  # one row: matrix-vector; more: linear
    assert gemv.shape == (rows, 48) and gemv.is_contiguous()
    torch.testing.assert_close(gemv, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_form_equals_linear(dtype):
    gen = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(64, 40, generator=gen), torch.randn(1, 40, generator=gen), torch.randn(64, generator=gen)
    w, x, b = w.to(dtype), x.to(dtype), b.to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(gemv_linear(x, w, b), F.linear(x, w, b), rtol=tol, atol=tol)


def test_choose_needs_a_clear_win():
    timings = {(8, 4, 1): (1.0, 0.95), (8, 4, 2): (1.0, 0.5), (8, 4, 4): (1.0, 2.0)}
    assert choose(timings).transposed == frozenset({(8, 4, 2)})
    assert choose(timings, margin=1.0).transposed == frozenset({(8, 4, 1), (8, 4, 2)})
    # one row: the fastest of the other forms, gemv by weight shape
    timings = {(8, 4, 1): (1.0, 0.8, 0.6), (6, 4, 1): (1.0, 0.6, 0.8), (5, 4, 1): (1.0, 0.95, 0.95)}
    plan = choose(timings)
    assert plan.gemv == frozenset({(8, 4)}) and plan.transposed == frozenset({(6, 4, 1)})


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 16, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_form_computes_linear(rows, bias):
    """A packed weight (oneDNN's layout, an opaque tensor of the weight's shape) gives linear's product whatever the
    plan says: the plan dispatches on the tensor."""
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(48, 32, generator=gen), torch.randn(rows, 32, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    packed = pack_weight(w)
    assert packed.is_mkldnn and packed.shape == w.shape
    for plan in (GemmPlan(), all_transposed([w]), GemmPlan(packed=frozenset({(48, 32)}))):
        out = plan.linear(x, packed, b)
        assert out.shape == (rows, 48) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_choose_packs_a_shape_whose_buckets_sum_faster():
    """Packing is per shape (one layout for every row count): where the packed times summed over the buckets take at
    most the margin of the best plain forms' sum; the plain forms stay planned for plain weights of the shape."""
    timings = {(8, 4, 1): (1.0, 0.9, 0.8), (8, 4, 2): (2.0, 1.0), (6, 4, 1): (1.0, 1.0, 1.0), (6, 4, 2): (2.0, 2.0)}
    packed = {(8, 4, 1): 1.0, (8, 4, 2): 0.7, (6, 4, 1): 1.2, (6, 4, 2): 1.0}
    plan = choose(timings, packed=packed)
    # (8, 4): 1.7 packed against 0.8 + 1.0 plain (not 0.9 of it); (6, 4): 2.2 against 3.0
    assert plan.packed == frozenset({(6, 4)})
    assert plan.transposed == frozenset({(8, 4, 2)}) and plan.gemv == frozenset({(8, 4)})
    assert choose(timings).packed == frozenset()


def _model_weights(shapes: list[tuple[int, int]]) -> ModelWeights:
    """Two layers whose four projections have ``shapes`` (qkv, o, up, down), and an LM head shaped like qkv."""
    norm = torch.ones(4)

    def layer() -> LayerWeights:
        qkv, o, up, down = (torch.randn(*s) for s in shapes)
        return LayerWeights(qkv, None, o, None, norm, None, norm, None, up, None, down, None)

    return ModelWeights(torch.randn(10, 4), [layer(), layer()], norm, None, torch.randn(*shapes[0]))


@needs_packing
def test_packing_replaces_the_layers_projections_of_packed_shapes_only():
    weights = _model_weights([(12, 4), (4, 4), (16, 4), (4, 8)])
    before = [layer.up_w.clone() for layer in weights.layers]
    GemmPlan(packed=frozenset({(12, 4), (16, 4)})).pack(weights)
    for layer, up in zip(weights.layers, before, strict=True):
        assert layer.qkv_w.is_mkldnn and layer.up_w.is_mkldnn and not layer.o_w.is_mkldnn
        assert not layer.down_w.is_mkldnn
        torch.testing.assert_close(GemmPlan().linear(torch.ones(2, 4), layer.up_w), torch.ones(2, 4) @ up.T)
    assert not weights.lm_head.is_mkldnn, "the LM head is read as a plain matrix (draft heads fold it)"
    forced = _model_weights([(12, 4), (4, 4), (16, 4), (4, 8)])
    assert plan_for("packed", forced, torch.device("cpu")).packed == frozenset({(12, 4), (4, 4), (16, 4), (4, 8)})
    assert plan_for("packed", forced, torch.device("cpu"), packing=False).packed == frozenset()


@needs_packing
def test_measure_times_the_packed_form_of_packable_shapes():
    weights = [torch.randn(16, 8), torch.randn(8, 16)]
    packed: dict = {}
    timings = measure(weights, repeats=1, buckets=(1, 4), packed=packed, packable=frozenset({(16, 8)}))
    assert set(packed) == {(16, 8, 1), (16, 8, 4)} and all(t > 0 for t in packed.values())
    assert set(timings) == {(16, 8, 1), (16, 8, 4), (8, 16, 1), (8, 16, 4)}
    plan = calibrate(weights, torch.device("cpu"), frozenset({(16, 8)}))
    assert plan.packed <= frozenset({(16, 8)})


def test_plan_applies_per_shape_and_bucket(monkeypatch):
    """A plan transposes only the (shape, bucket) it names; other shapes and row counts use linear."""
    w, other = torch.randn(8, 4), torch.randn(6, 4)
    plan = GemmPlan(frozenset({(8, 4, 4)}))
    calls = []
    monkeypatch.setattr(
        gemm, "transposed_linear", lambda x, w, b=None: calls.append(tuple(w.shape)) or F.linear(x, w, b)
    )
    plan.linear(torch.randn(3, 4), w)  # bucket 4: transposed
    plan.linear(torch.randn(5, 4), w)  # bucket 8: linear
    plan.linear(torch.randn(3, 4), other)  # other shape: linear
    assert calls == [(8, 4)]


def test_measure_times_each_shape_once_per_bucket():
    weights = [torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)]
    timings = measure(weights, repeats=1, buckets=(1, 4))
    assert set(timings) == {(16, 8, 1), (16, 8, 4), (8, 16, 1), (8, 16, 4)}
    assert all(t > 0 for forms in timings.values() for t in forms)
    assert {key: len(forms) for key, forms in timings.items()} == {
        (16, 8, 1): 3,
        (16, 8, 4): 2,
        (8, 16, 1): 3,
        (8, 16, 4): 2,
    }
    assert calibrate(weights, torch.device("meta")) == GemmPlan()  # off the CPU: always linear
    assert ROW_BUCKETS[0] == 1


def test_small_products_are_timed_over_many_calls():
    """A product of a few microseconds is timed over many calls per timing (one call's time is mostly timer
    and scheduling noise: the plan flipped from load to load); a slow one once per timing."""
    calls = {"fast": 0, "slow": 0}

    def fast():
        calls["fast"] += 1

    def slow():
        calls["slow"] += 1
        time.sleep(2 * gemm.MIN_TIMING_SECONDS)

    best = gemm._best_seconds([fast], repeats=3)
    assert calls["fast"] >= 3 * 100 and best[0] < gemm.MIN_TIMING_SECONDS / 100
    gemm._best_seconds([slow], repeats=3)
    assert calls["slow"] == 1 + 1 + 3  # warm-up, the probe of its length, one call per timing


CPUINFO_ZEN4 = (
    "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\n"
)
CPUINFO_AVX2 = "processor\t: 0\nflags\t\t: fpu sse avx2 fma\n"


def test_auto_dtype():
    assert cpu_flags(CPUINFO_ZEN4) >= {"avx512_bf16", "avx2"}
    assert cpu_flags("no flags here") == frozenset()
    assert auto_dtype("cpu", None, cpu_flags(CPUINFO_ZEN4)) == "bfloat16"
    assert auto_dtype("cpu", None, frozenset({"amx_bf16"})) == "bfloat16"
    assert auto_dtype("cpu", None, cpu_flags(CPUINFO_AVX2)) == "float32"
    assert auto_dtype("cuda", (9, 0), frozenset()) == "bfloat16"
    assert auto_dtype("cuda", (8, 0), frozenset()) == "bfloat16"
    assert auto_dtype("cuda", (7, 5), frozenset()) == "float16"


def test_resolve_dtype():
    assert resolve_dtype("float32", "cpu") == "float32"
    assert resolve_dtype("auto", "cpu") in ("float32", "bfloat16")
    with pytest.raises(InvalidArgument, match="dtype"):
        resolve_dtype("fp8", "cpu")
