"""Inputs and reference comparisons shared by the kernel tests (CPU paths and Triton interpreter).

Tolerances are relative RMS errors (helpers.rel_rms), one name per kind of tensor.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_close

FWD_TOL = 1e-4  # fp32 outputs and final states against the fp32 reference
GRAD_TOL = 1e-3  # fp32 gradients against autograd through the reference
BF16_TOL = 2e-2  # bf16 inputs and outputs against the reference on the same (upcast) values


@pytest.fixture(autouse=True)
def one_thread():
    """Kernel tests run their many tiny ops on one thread: on a loaded 2-core machine OpenMP's
    barriers made the reference's backward 100x slower with two. Imported by each test module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_rel(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """assert_close, except that an (all but) zero reference is compared in absolute terms: a
    gradient that is exactly zero in the reference (e.g. dg at T = 1 with no initial state) is
    rounding noise in any chunked form, and a relative error of noise over zero means nothing."""
    if actual.numel() == 0:
        assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        return
    if expected.detach().double().pow(2).mean().sqrt() < 1e-7:
        noise = float(actual.detach().double().pow(2).mean().sqrt())
        assert actual.shape == expected.shape and noise < 1e-6, f"{name}: RMS {noise:.2e} where the reference is 0"
        return
    assert_close(name, actual, expected, tol)


def interpreter_or_skip():
    """Triton for a Triton test module, in interpreter mode, or skip the module.

    TRITON_INTERPRET is read when a @triton.jit decorator runs, so tests/conftest.py sets it
    before any k3 module is imported. A user who sets it to something else has asked for compiled
    kernels: these interpreter tests then skip (on a GPU, jobs/gpu_check.py checks those).
    """
    import triton  # a test dependency: missing, it is a broken install, not a reason to skip

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is set to something other than 1 (compiled kernels asked for; "
                    "these are the interpreter tests, jobs/gpu_check.py checks compiled ones)",
                    allow_module_level=True)
    return triton


def assert_interpreted(kernel) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):  # tests/conftest.py sets it first: a harness bug
        pytest.fail("k3's Triton kernels were imported before TRITON_INTERPRET=1 was set")


def kda_inputs(B, T, H, K, V, gate="bounded", seed=0, dtype=torch.float32):
    """q, k (L2-normalised), v, g, beta as the model makes them. gate: bounded (K3, g in (-5, 0)),
    unbounded (Kimi Linear, far below -5 per token), low (pinned at -5) or zero (near 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    z = torch.randn(B, T, H, K, generator=gen) * 2
    if gate == "bounded":
        g = -5.0 * torch.sigmoid(z)
    elif gate == "unbounded":
        g = -F.softplus(z) * 3
    elif gate == "low":
        g = torch.full((B, T, H, K), -5.0)
    else:
        g = -torch.rand(B, T, H, K, generator=gen) * 1e-6
    beta = torch.rand(B, T, H, generator=gen)
    return [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]


def lower_bound_for(gate: str) -> float | None:
    return None if gate == "unbounded" else -5.0


def check_kda(fn, xs, h0=None, cu_seqlens=None, grads=True, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, lower_bound=-5.0, **kw):
    """Run fn (chunk_kda's signature) and the reference recurrence on the same inputs; compare the
    output, the final state and, with grads, every input gradient (upstream grads random)."""
    from k3.kernels.kda import naive_recurrent_kda

    a = [x.detach().clone().requires_grad_(grads) for x in xs]
    b = [x.detach().clone().requires_grad_(grads) for x in xs]
    ha = hb = None
    if h0 is not None:
        ha, hb = (h0.detach().clone().requires_grad_(grads) for _ in range(2))
    o, s, states = fn(*a, initial_state=ha, output_final_state=True, cu_seqlens=cu_seqlens, lower_bound=lower_bound,
                      **kw)
    o_ref, s_ref, _ = naive_recurrent_kda(*b, initial_state=hb, output_final_state=True, cu_seqlens=cu_seqlens)
    assert o.dtype == xs[2].dtype and s.dtype == torch.float32 and states == {}
    assert_rel("o", o, o_ref, fwd_tol)
    assert_rel("final_state", s, s_ref, fwd_tol)
    if not grads:
        return
    gen = torch.Generator().manual_seed(123)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen)
    ((o.float() * do.float()).sum() + (s * ds).sum()).backward()
    ((o_ref.float() * do.float()).sum() + (s_ref * ds).sum()).backward()
    for name, x, y in zip(["dq", "dk", "dv", "dg", "dbeta"], a, b):
        assert x.grad.dtype == x.dtype, f"{name}: dtype {x.grad.dtype} != input {x.dtype}"
        assert_rel(name, x.grad, y.grad, grad_tol)
    if h0 is not None:
        assert_rel("dh0", ha.grad, hb.grad, grad_tol)


