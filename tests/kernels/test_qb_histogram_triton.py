"""QB margin histogram's Triton kernel under the interpreter (TRITON_INTERPRET=1, CPU tensors):
bin for bin against the reference."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_interpreted, check_histogram, interpreter_or_skip, one_thread  # noqa: F401

interpreter_or_skip()

from k3.kernels.qb_histogram import naive_qb_histogram  # noqa: E402
from k3.kernels.qb_histogram import triton as qb_triton  # noqa: E402


def setup_module():
    assert_interpreted(qb_triton.qb_histogram_kernel)


@pytest.mark.parametrize("n,e,bins", [(63, 5, 7), (1500, 17, 64), (1, 3, 2), (257, 70, 256), (0, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_matches_reference_bin_for_bin(n, e, bins, dtype):
    check_histogram(qb_triton.qb_histogram_triton, n, e, bins, dtype)


def test_edges_infinities_and_strided_margins():
    margins = torch.tensor([[-3.0], [0.0], [0.2499], [0.25], [0.5], [0.99], [1.0], [7.0],
                            [float("inf")], [float("-inf")]])
    lo, hi = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    assert qb_triton.qb_histogram_triton(margins, lo, hi, 4).tolist() == [[4, 1, 1, 4]]
    wide = torch.randn(40, 9, generator=torch.Generator().manual_seed(1))
    lo9, hi9 = torch.full((3,), -1.0), torch.full((3,), 1.0)
    assert torch.equal(qb_triton.qb_histogram_triton(wide[:, ::3], lo9, hi9, 16),
                       naive_qb_histogram(wide[:, ::3], lo9, hi9, 16))
