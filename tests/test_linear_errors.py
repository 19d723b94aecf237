"""Misuse of the W4A4 linear gets a clear error, never an IndexError or a silently wrong number."""

from __future__ import annotations

import pytest
import torch

from minite_common import (
    grouped_w4a4_linear,
    grouped_w4a4_linear_train,
    quantize_stacked_weight,
    quantize_weight,
    row_amax,
    w4a4_linear,
)


@pytest.fixture(scope="module")
def weight():
    return quantize_weight(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)))


def test_zero_d_input_is_refused(weight) -> None:
    with pytest.raises(ValueError, match="0-d tensor"):
        w4a4_linear(torch.tensor(1.0), weight)


def test_k_zero_is_refused(weight) -> None:
    with pytest.raises(ValueError, match="K=0 must be a positive multiple of"):
        quantize_weight(torch.empty(32, 0))
    with pytest.raises(ValueError, match="last dimension 0"):
        w4a4_linear(torch.empty(3, 0), weight)


def test_row_amax_checked(weight) -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    good = row_amax(x)
    ref = w4a4_linear(x, weight, row_amax=good * 2)  # a larger whole-row amax is legal
    assert ref.shape == (5, 32) and torch.isfinite(ref).all()
    for bad in (-good, good * 0.5, torch.full_like(good, float("nan"))):
        with pytest.raises(ValueError, match="row_amax"):
            w4a4_linear(x, weight, row_amax=bad)
    with pytest.raises(ValueError, match="shape"):
        w4a4_linear(x, weight, row_amax=good[:3])


def test_grouped_sizes_checked() -> None:
    w = quantize_weight(torch.randn(32, 64, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    for bad in ([-1, 4], [1.5, 1.5], torch.tensor([-1, 4])):
        with pytest.raises(ValueError, match="non-negative whole numbers"):
            grouped_w4a4_linear(x, w, bad)
    with pytest.raises(ValueError, match="summing to T"):
        grouped_w4a4_linear(x, w, [1, 1])
    # valid sizes as a (CPU) tensor: the same bits as the list
    assert torch.equal(
        grouped_w4a4_linear(x, w, torch.tensor([0, 3])), grouped_w4a4_linear(x, w, [0, 3])
    )
    master = torch.randn(32, 64, generator=torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="grouped_w4a4_linear_train: group sizes"):
        grouped_w4a4_linear_train(x, master, quantize_stacked_weight(master, 16), [2.5, 0.5])
