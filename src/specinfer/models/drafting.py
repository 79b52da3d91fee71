"""Drafting, the SSM's half of an iteration, shared by the in-process engine and the SSM worker.

:func:`draft_trees`: one SSM grows a draft tree per job, all jobs batched through the model depth by
depth (the SSM worker's ``Speculate``); :func:`head_drafts` drafts the next step's trees with the LLM's
draft head after verification (:mod:`specinfer.models.verification`). Each SSM pass computes what
drafting needs of its logits on the model's device, for all jobs at once (:func:`pass_tables`,
:mod:`specinfer.models.on_device`), and copies the small results to the host once; the host grows the
trees and draws the drafts from their sparse distributions (:func:`propose`).

Jobs are :class:`~specinfer.core.iteration.DraftSpec`; each draws from the random stream its spec names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from specinfer.core import (
    BestFirstTreeBuilder,
    DraftTree,
    Proposal,
    TreeBuilder,
    VerifyResult,
    draw_without_replacement,
)
from specinfer.core.coupled import coupled_children
from specinfer.core.grammar_states import DraftGrammars
from specinfer.core.iteration import DraftSpec, VerifySpec
from specinfer.core.sampling import SparseDist
from specinfer.kernels import cpu_rows
from specinfer.models.head_drafter import HeadDrafter
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.on_device import (
    RowHistory,
    adjusted_rows,
    masked_rows,
    pack,
    processed_probs,
    ranked_top_k,
    select_rows,
    serial_on_cpu,
    stack_rows,
    to_host,
)


@dataclass(frozen=True)
class RowTable:
    """What drafting needs of one SSM logit row, in host memory. Greedy: ``tokens``, the top tokens
    best first, and ``probs``, their softmax probabilities (temperature 1: the SSM's confidence, which
    scores dynamic trees; zeros when no job of the pass grows one). Sampling: the top tokens of the processed
    distribution, their (not renormalised) probabilities, and ``nonzero``, how many tokens it gives mass to."""

    tokens: np.ndarray  # [k] int64
    probs: np.ndarray  # [k] float64
    nonzero: int = 0


def pass_tables(
    rows: torch.Tensor, jobs: Sequence[DraftSpec], widths: Sequence[int], columns: np.ndarray | None = None
) -> list[RowTable]:
    """:class:`RowTable` of each row of one SSM pass (``rows`` ``[R, V]`` on the SSM's device; row r
    belongs to ``jobs[r]``, which wants ``widths[r]`` children there), with one device-to-host copy. ``columns``
    # [V] int64: the token of each column, where the rows hold some tokens' logits alone (the others' -inf: greedy
    jobs only, see :meth:`~specinfer.models.head_drafter.HeadDrafter.forward_tree_columns`); None: column = token."""
    if columns is not None and not all(job.sampling.greedy for job in jobs):
        raise ValueError("pass_tables: rows of some tokens' columns serve greedy jobs alone")
    vocab = rows.shape[-1]
    greedy = [r for r, job in enumerate(jobs) if job.sampling.greedy]
    sampled = [r for r, job in enumerate(jobs) if not job.sampling.greedy]
    parts: list[torch.Tensor] = []
    g_width = min(vocab, max((widths[r] for r in greedy), default=0))
    s_width = min(vocab, max((jobs[r].draft_support for r in sampled), default=0))
    scored = any(
        jobs[r].budget is not None for r in greedy
    )  # dynamic trees score slots by the softmax; static ones need none
    g_tokens = g_probs = None  # [Rg, Wg] in host memory, where the rows were there already
    if greedy and cpu_rows.serves(rows, g_width):
        # rows in host memory (an SSM on the CPU): the crossing is a view, and one C pass a row finds the top tokens
        # and their softmax, where PyTorch takes several passes over the vocabulary and a float64 copy
        rows = torch.from_numpy(to_host(rows))  # [R, V]
        g_tokens, g_probs = cpu_rows.top_k(select_rows(rows, greedy).numpy(), g_width, scored)
    elif greedy:
        x = select_rows(rows, greedy)  # [Rg, V]
        tokens, _ = ranked_top_k(x, g_width)  # [Rg, Wg]
        parts.append(tokens)
        if scored:
            x = x.to(torch.float64)
            parts.append(torch.softmax(x - x.max(dim=-1, keepdim=True).values, dim=-1).gather(-1, tokens))
    if sampled:
        probs = processed_probs(select_rows(rows, sampled), [jobs[r].sampling for r in sampled])  # [Rs, V]
        tokens, top = ranked_top_k(probs, s_width)  # [Rs, S]
        parts += [tokens, top, (probs > 0).sum(dim=-1)]
    host = to_host(pack(parts)) if parts else np.zeros(0)
    out: list[RowTable | None] = [None] * len(jobs)
    at = 0
    if greedy:
        if g_tokens is None:
            n = len(greedy) * g_width
            g_tokens = host[:n].reshape(-1, g_width).astype(np.int64)
            g_probs = host[n : 2 * n].reshape(-1, g_width) if scored else None
            at = 2 * n if scored else n
        if g_probs is None:
            g_probs = np.zeros_like(g_tokens, dtype=np.float64)
        if columns is not None:
            g_tokens = columns[g_tokens]
        for i, r in enumerate(greedy):
            out[r] = RowTable(g_tokens[i], g_probs[i])
    if sampled:
        n = len(sampled) * s_width
        tokens, probs = (
            host[at : at + n].reshape(-1, s_width).astype(np.int64),
            host[at + n : at + 2 * n].reshape(-1, s_width),
        )
        nonzero = host[at + 2 * n :].astype(np.int64)
        for i, r in enumerate(sampled):
            out[r] = RowTable(tokens[i], probs[i], int(nonzero[i]))
    return out  # type: ignore[return-value]


def propose(table: RowTable, width: int, job: DraftSpec, rng: np.random.Generator, depth: int) -> Proposal:
    """Children (at ``depth`` below the root) of one node: the top ``width`` under greedy decoding; under
    sampling, drawn without replacement from the sparse processed distribution q (the ``job.draft_support``
    most likely tokens, renormalised), which comes with them: from ``rng`` (MSS), or by Gumbel-top-k with
    the position noise of their sequence index (coupled verification). ``slot_probs`` score a dynamic
    tree's slots: greedy, the SSM's own softmax at its top tokens; sampling, q's largest probabilities."""
    if job.sampling.greedy:
        return Proposal(tuple(table.tokens[:width].tolist()), None, tuple(table.probs[:width].tolist()))
    k = min(job.draft_support, table.nonzero)
    top = table.probs[:k]
    q = SparseDist(table.tokens[:k], top / top.sum())
    if job.sampling.coupled:  # the root is the last committed token, at sequence index len(context)
        tokens = coupled_children(q, job.seed, len(job.context_tokens) + depth, width)
    else:
        tokens = draw_without_replacement(q, width, rng)
    return Proposal(tuple(tokens), q, tuple(float(p) for p in q.probs[:width]))


