"""Grouped matmul (MoE experts): the one-call path against the per-group loop, forward and
backward, on odd group sizes with empty groups; inside torch.compile; bad inputs."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from k3.kernels.grouped_mm import grouped_mm, naive_grouped_mm


def inputs(sizes: list[int], K: int = 37, N: int = 19, dtype=torch.float32, seed: int = 0, transposed=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), K, generator=g).to(dtype).requires_grad_()
    w = torch.randn(len(sizes), N, K, generator=g).to(dtype) if transposed else \
        torch.randn(len(sizes), K, N, generator=g).to(dtype)
    w = w.requires_grad_()
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, w, offs


def grads(fn, x, w, offs, transposed):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w.transpose(1, 2) if transposed else w, offs)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))
    return y, x.grad, w.grad


@pytest.mark.parametrize("sizes", [[5], [3, 0, 7, 1], [0, 0, 4], [0, 0], [1, 1, 1, 1, 1, 1, 1, 9]])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K,N", [(37, 19), (40, 24)])  # odd strides take the loop; 16-byte ones torch's op
def test_equals_the_loop_forward_and_backward(sizes, transposed, K, N):
    x, w, offs = inputs(sizes, K, N, transposed=transposed)
    got, want = grads(grouped_mm, x, w, offs, transposed), grads(naive_grouped_mm, x, w, offs, transposed)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        if b.numel():
            assert_close(name, a, b, 1e-6)
        else:  # every group empty: an empty result that still took part in the backward
            assert a.shape == b.shape


def test_bf16():
    x, w, offs = inputs([4, 0, 9], dtype=torch.bfloat16, seed=1)
    y = grouped_mm(x, w, offs)
    assert y.dtype == torch.bfloat16
    assert_close("bf16 y", y, naive_grouped_mm(x.float(), w.float(), offs), 1e-2)


def test_compiles_as_one_op_in_fp32():
    # torch._grouped_mm's own fake-tensor rule takes bf16 only; the custom op traces in fp32.
    x, w, offs = inputs([2, 0, 3], seed=2)
    fn = torch.compile(lambda a, b, o: grouped_mm(a, b, o) * 2, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(fn(x, w, offs), grouped_mm(x, w, offs) * 2)


def test_backward_compiles_in_fp32():
    # a compiled training step traces the backward too: both of its grouped products stay opaque
    x, w, offs = inputs([3, 0, 5], K=40, N=24, seed=4)  # 16-byte strides: torch._grouped_mm's path
    fn = torch.compile(lambda a, b, o: grouped_mm(a, b, o), fullgraph=True, backend="aot_eager")
    got, want = grads(fn, x, w, offs, False), grads(naive_grouped_mm, x, w, offs, False)
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert_close(name, a, b, 1e-6)


@pytest.mark.parametrize("args,match", [
    ((torch.ones(3, 4, 5), torch.ones(2, 5, 6), torch.tensor([1, 3], dtype=torch.int32)), "x must be"),
    ((torch.ones(3, 4), torch.ones(2, 5, 6), torch.tensor([1, 3], dtype=torch.int32)), "w must be"),
    ((torch.ones(3, 4), torch.ones(2, 4, 6, dtype=torch.float64), torch.tensor([1, 3], dtype=torch.int32)), "w must"),
    ((torch.ones(3, 4), torch.ones(2, 4, 6), torch.tensor([1, 3])), "offs must be int32"),
    ((torch.ones(3, 4), torch.ones(2, 4, 6), torch.tensor([3], dtype=torch.int32)), r"offs must be int32 \[G=2\]"),
    (([1.0], torch.ones(2, 4, 6), torch.tensor([1, 3], dtype=torch.int32)), "x must be a tensor"),
])
def test_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        grouped_mm(*args)


@pytest.mark.parametrize("offs", [[4, 2], [2, 4], [2, 9], [-3, 6], [0, 0], []])
def test_offs_that_do_not_rise_from_zero_to_m_are_refused(offs):
    # the native op left rows past offs[-1] uninitialised and read rows past M: garbage, no error
    with pytest.raises(ValueError, match=r"grouped_mm: offs must rise from >= 0 to M=6"):
        grouped_mm(torch.randn(6, 4), torch.randn(len(offs), 4, 8), torch.tensor(offs, dtype=torch.int32))


def test_offs_are_not_read_back_inside_a_compiled_graph():
    # a traced graph cannot read offs: the check is eager-only, and the graph still computes
    x, w, offs = inputs([2, 0, 3], seed=5)
    fn = torch.compile(lambda a, b, o: grouped_mm(a, b, o), fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        assert torch.equal(fn(x, w, offs), grouped_mm(x, w, offs))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("K,N", [(37, 19), (40, 24)])
def test_every_float_dtype_runs_on_cpu(dtype, K, N):
    # torch._grouped_mm takes fp32, bf16 and fp16 on CPU: fp64 failed inside it
    x, w, offs = inputs([3, 0, 5], K, N, dtype=dtype, seed=6)
    got, want = grads(grouped_mm, x, w, offs, False), grads(naive_grouped_mm, x, w, offs, False)
    tol = 1e-12 if dtype == torch.float64 else 1e-2
    for name, a, b in zip(("y", "dx", "dw"), got, want):
        assert a.dtype == dtype
        assert_close(name, a.double(), b.double(), tol)
