"""Prefix caching in the paged KV pool (specinfer.models.native.paged_pool): block keys, reference
counts, least-recently-used eviction, no write into a shared block, and exactness: logits with a
cached prefix equal logits without, and greedy output with prefix caching, paging and forced
preemption equals transformers'."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import hf_greedy  # tests/oracles.py
from test_kv_preemption import backend  # tests/test_kv_preemption.py

from specinfer.core import ExpansionConfig
from specinfer.engine import EngineConfig, GenerationRequest, SpeculationConfig, SpeculativeEngine
from specinfer.models.interface import TreeForward
from specinfer.models.kv_store import RequestCache
from specinfer.models.loading import eos_token_id
from specinfer.models.native import KVCacheFull, NativeBackend, NativeOptions
from specinfer.models.native.paged_pool import BlockStorage, PagedKVPool, block_key
from specinfer.models.native.spec import ModelSpec
from specinfer.models.native.step import PackedStep, StepRequest

SPEC = ModelSpec("llama", 16, 8, 2, 2, 1, 4, 8, 64, 1e-5, False, False, 1e4, (None,) * 2)  # 2 layers, 1 KV head of 4


def pool(block_size: int, blocks: int) -> PagedKVPool:
    return PagedKVPool(SPEC, torch.float32, torch.device("cpu"), block_size, blocks)


def value(tokens) -> float:
    """The K/V a position holds in these tests: a function of the tokens up to it, as a model's are
    (exact in float32)."""
    return float(hash(tuple(tokens)) % 1_000_003)


def forward(cache: RequestCache, context: list[int], tokens: list[int], parents: list[int]) -> list[int]:
    """What the backend does around a step, writing :func:`value` of each computed position's tokens
    where the model would write its K/V; returns the rows written."""
    chain = cache.sync(context, new_round=bool(parents) and parents[0] < 0)
    lc, lp = cache.context_len, cache.pending_len
    storage = cache.storage
    storage.reserve(lc + len(chain), lc + len(chain) + lp + len(tokens))
    nodes = cache.node_parents(parents)
    step = PackedStep.from_trees(
        [StepRequest(0, lc, chain, tokens, nodes, tuple(storage.block_table))], storage.pool.block_size
    )
    prefixes = [context[: lc + i + 1] for i in range(len(chain))]
    all_tokens = cache.pending_tokens + list(tokens)
    for j in range(lp, lp + len(tokens)):
        path, node = [], j
        while node >= 0:
            path.append(all_tokens[node])
            node = nodes[node]
        prefixes.append(context + path[::-1])
    k = storage.pool.k.flatten(1, -3)  # [layers, rows, kv_heads, head_dim]
    for row, prefix in zip(step.cache_rows, prefixes, strict=True):
        k[:, row] = value(prefix)
    cache.record_context(chain)
    cache.record_pending(tokens, parents)
    return list(step.cache_rows)


def held_context_values(cache: RequestCache) -> list[float]:
    k = cache.storage.pool.k.flatten(1, -3)
    return [float(k[0, r, 0, 0]) for r in cache.storage.rows(range(cache.context_len))]


def check_pool(p: PagedKVPool, caches: list[RequestCache]) -> None:
    """The pool's invariants, and each block's references are the tables that list it."""
    p.check()
    counts: dict[int, int] = {}
    for c in caches:
        for b in c.storage.block_table:
            counts[b] = counts.get(b, 0) + 1
    assert all(p.refs(b) == counts.get(b, 0) for b in range(p.num_blocks))
    assert p.free_blocks == p.num_blocks - len(counts)


def test_block_keys_chain_the_prefix():
    a = block_key(b"", [1, 2])
    assert a == block_key(b"", (1, 2)) and len(a) == 32
    assert block_key(a, [3, 4]) != block_key(block_key(b"", [9, 9]), [3, 4])  # the same tokens behind another prefix
    assert block_key(b"", [1, 2]) != block_key(b"", [2, 1])


def test_refcounts_and_least_recently_used_eviction():
    p = pool(2, 4)
    a, b, c = p.allocate(1), p.allocate(1), p.allocate(1)
    for blocks, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        p.register(blocks[0], key)
    p.register(p.allocate(1)[0], b"a")  # a key already cached: the second copy stays private
    assert p.cached_blocks == 3
    assert p.share(b"a") == a[0] and p.refs(a[0]) == 2
    p.release(b)  # idle first: evicted first
    p.release(a)
    p.release(c)
    assert p.refs(a[0]) == 1 and p.free_blocks == 2  # b and c idle, a still held once
    p.release(a)  # now idle, most recently
    assert p.free_blocks == 3 and p.cached_blocks == 3
    p.check()
    assert p.allocate(1) == b  # no free block: the least recently released idle one, its key dropped
    assert p.share(b"b") is None and p.share(b"c") == c[0]
    assert p.allocate(1) == a  # c is held again: a goes
    assert p.cached_blocks == 1
    with pytest.raises(KVCacheFull):
        p.allocate(2)
    p.check()


def test_a_request_takes_the_cached_blocks_of_its_prefix_and_never_writes_them():
    p = pool(4, 16)
    prefix = list(range(10))
    first = RequestCache(BlockStorage(p, prefix_caching=True))
    forward(first, prefix + [50, 51], [60, 61], [-1, 0])  # 12 context tokens: 3 full blocks, cached once the step ran
    assert first.reused == 0 and p.cached_blocks == 3
    second = RequestCache(BlockStorage(p, prefix_caching=True))
    written = forward(second, prefix + [70, 71, 72], [80], [-1])
    assert second.reused == 8  # blocks 0 and 1 hold tokens 0..7; block 2 holds 8, 9, 50, 51: not second's
    shared = first.storage.block_table[:2]
    assert second.storage.block_table[:2] == shared and all(p.refs(b) == 2 for b in shared)
    assert not {r // 4 for r in written} & set(shared), "a request wrote into a block it shares"
    assert held_context_values(second) == [value((prefix + [70, 71, 72])[: i + 1]) for i in range(13)]
    check_pool(p, [first, second])
    # the first request's context is cut inside a shared block: it drops that block, the second keeps it
    forward(first, prefix[:6] + [90, 91, 92], [], [])
    assert first.storage.block_table[0] == shared[0] and first.storage.block_table[1] != shared[1]
    assert first.reused == 0 and held_context_values(first) == [
        value((prefix[:6] + [90, 91, 92])[: i + 1]) for i in range(9)
    ]
    assert held_context_values(second)[:8] == [value(prefix[: i + 1]) for i in range(8)]
    check_pool(p, [first, second])
    first.storage.release()
    second.storage.release()
    check_pool(p, [])
    assert p.free_blocks == p.num_blocks and p.cached_blocks > 0  # cached blocks stay, idle


def test_off_no_block_is_shared():
    p = pool(4, 16)
    a, b = RequestCache(BlockStorage(p)), RequestCache(BlockStorage(p))
    forward(a, list(range(12)), [1], [-1])
    forward(b, list(range(12)), [1], [-1])
    assert b.reused == 0 and not set(a.storage.block_table) & set(b.storage.block_table) and p.cached_blocks == 0


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.integers(8, 40), st.data())
def test_random_requests_with_shared_prefixes_keep_the_pool_consistent(block_size, blocks, data):
    """Random requests on a few shared prefixes (new ones, trees, accepted paths, cuts, releases) on a
    pool that often runs out: every block is free, idle or held, held by as many tables as list it,
    and every context position of every request holds the K/V of its own tokens, whoever computed it."""
    p = pool(block_size, blocks)
    prefixes = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5]]
    caches: dict[int, RequestCache] = {}
    for _ in range(data.draw(st.integers(1, 30))):
        i = data.draw(st.integers(0, 3))
        cache = caches.get(i)
        op = data.draw(st.sampled_from(["new", "tree", "accept", "cut", "release"]))
        try:
            if op == "new" or cache is None:
                if cache is not None:
                    cache.storage.release()
                cache = caches[i] = RequestCache(BlockStorage(p, prefix_caching=True))
                base = data.draw(st.sampled_from(prefixes))
                forward(
                    cache,
                    base[: data.draw(st.integers(1, len(base)))] + data.draw(st.lists(st.integers(0, 9), max_size=5)),
                    [],
                    [],
                )
            elif op == "tree":
                n = data.draw(st.integers(1, 4))
                forward(
                    cache,
                    list(cache.context_tokens),
                    data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)),
                    [-1, *range(n - 1)],
                )
            elif op == "accept" and cache.pending_len:
                forward(
                    cache,
                    list(cache.context_tokens) + cache.pending_tokens[: data.draw(st.integers(1, cache.pending_len))],
                    [],
                    [],
                )
            elif op == "cut" and cache.context_len > 1:
                context = list(cache.context_tokens)[: data.draw(st.integers(1, cache.context_len - 1))]
                forward(cache, context + data.draw(st.lists(st.integers(0, 9), max_size=3)), [], [])
            elif op == "release":
                caches.pop(i).storage.release()
        except KVCacheFull:
            caches.pop(i).storage.release()  # a request the pool cannot hold gives its blocks back (a preemption)
        check_pool(p, list(caches.values()))
        for c in caches.values():
            if c.storage.block_table:
                assert held_context_values(c) == [value(list(c.context_tokens)[: j + 1]) for j in range(c.context_len)]


# -- the model: logits and greedy output --------------------------------------------------------


def options(block_size: int, prefix_caching: bool) -> NativeOptions:
    return NativeOptions(
        kv_cache_bytes=1 << 26,
        max_seq_len=256,
        attention="torch",
        gemm="linear",
        kv_block_size=block_size,
        prefix_caching=prefix_caching,
    )


def _shared_prefix_steps(native: NativeBackend, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefill the first prompt alone, then the others together, each with a 4-node tree on its
    prompt, then a step on the accepted paths: every logits tensor in order."""
    parents = [-1, 0, 0, 1]
    out = []
    items = [TreeForward(f"r{i}", p[:-1], [p[-1], 3, 5, 7], parents) for i, p in enumerate(prompts)]
    out += native.forward_tree(items[:1])
    out += native.forward_tree(items[1:])
    out += native.forward_tree(
        [TreeForward(it.request_id, [*it.context_tokens, it.tokens[0], 3], [11, 12], [-1, 0]) for it in items]
    )
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_logits_with_a_cached_prefix_equal_logits_without(model_pair, block_size):
    prefix = list(model_pair.prompts[0])[:40]
    prompts = [prefix + list(p)[:9] for p in model_pair.prompts[1:6]]
    cold = NativeBackend.load(model_pair.llm, options(block_size, False))
    warm = NativeBackend.load(model_pair.llm, options(block_size, True))
    want, got = _shared_prefix_steps(cold, prompts), _shared_prefix_steps(warm, prompts)
    assert cold.prefix_cache_stats is None
    stats = warm.prefix_cache_stats
    first = prompts[0][:-1]
    common = [
        next((j for j, (x, y) in enumerate(zip(first, p[:-1], strict=False)) if x != y), len(p) - 1)
        for p in prompts[1:]
    ]
    assert min(common) >= 40
    assert stats.hit_tokens == sum(
        c // block_size * block_size for c in common
    )  # the later prompts took the first one's full blocks
    assert stats.queried_tokens == sum(len(p) - 1 for p in prompts)
    assert [warm.prefix_hits(f"r{i}") for i in range(5)] == [0] * 5  # the last forward computed no context
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for r in warm.cached_requests():
        warm.release(r)
    assert warm.kv_blocks_free == warm.kv_budget.blocks  # cached blocks no request holds count as free


