"""KDA on CPU: the chunkwise torch path (forward and hand-written backward) and the slot-pool decode
step against the per-token recurrence; bad input."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close
from kernel_cases import (BF16_TOL, FWD_TOL, check_kda, check_kda_states, check_kda_step, kda_inputs,  # noqa: F401
                          lower_bound_for, one_thread, packed_lengths_cu)
from k3.kernels.kda import chunk_kda, kda_step, naive_chunk_kda
from k3.kernels.kda import cpu as kda_cpu
from k3.kernels.kda.cpu_blocks import (MID_ANCHOR_LOG2, diagonal_span, mid_anchor_safe, pair_products,
                                      pair_products_backward, unit_lower_inverse)


def naive_chunk(*args, lower_bound=None, **kw):
    return naive_chunk_kda(*args, **kw)  # the reference needs no bound


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 100])
@pytest.mark.parametrize("K", [32, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_forward_and_gradients_match_recurrence(gate, T, K, with_state):
    xs = kda_inputs(2, T, 2, K, 32, gate, seed=T * 7 + K)
    h0 = torch.randn(2, 2, K, 32, generator=torch.Generator().manual_seed(T)) if with_state else None
    check_kda(chunk_kda, xs, h0, lower_bound=lower_bound_for(gate))


@pytest.mark.parametrize("chunk_size", [16, 32, 48, 64, 12, 5])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_packed_sequences_and_chunk_sizes(chunk_size, gate):
    lengths = [17, 0, 64, 1, 130]
    cu = packed_lengths_cu(lengths)
    xs = kda_inputs(1, sum(lengths), 2, 16, 16, gate, seed=3)
    h0 = torch.randn(len(lengths), 2, 16, 16)
    check_kda(chunk_kda, xs, h0, cu_seqlens=cu, chunk_size=chunk_size, lower_bound=lower_bound_for(gate))


def test_packed_equals_each_sequence_alone():
    lengths = [17, 0, 64, 1, 130]
    cu = packed_lengths_cu(lengths)
    q, k, v, g, beta = kda_inputs(1, sum(lengths), 2, 16, 16, "bounded", seed=4)
    h0 = torch.randn(len(lengths), 2, 16, 16)
    o, s, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, lower_bound=-5.0)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oi, si, _ = chunk_kda(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[i:i + 1],
                           output_final_state=True)
        if b > a:
            assert_close(f"o[seq {i}]", oi, o[:, a:b], FWD_TOL)
        assert_close(f"state[seq {i}]", si, s[i:i + 1], FWD_TOL)


@pytest.mark.parametrize("chunk_size", [16, 64, 5])
def test_states_at_any_offset_equal_the_recurrence(chunk_size):
    # a prefix cache's snapshots read in one pass: on chunk boundaries, off them (the pass cuts
    # the chunk there), at a sequence's end; packed, several sequences, with h0
    states_at = {0: [3, chunk_size, 128, 130], 1: [1, 64], 3: [100, 199], 4: [5]}
    check_kda_states(chunk_kda, [130, 64, 0, 200, 5], states_at, chunk_size)


def test_states_at_chunk_boundaries_change_nothing():
    check_kda_states(chunk_kda, [130, 64, 0, 200, 5], {0: [64, 128], 1: [64], 3: [192]}, 64)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_naive_chunk_form_equals_the_recurrence(chunk_size, gate):
    # the readable chunk form (the WY/UT transform) against the per-token one, forward and backward
    lengths = [63, 0, 17, 1]
    xs = kda_inputs(1, sum(lengths), 2, 16, 8, gate, seed=chunk_size)
    check_kda(naive_chunk, xs, torch.randn(len(lengths), 2, 16, 8), cu_seqlens=packed_lengths_cu(lengths),
              chunk_size=chunk_size)
    check_kda_states(naive_chunk, [40, 0, 33], {0: [7, 32, 40], 2: [33]}, chunk_size)


def test_bf16_inputs():
    xs = kda_inputs(1, 100, 2, 32, 32, "bounded", seed=9, dtype=torch.bfloat16)
    check_kda(chunk_kda, xs, torch.randn(1, 2, 32, 32), fwd_tol=BF16_TOL, grad_tol=BF16_TOL)


@pytest.mark.parametrize("gate", ["low", "zero"])
def test_stress_long_gates_at_the_bound_and_near_zero(gate):
    # Thousands of steps with every gate at -5 (the state forgets fast; sub-chunk factors reach
    # their extremes) or at ~0 (the state never forgets): finite, and within tolerance.
    xs = kda_inputs(1, 2500, 1, 16, 16, gate, seed=5)
    check_kda(chunk_kda, xs, torch.randn(1, 1, 16, 16))


def test_stress_unbounded_gate_far_below_the_bound():
    q, k, v, g, beta = kda_inputs(1, 300, 1, 16, 16, "unbounded", seed=6)
    g = g * 20  # per-token log-decays down to ~ -300: e^(G_i - G_j) spans far beyond fp32
    check_kda(chunk_kda, [q, k, v, g, beta], torch.randn(1, 1, 16, 16), lower_bound=None)


def test_non_contiguous_inputs_are_handled():
    q, k, v, g, beta = kda_inputs(1, 40, 2, 16, 16, "bounded", seed=8)
    o, s, _ = chunk_kda(q, k, v, g, beta, output_final_state=True, lower_bound=-5.0)
    t = lambda x: x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    o2, s2, _ = chunk_kda(t(q), t(k), t(v), t(g), t(beta), output_final_state=True, lower_bound=-5.0)
    assert not t(q).is_contiguous()
    assert torch.equal(o, o2) and torch.equal(s, s2)


def test_building_blocks():
    # (I + A)^-1 for power-of-two and other sizes; pair products against the [C, C, K] definition.
    for C in (1, 5, 16, 48, 64):
        A = torch.randn(3, C, C, dtype=torch.float64).tril(-1) * 0.3
        want = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
        assert_close(f"inverse C={C}", unit_lower_inverse(A), want, 1e-12)
    gen = torch.Generator().manual_seed(0)
    X, Y = torch.randn(2, 64, 2, 8, generator=gen, dtype=torch.float64), torch.randn(2, 64, 1, 8, generator=gen, dtype=torch.float64)
    G = -(torch.rand(2, 64, 1, 8, generator=gen, dtype=torch.float64) * 7).cumsum(1)
    decay = (G[:, :, None, 0, :] - G[:, None, :, 0, :]).exp2()  # [2, i, j, K]
    want = torch.einsum("bipk,bjk,bijk->bipj", X, Y[:, :, 0], decay) * torch.ones(64, 64).tril()[:, None, :]
    for bounded in (False, True):  # log2 steps of <= 7 keep the bounded promise (g >= -4.9)
        assert_close(f"pair products (bounded={bounded})", pair_products(X, Y, G, bounded), want, 1e-12)


@pytest.mark.parametrize("C", [64, 48])
@pytest.mark.parametrize("bounded, span", [(False, 16), (True, 16), (True, None)])
def test_pair_products_and_gradients_for_each_anchoring(C, bounded, span):
    # exact pairwise blocks, sub-chunks anchored at their middle, the whole chunk anchored at its
    # middle (span None: C): values and both gradients against autograd of the [C, C, K] definition
    gen = torch.Generator().manual_seed(C)
    X = torch.randn(2, 3, C, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    Y = torch.randn(2, 3, C, 1, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    G = -(torch.rand(2, 3, C, 1, 8, generator=gen, dtype=torch.float64) * 0.8).cumsum(2)  # whole chunk within 2^+-26
    span = span or C
    assert diagonal_span(G, bounded=False) == C
    decay = (G[..., :, None, 0, :] - G[..., None, :, 0, :]).exp2()  # [.., i, j, K]
    lower = torch.ones(C, C, dtype=torch.float64).tril()[:, None, :]
    want = torch.einsum("...ipk,...jk,...ijk->...ipj", X, Y[..., 0, :], decay) * lower
    dP = torch.randn(want.shape, generator=gen, dtype=torch.float64) * lower
    dX_want, dY_want = torch.autograd.grad((want * dP).sum(), (X, Y))
    with torch.no_grad():
        got = pair_products(X, Y, G, bounded, span)
        dX, dY = pair_products_backward(dP, X, Y, G, bounded, span)
    assert_close("pair products", got, want, 1e-12)
    assert_close("dX", dX, dX_want, 1e-12)
    assert_close("dY", dY, dY_want, 1e-12)


def test_diagonal_span_anchors_the_whole_chunk_only_where_its_decays_allow():
    G = torch.zeros(2, 64, 1, 8)
    assert diagonal_span(G, bounded=False) == 64
    G[1, 20, 0, 3] = MID_ANCHOR_LOG2  # its chunk's middle token is 32, its sub-chunk's 24: both at 0
    assert diagonal_span(G, bounded=False) == 64
    G[1, 0:16, 0, 3] = MID_ANCHOR_LOG2 * 1.01  # tokens 0..15 too far from token 32, not from token 8
    assert diagonal_span(G, bounded=False) == 16 and diagonal_span(G, bounded=True) == 16
    G[1, 20, 0, 3] = MID_ANCHOR_LOG2 * 1.01  # and now token 20 from token 24 too
    assert diagonal_span(G, bounded=False) is None
    assert diagonal_span(G, bounded=True) == 16  # the bound's promise stands for the sub-chunks
    G[1, 20, 0, 3] = float("nan")
    assert diagonal_span(G, bounded=False) is None
    assert diagonal_span(torch.zeros(1, 12, 1, 4), bounded=False) == 12  # a chunk no longer than a sub-chunk
    short = torch.zeros(1, 12, 1, 4)
    short[0, 0, 0, 0] = MID_ANCHOR_LOG2 * 2
    assert diagonal_span(short, bounded=False) is None and diagonal_span(short, bounded=True) == 12


def test_step_over_slots_matches_reference_and_leaves_other_slots():
    check_kda_step(None, K=16, V=8, seed=7, slot_dtype=torch.int32)
    # and T decode steps equal one chunked pass
    H, K, V = 2, 16, 8
    xs = kda_inputs(2, 9, H, K, V, "bounded", seed=8)
    pool = torch.zeros(4, H, K, V)
    outs = [kda_step(*(x[:, t] for x in xs), pool, torch.tensor([3, 1])) for t in range(9)]
    o_chunk, s_chunk, _ = chunk_kda(*xs, output_final_state=True)
    assert_close("decode steps", torch.stack(outs, 1), o_chunk, FWD_TOL)
    assert_close("decode state", pool[[3, 1]], s_chunk, FWD_TOL)


def test_step_with_no_sequences():
    pool = torch.randn(2, 1, 4, 4)
    before = pool.clone()
    o = kda_step(*(x[:0, 0] for x in kda_inputs(1, 1, 1, 4, 4)), pool, torch.zeros(0, dtype=torch.long))
    assert o.shape == (0, 1, 4) and torch.equal(pool, before)


def test_bad_inputs_name_the_argument():
    q, k, v, g, beta = kda_inputs(1, 8, 2, 16, 8, "bounded")
    cases = [
        ("v ", lambda: chunk_kda(q, k, v[:, :, :1], g, beta)),
        ("q ", lambda: chunk_kda(q[..., :8], k, v, g, beta)),
        ("beta", lambda: chunk_kda(q, k, v, g, beta[..., :1])),
        ("initial_state", lambda: chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 16, 8))),
        ("cu_seqlens", lambda: chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 5]))),
        ("cu_seqlens", lambda: chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 8.0]))),
        ("chunk_size", lambda: chunk_kda(q, k, v, g, beta, chunk_size=40)),
        ("g ", lambda: chunk_kda(q, k, v, g.abs(), beta)),  # a log-decay above 0
        ("g ", lambda: chunk_kda(q, k, v, g * 3, beta, lower_bound=-5.0)),  # a broken lower bound
        ("k ", lambda: chunk_kda(q, k.to("meta"), v, g, beta)),  # wrong device
        ("v ", lambda: chunk_kda(q, k, v.to("meta"), g, beta)),
        ("backend", lambda: chunk_kda(q, k, v, g, beta, backend="cuda")),
        ("q ", lambda: chunk_kda(q.long(), k, v, g, beta)),
    ]
    for match, call in cases:
        with pytest.raises(ValueError, match=match):
            call()
    pool = torch.zeros(4, 2, 16, 8)
    step = [x[:, 0] for x in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="slot_idx"):
        kda_step(*step, pool, torch.tensor([4]))  # out of range
    with pytest.raises(ValueError, match="slot_idx"):
        kda_step(*step, pool, torch.tensor([-1]))
    with pytest.raises(ValueError, match="slot_idx"):
        kda_step(*step, pool, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="state_pool"):
        kda_step(*step, pool.double(), torch.tensor([0]))
    with pytest.raises(ValueError, match="state_pool"):
        kda_step(*step, pool.to("meta"), torch.tensor([0]))
    with pytest.raises(ValueError, match="v "):
        kda_step(step[0], step[1], step[2][:, :1], *step[3:], pool, torch.tensor([0]))


def test_inference_path_equals_training_path():
    # Without grad the forward keeps no per-chunk states; the numbers must not change.
    lengths = [70, 5, 129]
    xs = kda_inputs(1, sum(lengths), 2, 16, 16, "bounded", seed=10)
    cu = packed_lengths_cu(lengths)
    h0 = torch.randn(3, 2, 16, 16)
    with torch.no_grad():
        o1, s1, _ = chunk_kda(*xs, initial_state=h0, output_final_state=True, cu_seqlens=cu, lower_bound=-5.0)
    o2, s2, _ = chunk_kda(*[x.requires_grad_() for x in xs], initial_state=h0, output_final_state=True, cu_seqlens=cu,
                       lower_bound=-5.0)
    assert torch.equal(o1, o2.detach()) and torch.equal(s1, s2.detach())


def test_an_unbounded_gate_takes_the_dense_diagonal_only_where_its_decays_allow():
    # mid_anchor_safe: every 16-token diagonal sub-chunk within MID_ANCHOR_LOG2 of its middle token
    G = torch.zeros(2, 64, 1, 8)
    assert mid_anchor_safe(G)
    G[1, 20, 0, 3] = MID_ANCHOR_LOG2  # token 20 of sub-chunk 16..31, its anchor token 24 at 0
    assert mid_anchor_safe(G)
    G[1, 20, 0, 3] = MID_ANCHOR_LOG2 * 1.01
    assert not mid_anchor_safe(G)
    G[1, 20, 0, 3] = float("nan")
    assert not mid_anchor_safe(G)
    # chunk_kda without a bound: a mild gate (Kimi Linear's as initialised: e^-0.3 a token at
    # most) anchors each whole chunk at its middle, a steeper one the 16-token sub-chunks, a steep
    # one takes the exact 4 x 4 pairwise blocks; all are the recurrence, forward and backward
    seen = []
    real = kda_cpu.pair_products

    def spy(X, Y, G, bounded, span):
        seen.append(span if bounded else None)
        return real(X, Y, G, bounded, span)

    q, k, v, g, beta = kda_inputs(1, 150, 2, 16, 16, "unbounded", seed=12)
    try:
        kda_cpu.pair_products = spy
        for scale, span in ((0.1, 64), (0.4, 16), (20.0, None)):  # softplus(z) * 3 * scale a token
            seen.clear()
            check_kda(chunk_kda, [q, k, v, g * scale, beta], torch.randn(1, 2, 16, 16), lower_bound=None)
            assert seen and all(b == span for b in seen), (scale, seen)
    finally:
        kda_cpu.pair_products = real


def test_layers_of_one_batch_share_its_chunking():
    lengths = [70, 5, 129]
    cu = packed_lengths_cu(lengths)
    q, k, v, g, beta = kda_inputs(1, sum(lengths), 2, 16, 16, "bounded", seed=13)
    built = []
    real = kda_cpu.ChunkTable

    class Counted(real):
        def __init__(self, *a, **kw):
            built.append(a)
            super().__init__(*a, **kw)

    def run(cu_seqlens, states_at=None):
        with torch.no_grad():
            return chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu_seqlens, lower_bound=-5.0,
                             states_at=states_at)

    try:
        kda_cpu.ChunkTable = Counted
        first = run(cu)
        assert len(built) == 1
        again = run(cu)  # the next layer: the same batch, nothing rebuilt, the same numbers
        assert len(built) == 1 and torch.equal(first.o, again.o)
        run(cu, {0: [10]})  # other offsets to read: another chunking
        run(packed_lengths_cu(lengths))  # an equal tensor, but another one: rebuilt (no value compare)
        assert len(built) == 3
        moved = packed_lengths_cu([5, 70, 129])
        run(moved)
        moved.copy_(cu)  # changed in place: its version moved, the chunking is rebuilt
        assert torch.equal(run(moved).o, first.o) and len(built) == 5
    finally:
        kda_cpu.ChunkTable = real


@pytest.mark.parametrize("lengths,spaced", [
    ([128], True),  # one tile, the sequence's two chunks
    ([128] * 16, True),  # two tiles (16 chunks x 2 heads fill one), each the same chunk of every sequence
    ([128, 128, 128], False),  # one tile of both chunk positions: not one spacing
    ([192, 64], False), ([70, 5, 129], False)])  # chunks of uneven spacing; padded chunks
def test_evenly_spaced_chunks_load_and_store_in_place_with_the_gathered_values(lengths, spaced, monkeypatch):
    # a tile of whole chunks evenly spaced in the stream (one sequence's run, or the same chunk of
    # sequences of one length) is read and written through a strided view, not gathered and
    # scattered by index: the same outputs, final states and gradients as the index path
    real = kda_cpu.ChunkLayout
    layouts = []

    class Seen(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            layouts.append(self)

    class Gathered(real):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.rows = {}

    def run(layout):
        monkeypatch.setattr(kda_cpu, "ChunkLayout", layout)
        xs = [x.detach().requires_grad_() for x in kda_inputs(1, sum(lengths), 2, 16, 16, "unbounded", seed=21)]
        o, s, _ = chunk_kda(*xs, output_final_state=True, cu_seqlens=packed_lengths_cu(lengths))
        (o.square().sum() + s.sum()).backward()
        return o, s, [x.grad for x in xs]

    want, got = run(Gathered), run(Seen)
    assert (len(layouts[-1].rows) > 0) == spaced
    if spaced:  # every tile of these batches is whole and evenly spaced
        assert len(layouts[-1].rows) == len(layouts[-1].tiles)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
