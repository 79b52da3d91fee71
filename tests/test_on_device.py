"""The device-side work on model outputs (specinfer.models.on_device) against its NumPy references.

Each batched function must give what the per-row reference in specinfer.core gives: logit
processing, top-k, the greedy accept walk; and verify_trees / the SSM pass tables, which run them,
must give the verdicts and proposals of the reference code path (greedy exactly; sampling exactly
too: the device computes MSS's lookups, the host walks with the same uniforms, so seeded results
are those of verify_stochastic on the same stream).
"""

from __future__ import annotations

import itertools
from functools import partial

import numpy as np
import pytest
import torch

from specinfer.core import (
    DraftTree,
    SamplingParams,
    TokenTree,
    draw_without_replacement,
    process_logits,
    sparsify,
    top_k_tokens,
    verify_greedy,
    verify_stochastic,
)
from specinfer.core.coupled import coupled_children, coupled_token, position_noise, verify_coupled
from specinfer.core.drafts import DraftGroup, ExpansionConfig
from specinfer.core.dynamic_trees import TreeBudget
from specinfer.core.iteration import DraftSpec, VerifySpec, draft_stream
from specinfer.kernels import cpu_qgemm, cpu_rows
from specinfer.models import drafting
from specinfer.models.drafting import pass_tables, propose
from specinfer.models.interface import TreeForward
from specinfer.models.on_device import (
    coupled_targets,
    greedy_accept,
    processed_probs,
    ranked_top_k,
    serial_on_cpu,
    stack_rows,
)
from specinfer.models.verification import verify_trees

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=9, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=40),  # top-k above the vocabulary: no filter
    SamplingParams(
        temperature=1.0, verification="coupled"
    ),  # coupled verification (the draw fixed by seed and position)
    SamplingParams(temperature=0.8, top_k=6, top_p=0.9, seed=5),  # a seed alone: coupled too
    SamplingParams(temperature=1.0, min_p=0.3),
    SamplingParams(temperature=0.6, min_p=0.1, top_k=7, top_p=0.9),
]


def test_processed_probs_matches_process_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(40, 30)).astype(np.float32) * 3
    logits[3, :10] = logits[3, 10]  # ties at the top-k boundary
    params = [PARAMS[i % len(PARAMS)] for i in range(len(logits))]
    got = processed_probs(torch.from_numpy(logits), params).numpy()
    for row, p, g in zip(logits, params, got, strict=True):
        want = process_logits(row, p)
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-15)
        assert np.array_equal(g > 0, want > 0)


def test_processed_probs_refuses_greedy_rows():
    with pytest.raises(ValueError, match="greedy"):
        processed_probs(torch.zeros(1, 4), [SamplingParams()])


def test_ranked_top_k_orders_like_top_k_tokens_with_ties():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, size=(50, 12)).astype(np.float32)  # many ties
    for k in (1, 3, 12):
        idx, vals = ranked_top_k(torch.from_numpy(x), k)
        for row, got, v in zip(x, idx.numpy(), vals.numpy(), strict=True):
            want = top_k_tokens(row, k)
            # the tokens' values agree rank by rank, and equal values come in index order
            assert np.array_equal(row[got], row[want]) and np.array_equal(v, row[want])
            for a, b in itertools.pairwise(got):
                assert row[a] > row[b] or a < b


def random_tree(rng: np.random.Generator, n: int, vocab: int) -> TokenTree:
    """A random trie of at most ``n`` nodes: each new node under a random node with a token its siblings lack."""
    tokens, parents, used = [int(rng.integers(vocab))], [-1], [set()]
    for _ in range(1, n):
        parent = int(rng.integers(len(tokens)))
        free = sorted(set(range(vocab)) - used[parent])
        if free:
            token = free[int(rng.integers(len(free)))]
            used[parent].add(token)
            tokens.append(token)
            parents.append(parent)
            used.append(set())
    return TokenTree(tuple(tokens), tuple(parents))


