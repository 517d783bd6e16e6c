"""QB margin histogram: the fast path against the readable reference, bin by bin."""
from __future__ import annotations

import pytest
import torch

import k3.kernels.qb_histogram.cpu as cpu_path
from k3.kernels.qb_histogram import naive_qb_histogram, qb_histogram
from kernel_cases import check_histogram


@pytest.mark.parametrize("n,e,bins", [(63, 5, 7), (1500, 17, 64), (1, 3, 2), (257, 1, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matches_reference_on_odd_shapes(n, e, bins, dtype):
    check_histogram(qb_histogram, n, e, bins, dtype)


def test_chunked_path_matches(monkeypatch):
    monkeypatch.setattr(cpu_path, "CHUNK_ELEMENTS", 37)  # many ragged chunks
    margins = torch.randn(301, 9, generator=torch.Generator().manual_seed(1))
    lo, hi = torch.full((9,), -1.5, dtype=torch.float64), torch.full((9,), 1.5, dtype=torch.float64)
    assert torch.equal(qb_histogram(margins, -1.5, 1.5, 16), naive_qb_histogram(margins, lo, hi, 16))


def test_known_counts_and_edges():
    # bins of [0, 1) are [0, .25) [.25, .5) [.5, .75) [.75, 1); below -> 0, at or above hi -> last
    margins = torch.tensor([[-3.0], [0.0], [0.2499], [0.25], [0.5], [0.99], [1.0], [7.0]])
    assert qb_histogram(margins, 0.0, 1.0, 4).tolist() == [[3, 1, 1, 3]]


def test_empty_batch_gives_zeros():
    assert torch.equal(qb_histogram(torch.zeros(0, 4), -1.0, 1.0, 8), torch.zeros(4, 8, dtype=torch.int64))


def test_infinite_margins_clamp():
    m = torch.tensor([[float("-inf")], [float("inf")], [0.1]])
    assert qb_histogram(m, 0.0, 1.0, 2).tolist() == [[2, 1]]


def test_scalar_tensor_bounds():
    m = torch.randn(50, 3)
    assert torch.equal(qb_histogram(m, torch.tensor(-1.0), torch.tensor(1.0), 10), qb_histogram(m, -1.0, 1.0, 10))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(margins=torch.zeros(4)), r"\[N, E\]"),
        (dict(margins=torch.zeros(4, 3, dtype=torch.int64)), "floating"),
        (dict(bins=0), "bins"),
        (dict(bins=2.0), "bins"),
        (dict(lo=1.0, hi=1.0), "hi > lo"),
        (dict(lo=torch.zeros(2)), r"\[E=3\]"),
        (dict(lo=torch.zeros(3, dtype=torch.int64)), "floating"),
        (dict(hi=float("inf")), "finite"),
        (dict(margins=torch.tensor([[0.0, float("nan"), 0.0]])), "NaN"),
    ],
)
def test_bad_input(kwargs, match):
    args = dict(margins=torch.zeros(4, 3), lo=-1.0, hi=1.0, bins=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        qb_histogram(args["margins"], args["lo"], args["hi"], args["bins"])