def packed_lengths_cu(lengths):
    return torch.tensor([0] + list(lengths)).cumsum(0)


def check_kda_states(fn, lengths, states_at, chunk_size):
    """states_at through fn (chunk_kda's signature, no grad) on a packed batch with h0: every
    asked-for state, the output and the final state against the recurrence's. When every offset
    is a multiple of chunk_size (no extra cut), asking changes neither o nor the final state."""
    from k3.kernels.kda import naive_recurrent_kda

    cu = packed_lengths_cu(lengths)
    xs = kda_inputs(1, sum(lengths), 2, 16, 16, "bounded", seed=sum(lengths))
    h0 = torch.randn(len(lengths), 2, 16, 16, generator=torch.Generator().manual_seed(2))
    run = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        got = fn(*xs, **run, chunk_size=chunk_size, lower_bound=-5.0, states_at=states_at)
        plain = fn(*xs, **run, chunk_size=chunk_size, lower_bound=-5.0)
        ref = naive_recurrent_kda(*xs, **run, states_at=states_at)
    assert sorted(got.states) == sorted(ref.states) == sorted((i, o) for i, offs in states_at.items() for o in offs)
    for key, state in got.states.items():
        assert state.dtype == torch.float32
        assert_rel(f"state after {key[1]} of sequence {key[0]}", state, ref.states[key], FWD_TOL)
    assert_rel("o", got.o, ref.o, FWD_TOL)
    assert_rel("final_state", got.final_state, ref.final_state, FWD_TOL)
    if all(off % chunk_size == 0 for offs in states_at.values() for off in offs):
        assert torch.equal(got.o, plain.o) and torch.equal(got.final_state, plain.final_state)


