"""SiTU-GLU on CPU: the blocked fp32 autograd.Function against the readable formula."""
from __future__ import annotations

import pytest
import torch

import k3.kernels.situ_glu.cpu as cpu_path
from kernel_cases import BF16_TOL, check_situ, one_thread, situ_inputs  # noqa: F401
from k3.kernels.situ_glu import naive_situ_glu, situ_glu


@pytest.mark.parametrize("shape", [(1,), (15, 17), (2, 63, 100), (0, 8), ()])
def test_fp32_forward_and_backward(shape):
    check_situ(situ_glu, *situ_inputs(shape, seed=len(shape)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_in_and_out(dtype):
    check_situ(situ_glu, *situ_inputs((33, 65), dtype, seed=2), fwd_tol=BF16_TOL, grad_tol=BF16_TOL)


def test_many_blocks_non_contiguous_and_other_bounds(monkeypatch):
    monkeypatch.setattr(cpu_path, "BLOCK", 100)  # ragged blocks
    gate, up = situ_inputs((64, 37), seed=3)
    check_situ(situ_glu, gate.t(), up.t())
    check_situ(situ_glu, gate, up, b1=2.0, b2=7.0)


def test_bounded_and_equal_to_swiglu_near_zero():
    g = torch.linspace(-1e4, 1e4, 1001)
    assert situ_glu(g, g.flip(0)).abs().max() <= 100.0
    small = torch.randn(100) * 1e-3
    torch.testing.assert_close(situ_glu(small, small), torch.nn.functional.silu(small) * small, rtol=1e-3, atol=1e-12)
    torch.testing.assert_close(situ_glu(g, g), naive_situ_glu(g, g))


@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.ones(3), torch.ones(4)), "shape"),
        ((torch.ones(3), torch.ones(3, dtype=torch.float64)), "dtype"),
        ((torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32)), "floating"),
        ((torch.ones(3), torch.ones(3, device="meta")), "up is on device meta"),
        ((torch.ones(3), [1.0, 2.0, 3.0]), "up must be a tensor"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        situ_glu(*args)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", ["b1", "b2"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 0.0, -1.0, True, "4"])
def test_bad_bounds_name_the_argument_on_every_backend(backend, name, bad):
    # b = inf used to give inf * tanh(x / inf) = NaN instead of an error
    with pytest.raises(ValueError, match=f"situ_glu: {name} must be a finite number > 0"):
        situ_glu(torch.ones(2), torch.ones(2), **{name: bad}, backend=backend)


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        situ_glu(torch.ones(2), torch.ones(2), backend="gpu")


def test_traced_by_torch_compile_one_graph_serves_every_batch():
    # the engine's decode graphs trace it with the batch symbolic: the blocks' Python loop would fix
    # the element count in the graph; traced, the formula runs as is (forward and backward). The
    # first shape compiles a static graph, the second a dynamic one, which the third reuses.
    from torch._dynamo.utils import counters

    fn = torch.compile(lambda gate, up: situ_glu(gate, up), backend="aot_eager", fullgraph=True)
    before = counters["stats"]["unique_graphs"]
    for rows in (3, 5, 9):
        check_situ(fn, *situ_inputs((rows, 40), seed=rows))
    assert counters["stats"]["unique_graphs"] - before == 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_differentiable_once_and_says_so(backend):
    # a second backward through the blocked one failed with "modified by an inplace operation"
    gate, up = (torch.randn(5, generator=torch.Generator().manual_seed(s)).requires_grad_() for s in (0, 1))
    (dgate,) = torch.autograd.grad(situ_glu(gate, up, backend=backend).square().sum(), gate, create_graph=True)
    assert torch.equal(dgate, torch.autograd.grad(situ_glu(gate, up, backend=backend).square().sum(), gate)[0])
    with pytest.raises(RuntimeError, match="differentiate twice .*@once_differentiable"):
        dgate.sum().backward()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("b1,b2,name", [
    (3.5e38, 25.0, "b1"),  # finite in Python, inf in the fp32 math: NaN out
    (1e39, 25.0, "b1"),
    (4.0, 1e-46, "b2"),  # 0 in fp32: u / 0 = NaN at u = 0
    (1e20, 1e20, r"b1 \* b2"),  # the output's bound past fp32: inf out
])
def test_bounds_whose_use_overflows_fp32_name_the_argument(backend, b1, b2, name):
    with pytest.raises(ValueError, match=f"situ_glu: {name} "):
        situ_glu(torch.tensor([0.0, 1e30]), torch.tensor([0.0, 1e30]), b1=b1, b2=b2, backend=backend)


@pytest.mark.parametrize("b1,b2", [(1e19, 1e19), (1e-39, 25.0), (4.0, 2.0**-149)])  # subnormal bounds work
def test_bounds_at_the_edges_of_fp32_still_run(b1, b2):
    g = torch.linspace(-50, 50, 101)
    assert torch.isfinite(situ_glu(g, g, b1=b1, b2=b2)).all()
    assert torch.equal(situ_glu(g, g, b1=b1, b2=b2), naive_situ_glu(g, g, b1=b1, b2=b2))
