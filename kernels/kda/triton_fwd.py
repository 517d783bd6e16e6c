"""KDA's chunked forward in Triton: cumsum -> intra -> solve -> state.

The chunk form is `naive_chunk_kda`'s (reference.py); the pairwise decays are anchored as on the
CPU path (cpu_blocks.py). A batch arrives packed ([T_total, ...] with a ChunkTable, chunks.py); a
program owns one chunk or one sequence, never both, so varlen and cuts at asked-for offsets cost
nothing but the table. Decays are kept in base 2 (G2 = cumsum(g) * log2 e) so every exponential
is an exp2.

- cumsum: chunk-local cumulative log2-decay G.
- intra: Aqk and A by 16-token sub-chunk pairs.
- solve: (I + A)^-1, u and w.
- state: sequential over a sequence's chunks: delta, o, the final state, and (SAVE_H) the state
  entering chosen chunks (every chunk for the backward, the asked-for ones for states_at).

Every load converts to fp32 (the interpreter computes bf16 wrongly, and the state is fp32
anyway). Dots use tf32x3 (three tf32 passes, about fp32 accuracy) for fp32 inputs and tf32 otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunks import ChunkTable

LOG2E = 1.4426950408889634
# Software pipelining multiplies the shared memory of the state kernels past H100/H200's 227 KB.
SEQUENTIAL = dict(num_stages=1)


@triton.jit
def chunk_span(chunks, i_t):
    """First token and end of chunk i_t: row i_t of the ChunkTable's bounds [NT, 2]."""
    t0 = tl.load(chunks + i_t * 2).to(tl.int32)
    t1 = tl.load(chunks + i_t * 2 + 1).to(tl.int32)
    return t0, t1


