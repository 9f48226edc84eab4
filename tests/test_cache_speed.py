"""The cache command's compiled counting loops against a brute force over the selections."""

from __future__ import annotations

import numpy as np
import pytest

from coldset.analysis.streams import CacheError, DecodeTokens, count_selections


def brute_counts(experts: np.ndarray, num_experts: int) -> np.ndarray:
    """Selections per (layer, expert), one selection at a time."""
    out = np.zeros((experts.shape[1], num_experts))
    for t, layer, r in np.ndindex(*experts.shape):
        if experts[t, layer, r] >= 0:
            out[layer, experts[t, layer, r]] += 1
    return out


def tokens_of(experts: np.ndarray, num_experts: int) -> DecodeTokens:
    T = experts.shape[0]
    z = np.zeros(T, np.int32)
    return DecodeTokens(experts, z, np.arange(T, dtype=np.int32), z, np.zeros(T, bool), np.asarray(["r"]),
                        np.asarray([""]), num_experts)


def test_counts_equal_a_count_of_every_selection():
    rng = np.random.default_rng(3)
    experts = rng.integers(-1, 7, size=(300, 4, 3)).astype(np.int16)  # -1: a layer or rank without a selection
    np.testing.assert_array_equal(tokens_of(experts, 7).counts(), brute_counts(experts, 7))
    assert tokens_of(experts[:0], 7).counts().shape == (4, 7)


def test_counts_refuse_an_expert_outside_the_table():
    experts = np.zeros((5, 2, 2), np.int16)
    experts[3, 1, 0] = 9
    with pytest.raises(CacheError, match=r"1 decode selection\(s\) name an expert >= num_experts 9"):
        tokens_of(experts, 9).counts()
    out = np.zeros((2, 9), np.int64)
    assert count_selections(experts, out) == 1 and out.sum() == 19