def draft_trees(
    ssm: CausalLM,
    jobs: Sequence[DraftSpec],
    on_pass: Callable[[int, float], None] | None = None,
    grammars: DraftGrammars | None = None,
) -> list[DraftTree]:
    """One draft tree per job, in job order: static jobs grow their expansion, budgeted ones a
    best-first dynamic tree. ``on_pass(frontier_tokens, seconds)`` hears of every SSM pass. With ``grammars``
    (compiled for the token IDs the SSM drafts in), a constrained job's rows are masked by its grammar after each
    frontier node's path before anything is drafted from them: no node is a token the grammar forbids, a sampled
    node's q is the masked distribution renormalised (what it was drawn from), and nothing is drafted below EOS."""
    builders = {
        i: (
            TreeBuilder(job.root_token, job.expansion)
            if job.expansion is not None
            else BestFirstTreeBuilder(job.root_token, job.budget)
        )
        for i, job in enumerate(jobs)
    }
    rngs = [job.rng() for job in jobs]  # one generator per job for all its depths
    states = grammars.states(jobs) if grammars is not None else {}  # by job index: the constrained ones
    depths = [1] * len(jobs)  # the depth of the children each job's next pass drafts (one pass per depth)
    out: dict[int, DraftTree] = {}
    while builders:
        started = time.perf_counter()  # a pass costs its Python work too: building the items, drafting the children
        order = list(builders)
        items = []
        for i in order:
            frontier = builders[i].frontier()
            items.append(
                TreeForward(
                    jobs[i].request_id,
                    jobs[i].context_tokens,
                    builders[i].tokens_of(frontier),
                    builders[i].parents_of(frontier),
                )
            )
        # a draft head's greedy passes rank its draft vocabulary's columns alone (no grammar or adjustment reads them)
        columns = _columns(ssm, [jobs[i] for i in order], any(i in states for i in order))
        logits = ssm.forward_tree(items) if columns is None else ssm.forward_tree_columns(items)
        owners = [i for i, item in zip(order, items, strict=True) for _ in item.tokens]  # the job of each row
        rows = stack_rows(logits)
        limits: list[int | None] = [None] * rows.shape[0]  # most children per row (None: the builder's width)
        if grammars is not None and any(i in states for i in order):
            # the constrained distribution is the SSM's masked before biases and penalties, as the LLM's is
            blocks, limits = _grammar_masks(grammars, states, builders, order, items)
            rows = masked_rows(rows, blocks)
        if any(jobs[i].sampling.adjusts_logits for i in order):
            # the request's biases and penalties on the draft's rows too, as verification will apply them to the
            # LLM's: drafts that follow them are accepted (verification is exact either way)
            rows = adjusted_rows(rows, _draft_histories(jobs, builders, order, items))
        with serial_on_cpu(rows.device):  # the pass's logits work beside the kernels' team (see there)
            tables = pass_tables(rows, [jobs[i] for i in owners], [builders[i].width() for i in owners], columns)
        at = 0
        for i, item in zip(order, items, strict=True):
            b = builders[i]
            span = slice(at, at + len(item.tokens))
            proposals = [
                propose(table, b.width() if most is None else min(b.width(), most), jobs[i], rngs[i], depths[i])
                for table, most in zip(tables[span], limits[span], strict=True)
            ]
            at += len(item.tokens)
            depths[i] += 1
            if isinstance(b, BestFirstTreeBuilder):
                b.expand(proposals)
            else:
                b.expand([(p.tokens, p.q) for p in proposals])
            if b.done:
                out[i] = b.build()
                del builders[i]
        if on_pass is not None:
            on_pass(sum(len(it.tokens) for it in items), time.perf_counter() - started)
    return [out[i] for i in range(len(jobs))]