def test_greedy_accept_matches_verify_greedy():
    rng = np.random.default_rng(2)
    vocab = 3  # small: long accepted paths
    for _ in range(50):
        trees = [random_tree(rng, int(rng.integers(1, 30)), vocab) for _ in range(int(rng.integers(1, 6)))]
        argmaxes = [rng.integers(0, vocab, len(t)) for t in trees]
        tokens, parents, segments, at = [], [], [], 0
        for g, t in enumerate(trees):
            tokens += t.tokens
            parents += [at if p < 0 else at + p for p in t.parents]
            segments += [g] * len(t)
            at += len(t)
        depth = max(int(max(t.depths)) for t in trees)
        ends = greedy_accept(
            torch.from_numpy(np.concatenate(argmaxes)),
            torch.tensor(tokens),
            torch.tensor(parents),
            torch.tensor(segments),
            len(trees),
            depth,
        )
        starts = np.cumsum([0] + [len(t) for t in trees])
        for g, (t, am) in enumerate(zip(trees, argmaxes, strict=True)):
            want = verify_greedy(t, am)
            assert int(ends[g]) - starts[g] == (want.accepted_nodes[-1] if want.accepted_nodes else 0)


def test_stack_rows_views_adjacent_slices_and_copies_others():
    base = torch.arange(24.0).reshape(6, 4)
    parts = [base[0:2], base[2:3], base[3:6]]
    stacked = stack_rows(parts)
    assert stacked.data_ptr() == base.data_ptr() and torch.equal(stacked, base)
    apart = [base[0:2], base[3:6]]
    assert torch.equal(stack_rows(apart), torch.cat(apart)) and stack_rows(apart).data_ptr() != base.data_ptr()


# -- verify_trees and the SSM pass against the reference code path ------------------------------


class FixedLM:
    """A CausalLM stand-in whose logits are given per request: the rows of one tensor (as the native
    backend returns them) or separate tensors."""

    def __init__(self, logits: dict[str, torch.Tensor], one_tensor: bool) -> None:
        self.logits = logits
        self.one_tensor = one_tensor

    def forward_tree(self, batch):
        parts = [self.logits[item.request_id][: len(item.tokens)] for item in batch]
        if not self.one_tensor:
            return parts
        whole = torch.cat(parts)
        out, at = [], 0
        for p in parts:
            out.append(whole[at : at + len(p)])
            at += len(p)
        return out


def random_draft(rng: np.random.Generator, vocab: int, depth: int, width: int, groups: int, support: int) -> DraftTree:
    """A draft tree as SSMs make it: at each node ``groups`` drafts (merged SSMs), each ``width`` tokens
    drawn without replacement from its sparse q; a token two groups drew is one node in both groups."""
    tokens, parents, dgroups, frontier = [int(rng.integers(vocab))], [-1], [], [0]
    for _ in range(depth):
        new = []
        for u in frontier:
            node_of = {}
            for _ in range(groups):
                q = sparsify(rng.dirichlet(np.full(vocab, 0.3)), support)
                kids = []
                for t in draw_without_replacement(q, width, rng):
                    if t not in node_of:
                        node_of[t] = len(tokens)
                        tokens.append(t)
                        parents.append(u)
                        new.append(node_of[t])
                    kids.append(node_of[t])
                dgroups.append(DraftGroup(u, tuple(kids), q))
        frontier = new
    return DraftTree(TokenTree(tuple(tokens), tuple(parents)), tuple(dgroups))


