"""KDA ops: the chunkwise torch path and the slot-pool decode step against the recurrence."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close
from k3.kernels.kda import chunk_kda, kda_step, naive_kda_step, naive_recurrent_kda

FWD_TOL = 1e-5  # fp32 forward, chunkwise vs recurrent
GRAD_TOL = 1e-4  # fp32 gradients


def make_inputs(B, T, H, K, V, gate, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    z = torch.randn(B, T, H, K, generator=g) * 2
    if gate == "bounded":
        gg = -5.0 * torch.sigmoid(z)
    elif gate == "unbounded":
        gg = -F.softplus(z) * 3  # reaches far below -5 per token
    else:
        gg = -torch.rand(B, T, H, K, generator=g) * 1e-3  # near zero: long memory
    beta = torch.rand(B, T, H, generator=g)
    xs = [q, k, v, gg, beta]
    if requires_grad:
        xs = [x.clone().requires_grad_() for x in xs]
    return xs


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_equals_recurrent(gate, T, with_state):
    B, H, K, V = 2, 2, 32, 16
    q, k, v, g, beta = make_inputs(B, T, H, K, V, gate, seed=T)
    h0 = torch.randn(B, H, K, V) if with_state else None
    lb = -5.0 if gate == "bounded" else None
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, lower_bound=lb)
    assert_close("o", o, o_ref, FWD_TOL)
    assert_close("final_state", s, s_ref, FWD_TOL)


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("T", [17, 65])
def test_chunk_gradients_match_recurrence(gate, T):
    B, H, K, V = 1, 2, 16, 8
    xs = make_inputs(B, T, H, K, V, gate, seed=1, requires_grad=True)
    ys = [x.detach().clone().requires_grad_() for x in xs]
    h0 = torch.randn(B, H, K, V, requires_grad=True)
    h1 = h0.detach().clone().requires_grad_()
    do, ds = torch.randn(B, T, H, V), torch.randn(B, H, K, V)
    o, s = chunk_kda(*xs, initial_state=h0, output_final_state=True, lower_bound=-5.0 if gate == "bounded" else None)
    ((o * do).sum() + (s * ds).sum()).backward()
    o2, s2 = naive_recurrent_kda(*ys, initial_state=h1, output_final_state=True)
    ((o2 * do).sum() + (s2 * ds).sum()).backward()
    for name, a, b in zip(["dq", "dk", "dv", "dg", "dbeta"], xs, ys):
        assert_close(name, a.grad, b.grad, GRAD_TOL)
    assert_close("dh0", h0.grad, h1.grad, GRAD_TOL)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_packed_sequences(chunk_size):
    lengths = [17, 0, 64, 1, 130]
    T = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v, g, beta = make_inputs(1, T, 2, 16, 16, "bounded", seed=3)
    h0 = torch.randn(len(lengths), 2, 16, 16)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                     chunk_size=chunk_size, lower_bound=-5.0)
    assert_close("o", o, o_ref, FWD_TOL)
    assert_close("final_state", s, s_ref, FWD_TOL)
    # and each sequence alone gives the same
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if b > a:
            oi, si = chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[i:i + 1],
                               output_final_state=True)
            assert_close(f"seq{i}", oi, o[:, a:b], FWD_TOL)
            assert_close(f"state{i}", si, s[i:i + 1], FWD_TOL)


def test_long_gate_stress_no_overflow():
    # Gates pinned at the lower bound for thousands of steps, and near zero: finite and exact.
    for gate_value in (-5.0 + 1e-6, -1e-7):
        T = 3000
        q, k, v, _, beta = make_inputs(1, T, 1, 16, 16, "bounded", seed=5)
        g = torch.full((1, T, 1, 16), gate_value)
        o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
        o, s = chunk_kda(q, k, v, g, beta, output_final_state=True, lower_bound=-5.0)
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert_close(f"o(g={gate_value})", o, o_ref, FWD_TOL)


def test_step_over_slots_matches_reference_and_leaves_other_slots():
    N, P, H, K, V = 3, 6, 2, 16, 8
    q, k, v, g, beta = (x[:, 0] for x in make_inputs(N, 1, H, K, V, "unbounded", seed=7))
    pool = torch.randn(P, H, K, V)
    pool_ref = pool.clone()
    slots = torch.tensor([4, 0, 2])
    untouched = pool[[1, 3, 5]].clone()
    o = kda_step(q, k, v, g, beta, pool, slots)
    o_ref = naive_kda_step(q, k, v, g, beta, pool_ref, slots)
    assert_close("o", o, o_ref, FWD_TOL)
    assert_close("pool", pool, pool_ref, FWD_TOL)
    assert torch.equal(pool[[1, 3, 5]], untouched), "slots outside slot_idx changed"


def test_bad_inputs_name_the_argument():
    q, k, v, g, beta = make_inputs(1, 8, 2, 16, 8, "bounded")
    with pytest.raises(ValueError, match="v "):
        chunk_kda(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 16, 8))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_kda(q, k, v, g, beta, chunk_size=40)
    pool = torch.zeros(4, 2, 16, 8)
    with pytest.raises(ValueError, match="slot_idx"):
        kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool, torch.tensor([4]))
    with pytest.raises(ValueError, match="state_pool"):
        kda_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool.double(), torch.tensor([0]))
