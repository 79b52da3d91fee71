"""Verification, the LLM's half of an iteration, shared by the in-process engine and the LLM verifier.

:func:`verify_trees`: one batched LLM forward over every job's tree, then per job greedy verification,
coupled verification (seeded sampling, :mod:`specinfer.core.coupled`) or multi-step speculative
sampling (MSS), and the logprobs of the new tokens where a job asks for them (the LLM verifier's
``Verify``). An LLM with a draft head also drafts the next step's trees
(:func:`specinfer.models.drafting.head_drafts`).

The model's outputs stay on its device: each verify step computes what it needs there, for all jobs
at once (:mod:`specinfer.models.on_device`), and copies the small results to the host once. The host
keeps what is sequential and small: the MSS walk (:func:`specinfer.core.verify.walk_stochastic`).

Jobs are :class:`~specinfer.core.iteration.VerifySpec`; each draws from the random stream its spec names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from specinfer.core import DraftTree, TokenTree, VerifyResult
from specinfer.core.coupled import int64_seed
from specinfer.core.grammar_states import DraftGrammars
from specinfer.core.iteration import VerifySpec
from specinfer.core.requests import TokenLogprob
from specinfer.core.tree import path_below_root
from specinfer.core.verify import bonus_draws, mss_tries, verify_greedy, walk_stochastic
from specinfer.models.drafting import head_drafts
from specinfer.models.head_drafter import WithHead
from specinfer.models.interface import CausalLM, TreeForward
from specinfer.models.on_device import (
    RowHistory,
    adjusted_rows,
    coupled_targets,
    greedy_accept,
    masked_rows,
    mss_tables,
    pack,
    processed_probs,
    select_rows,
    serial_on_cpu,
    stack_rows,
    to_host,
    token_logprobs,
)


def verify_trees(
    llm: CausalLM, jobs: Sequence[VerifySpec], grammars: DraftGrammars | None = None
) -> list[VerifyResult]:
    """Accepted path and bonus token per job, in job order. An LLM with a draft head (:class:`WithHead`) also
    drafts the next step's tree of each job that asks for one (:attr:`VerifySpec.head`): ``next_tree``, masked by
    the request's grammar (:attr:`HeadDraft.constraint`) where ``grammars`` is given."""
    if not jobs:
        return []
    items = [TreeForward(j.request_id, j.context_tokens, j.draft.tree.tokens, j.draft.tree.parents) for j in jobs]
    if isinstance(llm, WithHead) and any(j.head is not None for j in jobs):
        logits, features = llm.llm.forward_tree_features(items)
        verdicts = _verdicts(jobs, logits)
        with serial_on_cpu(logits[0].device):  # the head's PyTorch layer beside the kernels' team (see there)
            return head_drafts(llm.head, jobs, verdicts, features, grammars)
    return _verdicts(jobs, llm.forward_tree(items))


def _verdicts(jobs: Sequence[VerifySpec], logits: Sequence[torch.Tensor]) -> list[VerifyResult]:
    """The walks of ``jobs`` on their trees' logits (each ``[n_nodes, V]`` on the model's device), serially on the
    CPU (:func:`~specinfer.models.on_device.serial_on_cpu`)."""
    with serial_on_cpu(logits[0].device):
        return _walks(jobs, stack_rows(logits))