@pytest.mark.parametrize("one_tensor", [True, False])
def test_verify_trees_equals_the_reference_verdicts(one_tensor: bool):
    """Mixed batches of greedy and sampled jobs (merged drafts with shared nodes, root-only trees, top-k, top-p): the
    verdicts are those of verify_greedy on the argmax and of verify_stochastic on process_logits
    with the job's own generator, token for token."""
    rng = np.random.default_rng(3)
    vocab = 16
    checked = {"greedy": 0, "sampled": 0, "coupled": 0, "accepted": 0}
    for round_ in range(40):
        jobs, logits = [], {}
        for i in range(int(rng.integers(1, 5))):
            sampled = bool(rng.integers(0, 3))
            params = PARAMS[int(rng.integers(len(PARAMS)))] if sampled else SamplingParams()
            draft = random_draft(
                rng,
                vocab,
                int(rng.integers(0, 4)),
                int(rng.integers(1, 4)),
                int(rng.integers(1, 3)),
                int(rng.integers(2, 10)),
            )
            rid = f"r{round_}-{i}"
            # logits that agree with the drafts now and then: greedy walks get somewhere
            rows = rng.normal(size=(len(draft.tree), vocab)) * 2
            for c, p in enumerate(draft.tree.parents):
                if p >= 0 and rng.random() < 0.5:
                    rows[p, draft.tree.tokens[c]] += 4
            logits[rid] = torch.from_numpy(rows.astype(np.float32))
            jobs.append(VerifySpec(rid, [1, 2], draft, params, seed=round_ * 10 + i, step=round_))
        got = verify_trees(FixedLM(logits, one_tensor), jobs)
        for job, verdict in zip(jobs, got, strict=True):
            rows = logits[job.request_id].numpy()
            if job.sampling.greedy:
                want = verify_greedy(job.draft.tree, rows.argmax(axis=-1))
                checked["greedy"] += 1
            elif job.sampling.coupled:
                target = lambda u, rows=rows, p=job.sampling: process_logits(rows[u], p)  # noqa: E731
                want = verify_coupled(
                    job.draft.tree, target, partial(position_noise, job.seed, vocab_size=vocab), len(job.context_tokens)
                )
                checked["coupled"] += 1
            else:
                want = verify_stochastic(
                    job.draft, lambda u, rows=rows, p=job.sampling: process_logits(rows[u], p), job.rng()
                )
                checked["sampled"] += 1
            checked["accepted"] += verdict.num_accepted
            assert verdict == want, f"{job.request_id}: {verdict} != {want}"
    assert checked["greedy"] > 10 and checked["sampled"] > 20 and checked["coupled"] > 5 and checked["accepted"] > 50, (
        checked
    )


def test_verify_trees_refuses_a_sampled_tree_without_draft_distributions():
    tree = TokenTree((1, 2), (-1, 0))
    job = VerifySpec("x", [0], DraftTree(tree, (DraftGroup(0, (1,), None),)), SamplingParams(temperature=1.0), 0, 0)
    with pytest.raises(ValueError, match="draft distributions"):
        verify_trees(FixedLM({"x": torch.zeros(2, 4)}, True), [job])


