"""Batched work on model outputs where they live, and the one place where they leave it.

A backend's ``forward_tree`` returns logits on the model's device (see
:mod:`specinfer.models.interface`). What the engine needs from them is computed there, batched over
every row of a step: argmax, top-k, logit processing (temperature, top-k, top-p), the greedy accept
walk, and the few numbers multi-step speculative sampling (MSS) looks up. The small results are
packed into one float64 tensor that crosses to the host through :func:`to_host`: once per LLM verify
step and once per SSM pass, for all requests together (and once more for a verify step whose requests ask
for the log-probabilities of the tokens they commit, which are known only after the walks). Nothing else
converts a model output (``tests/test_device_boundary.py`` holds the engine and the servicers to that).

Terms. A *row* is one tree node's logits; the rows of all requests of a call are stacked in request
order (``[N, V]``). A *packed* result is one flat float64 tensor of several parts; token IDs travel in
float64, which holds integers below 2**53 exactly. Each function here has its NumPy reference in
:mod:`specinfer.core` (named in its docstring), which the tests compare it with.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specinfer.core.coupled import noise_bits
from specinfer.core.sampling import SamplingParams


@contextlib.contextmanager
def serial_on_cpu(device: torch.device) -> Iterator[None]:
    """The block's PyTorch operations on the calling thread alone where ``device`` is the CPU.

    Why: a parallel PyTorch operation runs on OpenMP's team, whose worker then busy-waits for milliseconds
    (libgomp's GOMP_SPINCOUNT), beside our C kernels' own team (:mod:`specinfer.kernels.cpu_team`), whose worker
    then gets the core in turns; temperature-1 speculation of the bundled demo in process ran 40 % slower for it
    (BENCHMARKS.md, "The kernels' own thread team"). A step's work on its logits is small next to its forward, so
    on the CPU it runs serially; the forward keeps its threads."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# MSS keeps the previous target when a rejection leaves (almost) no mass: p == q_i up to rounding,
# where rejection has probability 0 (the same bound as specinfer.core.verify.mss_residual).
RESIDUAL_FLOOR = 1e-12


def to_host(packed: torch.Tensor) -> np.ndarray:
    """The device boundary: ``packed`` in host memory (one device-to-host copy, which waits for the
    device to finish the work queued before it)."""
    return packed.detach().to("cpu").numpy()


def wait_for(outputs: Sequence[torch.Tensor]) -> None:
    """Wait until the device has computed ``outputs`` (a model call's, to time it): their last
    element crosses, as a model call's results would."""
    last = [o for o in outputs if o.numel()]
    if last:
        to_host(last[-1].reshape(-1)[-1:])


def pack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``parts`` flattened into one float64 tensor, in order, for one :func:`to_host`.  # [sum numel]"""
    return torch.cat([p.reshape(-1).to(torch.float64) for p in parts])


def stack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows of ``parts`` (each ``[n_i, V]``) as one ``[sum n_i, V]`` tensor: a view when they are
    consecutive slices of one contiguous tensor (the native backend returns those), else a copy."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    offset = first.storage_offset()
    adjacent = all(p.is_contiguous() and p.dtype == first.dtype for p in parts)
    if adjacent:
        storage = first.untyped_storage().data_ptr()
        for p in parts:
            if p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
                adjacent = False
                break
            offset += p.numel()
    if adjacent:
        rows = sum(p.shape[0] for p in parts)
        return first.as_strided((rows, first.shape[1]), (first.shape[1], 1), first.storage_offset())
    return torch.cat(list(parts))


def select_rows(rows: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """Rows ``index`` of ``rows`` (all of them: ``rows`` itself, no copy).  # [len(index), ...]"""
    if len(index) == rows.shape[0]:
        return rows
    return rows.index_select(0, torch.tensor(index, dtype=torch.long, device=rows.device))


def masked_rows(rows: torch.Tensor, blocks: Sequence[tuple[int, np.ndarray]]) -> torch.Tensor:
    """``rows`` with every token a grammar mask forbids set to -inf: ``blocks`` holds (first row, masks ``[k, W]``
    int32, :mod:`specinfer.core.constraints`' bit layout) for rows ``first .. first + k - 1``; other rows are left
    whole, and a mask narrower than the rows allows none of the tokens past it. A row whose allowed tokens all have
    logit -inf (a cross-tokenizer SSM's row where the grammar allows only tokens it lacks) gets logit 0 at each of
    them: its distribution is uniform over the allowed tokens, never a row without a finite entry.  # [N, V]"""
    n, vocab = rows.shape
    words = (vocab + 31) // 32
    host = np.full((n, words), -1, dtype=np.int32)  # [N, W] all allowed
    for start, masks in blocks:
        end = start + masks.shape[0]
        host[start:end] = 0
        host[start:end, : min(words, masks.shape[1])] = masks[:, :words]
    bits = torch.from_numpy(host).to(rows.device)  # [N, W] one host-to-device copy
    shifts = torch.arange(32, dtype=torch.int32, device=rows.device)  # [32]
    allowed = ((bits[:, :, None] >> shifts) & 1).reshape(n, words * 32)[:, :vocab].bool()  # [N, V]
    out = rows.masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(out).all(dim=-1, keepdim=True)  # [N, 1]
    return torch.where(dead & allowed, torch.zeros((), dtype=out.dtype, device=out.device), out)


def ranked_top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row, best first, equal values in index order (as
    :func:`specinfer.core.sampling.top_k_tokens`): ``(indices [R, k] int64, values [R, k])``."""
    values, indices = torch.topk(x, k, dim=-1)  # [R, k]; the order of equal values is unspecified
    indices, by_index = indices.sort(dim=-1)
    values = values.gather(-1, by_index)
    values, order = values.sort(dim=-1, descending=True, stable=True)  # stable: equal values stay in index order
    return indices.gather(-1, order), values


def token_logprobs(rows: torch.Tensor, tokens: torch.Tensor, top: int) -> list[torch.Tensor]:
    """Each row's log-probability of its token in ``tokens`` under the row's raw distribution (log-softmax of the
    logits in fp32: temperature 1, no truncation), then the ``top`` most likely tokens of each row and theirs, best
    first (:func:`specinfer.core.sampling.token_logprob`).  # [R], [R, top], [R, top]"""
    logp = torch.log_softmax(rows.float(), dim=-1)  # [R, V]
    chosen = logp.gather(-1, tokens[:, None])[:, 0]  # [R]
    if top == 0:
        return [chosen]
    ids, values = ranked_top_k(logp, top)  # [R, top]
    return [chosen, ids, values]


@dataclass(frozen=True)
class RowHistory:
    """What rows ``start .. start + len(paths) - 1`` of one job continue, for their biases and penalties: the
    ``committed`` tokens (prompt and output; the root, the last committed token, last), the output beginning at
    ``output_start``, then each row's ``paths`` entry (its node's path below the root, the node's own token last)."""

    start: int
    params: SamplingParams
    committed: Sequence[int]
    output_start: int
    paths: Sequence[Sequence[int]]


def adjusted_rows(rows: torch.Tensor, histories: Sequence[RowHistory]) -> torch.Tensor:
    """``rows`` in fp32 with each history's biases and penalties applied to its rows
    (:func:`specinfer.core.sampling.adjust_logits` of the tokens each row continues: the output's counts plus its
    path's). Tokens outside the rows' vocabulary are left out (a draft model's may be smaller).  # [N, V]"""
    out = rows.float()
    if out is rows:
        out = rows.clone()
    vocab = rows.shape[1]
    for h in histories:
        params, n = h.params, len(h.paths)
        nodes = [u for u, path in enumerate(h.paths) for t in path if t < vocab]
        tokens = [t for path in h.paths for t in path if t < vocab]
        output = [t for t in h.committed[h.output_start :] if t < vocab]
        seen = [t for t in h.committed if t < vocab] if params.repetition_penalty != 1.0 else []
        bias = [(t, b) for t, b in params.logit_bias if t < vocab]
        # one host-to-device copy: the output, the path entries, (repetition) every committed token, biased tokens
        packed = torch.tensor([*output, *nodes, *tokens, *seen, *(t for t, _ in bias)], dtype=torch.long)
        sizes = [len(output), len(nodes), len(tokens), len(seen), len(bias)]
        out_tokens, path_nodes, path_tokens, seen_tokens, bias_tokens = packed.to(rows.device).split(sizes)
        x = out[h.start : h.start + n]  # [n, V] a view: adjusted in place
        if bias:  # first, as vLLM: the penalties see the biased logits
            x[:, bias_tokens] += torch.tensor([b for _, b in bias], dtype=x.dtype).to(x.device)
        counts = torch.bincount(out_tokens, minlength=vocab)[:vocab].to(x.dtype).expand(n, vocab).clone()  # [n, V]
        counts.index_put_((path_nodes, path_tokens), torch.ones_like(path_tokens, dtype=x.dtype), accumulate=True)
        if params.repetition_penalty != 1.0:
            hist = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            hist[seen_tokens] = True
            hist = hist.expand(n, vocab).clone()  # [n, V]
            hist[path_nodes, path_tokens] = True
            r = params.repetition_penalty
            x.copy_(torch.where(hist, torch.where(x > 0, x / r, x * r), x))
        x.sub_(params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(x.dtype))
    return out


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """:func:`specinfer.core.sampling.process_logits` of each row with its own (non-greedy)
    parameters: temperature, then min-p, then top-k, then top-p, in float64.  # [R, V]"""
    if any(p.greedy for p in params):
        raise ValueError("processed_probs takes sampling rows; greedy rows need only their argmax")
    device = logits.device
    x = (
        logits.to(torch.float64)
        / torch.tensor([p.temperature for p in params], dtype=torch.float64, device=device)[:, None]
    )  # [R, V]
    vocab = x.shape[-1]
    if any(p.min_p > 0.0 for p in params):  # p >= min_p * max p, in logits: x - max x >= log(min_p)
        floor = torch.tensor(
            [[math.log(p.min_p) if p.min_p > 0.0 else -math.inf] for p in params], dtype=torch.float64, device=device
        )  # [R, 1]
        x = torch.where(x - x.max(dim=-1, keepdim=True).values < floor, float("-inf"), x)
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]  # 0: no top-k filter on that row
    if any(ks):
        ranked = torch.topk(x, max(ks), dim=-1).values  # [R, max k], best first
        kth = ranked.gather(
            -1, torch.tensor([[max(k, 1) - 1] for k in ks], device=device)
        )  # [R, 1] the k-th largest value
        filtered = torch.tensor([[k > 0] for k in ks], device=device)  # [R, 1]
        x = torch.where(filtered & (x < kth), float("-inf"), x)
    x = x - x.max(dim=-1, keepdim=True).values
    probs = torch.exp(x)
    probs = probs / probs.sum(dim=-1, keepdim=True)  # [R, V]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([[p.top_p] for p in params], dtype=torch.float64, device=device)  # [R, 1]
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # keep the smallest prefix whose mass reaches top_p (the top token always stays)
        keep_sorted = (sorted_p.cumsum(dim=-1) - sorted_p) < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        nucleus = torch.where(keep, probs, 0.0)
        nucleus = nucleus / nucleus.sum(dim=-1, keepdim=True)
        probs = torch.where(
            top_p < 1.0, nucleus, probs
        )  # rows without top-p are left as they were, not renormalised again
    return probs


def coupled_targets(
    logits: torch.Tensor, params: Sequence[SamplingParams], seeds: torch.Tensor, indices: torch.Tensor
) -> torch.Tensor:
    """The LLM's Gumbel-max draw of each row (coupled verification,
    :func:`specinfer.core.coupled.coupled_token` of :func:`~specinfer.core.coupled.position_noise`):
    ``argmax_x(log p(x) + g(x))`` with p the row's processed distribution and g the position noise of
    the request's seed and the sequence index the row's token would take.  # [R] int64

    ``seeds`` and ``indices``: one per row, int64 on the rows' device.  # [R], [R]
    The noise is the same counter-based hash as on the host (:func:`~specinfer.core.coupled.noise_bits`),
    computed here for every token of every row."""
    probs = processed_probs(logits, params)  # [R, V]
    tokens = torch.arange(probs.shape[-1], dtype=torch.int64, device=probs.device)[None, :]  # [1, V]
    bits = noise_bits(seeds[:, None], indices[:, None], tokens)  # [R, V] int64 in [0, 2**32)
    noise = -torch.log(-torch.log((bits.to(torch.float64) + 0.5) / 2.0**32))  # [R, V] standard Gumbel
    return (torch.log(probs) + noise).argmax(dim=-1)  # log 0 = -inf: a token the processing removed is never drawn


def greedy_accept(
    argmax: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    segments: torch.Tensor,
    num_segments: int,
    max_depth: int,
) -> torch.Tensor:
    """The greedy accept walk (:func:`specinfer.core.verify.verify_greedy`) of every tree of a step at
    once: the row where each tree's walk ends (its deepest accepted node; the root when none
    is).  # [num_segments] int64

    ``argmax[i]``: the LLM's token after row i's sequence; ``tokens[i]``: row i's token; ``parents[i]``:
    the row of its parent (a root row: itself); ``segments[i]``: its tree's index (rows of a tree are
    consecutive, parents first); ``max_depth``: the deepest node's depth. A node is *accepted* when every
    edge from its root down to it is, an edge (u, c) when c's token is the argmax at u. Children of a
    node carry distinct tokens (a :class:`~specinfer.core.tree.TokenTree` is a trie), so the accepted
    nodes of a tree form a path from its root, and the deepest is the highest row."""
    n = tokens.shape[0]
    rows = torch.arange(n, device=tokens.device)
    is_root = parents == rows
    good = (tokens == argmax[parents]) | is_root  # [N] the edge into row i agrees with the LLM (roots: no edge)
    up = parents
    # pointer doubling: after s rounds good[i] covers the 2**s edges above i (or all up to the root)
    for _ in range(max(1, max_depth).bit_length()):
        good = good & good[up]
        up = up[up]
    return torch.full((num_segments,), -1, device=tokens.device).scatter_reduce(
        0, segments, torch.where(good, rows, -1), "amax"
    )


def mss_tables(
    probs: torch.Tensor,
    internal: torch.Tensor,
    try_tokens: torch.Tensor,
    try_valid: torch.Tensor,
    q_tokens: torch.Tensor,
    q_probs: torch.Tensor,
    draws: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the MSS walk (:func:`specinfer.core.verify.walk_stochastic`) looks up, for every node of
    the sampled trees: ``(try_probs [Ni, K] float64, bonus [Ns, R] int64)``.

    At a node u the k-th try is made only when the ones before it were rejected, so the target it
    meets is fixed: p_u after k rejections, each ``p <- normalize(max(0, p - q_j))``
    (:func:`specinfer.core.verify.mss_residual`). ``try_probs[i, k]`` is that target at the k-th try's
    token, for ``internal[i]``, the i-th node with tries. A walk that ends at u has rejected all of u's
    tries; ``bonus[r, j]`` is the token drawn, as :func:`specinfer.core.sampling.sample` draws it, from
    node r's final target with the uniform ``draws[r, j]``.

    ``probs``: each node's processed distribution ``[Ns, V]``; per internal node and try (padded to K
    tries): ``try_tokens`` ``[Ni, K]``, ``try_valid`` ``[Ni, K]`` (False: padding), the try's sparse q
    ``q_tokens``/``q_probs`` ``[Ni, K, S]`` (padding: probability 0)."""
    p = probs.index_select(0, internal)  # [Ni, V]
    seen = []
    for k in range(try_tokens.shape[1]):
        seen.append(p.gather(-1, try_tokens[:, k : k + 1]))  # [Ni, 1]
        residual = p.scatter_add(-1, q_tokens[:, k], -q_probs[:, k]).clamp_min(
            0.0
        )  # max(0, p - q_k): q_k is 0 off its support
        total = residual.sum(dim=-1, keepdim=True)
        p = torch.where(try_valid[:, k : k + 1] & (total > RESIDUAL_FLOOR), residual / total, p)
    try_probs = torch.cat(seen, dim=-1) if seen else probs.new_zeros((internal.shape[0], 0))
    final = probs.index_copy(0, internal, p)  # [Ns, V] each node's target once all its tries are rejected
    cdf = (final / final.sum(dim=-1, keepdim=True)).cumsum(dim=-1)
    cdf = cdf / cdf[:, -1:]
    bonus = torch.searchsorted(cdf, draws, right=True).clamp_max(probs.shape[-1] - 1)  # [Ns, R]
    return try_probs, bonus