def situ_inputs(shape, dtype=torch.float32, seed=0):
    """gate and up spanning the soft-clamp regimes: near 0, O(1), and far past b1 and b2."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([1e-3, 1.0, 8.0, 60.0])[torch.randint(0, 4, shape, generator=gen)]
    gate = torch.randn(shape, generator=gen) * scale
    up = torch.randn(shape, generator=gen) * scale.flip(-1) if len(shape) else torch.randn(shape, generator=gen)
    return gate.to(dtype), up.to(dtype)


def check_situ(fn, gate, up, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, **kw):
    """fn(gate, up) and its gradients against autograd through naive_situ_glu; inputs untouched."""
    from k3.kernels.situ_glu import naive_situ_glu

    g0, u0 = gate.clone(), up.clone()
    a = [x.detach().clone().requires_grad_() for x in (gate, up)]
    b = [x.detach().clone().requires_grad_() for x in (gate, up)]
    h = fn(*a, **kw)
    h_ref = naive_situ_glu(*b, **kw)
    assert h.dtype == gate.dtype and h.shape == gate.shape
    assert_rel("h", h, h_ref, fwd_tol)
    dh = torch.randn(h.shape, generator=torch.Generator().manual_seed(1)).to(h.dtype)
    (h.float() * dh.float()).sum().backward()
    (h_ref.float() * dh.float()).sum().backward()
    for name, x, y in (("dgate", a[0], b[0]), ("dup", a[1], b[1])):
        assert x.grad.dtype == x.dtype
        assert_rel(name, x.grad, y.grad, grad_tol)
    assert torch.equal(gate, g0) and torch.equal(up, u0), "inputs were modified"


def mla_case(lens, H=3, L=32, R=16, page_size=16, dtype=torch.float32, seed=0, spare_pages=3):
    """A paged latent cache holding len(lens) sequences in shuffled, interleaved pages.

    Returns q_lat, q_rope, kv_cache, page_table (int32, -1 past each sequence's end), seq_lens.
    """
    gen = torch.Generator().manual_seed(seed)
    N = len(lens)
    need = [(n + page_size - 1) // page_size for n in lens]
    n_pages = sum(need) + spare_pages
    ids = torch.randperm(n_pages, generator=gen)  # out-of-order pages, shared pool
    table = torch.full((N, max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for i, k in enumerate(need):
        table[i, :k] = ids[used:used + k]
        used += k
    kv = torch.randn(n_pages, page_size, L + R, generator=gen)
    q_lat = torch.randn(N, H, L, generator=gen) * 0.3
    q_rope = torch.randn(N, H, R, generator=gen) * 0.3
    return q_lat.to(dtype), q_rope.to(dtype), kv.to(dtype), table, torch.tensor(lens, dtype=torch.int32)


def check_mla(fn, case, with_uv=False, tol=FWD_TOL, **kw):
    from k3.kernels.mla_decode import naive_mla_decode

    q_lat, q_rope, kv, table, lens = case
    N, H, L = q_lat.shape
    extra = ()
    if with_uv:
        gen = torch.Generator().manual_seed(5)
        extra = (torch.randn(H, 24, L, generator=gen).to(q_lat.dtype) * 0.2,
                 torch.randn(N, H, 24, generator=gen).to(q_lat.dtype))
    scale = 0.125
    got = fn(q_lat, q_rope, kv, table, lens, scale, *extra, **kw)
    want = naive_mla_decode(q_lat, q_rope, kv, table, lens, scale, *extra)
    assert got.dtype == q_lat.dtype
    assert_rel("o" if with_uv else "ctx", got, want, tol)


def check_histogram(fn, n, e, bins, dtype):
    """fn (qb_histogram's signature) against the reference bin for bin, on margins [n, e] with a
    window per expert that some margins fall outside: int64 [e, bins], every token counted once."""
    from k3.kernels.qb_histogram import naive_qb_histogram

    g = torch.Generator().manual_seed(n * 31 + e)
    margins = (torch.randn(n, e, generator=g) * 0.7).to(dtype)
    lo = -torch.rand(e, generator=g) - 0.2
    hi = torch.rand(e, generator=g) + 0.2
    got = fn(margins, lo, hi, bins)
    assert got.dtype == torch.int64 and got.shape == (e, bins)
    assert torch.equal(got, naive_qb_histogram(margins, lo, hi, bins))
    assert torch.equal(got.sum(1), torch.full((e,), n))  # clamped, so every token counts once


def check_kda_step(backend, K, V, seed, slot_dtype=torch.int64):
    """kda_step over a pool of 6 slots, 3 sequences in slots 4, 0, 2: output and updated slots
    equal the reference's, and the other slots stay bit-identical."""
    from helpers import assert_close
    from k3.kernels.kda import kda_step, naive_kda_step

    N, P, H = 3, 6, 2
    q, k, v, g, beta = (x[:, 0] for x in kda_inputs(N, 1, H, K, V, "unbounded", seed=seed))
    pool = torch.randn(P, H, K, V)
    pool_ref = pool.clone()
    slots = torch.tensor([4, 0, 2], dtype=slot_dtype)
    untouched = pool[[1, 3, 5]].clone()
    o = kda_step(q, k, v, g, beta, pool, slots, backend=backend)
    o_ref = naive_kda_step(q, k, v, g, beta, pool_ref, slots)
    assert_close("o", o, o_ref, FWD_TOL)
    assert_close("pool", pool, pool_ref, FWD_TOL)
    assert torch.equal(pool[[1, 3, 5]], untouched), "slots outside slot_idx changed"