@pytest.mark.parametrize("c_rows", [True, False], ids=["C rows", "PyTorch rows"])
def test_pass_tables_propose_what_the_reference_drafts(c_rows, monkeypatch):
    """One SSM pass over rows of greedy and sampled jobs: the proposals equal top_k_tokens, and
    draws from sparsify(process_logits(row)) with the job's generator, row by row; the greedy rows' tables from the
    C kernel (rows in host memory, kernels/cpu_rows.c) or from PyTorch's operations (rows on an accelerator)."""
    if c_rows and not cpu_rows.serves(torch.zeros(1, 20), 4):
        pytest.skip(f"no CPU kernels here: {cpu_qgemm.unavailable_reason()}")
    if not c_rows:
        monkeypatch.setattr(drafting.cpu_rows, "serves", lambda rows, k: False)
    rng = np.random.default_rng(4)
    vocab = 20
    logits = torch.from_numpy((rng.normal(size=(30, vocab)) * 2).astype(np.float32))
    jobs, widths = [], []
    for r in range(len(logits)):
        params = SamplingParams() if r % 3 == 0 else PARAMS[r % len(PARAMS)]
        static = (
            ExpansionConfig((2,)) if r % 2 else None
        )  # the others grow dynamic trees, whose slots the softmax scores
        budget = None if r % 2 else TreeBudget(6, 2)
        jobs.append(DraftSpec(f"d{r}", [1], 2, static, params, int(rng.integers(1, 8)), r, 0, draft_stream(0), budget))
        widths.append(int(rng.integers(1, 5)))
    tables = pass_tables(logits, jobs, widths)
    r_depth = [int(d) for d in rng.integers(0, 4, size=len(jobs))]
    for row, job, width, table in zip(logits.numpy(), jobs, widths, tables, strict=True):
        depth = 1 + r_depth.pop()
        got = propose(table, width, job, job.rng(), depth)
        if job.sampling.greedy:
            x = row.astype(np.float64)
            probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
            assert list(got.tokens) == top_k_tokens(row, width) and got.q is None
            if job.budget is not None:
                np.testing.assert_allclose(got.slot_probs, probs[list(got.tokens)], rtol=1e-12)
        else:
            q = sparsify(process_logits(row, job.sampling), job.draft_support)
            assert np.array_equal(got.q.tokens, q.tokens)
            np.testing.assert_allclose(got.q.probs, q.probs, rtol=1e-12)
            if job.sampling.coupled:  # Gumbel-top-k with the noise of the children's sequence index
                assert list(got.tokens) == coupled_children(q, job.seed, len(job.context_tokens) + depth, width)
            else:
                assert list(got.tokens) == draw_without_replacement(q, width, job.rng())


@pytest.mark.parametrize("c_rows", [True, False], ids=["C rows", "PyTorch rows"])
def test_pass_tables_of_some_columns_rank_as_the_whole_rows(c_rows, monkeypatch):
    """Greedy rows that hold some tokens' logits alone (a draft head's draft vocabulary, ``columns``) give the tables
    of the whole rows with -inf at every other token: the same tokens, best first, and their softmax; sampled jobs
    are refused (they draw from processed whole rows)."""
    if c_rows and not cpu_rows.serves(torch.zeros(1, 20), 4):
        pytest.skip(f"no CPU kernels here: {cpu_qgemm.unavailable_reason()}")
    if not c_rows:
        monkeypatch.setattr(drafting.cpu_rows, "serves", lambda rows, k: False)
    rng = np.random.default_rng(5)
    vocab, columns = 40, np.array([1, 3, 4, 9, 17, 22, 30, 31, 38])
    part = torch.from_numpy((rng.normal(size=(6, len(columns))) * 2).astype(np.float32))  # [R, K]
    part[0, 2] = part[0, 5]  # a tie: the lower token first, as in the whole row
    whole = torch.full((6, vocab), float("-inf")).index_copy_(1, torch.from_numpy(columns), part)  # [R, V]
    jobs = [
        DraftSpec(f"d{r}", [1], 2, None, SamplingParams(), 1, r, 0, draft_stream(0), TreeBudget(6, 2)) for r in range(6)
    ]
    widths = [1, 2, 3, 4, 5, 3]
    got = pass_tables(part, jobs, widths, columns)
    want = pass_tables(whole, jobs, widths)
    for g, w, width in zip(got, want, widths, strict=True):
        assert g.tokens[:width].tolist() == w.tokens[:width].tolist()
        np.testing.assert_allclose(g.probs[:width], w.probs[:width], rtol=1e-12)
    sampled = DraftSpec("s", [1], 2, None, PARAMS[1], 1, 0, 0, draft_stream(0), TreeBudget(6, 2))
    with pytest.raises(ValueError, match="greedy"):
        pass_tables(part[:1], [sampled], [1], columns)