def _columns(ssm: CausalLM, jobs: Sequence[DraftSpec], constrained: bool) -> np.ndarray | None:
    """The token of each logit column where ``ssm`` is a draft head with a draft vocabulary and a pass of ``jobs``
    needs its columns alone (greedy, unconstrained, unadjusted); None: the pass takes whole rows."""
    if not isinstance(ssm, HeadDrafter) or ssm.columns is None or constrained:
        return None
    if not all(job.sampling.greedy and not job.sampling.adjusts_logits for job in jobs):
        return None
    return ssm.columns_on_host


def _grammar_masks(grammars, states, builders, order, items) -> tuple[list[tuple[int, np.ndarray]], list[int | None]]:
    """The grammar masks of one SSM pass's rows (:func:`masked_rows`' blocks: each constrained job's frontier, the
    tokens allowed after each node's path) and the most children of each row: under greedy decoding the top-k would
    otherwise pass the allowed tokens; none below EOS."""
    blocks, limits, start = [], [], 0
    for i, item in zip(order, items, strict=True):
        state = states.get(i)
        if state is None:
            limits += [None] * len(item.tokens)
        else:
            paths = [builders[i].path_tokens(node) for node in builders[i].frontier()]
            masks = grammars.masks(state, paths)  # [F, W]
            allowed = np.unpackbits(masks.view(np.uint8), axis=1).sum(axis=1)  # [F]
            limits += [0 if path and path[-1] == state.eos else int(n) for path, n in zip(paths, allowed, strict=True)]
            blocks.append((start, masks))
        start += len(item.tokens)
    return blocks, limits


def _draft_histories(jobs, builders, order, items) -> list[RowHistory]:
    """The :class:`RowHistory` of each job of one SSM pass that adjusts its logits: its frontier nodes' paths."""
    out, start = [], 0
    for i, item in zip(order, items, strict=True):
        job = jobs[i]
        if job.sampling.adjusts_logits:
            paths = [builders[i].path_tokens(node) for node in builders[i].frontier()]
            committed = [*job.context_tokens, job.root_token]
            out.append(RowHistory(start, job.sampling, committed, job.output_start, paths))
        start += len(item.tokens)
    return out


def head_drafts(
    head: HeadDrafter,
    jobs: Sequence[VerifySpec],
    results: Sequence[VerifyResult],
    features: Sequence[torch.Tensor],
    grammars: DraftGrammars | None = None,
) -> list[VerifyResult]:
    """``results`` with the next step's head trees of the jobs that ask for one: the head first takes the
    features of each job with a :class:`~specinfer.core.iteration.HeadDraft` (a tree asked or not: it keeps up),
    its computed context and accepted path (``features[i]``: its chain rows, then its tree's nodes,
    :meth:`~specinfer.models.native.backend.NativeBackend.forward_tree_features`), then drafts from the bonus
    tokens, all jobs batched (:func:`draft_trees`, masked by ``grammars`` where given)."""
    specs, where = [], []
    for i, (job, result) in enumerate(zip(jobs, results, strict=True)):
        if job.head is None:
            continue
        committed = [*job.context_tokens, job.draft.tree.tokens[0], *result.accepted_tokens]
        chain = features[i].shape[0] - len(job.draft.tree)  # context tokens the LLM computed in this call
        rows = [*range(chain), chain, *(chain + u for u in result.accepted_nodes)]
        index = torch.tensor(rows, device=features[i].device)
        head.absorb(job.request_id, committed, len(job.context_tokens) - chain, features[i].index_select(0, index))
        spec = job.head_spec(committed, result.bonus_token)
        if spec is not None:  # else it only kept up
            specs.append(spec)
            where.append(i)
    out = list(results)
    for i, tree in zip(where, draft_trees(head, specs, None, grammars), strict=True):
        out[i] = replace(out[i], next_tree=tree)
    return out