def _walks(jobs: Sequence[VerifySpec], raw: torch.Tensor) -> list[VerifyResult]:
    """:func:`_verdicts` of the stacked rows ``raw``  # [N, V] every tree's nodes, job after job"""
    if raw.device.type == "cpu" and all(_plain_greedy(j) for j in jobs):
        return _greedy_on_cpu(jobs, raw)
    starts = np.cumsum([0, *(len(j.draft.tree) for j in jobs)])[:-1].tolist()  # each job's first row
    rows = _masked(raw, jobs, starts) if any(j.masks is not None for j in jobs) else raw
    rows = _adjusted(rows, jobs, starts) if any(j.sampling.adjusts_logits for j in jobs) else rows
    greedy = [i for i, j in enumerate(jobs) if j.sampling.prunable]  # greedy and coupled: a walk towards fixed targets
    sampled = [i for i, j in enumerate(jobs) if not j.sampling.prunable]  # multi-step speculative sampling
    parts: list[torch.Tensor] = []
    walks = _GreedyPlan([jobs[i] for i in greedy], rows.device.type == "cpu") if greedy else None
    if walks is not None:
        parts += walks.device_part(rows, [starts[i] for i in greedy])
    mss = _MssPlan([jobs[i] for i in sampled]) if sampled else None
    if mss is not None:
        parts += mss.device_part(rows, [starts[i] for i in sampled])
    host = to_host(pack(parts))  # the step's one device-to-host copy
    results: dict[int, VerifyResult] = {}
    taken = 0 if walks is None else walks.host_values
    if walks is not None:
        for i, result in zip(greedy, walks.results(host[:taken]), strict=True):
            results[i] = result
    if mss is not None:
        for i, result in zip(sampled, mss.results(host[taken:]), strict=True):
            results[i] = result
    out = [results[i] for i in range(len(jobs))]
    return _with_logprobs(raw, jobs, starts, out) if any(j.logprobs is not None for j in jobs) else out


def _paths(tree: TokenTree) -> list[list[int]]:
    """Each node's path below the root, its own token last (the root's: empty)."""
    return [path_below_root(tree.tokens, tree.parents, u) for u in range(len(tree))]


def _masked(rows: torch.Tensor, jobs: Sequence[VerifySpec], starts: Sequence[int]) -> torch.Tensor:
    """``rows`` with every token a job's grammar forbids after a node set to -inf (:attr:`VerifySpec.masks`),
    before penalties, temperature, top-k and top-p: the constrained distribution.  # [N, V]"""
    return masked_rows(
        rows, [(start, job.masks) for job, start in zip(jobs, starts, strict=True) if job.masks is not None]
    )


def _adjusted(rows: torch.Tensor, jobs: Sequence[VerifySpec], starts: Sequence[int]) -> torch.Tensor:
    """``rows`` with the biases and penalties of the jobs that have any (:func:`adjusted_rows`).  # [N, V]"""
    return adjusted_rows(
        rows,
        [
            RowHistory(
                start,
                job.sampling,
                [*job.context_tokens, job.draft.tree.tokens[0]],
                job.output_start,
                _paths(job.draft.tree),
            )
            for job, start in zip(jobs, starts, strict=True)
            if job.sampling.adjusts_logits
        ],
    )


def _with_logprobs(
    rows: torch.Tensor, jobs: Sequence[VerifySpec], starts: Sequence[int], results: Sequence[VerifyResult]
) -> list[VerifyResult]:
    """``results`` with the logprobs of their new tokens where the job asks for them: token k (accepted, then the
    bonus) was chosen at the k-th node of the accepted path (the root first), so its row is that node's. One
    device pass over those rows, one more copy to the host."""
    asking = [i for i, j in enumerate(jobs) if j.logprobs is not None]
    index, tokens = [], []
    for i in asking:
        index.extend(starts[i] + u for u in (0, *results[i].accepted_nodes))
        tokens.extend(results[i].new_tokens)
    top = min(max(jobs[i].logprobs or 0 for i in asking), rows.shape[1])  # a vocabulary may hold fewer tokens
    device = rows.device
    parts = token_logprobs(select_rows(rows, index), torch.tensor(tokens, dtype=torch.long, device=device), top)
    host = to_host(pack(parts))
    n = len(index)
    chosen = host[:n]
    ids = host[n : n + n * top].reshape(n, top).astype(np.int64)
    values = host[n + n * top :].reshape(n, top)
    out, at = list(results), 0
    for i in asking:
        k = min(jobs[i].logprobs or 0, top)
        logprobs = []
        for token in results[i].new_tokens:
            alternatives = tuple((int(t), float(v)) for t, v in zip(ids[at, :k], values[at, :k], strict=True))
            logprobs.append(TokenLogprob(int(token), float(chosen[at]), alternatives))
            at += 1
        out[i] = replace(results[i], logprobs=tuple(logprobs))
    return out


