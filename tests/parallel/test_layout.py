"""Pure checks of the parallel layout and sharding (no processes): stages and vocabulary blocks
partition the model, and the shards of every weight put back together give the weight."""

from __future__ import annotations

import pytest
import torch

from specinfer.core import InvalidArgument
from specinfer.models.native.parallel.layout import ParallelLayout, check_layout, shard_spec
from specinfer.models.native.parallel.shard import shard_weights
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.weights import LayerWeights, ModelWeights

SPEC = ModelSpec("llama", 97, 64, 5, 8, 2, 8, 96, 256, 1e-6, False, True, 10000.0, (None,) * 5)


def random_weights(spec: ModelSpec) -> ModelWeights:
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    qkv = (spec.heads + 2 * spec.kv_heads) * spec.head_dim
    layers = [
        LayerWeights(
            qkv_w=r(qkv, spec.hidden_size),
            qkv_b=r(qkv),
            o_w=r(spec.hidden_size, spec.heads * spec.head_dim),
            o_b=r(spec.hidden_size),
            norm1_w=r(spec.hidden_size),
            norm1_b=None,
            norm2_w=r(spec.hidden_size),
            norm2_b=None,
            up_w=r(2 * spec.intermediate_size, spec.hidden_size),
            up_b=None,
            down_w=r(spec.hidden_size, spec.intermediate_size),
            down_b=None,
        )
        for _ in range(spec.layers)
    ]
    return ModelWeights(
        r(spec.vocab_size, spec.hidden_size), layers, r(spec.hidden_size), None, r(spec.vocab_size, spec.hidden_size)
    )


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 3), (2, 2), (1, 5)])
def test_stages_and_vocabulary_blocks_partition_the_model(tp, pp):
    layouts = [ParallelLayout(tp, pp, rank) for rank in range(tp * pp)]
    layers = [i for stage in range(pp) for i in layouts[0].layer_range(SPEC.layers, stage)]
    assert layers == list(range(SPEC.layers))
    sizes = [len(layouts[0].layer_range(SPEC.layers, stage)) for stage in range(pp)]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    vocab = [t for lay in layouts[:tp] for t in lay.vocab_range(SPEC.vocab_size)]
    assert vocab == list(range(SPEC.vocab_size))
    assert [lay.stage * tp + lay.tp_rank for lay in layouts] == list(range(tp * pp))
    assert sum(shard_spec(SPEC, lay).layers for lay in layouts[::tp]) == SPEC.layers


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2), (1, 2)])
def test_shards_put_back_together_give_the_weights(tp, pp):
    full = random_weights(SPEC)
    shards = {rank: shard_weights(SPEC, full, ParallelLayout(tp, pp, rank)) for rank in range(tp * pp)}
    d, hq, hkv = SPEC.head_dim, SPEC.heads // tp, SPEC.kv_heads // tp
    for stage in range(pp):
        ranks = ParallelLayout(tp, pp, 0).stage_ranks(stage)
        for local, i in enumerate(ParallelLayout(tp, pp, stage * tp).layer_range(SPEC.layers)):
            want, parts = full.layers[i], [shards[r].layers[local] for r in ranks]
            q = torch.cat([p.qkv_w[: hq * d] for p in parts])
            k = torch.cat([p.qkv_w[hq * d : (hq + hkv) * d] for p in parts])
            v = torch.cat([p.qkv_w[(hq + hkv) * d :] for p in parts])
            assert torch.equal(torch.cat([q, k, v]), want.qkv_w)
            assert torch.equal(torch.cat([p.o_w for p in parts], dim=1), want.o_w)
            gates, ups = zip(*(p.up_w.chunk(2) for p in parts), strict=True)
            assert torch.equal(torch.cat([*gates, *ups]), want.up_w)
            assert torch.equal(torch.cat([p.down_w for p in parts], dim=1), want.down_w)
            # a row-parallel bias is added once, by tensor rank 0
            assert torch.equal(parts[0].o_b, want.o_b) and all(p.o_b is None for p in parts[1:])
        first, last = stage == 0, stage == pp - 1
        assert torch.equal(torch.cat([shards[r].embed for r in ranks]), full.embed if first else full.embed[:0])
        assert torch.equal(torch.cat([shards[r].lm_head for r in ranks]), full.lm_head if last else full.lm_head[:0])
        assert all((shards[r].final_norm_w is not None) == last for r in ranks)


@pytest.mark.parametrize(
    ("tp", "pp", "message"),
    [
        (3, 1, "tensor-parallel: 3 does not divide the model's 8 attention heads"),
        (4, 1, "tensor-parallel: 4 does not divide the model's 2 key/value heads"),
        (1, 6, "pipeline-parallel: 6 stages but the model has only 5 layers"),
        (0, 1, "tensor-parallel: must be >= 1"),
    ],
)
def test_layouts_the_model_cannot_take_name_the_setting(tp, pp, message):
    with pytest.raises(InvalidArgument, match=message):
        check_layout(SPEC, tp, pp)