NEW_TOKENS = 30
NUM_PROMPTS = 10


@pytest.fixture(scope="module")
def shared(model_pair):
    """NUM_PROMPTS prompts sharing a 48-token prefix, their longest sequence, transformers' greedy output."""
    prefix = list(model_pair.prompts[0])[:48]
    prompts = [tuple(prefix + list(p)[:12]) for p in model_pair.prompts[1 : NUM_PROMPTS + 1]]
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    return prompts, longest, hf_greedy(model_pair.llm, prompts, NEW_TOKENS)


@pytest.mark.parametrize("speculation", ["none", pytest.param("auto", marks=pytest.mark.slow), "1,1,3,1"])
def test_greedy_output_is_transformers_with_prefix_caching_and_preemption(model_pair, shared, speculation):
    """A pool of about 2.5 requests at their longest for 10 requests with a common prefix: they are
    preempted and resumed, later ones and resumed ones take cached blocks, and the output is
    transformers' greedy output."""
    prompts, longest, expected = shared
    spec = (
        None
        if speculation == "none"
        else SpeculationConfig(None if speculation == "auto" else ExpansionConfig.parse(speculation))
    )
    llm = backend(model_pair.llm, longest, 4, 2.5)
    ssm = backend(model_pair.ssm, longest, 4, NUM_PROMPTS + 1, 256)
    assert llm.prefix_caching and ssm.prefix_caching  # on by default
    engine = SpeculativeEngine(llm, [ssm], EngineConfig(eos_token_id=eos_token_id(model_pair.llm)))
    results = engine.generate(
        [GenerationRequest(f"r{i}", p, NEW_TOKENS, speculation=spec) for i, p in enumerate(prompts)]
    )
    for i, (res, exp) in enumerate(zip(results, expected, strict=True)):
        assert res.output_tokens == exp, f"prompt {i} differs"
    assert engine.preemptions > 0, "the pool was meant to be too small for the batch"
    assert llm.prefix_cache_stats.hit_tokens > 0
    cached = [r.cached_prompt_tokens for r in results]
    assert all(c % 4 == 0 and c < len(p) for c, p in zip(cached, prompts, strict=True)) and sum(cached) >= 48
    assert llm.kv_blocks_free == llm.kv_budget.blocks


def test_prefix_caching_off_reuses_nothing(model_pair, shared):
    prompts, longest, expected = shared
    llm = backend(model_pair.llm, longest, 4, 2.5)
    llm = NativeBackend(llm.spec, llm.runner, dataclasses.replace(llm.options, prefix_caching=False))
    engine = SpeculativeEngine(llm, [], EngineConfig(eos_token_id=eos_token_id(model_pair.llm)))
    results = engine.generate([GenerationRequest(f"r{i}", p, NEW_TOKENS) for i, p in enumerate(prompts[:4])])
    assert [r.output_tokens for r in results] == expected[:4]
    assert llm.prefix_cache_stats is None and all(r.cached_prompt_tokens == 0 for r in results)