def _plain_greedy(job: VerifySpec) -> bool:
    """Whether ``job`` is greedy with nothing to apply to its rows or report beside its verdict."""
    return job.sampling.greedy and job.masks is None and job.logprobs is None and not job.sampling.adjusts_logits


def _greedy_on_cpu(jobs: Sequence[VerifySpec], rows: torch.Tensor) -> list[VerifyResult]:
    """:func:`_verdicts` of :func:`_plain_greedy` jobs whose rows  # [N, V] are in host memory: every row's argmax,
    then each tree's walk (what the general path computes, without its device-side packing: tens of microseconds a
    step on a CPU, where a one-token step's whole host work is a few hundred)."""
    # [N] the step's one crossing (a view or a no-op copy here); of fp32 rows NumPy's argmax, a few microseconds where
    # PyTorch's takes 15-100 (the first of equal maxima either way; NumPy has no bf16)
    targets = to_host(rows).argmax(axis=-1) if rows.dtype == torch.float32 else to_host(rows.argmax(dim=-1))
    out, at = [], 0
    for job in jobs:
        n = len(job.draft.tree)
        out.append(verify_greedy(job.draft.tree, targets[at : at + n]))
        at += n
    return out


def _targets(rows: torch.Tensor, jobs: Sequence[VerifySpec], starts: Sequence[int]) -> torch.Tensor:
    """The LLM's token after each node of ``jobs``' trees (rows from ``starts``), in their order: the
    argmax (greedy), or the Gumbel-max draw of its sequence index (coupled).  # [Ng]"""
    index: list[int] = []  # each node's row
    where, meta, params = [], [], []  # coupled nodes: their place in ``index``, (seed, sequence index), parameters
    for start, job in zip(starts, jobs, strict=True):
        n = len(job.draft.tree)
        if job.sampling.coupled:
            # a node at depth d (the root: the last committed token, at index len(context)) is followed by index
            # len(context) + d + 1
            where.extend(range(len(index), len(index) + n))
            seed = int64_seed(job.seed)  # a seed of 2**63 or more as the int64 of its bits
            meta.extend((seed, len(job.context_tokens) + int(d) + 1) for d in job.draft.tree.depths)
            params.extend([job.sampling] * n)
        index.extend(range(start, start + n))
    # [Ng] (the argmax of every row, then these: no copy of rows)
    targets = select_rows(rows.argmax(dim=-1)[:, None], index)[:, 0]
    if meta:
        seeds, indices = torch.tensor(meta, dtype=torch.int64).T.to(rows.device)  # one host-to-device copy
        drawn = coupled_targets(select_rows(rows, [index[w] for w in where]), params, seeds, indices)
        targets = targets.index_put((torch.tensor(where, device=rows.device),), drawn)
    return targets


def _greedy_part_on_device(argmax: torch.Tensor, jobs: Sequence[VerifySpec]) -> list[torch.Tensor]:
    """Greedy and coupled walks of ``jobs`` on ``argmax``'s device, every tree at once: each walk's end (a node of its
    tree) and the LLM's token there, the bonus. ``argmax``: every node's target, tree after tree.  # [Ng] -> [G], [G]"""
    tokens, parents, segments, firsts, depth, at = [], [], [], [], 0, 0
    for g, job in enumerate(jobs):
        tree = job.draft.tree
        firsts.append(at)
        tokens.extend(tree.tokens)
        parents.extend(at if p < 0 else at + p for p in tree.parents)
        segments.extend([g] * len(tree))
        depth = max(depth, int(tree.depths.max()))
        at += len(tree)
    meta = torch.tensor([tokens, parents, segments], dtype=torch.long).to(
        argmax.device
    )  # [3, Ng] one host-to-device copy
    ends = greedy_accept(argmax, meta[0], meta[1], meta[2], len(jobs), depth)
    return [ends - meta.new_tensor(firsts), argmax[ends]]


