"""CUDA graphs of the native runtime (``specinfer.models.native.graphs``): padded steps give the eager steps' logits.

On a CPU the padded path runs eagerly (``capture=False``): what is tested there is the padding (static buffers,
padding tokens on the scratch row, padding segments and logit rows, the metadata of ``pad_metadata``), with the
PyTorch attention and the Triton kernel under the interpreter. With ``SPECINFER_TEST_DEVICE=cuda`` the same steps
are captured and replayed as CUDA graphs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from devices import TEST_DEVICE, on_test_device  # tests/devices.py
from test_native import _rel, save_tiny_checkpoint  # tests/test_native.py

from specinfer.kernels import build_paged_tree_metadata, build_tree_metadata, tree_attention_ref
from specinfer.kernels.metadata import MetadataShape, pad_metadata
from specinfer.models.interface import TreeForward
from specinfer.models.native import NativeBackend, NativeOptions
from specinfer.models.native.backend import new_pool, pool_geometry, uses_cuda_graphs
from specinfer.models.native.graphs import GraphLimits, GraphRunner, GraphStats, StepShape, warmup_steps
from specinfer.models.native.step import PackedStep, StepRequest
from specinfer.models.native.warmup import warm_graphs

CAPTURE = TEST_DEVICE.startswith("cuda")
MAX_TOKENS = 48  # the tests' long prefill (60 tokens) runs eagerly, the rest padded


def _backends(path, model: str, kv_block_size: int, attention: str) -> tuple[NativeBackend, NativeBackend]:
    """The same weights twice: steps as they are (eager), and padded through a GraphRunner (own KV pool)."""
    options = on_test_device(
        NativeOptions(kv_cache_bytes=1 << 22, attention=attention, kv_block_size=kv_block_size, cuda_graph_tokens=0)
    )
    eager = NativeBackend.load(path, options)
    model_ = eager.runner.model
    device = torch.device(options.device)
    pool = new_pool(eager.spec, options, device, pool_geometry(eager.spec, options))
    limits = GraphLimits(eager.rows_per_request, options.max_tree_nodes)
    graphs = GraphRunner(model_, pool, device, limits, MAX_TOKENS, capture=CAPTURE)
    return eager, NativeBackend(eager.spec, graphs, options)


def _script(vocab: int) -> list[list[TreeForward]]:
    """A serving loop's calls: prefills of several lengths (one past MAX_TOKENS), tree steps whose accepted paths
    the next context adopts, SSM-style calls that attach frontier nodes to pending ones, a released request and a
    new one."""
    gen = np.random.default_rng(3)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in gen.integers(3, vocab, n)]

    prompts = {"a": tokens(1), "b": tokens(9), "c": tokens(23)}
    calls = [[TreeForward(r, [], p, list(range(-1, len(p) - 1))) for r, p in prompts.items()]]
    parents = [-1, 0, 0, 1, 1, 2, 4]
    contexts = {r: p[:-1] for r, p in prompts.items()}
    roots = {r: p[-1] for r, p in prompts.items()}
    for _ in range(3):  # tree steps; the path root -> 1 -> 3 and a bonus token are accepted
        step = []
        for r in contexts:
            tree = [roots[r], *tokens(len(parents) - 1)]
            step.append(TreeForward(r, contexts[r], tree, parents))
            contexts[r] = contexts[r] + [tree[0], tree[1], tree[3]]
            roots[r] = tokens(1)[0]
        calls.append(step)
    ctx = contexts["b"] + [roots["b"]]
    calls.append([TreeForward("b", ctx[:-1], [ctx[-1]], [-1])])  # an SSM's root, then its frontier
    calls.append([TreeForward("b", ctx[:-1], tokens(2), [0, 0])])
    calls.append([TreeForward("b", ctx[:-1], tokens(3), [2, 1, 2])])
    calls.append([TreeForward("d", [], tokens(60), list(range(-1, 59)))])  # past MAX_TOKENS: eager
    calls.append(
        [TreeForward("a", contexts["a"], [roots["a"]], [-1]), TreeForward("d", [], tokens(5), [-1, 0, 0, 1, 1])]
    )
    return calls


MODELS = ["llama-gqa", "gemma2-capped", "mistral-window", "qwen3", "opt"]


@pytest.mark.parametrize("kv_block_size", [0, 3], ids=["contiguous", "paged"])
@pytest.mark.parametrize("model", MODELS)
def test_padded_steps_give_the_eager_logits(tmp_path, model, kv_block_size):
    """Every call of a serving loop's script gives, padded, the eager step's logits (fp32), on both KV layouts; same
    shapes share one padded step, and a prefill past ``max_tokens`` runs eagerly."""
    save_tiny_checkpoint(model, tmp_path)
    eager, graphs = _backends(tmp_path, model, kv_block_size, "torch")
    script = _script(eager.vocab_size)
    for i, call in enumerate(script):
        if i == len(script) - 2:
            eager.release("c")  # a slot or blocks freed between steps, then a new request
            graphs.release("c")
        want, got = eager.forward_tree(call), graphs.forward_tree(call)
        for w, g in zip(want, got, strict=True):
            assert g.shape == w.shape
            assert _rel(g, w.cpu()) < 1e-5, f"call {i}"
    runner = graphs.runner
    assert runner.capture_error is None
    assert runner.eager_steps == 1  # the 60-token prefill
    assert runner.graphs < len(script) - 1  # the three tree steps share one shape


@pytest.mark.parametrize("kv_block_size", [0, 3], ids=["contiguous", "paged"])
def test_padded_steps_through_the_triton_kernel(tmp_path, kv_block_size):
    """The same with the Triton kernel (the interpreter on a CPU), which is what a graph holds on a GPU: its
    programs of padding segments exit, the padding tokens' rows are never read."""
    save_tiny_checkpoint("gemma2-capped", tmp_path)  # soft-caps and a sliding window: every kernel option
    eager, graphs = _backends(tmp_path, "gemma2-capped", kv_block_size, "triton")
    for i, call in enumerate(_script(eager.vocab_size)[:6]):
        for w, g in zip(eager.forward_tree(call), graphs.forward_tree(call), strict=True):
            assert _rel(g, w.cpu()) < 1e-5, f"call {i}"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_padded_metadata_gives_the_same_attention(paged):
    """Kernel level: the padded metadata (more segments, words, bit rows, table entries, query rows) gives the real
    rows the attention of the metadata it pads, through the fp32 reference; padding rows are left alone."""
    gen = torch.Generator().manual_seed(0)
    parents = [(-1, 0, 0, 1, 2), (-1,), tuple(range(-1, 6)), (-1, 0, 1, 1)]
    prefix = [7, 0, 3, 12]
    block = 4
    tables = []
    if paged:
        free = torch.randperm(40, generator=gen).tolist()
        for p, n in zip(prefix, map(len, parents), strict=True):
            tables.append([free.pop() for _ in range(-(-(p + n) // block) + 1)])  # one block more than needed
        meta = build_paged_tree_metadata(parents, prefix, tables, block, "cpu")
        k = torch.randn(41, block, 2, 16, generator=gen)
    else:
        starts = [0, 20, 30, 50]
        meta = build_tree_metadata(parents, prefix, starts, "cpu")
        k = torch.randn(70, 2, 16, generator=gen)
    v = torch.randn(k.shape, generator=gen)
    q = torch.randn(meta.total_queries, 4, 16, generator=gen)
    want = tree_attention_ref(q, k, v, meta)
    shape = MetadataShape.covering(meta, 32)
    assert (shape.batch, shape.max_queries, shape.queries) == (4, 8, 32)
    padded = pad_metadata(meta, dataclasses.replace(shape, batch=8, words=2, bit_rows=32), k.shape[0], "cpu")
    q_padded = torch.cat([q, torch.full((32 - q.shape[0], 4, 16), float("nan"))])
    got = tree_attention_ref(q_padded, k, v, padded)
    torch.testing.assert_close(got[: q.shape[0]], want, rtol=0, atol=0)


def test_shapes_round_up_and_a_smaller_shape_is_refused():
    meta = build_tree_metadata([(-1, 0, 0), (-1,)], [5, 300], [0, 400], "cpu")
    shape = MetadataShape.covering(meta, 4)
    assert shape == MetadataShape(
        batch=2, queries=4, max_queries=4, words=1, bit_rows=4, table_width=0, max_prefix_len=512
    )
    assert shape.holds(meta) and not dataclasses.replace(shape, queries=3).holds(meta)
    with pytest.raises(ValueError, match="cannot hold"):
        MetadataShape.covering(meta, 3)
    with pytest.raises(ValueError, match="does not hold"):
        pad_metadata(meta, dataclasses.replace(shape, max_queries=2), 1000, "cpu")


def test_cuda_graphs_only_where_they_can_run():
    """A CUDA device with the Triton attention and no offloading; never on a CPU, and 0 turns them off."""
    options = NativeOptions(device="cuda", attention="triton")
    assert uses_cuda_graphs(options, torch.device("cuda"))
    assert not uses_cuda_graphs(options, torch.device("cpu"))
    assert not uses_cuda_graphs(dataclasses.replace(options, attention="torch"), torch.device("cuda"))
    assert not uses_cuda_graphs(dataclasses.replace(options, offload=True), torch.device("cuda"))
    assert not uses_cuda_graphs(dataclasses.replace(options, cuda_graph_tokens=0), torch.device("cuda"))
    with pytest.raises(ValueError, match="cuda_graph_tokens"):
        NativeOptions(cuda_graph_tokens=-1)
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(None, None, torch.device("cpu"), GraphLimits(64, 64), 64, capture=True)


def test_a_failed_capture_leaves_the_steps_eager(tmp_path):
    """A capture that raises (an operation a graph cannot hold, say) is logged, recorded and ends capturing for the
    runner's life; that step and every later one run eagerly with the eager logits."""
    save_tiny_checkpoint("llama-gqa", tmp_path)
    eager, graphs = _backends(tmp_path, "llama-gqa", 16, "torch")
    runner = graphs.runner
    runner.capture = True  # as on CUDA, with a capture that fails

    def failing_capture(padded):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner._capture = failing_capture
    for i, call in enumerate(_script(eager.vocab_size)[:3]):
        for w, g in zip(eager.forward_tree(call), graphs.forward_tree(call), strict=True):
            assert _rel(g, w.cpu()) < 1e-5, f"call {i}"
    assert "operation not permitted" in runner.capture_error
    assert runner.graphs == 0 and runner.max_graphs == 0 and runner.eager_steps == 3


def test_warmup_steps_cover_every_batch_and_tree_size_once():
    """Each step is a batch whose first tree is its largest, at most max_tokens nodes in all; each (requests, largest
    tree, packed tokens), rounded up to powers of two, appears once, and every batch of up to 8 trees of up to 16
    nodes is covered; lone requests first, then incremental batches."""
    steps = warmup_steps(8, 16, 32)
    keys = []
    for sizes in steps:
        b, q, t = len(sizes), sizes[0], sum(sizes)
        assert all(1 <= n <= q for n in sizes) and t <= 32
        keys.append((1 << (b - 1).bit_length(), 1 << (q - 1).bit_length(), 1 << (t - 1).bit_length()))
    assert len(set(keys)) == len(keys)
    for b in range(1, 9):  # every batch whose largest tree has up to 16 nodes, packed tokens at most 32
        for q in range(1, 17):
            for total in range(q + b - 1, min(b * q, 32) + 1):
                pad = (1 << (b - 1).bit_length(), 1 << (q - 1).bit_length(), 1 << (total - 1).bit_length())
                assert pad in keys, (b, q, total)
    kinds = [0 if len(s) == 1 else 1 if s[0] == 1 else 2 for s in steps]
    assert kinds == sorted(kinds)


def _step(prefix: int, parents: list[int], block_size: int) -> PackedStep:
    table = tuple(range(-(-(prefix + len(parents)) // block_size))) if block_size else ()
    request = StepRequest(0, prefix, [], [7] * len(parents), parents, table)
    return PackedStep.from_trees([request], block_size)


@pytest.mark.parametrize("block_size", [0, 16], ids=["contiguous", "paged"])
def test_a_growing_context_keeps_its_step_shape(block_size):
    """The shape a step replays depends on its tokens, batch and tree, not on how long its context has grown: the
    block table is as wide as a request's longest and the split heuristic plans for the longest prefix (a context
    passing 256, 512, ... tokens was a new capture in the serving path)."""
    limits = GraphLimits(request_rows=2304, tree_rows=256)
    parents = [-1, 0, 0, 1]
    shapes = set()
    for prefix in (3, 255, 300, 700, 1500, 2299):
        step = _step(prefix, parents, block_size)
        shapes.add(StepShape.covering(step, step.metadata(torch.device("cpu")), limits, block_size))
    assert len(shapes) == 1
    (shape,) = shapes
    assert shape.tokens == 4 and shape.meta.max_prefix_len == 2304
    assert shape.meta.table_width == (144 if block_size else 0)
    chain = _step(5, [-1, 0, 1, 2], block_size)
    assert StepShape.covering(chain, chain.metadata(torch.device("cpu")), limits, block_size) == shape


def test_warmed_up_runner_captures_nothing_while_serving(tmp_path):
    """After the warm-up (its shapes padded and, on CUDA, captured) a serving loop's steps within its batch and tree
    bounds (verify steps, a new request's prompt, an SSM's frontier calls on pending nodes) meet only shapes it has,
    with the eager steps' logits; the statistics say which phase captured what."""
    save_tiny_checkpoint("llama-gqa", tmp_path)
    eager, graphs = _backends(tmp_path, "llama-gqa", 4, "torch")
    stats = warm_graphs(graphs, max_batch=4, max_nodes=8, seconds=600)
    assert stats == GraphStats(
        warmup=graphs.runner.graphs, serving=0, eager_steps=0, warmup_seconds=stats.warmup_seconds
    )
    assert stats.warmup == len(warmup_steps(4, 8, MAX_TOKENS)) and graphs.cached_requests() == []
    gen = np.random.default_rng(5)

    def tokens(n: int) -> list[int]:
        return [int(t) for t in gen.integers(3, eager.vocab_size, n)]

    # as a verifier is called: each tree's root is the token the last step added, its context the tokens before;
    # "c" arrives later, its prompt computed as a chain before its first tree (fewer logit rows than tokens)
    contexts, roots = {"a": tokens(4), "b": tokens(6)}, {"a": 9, "b": 11}
    calls = []
    for step in range(12):
        if step == 4:
            contexts["c"], roots["c"] = tokens(5), 13
        batch = []
        for r in contexts:
            n = int(gen.integers(1, 9))
            tree, parents = [roots[r], *tokens(n - 1)], [-1] + [int(gen.integers(0, j)) for j in range(1, n)]
            batch.append(TreeForward(r, contexts[r], tree, parents))
            path = [0]
            while (children := [j for j in range(n) if parents[j] == path[-1]]) and len(path) < 3:
                path.append(children[0])
            contexts[r] = contexts[r] + [tree[j] for j in path]  # the accepted path; its bonus token the next root
            roots[r] = tokens(1)[0]
        calls.append(batch)
    ctx = contexts["a"]  # an SSM's drafting round: the root, then frontiers attached to the round's pending nodes
    calls += [[TreeForward("a", ctx, [roots["a"]], [-1])], [TreeForward("a", ctx, tokens(2), [0, 0])]]
    calls += [[TreeForward("a", ctx, tokens(3), [1, 1, 2])], [TreeForward("a", ctx, tokens(2), [3, 5])]]
    for i, call in enumerate(calls):
        for w, g in zip(eager.forward_tree(call), graphs.forward_tree(call), strict=True):
            assert _rel(g, w.cpu()) < 1e-5, f"call {i}"
    assert graphs.graph_stats.serving == 0 and graphs.graph_stats.warmup == stats.warmup
    graphs.forward_tree([TreeForward("d", [], [3] * 20, list(range(-1, 19)))])  # a 20-node chain: past the warm-up
    assert graphs.graph_stats.serving == 1
    assert eager.graph_stats is None


def test_warmup_is_bounded_by_its_seconds(tmp_path):
    """A warm-up out of time stops where it is (the commonest shapes first), leaves no request behind, and the shapes
    it did not reach are captured when met."""
    save_tiny_checkpoint("llama-gqa", tmp_path)
    _, graphs = _backends(tmp_path, "llama-gqa", 0, "torch")
    stats = warm_graphs(graphs, max_batch=4, max_nodes=8, seconds=0)
    assert stats.warmup == 1 and graphs.cached_requests() == []  # the contexts' step alone
    assert stats.serving == 0
