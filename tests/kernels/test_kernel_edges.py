"""Adversarial inputs to the kernels' public functions: each gives the right result or a
ValueError naming the argument (they used to raise RuntimeError, return NaN/inf or miscount)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3.kernels.kda import KDAOutput, chunk_kda, kda_step, naive_recurrent_kda
from k3.kernels.qb_histogram import naive_qb_histogram, qb_histogram


def _kda(T=20, H=2, K=8, V=8, seed=0):
    g_ = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1)
    k = F.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1)
    v = torch.randn(1, T, H, V, generator=g_)
    g = -torch.rand(1, T, H, K, generator=g_)
    beta = torch.rand(1, T, H, generator=g_)
    return q, k, v, g, beta


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_qb_histogram_non_contiguous_margins():
    m = torch.randn(16, 64).t()  # [64, 16], transposed view
    assert not m.is_contiguous()
    lo, hi = torch.full((16,), -1.0), torch.full((16,), 1.0)
    assert torch.equal(qb_histogram(m, lo, hi, 32), naive_qb_histogram(m.contiguous(), lo, hi, 32))


@pytest.mark.parametrize("lo,hi", [(1.0, 1.0 + 1e-12), (1e8, 1e8 + 1)])
def test_qb_histogram_window_that_collapses_in_fp32(lo, hi):
    with pytest.raises(ValueError, match="lo and hi.*collapse"):
        qb_histogram(torch.randn(10, 4), lo, hi, 16)
    # in fp64 the same window is fine
    assert int(qb_histogram(torch.randn(10, 4, dtype=torch.float64), lo, hi, 16).sum()) == 40


def test_qb_histogram_more_bins_than_fp32_counts_exactly():
    with pytest.raises(ValueError, match="bins must be <= 2\\^24"):
        qb_histogram(torch.tensor([[5.0, 0.0]]), 0.0, 1.0, 2**24 + 2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_kda_no_tokens(backend, with_state):
    q, k, v, g, beta = _kda(T=0)
    h0 = torch.randn(1, 2, 8, 8) if with_state else None
    o, final, states = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)
    assert o.shape == v.shape and states == {}
    assert torch.equal(final, h0 if with_state else torch.zeros(1, 2, 8, 8))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunk_kda_returns_the_same_triple_whatever_is_asked(backend):
    xs = _kda(T=16, K=16, V=16)
    for kw in (dict(), dict(output_final_state=True), dict(states_at={0: [5]})):
        with torch.no_grad():
            out = chunk_kda(*xs, **kw, backend=backend)
        assert isinstance(out, KDAOutput) and len(out) == 3
        assert (out.final_state is not None) == ("output_final_state" in kw)
        assert sorted(out.states) == ([(0, 5)] if "states_at" in kw else [])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("states_at, match", [
    ({0: [0]}, "offset 0 of sequence 0 must be an integer in \\(0, 20\\]"),
    ({0: [21]}, "offset 21 of sequence 0"),
    ({0: [2.5]}, "offset 2.5 of sequence 0"),
    ({1: [4]}, "sequence 1 out of range \\[0, 1\\)"),
    ({0: 4}, "offsets of sequence 0 must be a list"),
    ([4], "must be a dict"),
])
def test_chunk_kda_bad_states_at(backend, states_at, match):
    with torch.no_grad(), pytest.raises(ValueError, match=f"kda: states_at {match}"):
        chunk_kda(*_kda(K=16, V=16), states_at=states_at, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunk_kda_states_at_is_for_inference(backend):
    q, k, v, g, beta = _kda(K=16, V=16)
    with pytest.raises(ValueError, match="kda: states_at is for inference"):
        chunk_kda(q.requires_grad_(), k, v, g, beta, states_at={0: [4]}, backend=backend)


def test_chunk_kda_huge_q_with_gate_at_the_bound():
    q, k, v, g, beta = _kda()
    q, g = q * 1e8, torch.full_like(g, -5.0)
    o = chunk_kda(q, k, v, g, beta, lower_bound=-5.0).o
    assert torch.isfinite(o).all()
    assert _rel(o, naive_recurrent_kda(q, k, v, g, beta).o) < 1e-5


@pytest.mark.parametrize("value", [float("-inf"), -1e38])
def test_chunk_kda_unbounded_gate_far_below_fp32_underflow(value):
    q, k, v, g, beta = _kda()
    g[0, 3, 0, 0] = value
    o = chunk_kda(q, k, v, g, beta).o
    want = naive_recurrent_kda(q, k, v, g, beta).o  # exp(g) = 0: the state's channel resets
    assert torch.isfinite(o).all() and _rel(o, want) < 1e-5


@pytest.mark.parametrize("lower_bound", [float("nan"), float("-inf"), 0.0, 1.0])
def test_chunk_kda_bad_lower_bound(lower_bound):
    with pytest.raises(ValueError, match="lower_bound"):
        chunk_kda(*_kda(), lower_bound=lower_bound)


@pytest.mark.parametrize("dims,name", [(dict(H=0), "k"), (dict(K=0), "k"), (dict(V=0), "v")])
def test_chunk_kda_empty_head_dims(dims, name):
    with pytest.raises(ValueError, match=f"kda: {name} needs"):
        chunk_kda(*_kda(**dims))


@pytest.mark.parametrize("bad", [0.5, float("nan")])
def test_kda_step_checks_the_gate(bad):
    N, H, K, V = 2, 2, 8, 8
    g = -torch.rand(N, H, K)
    g[1, 0, 3] = bad
    pool = torch.zeros(4, H, K, V)
    with pytest.raises(ValueError, match="kda: g must be a log-decay"):
        kda_step(torch.randn(N, H, K), torch.randn(N, H, K), torch.randn(N, H, V), g, torch.rand(N, H), pool,
                 torch.tensor([0, 1]))
    assert torch.equal(pool, torch.zeros(4, H, K, V))


@pytest.mark.parametrize("chunk_size", [1 << 20, 272, 1024])
def test_chunk_kda_chunk_size_past_the_bound(chunk_size):
    # 2**20 at T=5 allocated [H, C, C] tiles: 17 TB asked for, no error
    with pytest.raises(ValueError, match=r"kda: chunk_size must be .* at most 256"):
        chunk_kda(*_kda(T=5), chunk_size=chunk_size)


def test_chunk_kda_chunk_size_at_the_bound_runs():
    xs = _kda(T=5)
    assert _rel(chunk_kda(*xs, chunk_size=256).o, naive_recurrent_kda(*xs).o) < 1e-5


BAD_SCALES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.5, "0.3", True, torch.tensor([1.0, 2.0])]


@pytest.mark.parametrize("scale", BAD_SCALES)
def test_kda_scale_must_be_finite_and_positive(scale):
    # NaN or inf returned NaN everywhere; a string or a 2-element tensor raised from float()
    q, k, v, g, beta = _kda()
    with pytest.raises(ValueError, match="kda: scale must be a finite number > 0"):
        chunk_kda(q, k, v, g, beta, scale=scale)
    pool = torch.zeros(4, 2, 8, 8)
    with pytest.raises(ValueError, match="kda: scale must be a finite number > 0"):
        kda_step(*(x[0, :2] for x in (q, k, v, g, beta)), pool, torch.tensor([0, 1]), scale=scale)
    assert torch.equal(pool, torch.zeros(4, 2, 8, 8))  # refused before the state was touched


@pytest.mark.parametrize("scale", [None, 0.25, torch.tensor(0.25)])
def test_kda_scale_none_is_the_default_and_numbers_or_0d_tensors_are_taken(scale):
    q, k, v, g, beta = _kda()
    want = naive_recurrent_kda(q, k, v, g, beta, scale=scale if scale is not None else 8 ** -0.5).o
    assert _rel(chunk_kda(q, k, v, g, beta, scale=scale).o, want) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunk_kda_is_differentiable_once_and_says_so(backend):
    # create_graph=True gave exact first gradients, then a second backward failed inside the
    # hand-written one ("modified by an inplace operation") or, on Triton, had nothing to follow
    xs = [x.requires_grad_() for x in _kda(T=5)]
    o = chunk_kda(*xs, backend=backend).o
    first = torch.autograd.grad(o.square().sum(), xs, create_graph=True)
    want = torch.autograd.grad(chunk_kda(*xs, backend=backend).o.square().sum(), xs)
    assert all(torch.equal(a, b) for a, b in zip(first, want))
    with pytest.raises(RuntimeError, match="differentiate twice .*@once_differentiable"):
        first[0].sum().backward()