@triton.jit
def kda_cumsum_kernel(x, out, chunks, mult, H: tl.constexpr, K: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    """Chunk-local (reverse) cumulative sum over tokens, times mult: [T, H, K] -> fp32 [T, H, K]."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1 = chunk_span(chunks, i_t)
    o_t = t0 + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m = (o_t < t1)[:, None] & (o_k < K)[None, :]
    p = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    b_c = tl.cumsum(b_x, axis=0)
    if REVERSE:
        b_c = tl.sum(b_x, axis=0)[None, :] - b_c + b_x
    tl.store(out + p, b_c * mult, mask=m)


@triton.jit
def kda_intra_kernel(q, k, G, beta, Aqk, Akk, chunks, scale,
                     H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                     BOUNDED: tl.constexpr, PREC: tl.constexpr):
    """One [BC, BC] block (i, j <= i) of Aqk = (q k^T) and A = beta (k k^T) with pairwise decays."""
    i_t, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_i, i_j = i_p // NC, i_p % NC
    t0, t1 = chunk_span(chunks, i_t)
    if i_j > i_i or t0 + i_i * BC >= t1:
        return
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_i = t0 + i_i * BC + o_c
    o_j = t0 + i_j * BC + o_c
    m_i, m_j = o_i < t1, o_j < t1
    m_k = o_k < K
    p_i = (o_i.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    p_j = (o_j.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    mi2, mj2 = m_i[:, None] & m_k[None, :], m_j[:, None] & m_k[None, :]
    b_q = tl.load(q + p_i, mask=mi2, other=0.).to(tl.float32) * scale
    b_b = tl.load(beta + o_i.to(tl.int64) * H + i_h, mask=m_i, other=0.).to(tl.float32)
    b_kb = tl.load(k + p_i, mask=mi2, other=0.).to(tl.float32) * b_b[:, None]
    b_gi = tl.load(G + p_i, mask=mi2, other=0.)
    b_kj = tl.load(k + p_j, mask=mj2, other=0.).to(tl.float32)
    b_gj = tl.load(G + p_j, mask=mj2, other=0.)
    if i_i > i_j:
        # Anchor at the last token of block j: both factors are <= 1 for any gate.
        p_n = ((t0 + i_j * BC + BC - 1).to(tl.int64) * H + i_h) * K + o_k
        b_n = tl.load(G + p_n, mask=m_k, other=0.)
        b_fi = tl.exp2(tl.minimum(b_gi - b_n[None, :], 0.))
        b_y = b_kj * tl.exp2(b_n[None, :] - b_gj)
        b_aqk = tl.dot(b_q * b_fi, tl.trans(b_y), input_precision=PREC)
        b_akk = tl.dot(b_kb * b_fi, tl.trans(b_y), input_precision=PREC)
    else:
        keep_q = o_c[:, None] >= o_c[None, :]
        keep_k = o_c[:, None] > o_c[None, :]
        if BOUNDED:
            # Anchor at the middle token: |exponent| <= 8 tokens of the bounded decay.
            r_m = tl.minimum(t0 + i_i * BC + BC // 2, t1 - 1)
            b_m = tl.load(G + (r_m.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
            b_fx = tl.exp2(tl.where(mi2, b_gi - b_m[None, :], 0.))
            b_y = b_kj * tl.exp2(tl.where(mj2, b_m[None, :] - b_gj, 0.))
            b_aqk = tl.dot(b_q * b_fx, tl.trans(b_y), input_precision=PREC)
            b_akk = tl.dot(b_kb * b_fx, tl.trans(b_y), input_precision=PREC)
        else:
            # Unbounded gate: the exact pairwise decay, one column at a time.
            b_aqk = tl.zeros([BC, BC], dtype=tl.float32)
            b_akk = tl.zeros([BC, BC], dtype=tl.float32)
            for j in range(0, BC):
                r_j = t0 + i_i * BC + j
                p_r = (r_j.to(tl.int64) * H + i_h) * K + o_k
                m_r = o_k < tl.where(r_j < t1, K, 0)  # (a bool vector & bool scalar breaks the interpreter)
                b_kr = tl.load(k + p_r, mask=m_r, other=0.).to(tl.float32)
                b_gr = tl.load(G + p_r, mask=m_r, other=0.)
                b_e = b_kr[None, :] * tl.exp2(tl.minimum(b_gi - b_gr[None, :], 0.))
                sel = o_c[None, :] == j
                b_aqk = tl.where(sel, tl.sum(b_q * b_e, 1)[:, None], b_aqk)
                b_akk = tl.where(sel, tl.sum(b_kb * b_e, 1)[:, None], b_akk)
        b_aqk = tl.where(keep_q, b_aqk, 0.)
        b_akk = tl.where(keep_k, b_akk, 0.)
    p_a = (o_i.to(tl.int64)[:, None] * H + i_h) * BT + i_j * BC + o_c[None, :]
    tl.store(Aqk + p_a, b_aqk, mask=m_i[:, None])
    tl.store(Akk + p_a, b_akk, mask=m_i[:, None])


@triton.jit
def kda_solve_kernel(Akk, Tinv, k, v, G, beta, u, w, chunks,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, PREC: tl.constexpr):
    """Tinv = (I + A)^-1 by forward substitution, u = Tinv (beta v), w = Tinv (beta k e^G)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1 = chunk_span(chunks, i_t)
    o_r = tl.arange(0, BT)
    o_t = t0 + o_r
    m_t = o_t < t1
    p_a = (o_t.to(tl.int64)[:, None] * H + i_h) * BT + o_r[None, :]
    b_a = tl.load(Akk + p_a, mask=m_t[:, None], other=0.)
    b_inv = tl.where(o_r[:, None] == o_r[None, :], 1., 0.)
    for i in range(1, BT):
        # Row i of the inverse: e_i - sum_(j < i) A_ij Tinv_j (rows j >= i are still e_j, A_ij = 0 there).
        b_ai = tl.sum(tl.where(o_r[:, None] == i, b_a, 0.), 0)
        b_row = tl.sum(b_ai[:, None] * b_inv, 0)
        b_inv = b_inv - tl.where(o_r[:, None] == i, b_row[None, :], 0.)
    tl.store(Tinv + p_a, b_inv, mask=m_t[:, None])
    b_b = tl.load(beta + o_t.to(tl.int64) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        mv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (o_t.to(tl.int64)[:, None] * H + i_h) * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=mv, other=0.).to(tl.float32) * b_b[:, None]
        tl.store(u + p_v, tl.dot(b_inv, b_v, input_precision=PREC), mask=mv)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        mk = m_t[:, None] & (o_k < K)[None, :]
        p_k = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
        b_k = tl.load(k + p_k, mask=mk, other=0.).to(tl.float32)
        b_g = tl.load(G + p_k, mask=mk, other=0.)
        b_kg = b_k * b_b[:, None] * tl.exp2(b_g)
        tl.store(w + p_k, tl.dot(b_inv, b_kg, input_precision=PREC), mask=mk)


@triton.jit
def kda_state_kernel(q, k, w, u, G, Aqk, h0, ht, h_out, h_idx, delta, o, chunks, seq_chunks, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_H: tl.constexpr,
                     STORE_O: tl.constexpr, PREC: tl.constexpr):
    """The chunk-to-chunk hand-off for one sequence, head and V block: S [K, BV] in fp32.

    SAVE_H: the state entering chunk c goes to h_out[h_idx[c]] where h_idx[c] >= 0."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_lo = tl.load(seq_chunks + i_n).to(tl.int64)  # int64: h offsets reach NT * H * K * V
    c_hi = tl.load(seq_chunks + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + p_s, mask=m_kv, other=0.).to(tl.float32)
    for i_c in range(c_lo, c_hi):
        t0, t1 = chunk_span(chunks, i_c)
        o_t = t0 + o_r
        m_t = o_t < t1
        mtk, mtv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        if SAVE_H:
            i_s = tl.load(h_idx + i_c).to(tl.int64)
            if i_s >= 0:
                p_h = (i_s * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
                tl.store(h_out + p_h, b_s, mask=m_kv)
        p_tk = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
        p_tv = (o_t.to(tl.int64)[:, None] * H + i_h) * V + o_v[None, :]
        b_w = tl.load(w + p_tk, mask=mtk, other=0.)
        b_d = tl.load(u + p_tv, mask=mtv, other=0.) - tl.dot(b_w, b_s, input_precision=PREC)
        tl.store(delta + p_tv, b_d, mask=mtv)
        b_g = tl.load(G + p_tk, mask=mtk, other=0.)
        if STORE_O:
            b_q = tl.load(q + p_tk, mask=mtk, other=0.).to(tl.float32) * scale * tl.exp2(b_g)
            p_a = (o_t.to(tl.int64)[:, None] * H + i_h) * BT + o_r[None, :]
            b_aqk = tl.load(Aqk + p_a, mask=m_t[:, None], other=0.)
            b_o = tl.dot(b_q, b_s, input_precision=PREC) + tl.dot(b_aqk, b_d, input_precision=PREC)
            tl.store(o + p_tv, b_o.to(o.dtype.element_ty), mask=mtv)
        r_l = t1 - 1
        b_gl = tl.load(G + (r_l.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_k = tl.load(k + p_tk, mask=mtk, other=0.).to(tl.float32) * tl.exp2(tl.minimum(b_gl[None, :] - b_g, 0.))
        b_s = b_s * tl.exp2(b_gl)[:, None] + tl.dot(tl.trans(b_k), b_d, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + p_s, b_s, mask=m_kv)


def block_sizes(K: int, V: int) -> tuple[int, int]:
    """BK covers all of K (<= 256); BV keeps the [BK, BV] fp32 state block at <= 8K values."""
    BK = max(16, triton.next_power_of_2(K))
    return BK, min(max(16, triton.next_power_of_2(V)), max(16, 8192 // BK))


def dot_precision(*xs: torch.Tensor) -> str:
    return "tf32x3" if all(x.dtype == torch.float32 for x in xs) else "tf32"


def chunk_fwd(q, k, v, g, beta, scale: float, h0, table: ChunkTable, bounded: bool, want_final: bool, snap=None):
    """q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H] (contiguous, T > 0); h0: [N, H, K, V] fp32 or None.

    snap: (h_idx [NT] int32, h_out [S, H, K, V] fp32) or None: the state entering chunk c goes
    to h_out[h_idx[c]] where h_idx[c] >= 0. Returns o, the final state (or None) and what the
    backward needs.
    """
    T, H, K = k.shape
    V = v.shape[-1]
    BT, NT, N = table.size, table.num_chunks, table.num_seqs
    BC = min(16, BT)
    BK, BV = block_sizes(K, V)
    prec = dot_precision(q, k, v)
    f32 = dict(dtype=torch.float32, device=k.device)
    G = torch.empty(T, H, K, **f32)
    Aqk, Akk = torch.zeros(T, H, BT, **f32), torch.zeros(T, H, BT, **f32)
    Tinv = torch.empty(T, H, BT, **f32)
    u, w, delta = torch.empty(T, H, V, **f32), torch.empty(T, H, K, **f32), torch.empty(T, H, V, **f32)
    o = torch.empty_like(v)
    ht = torch.empty(N, H, K, V, **f32) if want_final else None
    kda_cumsum_kernel[(NT, H)](g, G, table.bounds, LOG2E, H=H, K=K, BT=BT, BK=BK, REVERSE=False)
    kda_intra_kernel[(NT, H, (BT // BC) ** 2)](
        q, k, G, beta, Aqk, Akk, table.bounds, scale, H=H, K=K, BT=BT, BC=BC, BK=BK, BOUNDED=bounded, PREC=prec)
    kda_solve_kernel[(NT, H)](Akk, Tinv, k, v, G, beta, u, w, table.bounds,
                              H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, PREC=prec, **SEQUENTIAL)
    h_idx, h_out = snap if snap is not None else (w, w)  # unused pointers when SAVE_H is off
    kda_state_kernel[(N, H, triton.cdiv(V, BV))](
        q, k, w, u, G, Aqk, h0 if h0 is not None else w, ht if ht is not None else w, h_out, h_idx, delta, o,
        table.bounds, table.first, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_H0=h0 is not None, STORE_HT=want_final, SAVE_H=snap is not None, STORE_O=True, PREC=prec, **SEQUENTIAL)
    return o, ht, (G, Aqk, Tinv, u, w)