class _GreedyPlan:
    """Greedy and coupled verification of one step's prunable jobs: the device's part and the walks. ``on_host``
    (the rows are on a CPU): the device's part is every node's target alone, and each tree is walked on the host after
    the step's one copy (:func:`~specinfer.core.verify.verify_greedy`, microseconds a tree, where the device walk's
    twenty-odd tensor operations cost a CPU step 0.2-0.3 ms: BENCHMARKS.md, "Greedy walks on the host on a CPU").
    Otherwise every tree is walked on the device at once and the copy holds each walk's end and bonus token."""

    def __init__(self, jobs: Sequence[VerifySpec], on_host: bool) -> None:
        self.jobs = list(jobs)
        self.on_host = on_host
        nodes = sum(len(j.draft.tree) for j in self.jobs)
        self.host_values = nodes if on_host else 2 * len(self.jobs)  # what results() reads of the step's copy

    def device_part(self, rows: torch.Tensor, starts: Sequence[int]) -> list[torch.Tensor]:
        """``rows`` are the step's, the jobs' trees begin at ``starts``: the targets  # [Ng], or the walks' ends
        and bonus tokens  # [G], [G]."""
        targets = _targets(rows, self.jobs, starts)  # [Ng]
        return [targets] if self.on_host else _greedy_part_on_device(targets, self.jobs)

    def results(self, host: np.ndarray) -> list[VerifyResult]:
        """The verdicts from :meth:`device_part`'s values in host memory  # [host_values]."""
        if self.on_host:
            ends = np.cumsum([len(j.draft.tree) for j in self.jobs])
            targets = np.split(host.astype(np.int64), ends[:-1])
            return [verify_greedy(j.draft.tree, t) for j, t in zip(self.jobs, targets, strict=True)]
        g = len(self.jobs)
        ends, bonus = host[:g].astype(np.int64), host[g : 2 * g].astype(np.int64)
        return [_greedy_result(j.draft, int(e), int(b)) for j, e, b in zip(self.jobs, ends, bonus, strict=True)]


def _greedy_result(draft: DraftTree, end: int, bonus: int) -> VerifyResult:
    """The verdict of a greedy walk that ended at node ``end``: the path down to it, then ``bonus``."""
    tree, path, u = draft.tree, [], end
    while u > 0:
        path.append(u)
        u = tree.parents[u]
    path.reverse()
    return VerifyResult(tuple(path), tuple(tree.tokens[i] for i in path), bonus)