def test_verify_trees_of_a_forward_tree_item():
    """verify_trees hands the model each job's context and tree as they are."""
    seen = []

    class Recording(FixedLM):
        def forward_tree(self, batch):
            seen.extend(batch)
            return super().forward_tree(batch)

    tree = TokenTree((5, 6), (-1, 0))
    job = VerifySpec("a", [1, 2], DraftTree(tree), SamplingParams(), 0, 0)
    verify_trees(Recording({"a": torch.zeros(2, 8)}, True), [job])
    assert seen == [TreeForward("a", [1, 2], (5, 6), (-1, 0))]


def test_a_sampled_root_alone_draws_its_token_like_the_reference():
    """Trees without tries (no speculation): the device has no MSS lookups to make, only the bonus draws."""
    rng = np.random.default_rng(5)
    logits = {f"r{i}": torch.from_numpy(rng.normal(size=(1, 9)).astype(np.float32)) for i in range(20)}
    params = SamplingParams(temperature=0.8, top_p=0.9)
    jobs = [
        VerifySpec(rid, [1], DraftTree(TokenTree((3,), (-1,))), params, seed=i, step=0) for i, rid in enumerate(logits)
    ]
    got = verify_trees(FixedLM(logits, True), jobs)
    want = [
        verify_stochastic(j.draft, lambda u, j=j: process_logits(logits[j.request_id].numpy()[u], params), j.rng())
        for j in jobs
    ]
    assert got == want and len({v.bonus_token for v in got}) > 1


def test_coupled_targets_match_the_host_reference():
    """The device's Gumbel-max draws (hashed noise in torch) equal core.coupled's (the same hash in NumPy)."""
    rng = np.random.default_rng(8)
    vocab = 300
    logits = torch.from_numpy(rng.normal(size=(40, vocab)) * 2)
    params = [PARAMS[i % len(PARAMS)] for i in range(40)]
    seeds = rng.integers(0, 2**62, size=40)
    indices = rng.integers(0, 5000, size=40)
    got = coupled_targets(logits, params, torch.from_numpy(seeds), torch.from_numpy(indices)).tolist()
    want = [
        coupled_token(
            process_logits(logits[r].numpy(), params[r]), position_noise(int(seeds[r]), int(indices[r]), vocab)
        )
        for r in range(40)
    ]
    assert got == want


def test_the_device_walk_and_the_host_walk_agree():
    """A CPU step copies every node's target and walks each greedy tree on the host; a GPU step walks them all on the
    device and copies the ends and bonus tokens (``_GreedyPlan``). Run here on CPU tensors, both give the same
    verdicts."""
    from specinfer.models.verification import _GreedyPlan

    rng = np.random.default_rng(5)
    vocab, accepted = 3, 0  # small: long accepted paths
    for round_ in range(50):
        trees = [random_tree(rng, int(rng.integers(1, 30)), vocab) for _ in range(int(rng.integers(1, 6)))]
        jobs = [VerifySpec(f"r{round_}-{g}", [1], DraftTree(t), SamplingParams(), 0, 0) for g, t in enumerate(trees)]
        starts = np.cumsum([0] + [len(t) for t in trees])[:-1].tolist()
        rows = torch.from_numpy(rng.normal(size=(sum(len(t) for t in trees), vocab)).astype(np.float32))
        verdicts = []
        for on_host in (True, False):
            plan = _GreedyPlan(jobs, on_host)
            host = torch.cat([p.reshape(-1).double() for p in plan.device_part(rows, starts)]).numpy()
            assert host.size == plan.host_values
            verdicts.append(plan.results(host))
        assert verdicts[0] == verdicts[1]
        accepted += sum(v.num_accepted for v in verdicts[0])
    assert accepted > 20  # the walks go somewhere


def test_serial_on_cpu_runs_the_block_on_one_torch_thread_and_restores_the_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with serial_on_cpu(torch.device("cpu")):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), serial_on_cpu(torch.device("cpu")):
            raise RuntimeError("the count comes back after an error too")
        assert torch.get_num_threads() == 2
        with serial_on_cpu(torch.device("meta")):  # another device's work keeps the host's threads
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
