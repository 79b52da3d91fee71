"""Drafting's logit-row tables in C (kernels/cpu_rows.c) against their PyTorch reference (cpu_rows.reference): the
same top tokens in the same order (ties in index order) and the same softmax at them in double precision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specinfer.kernels import cpu_qgemm, cpu_rows

pytestmark = pytest.mark.skipif(
    cpu_qgemm.unavailable_reason() is not None, reason=f"no CPU kernels here: {cpu_qgemm.unavailable_reason()}"
)


def check(x: np.ndarray, k: int) -> None:
    for scored in (True, False):
        idx, probs = cpu_rows.top_k(x, k, scored)
        want_idx, want_probs = cpu_rows.reference(torch.from_numpy(np.ascontiguousarray(x)), k, scored)
        np.testing.assert_array_equal(idx, want_idx.numpy())
        if scored:
            np.testing.assert_allclose(probs, want_probs.numpy(), rtol=1e-12, atol=0)
        else:
            assert probs is None


@pytest.mark.parametrize(
    ("rows", "vocab", "k"), [(1, 4096, 8), (7, 4096, 4), (3, 37, 37), (2, 13, 5), (4, 100, 1), (2, 50257, 16)]
)
def test_top_k_and_softmax_equal_the_reference(rows, vocab, k):
    rng = np.random.default_rng(rows * vocab + k)
    check((rng.normal(size=(rows, vocab)) * 4).astype(np.float32), k)


def test_ties_come_in_index_order_and_the_lowest_indices_win_the_last_place():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, size=(50, 29)).astype(np.float32)  # many ties, some at the k-th place
    for k in (1, 3, 10, 29):
        check(x, k)


def test_minus_infinity_entries_count_as_probability_zero():
    """Grammar-masked rows: -inf logits, possibly among the top k when few tokens are allowed."""
    x = np.full((3, 40), -np.inf, dtype=np.float32)
    x[0, 7] = 1.0
    x[1, [3, 30]] = 2.0
    x[2] = np.linspace(-800.0, 5.0, 40, dtype=np.float32)  # terms far below the largest, below exp(-700)
    check(x, 3)
    idx, probs = cpu_rows.top_k(x, 3, True)
    assert idx[0].tolist() == [7, 0, 1] and probs[0].tolist() == [1.0, 0.0, 0.0]
    assert idx[1].tolist() == [3, 30, 0] and probs[1].tolist() == [0.5, 0.5, 0.0]


def test_rows_of_a_wider_array_are_read_in_place():
    """A view of some columns' rows (a leading stride above the row length), as a pass's rows can be."""
    rng = np.random.default_rng(2)
    wide = rng.normal(size=(6, 300)).astype(np.float32)
    check(wide[:, :257], 9)


def test_many_rows_split_across_threads_equal_one_thread():
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(40, 32768)) * 3).astype(np.float32)  # above the kernel's threshold for threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = cpu_rows.top_k(x, 6, True)
        torch.set_num_threads(1)
        one = cpu_rows.top_k(x, 6, True)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_array_equal(two[0], one[0])
    np.testing.assert_array_equal(two[1], one[1])
    check(x, 6)


def test_bad_arguments_are_refused():
    x = np.zeros((2, 10), dtype=np.float32)
    with pytest.raises(ValueError, match="k must be"):
        cpu_rows.top_k(x, 11, False)
    with pytest.raises(ValueError, match="k must be"):
        cpu_rows.top_k(x, 0, False)
    with pytest.raises(ValueError, match="float32"):
        cpu_rows.top_k(x.astype(np.float64), 2, False)
    with pytest.raises(ValueError, match="unit stride"):
        cpu_rows.top_k(x[:, ::2], 2, False)
    assert not cpu_rows.serves(torch.zeros(2, 300), cpu_rows.MAX_K + 1)
    assert not cpu_rows.serves(torch.zeros(2, 10, dtype=torch.bfloat16), 2)
    assert cpu_rows.serves(torch.zeros(2, 10), 2)