class _MssPlan:
    """Multi-step speculative sampling of one step's sampled jobs: the host's tables of tries and
    uniforms, the device's part (:func:`~specinfer.models.on_device.mss_tables`), the walks."""

    def __init__(self, jobs: Sequence[VerifySpec]) -> None:
        self.jobs = list(jobs)
        self.tries = [mss_tries(j.draft) for j in self.jobs]
        self.draws = [bonus_draws(t) for t in self.tries]
        # Each walk takes its uniforms in order, one per try and one for the bonus token: drawn here
        # up front, as many as its longest walk may use, they are the values verify_stochastic would
        # take from the same generator (the generator is the step's own: the surplus is never used).
        self.uniforms = [j.rng().random(max(hi for _, hi in d) + 1) for j, d in zip(self.jobs, self.draws, strict=True)]
        self.rows: list[list[int]] = []  # per job, its nodes' rows among the sampled rows
        self.internal: dict[int, int] = {}  # sampled row -> its index among rows with tries
        at = 0
        for tries in self.tries:
            self.rows.append(list(range(at, at + len(tries))))
            for u, node_tries in enumerate(tries):
                if node_tries:
                    self.internal[at + u] = len(self.internal)
            at += len(tries)
        self.num_rows = at
        self.width = max(hi - lo + 1 for d in self.draws for lo, hi in d)  # R: bonus draws per node
        self.max_tries = max((len(t) for tries in self.tries for t in tries), default=0)  # K

    def device_part(self, rows: torch.Tensor, starts: Sequence[int]) -> list[torch.Tensor]:
        """The device's tables for these jobs (their trees' rows begin at ``starts`` in ``rows``).
        # [Ni * K], [Ns * R]"""
        device = rows.device
        index = [s + k for s, j in zip(starts, self.jobs, strict=True) for k in range(len(j.draft.tree))]
        params = [j.sampling for j in self.jobs for _ in range(len(j.draft.tree))]
        probs = processed_probs(select_rows(rows, index), params)  # [Ns, V]
        flat = [t for tries in self.tries for t in tries]  # per sampled row, its tries
        internal = [r for r in range(self.num_rows) if flat[r]]
        k_max, support = self.max_tries, max((t.q.tokens.size for r in internal for t in flat[r]), default=1)
        try_tokens = np.zeros((len(internal), k_max), dtype=np.int64)
        try_valid = np.zeros((len(internal), k_max), dtype=bool)
        q_tokens = np.zeros((len(internal), k_max, support), dtype=np.int64)
        q_probs = np.zeros((len(internal), k_max, support), dtype=np.float64)
        for i, r in enumerate(internal):
            for k, t in enumerate(flat[r]):
                try_tokens[i, k], try_valid[i, k] = t.token, True
                q_tokens[i, k, : t.q.tokens.size], q_probs[i, k, : t.q.probs.size] = t.q.tokens, t.q.probs
        draws = np.zeros((self.num_rows, self.width), dtype=np.float64)
        for rows_of_job, ranges, uniforms in zip(self.rows, self.draws, self.uniforms, strict=True):
            for r, (lo, hi) in zip(rows_of_job, ranges, strict=True):
                draws[r, : hi - lo + 1] = uniforms[lo : hi + 1]

        def to(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        try_probs, bonus = mss_tables(
            probs,
            to(np.array(internal, dtype=np.int64)),
            to(try_tokens),
            to(try_valid),
            to(q_tokens),
            to(q_probs),
            to(draws),
        )
        return [try_probs, bonus]

    def results(self, host: np.ndarray) -> list[VerifyResult]:
        """The walks, from :meth:`device_part`'s tables in host memory."""
        n_try = len(self.internal) * self.max_tries
        try_probs = host[:n_try].reshape(len(self.internal), self.max_tries)
        bonus = host[n_try : n_try + self.num_rows * self.width].astype(np.int64).reshape(self.num_rows, self.width)
        out = []
        for job, tries, ranges, rows, uniforms in zip(
            self.jobs, self.tries, self.draws, self.rows, self.uniforms, strict=True
        ):
            out.append(
                walk_stochastic(
                    job.draft, tries, self._try_prob(try_probs, rows), self._bonus(bonus, rows, ranges), uniforms
                )
            )
        return out

    def _try_prob(self, try_probs: np.ndarray, rows: list[int]) -> Callable[[int, int], float]:
        return lambda u, k: float(try_probs[self.internal[rows[u]], k])

    @staticmethod
    def _bonus(bonus: np.ndarray, rows: list[int], ranges: list[tuple[int, int]]) -> Callable[[int, int], int]:
        def lookup(u: int, j: int) -> int:
            lo, hi = ranges[u]
            if not lo <= j <= hi:
                raise RuntimeError(
                    f"the walk drew its bonus at node {u} with uniform {j}, outside the planned {lo}..{hi}"
                )
            return int(bonus[rows[u], j - lo])

        return lookup
