"""The paged KV pool of the native runtime (KV blocks, see specinfer.kernels.metadata): block
accounting, and the same K/V and logits as contiguous slots."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specinfer.models.interface import TreeForward
from specinfer.models.kv_store import RequestCache
from specinfer.models.native import KVCacheFull, NativeBackend, NativeOptions
from specinfer.models.native.kv_pool import KVPool, SlotStorage
from specinfer.models.native.paged_pool import BlockStorage, PagedKVPool
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.step import PackedStep, StepRequest

SPEC = ModelSpec("llama", 16, 8, 2, 2, 1, 4, 8, 64, 1e-5, False, False, 1e4, (None,) * 2)  # 2 layers, 1 KV head of 4


def _used(pool: PagedKVPool, storages: list[BlockStorage]) -> list[int]:
    """Every block held by a storage; checks that no block is held twice or also free."""
    held = [b for s in storages for b in s.block_table]
    assert len(held) == len(set(held)), "a KV block is shared between live requests"
    assert len(held) + pool.free_blocks == pool.num_blocks
    assert not set(held) & set(pool._free)
    return held


def test_blocks_grow_on_demand_and_are_freed():
    pool = PagedKVPool(SPEC, torch.float32, torch.device("cpu"), 4, 6)
    a = BlockStorage(pool)
    a.reserve(5, 5)  # 5 context rows: 2 blocks
    assert len(a.block_table) == 2 and pool.free_blocks == 4
    a.reserve(5, 5 + 6)  # 6 tree nodes behind the context: 3 blocks
    assert len(a.block_table) == 3 and pool.free_blocks == 3
    a.adopt_pending(5, [0, 2, 5])  # context 8: 2 blocks
    assert len(a.block_table) == 2 and pool.free_blocks == 4
    a.reserve(8, 8 + 4)
    a.clear_pending()  # back to the context's blocks
    assert len(a.block_table) == 2
    a.truncate_context(3)
    assert len(a.block_table) == 1
    b = BlockStorage(pool)
    b.reserve(20, 20)
    _used(pool, [a, b])
    with pytest.raises(KVCacheFull):
        BlockStorage(pool).reserve(1, 1)  # 1 + 5 blocks held, none free
    before = list(a.block_table)
    with pytest.raises(KVCacheFull):
        a.reserve(10, 10)  # wants 2 more: nothing taken
    assert a.block_table == before
    b.release()
    assert b.block_table == [] and pool.free_blocks == 5
    a.release()
    assert pool.free_blocks == pool.num_blocks


def test_adopt_moves_rows_across_blocks():
    """Pending node j sits at logical position context + j; adopting a path moves its rows to the
    positions right behind the context, also when they cross a block boundary."""
    pool = PagedKVPool(SPEC, torch.float32, torch.device("cpu"), 3, 8)
    s = BlockStorage(pool)
    s.reserve(2, 2 + 7)
    rows = s.rows(range(9))
    k = pool.k.flatten(1, 2)  # [layers, rows, kv_heads, head_dim]
    for p, r in enumerate(rows):
        k[:, r] = float(p)
    s.adopt_pending(2, [1, 4, 6])
    assert [float(k[0, r, 0, 0]) for r in s.rows(range(5))] == [0.0, 1.0, 3.0, 6.0, 8.0]
    assert len(s.block_table) == 2


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 3, 4]), st.data())
def test_random_operations_keep_blocks_and_rows_consistent(block_size, data):
    """Random context extensions, trees, accepted paths, truncations and releases on 3 requests:
    free + held blocks stay the pool's, no block is held twice, a request holds exactly its
    context's blocks between steps, and every context position's K/V equal a contiguous pool's."""
    limit = 24  # rows a request may use (context + tree)
    paged = PagedKVPool(SPEC, torch.float32, torch.device("cpu"), block_size, 3 * -(-limit // block_size))
    slots = KVPool(SPEC, torch.float32, torch.device("cpu"), limit, 3)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    caches: dict[int, tuple[RequestCache, RequestCache]] = {}

    def new() -> tuple[RequestCache, RequestCache]:
        return RequestCache(BlockStorage(paged)), RequestCache(SlotStorage(slots, slots.allocate()))

    def forward(
        pair: tuple[RequestCache, RequestCache], context: list[int], tokens: list[int], parents: list[int]
    ) -> None:
        """What the backend does, with random values as the K/V the model would write."""
        chains = [c.sync(context, new_round=bool(parents) and parents[0] < 0) for c in pair]
        assert chains[0] == chains[1]
        values = torch.randn(
            2, SPEC.layers, len(chains[0]) + len(tokens), SPEC.kv_heads, SPEC.head_dim, generator=gen
        )  # K, V
        for cache, pool, chain in zip(pair, (paged, slots), chains, strict=True):
            lc, lp = cache.context_len, cache.pending_len
            cache.storage.reserve(lc + len(chain), lc + len(chain) + lp + len(tokens))
            request = StepRequest(
                cache.storage.start, lc, chain, tokens, cache.node_parents(parents), tuple(cache.storage.block_table)
            )
            step = PackedStep.from_trees([request], block_size if pool is paged else 0)
            pool.k.flatten(1, -3)[:, list(step.cache_rows)] = values[0]
            pool.v.flatten(1, -3)[:, list(step.cache_rows)] = values[1]
            cache.record_context(chain)
            cache.record_pending(tokens, parents)

    for _ in range(data.draw(st.integers(1, 25))):
        i = data.draw(st.integers(0, 2))
        if i not in caches:
            caches[i] = new()
        pair = caches[i]
        cache = pair[0]
        op = data.draw(st.sampled_from(["extend", "tree", "accept", "truncate", "release"]))
        context = list(cache.context_tokens)
        if op == "extend" and len(context) < limit - 4:
            forward(pair, context + data.draw(st.lists(st.integers(0, 15), min_size=1, max_size=4)), [], [])
        elif op == "tree" and context and len(context) + cache.pending_len < limit - 6:
            n, lp = data.draw(st.integers(1, 5)), cache.pending_len
            if lp and data.draw(st.booleans()):  # more nodes on the pending tree (SSM-style expansion)
                parents = [data.draw(st.integers(0, lp + j - 1)) for j in range(n)]
            else:  # a new tree on the context
                parents = [-1] + [data.draw(st.integers(0, j - 1)) for j in range(1, n)]
            forward(pair, context, [int(t) for t in torch.randint(0, 16, (n,), generator=gen)], parents)
        elif op == "accept" and cache.pending_len:
            node, path = data.draw(st.integers(0, cache.pending_len - 1)), []
            while node >= 0:
                path.append(cache.pending_tokens[node])
                node = cache.pending_parents[node]
            forward(pair, context + path[::-1], [], [])
        elif op == "truncate" and context:
            forward(pair, context[: data.draw(st.integers(0, len(context) - 1))], [], [])
        elif op == "release":
            for c in caches.pop(i):
                c.storage.release()
        live = [c for c, _ in caches.values()]
        _used(paged, [c.storage for c in live])
        for paged_cache, slot_cache in caches.values():
            if not paged_cache.pending_len:
                assert len(paged_cache.storage.block_table) == -(-paged_cache.context_len // block_size)
            rows, start = paged_cache.storage.rows(range(slot_cache.context_len)), slot_cache.storage.start
            for got, want in ((paged.k, slots.k), (paged.v, slots.v)):
                # [layers, context_len, kv_heads, head_dim]
                assert torch.equal(got.flatten(1, 2)[:, rows], want[:, start : start + slot_cache.context_len])


def test_paged_step_layout():
    """Physical rows through the block table (block size 2): request a has a chain and a tree, b a tree."""
    step = PackedStep.from_trees(
        [
            StepRequest(
                kv_start=0, cached=3, chain=[7, 8], tokens=[5, 6], parents=[-1, 0, 1, 0], block_table=(9, 4, 7, 1, 0)
            ),
            StepRequest(kv_start=0, cached=1, chain=[], tokens=[1], parents=[-1], block_table=(3,)),
        ],
        block_size=2,
    )
    # a: positions 3, 4 (chain), 7, 8 (new nodes behind 2 pending): blocks 4, 7, 1, 0
    assert step.cache_rows == (4 * 2 + 1, 7 * 2 + 0, 1 * 2 + 1, 0 * 2 + 0, 3 * 2 + 1)
    assert step.seg_tables == ((9, 4, 7, 1, 0),) * 2 + ((3,),)
    meta = step.metadata(torch.device("cpu"))
    assert meta.paged and meta.block_size == 2 and meta.block_tables == step.seg_tables
    assert PackedStep.from_trees([StepRequest(kv_start=5, cached=0, chain=[1], tokens=[], parents=[])]).seg_tables == ()


def _steps(native: NativeBackend, vocab: int) -> list[torch.Tensor]:
    """Ragged prefills, tree-verify steps that adopt accepted paths, a release and a new request
    (reused blocks), and a context cut back; every logits tensor in order."""
    gen = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(0, vocab, (n,), generator=gen).tolist() for i, n in enumerate((1, 9, 40, 23))}
    out = native.forward_tree([TreeForward(rid, [], p, list(range(-1, len(p) - 1))) for rid, p in prompts.items()])
    parents = [-1, 0, 0, 1, 1, 2, 4]
    for step in range(4):
        if step == 2:
            native.release("r1")
            del prompts["r1"]
            prompts["r4"] = torch.randint(0, vocab, (17,), generator=gen).tolist()
        if step == 3:
            prompts["r2"] = prompts["r2"][:30]  # diverges from the cache: truncation
        items = [
            TreeForward(
                rid, p[:-1], [p[-1]] + [(11 * k + 7 * i + 3 * step) % vocab for k in range(1, len(parents))], parents
            )
            for i, (rid, p) in enumerate(prompts.items())
        ]
        out += native.forward_tree(items)
        # accept root -> 1 -> 4 -> 6 (across block boundaries for small blocks), plus a bonus token
        prompts = {
            it.request_id: list(it.context_tokens) + [it.tokens[0], it.tokens[1], it.tokens[4], it.tokens[6], step + 1]
            for it in items
        }
    return out


@pytest.fixture(scope="module")
def contiguous_logits(model_pair) -> list[torch.Tensor]:
    native = NativeBackend.load(
        model_pair.llm, NativeOptions(kv_cache_bytes=1 << 26, max_seq_len=256, attention="torch", gemm="linear")
    )
    return _steps(native, native.vocab_size)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_logits_equal_contiguous(model_pair, contiguous_logits, block_size):
    native = NativeBackend.load(
        model_pair.llm,
        NativeOptions(
            kv_cache_bytes=1 << 26, max_seq_len=256, attention="torch", gemm="linear", kv_block_size=block_size
        ),
    )
    got = _steps(native, native.vocab_size)
    assert len(got) == len(contiguous_logits)
    for a, b in zip(got, contiguous_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    held = sum(len(native._caches[r].storage.block_table) for r in native.cached_requests())
    assert native.kv_blocks_free == native.kv_budget.blocks - held
    for r in native.cached_requests():
        native.release(r)
    assert native.kv_blocks_free == native.kv_budget.blocks


def test_paged_capacity(model_pair):
    """``max_requests`` keeps the slots' guarantee (each request at its longest); the paged pool
    has ``kv_cache_bytes / (bytes per token * block size)`` blocks."""
    options = NativeOptions(
        kv_cache_bytes=1 << 24, max_seq_len=200, max_tree_nodes=56, attention="torch", gemm="linear"
    )
    slots = NativeBackend.load(model_pair.llm, options)
    paged = NativeBackend.load(model_pair.llm, dataclasses.replace(options, kv_block_size=16))
    per_token = KVPool.bytes_per_token(paged.spec, torch.float32)
    assert paged.kv_budget.blocks == (1 << 24) // (per_token * 16)
    assert paged.max_requests == paged.kv_budget.blocks // 16  # 256 rows a request: 16 blocks
    assert slots.max_requests == (1 << 24) // (per_token * 256) == slots.kv_budget.blocks
    # a short request holds only its context's blocks
    paged.forward_tree([TreeForward("a", [], [1, 2, 3], [-1, 0, 1])])
    assert paged.kv_blocks_free == paged.kv_budget.blocks - 1
    with pytest.raises(ValueError, match="kv_block_size"):
        NativeOptions(kv_block_size=-1)
