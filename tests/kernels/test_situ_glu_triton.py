"""SiTU-GLU's Triton kernels under the interpreter (TRITON_INTERPRET=1, CPU tensors)."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import BF16_TOL, assert_interpreted, check_situ, interpreter_or_skip, one_thread, situ_inputs  # noqa: F401

interpreter_or_skip()
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # numpy, sigmoid(-big)

from k3.kernels.situ_glu import situ_glu  # noqa: E402
from k3.kernels.situ_glu import triton as situ_triton  # noqa: E402


def situ_glu_triton(gate, up, **kw):
    return situ_glu(gate, up, backend="triton", **kw)


def setup_module():
    assert_interpreted(situ_triton.situ_glu_fwd_kernel)


@pytest.mark.parametrize("shape", [(1,), (15, 17), (3, 1100), (0, 4)])
def test_fp32_forward_and_backward(shape):
    check_situ(situ_glu_triton, *situ_inputs(shape, seed=len(shape)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_in_and_out(dtype):
    check_situ(situ_glu_triton, *situ_inputs((33, 65), dtype, seed=2), fwd_tol=BF16_TOL, grad_tol=BF16_TOL)


def test_tanh_near_zero_and_far_out():
    x = torch.cat([torch.logspace(-8, 3, 200), -torch.logspace(-8, 3, 200), torch.zeros(1)])
    got = situ_glu_triton(x, torch.ones_like(x), b1=1.0, b2=1e30)  # = tanh(x) sigmoid(x) * tanh(1e-30) 1e30
    want = torch.tanh(x.double()) * torch.sigmoid(x.double())
    assert ((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-30).all()  # a few ulp, even at 1e-8


def test_non_contiguous_and_other_bounds():
    gate, up = situ_inputs((64, 37), seed=3)
    check_situ(situ_glu_triton, gate.t(), up.t(), b1=2.0, b2=7.0)
