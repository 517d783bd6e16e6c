"""Triton kernels for KDA: the chunked forward and backward, and the decode step over state slots.

The chunked algorithm is the one in cpu.py (read that docstring first). Every batch is handled
as packed sequences ([1, T_total] with cu_seqlens); a program owns one chunk (BT tokens) or one
sequence, never both, so varlen costs nothing but the index tables. Decays are kept in base 2
(G2 = cumsum(g) * log2 e) so every exponential is an exp2.

Forward:  cumsum -> intra (Aqk and A by 16-token sub-chunk pairs) -> solve ((I + A)^-1, u, w)
          -> state (sequential over chunks: delta, o, final state).
Backward: state recompute (h per chunk) -> bwd state (reverse: dh per chunk, ddelta) -> bwd chunk
          (everything that needs h, dh; dA, dAqk) -> bwd intra (pair-product gradients, sums)
          -> reverse cumsum (dg).

Every load converts to fp32 (the interpreter computes bf16 wrongly, and the state is fp32
anyway). Dots use tf32x3 (three tf32 passes, about fp32 accuracy) for fp32 inputs and tf32 otherwise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT: tl.constexpr):
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    return bos + i_c * BT, eos


@triton.jit
def kda_cumsum_kernel(x, out, cu_seqlens, chunk_indices, mult, H: tl.constexpr, K: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, REVERSE: tl.constexpr):
    """Chunk-local (reverse) cumulative sum over tokens, times mult: [T, H, K] -> fp32 [T, H, K]."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    o_t = t0 + tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m = (o_t < eos)[:, None] & (o_k < K)[None, :]
    p = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    b_x = tl.load(x + p, mask=m, other=0.).to(tl.float32)
    b_c = tl.cumsum(b_x, axis=0)
    if REVERSE:
        b_c = tl.sum(b_x, axis=0)[None, :] - b_c + b_x
    tl.store(out + p, b_c * mult, mask=m)


@triton.jit
def kda_intra_kernel(q, k, G, beta, Aqk, Akk, cu_seqlens, chunk_indices, scale,
                     H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                     BOUNDED: tl.constexpr, PREC: tl.constexpr):
    """One [BC, BC] block (i, j <= i) of Aqk = (q k^T) and A = beta (k k^T) with pairwise decays."""
    i_t, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_i, i_j = i_p // NC, i_p % NC
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    if i_j > i_i or t0 + i_i * BC >= eos:
        return
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    o_i = t0 + i_i * BC + o_c
    o_j = t0 + i_j * BC + o_c
    m_i, m_j = o_i < eos, o_j < eos
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
            r_m = tl.minimum(t0 + i_i * BC + BC // 2, eos - 1)
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
                m_r = o_k < tl.where(r_j < eos, K, 0)  # (a bool vector & bool scalar breaks the interpreter)
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
def kda_solve_kernel(Akk, Tinv, k, v, G, beta, u, w, cu_seqlens, chunk_indices,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, PREC: tl.constexpr):
    """Tinv = (I + A)^-1 by forward substitution, u = Tinv (beta v), w = Tinv (beta k e^G)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    o_r = tl.arange(0, BT)
    o_t = t0 + o_r
    m_t = o_t < eos
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
def kda_state_kernel(q, k, w, u, G, Aqk, h0, ht, h_all, delta, o, cu_seqlens, chunk_offsets, scale,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, SAVE_H: tl.constexpr,
                     STORE_O: tl.constexpr, PREC: tl.constexpr):
    """The chunk-to-chunk hand-off for one sequence, head and V block: S [K, BV] in fp32."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_s += tl.load(h0 + p_s, mask=m_kv, other=0.).to(tl.float32)
    for i_c in range(0, tl.cdiv(eos - bos, BT)):
        t0 = bos + i_c * BT
        o_t = t0 + o_r
        m_t = o_t < eos
        mtk, mtv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        if SAVE_H:
            p_h = ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
            tl.store(h_all + p_h, b_s, mask=m_kv)
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
        r_l = tl.minimum(t0 + BT, eos) - 1
        b_gl = tl.load(G + (r_l.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_k = tl.load(k + p_tk, mask=mtk, other=0.).to(tl.float32) * tl.exp2(tl.minimum(b_gl[None, :] - b_g, 0.))
        b_s = b_s * tl.exp2(b_gl)[:, None] + tl.dot(tl.trans(b_k), b_d, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + p_s, b_s, mask=m_kv)


@triton.jit
def kda_bwd_state_kernel(q, k, w, G, Aqk, do, dht, dh_all, dh0, ddelta, cu_seqlens, chunk_offsets, scale,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr):
    """Reverse hand-off: dS (gradient of the state leaving each chunk) and ddelta per chunk."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + i_n).to(tl.int32)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int32)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_ds = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_ds += tl.load(dht + p_s, mask=m_kv, other=0.).to(tl.float32)
    n_c = tl.cdiv(eos - bos, BT)
    for i_c in range(n_c - 1, -1, -1):
        t0 = bos + i_c * BT
        o_t = t0 + o_r
        m_t = o_t < eos
        mtk, mtv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        p_h = ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(dh_all + p_h, b_ds, mask=m_kv)
        p_tk = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
        p_tv = (o_t.to(tl.int64)[:, None] * H + i_h) * V + o_v[None, :]
        p_a = (o_t.to(tl.int64)[:, None] * H + i_h) * BT + o_r[None, :]
        b_g = tl.load(G + p_tk, mask=mtk, other=0.)
        r_l = tl.minimum(t0 + BT, eos) - 1
        b_gl = tl.load(G + (r_l.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_kend = tl.load(k + p_tk, mask=mtk, other=0.).to(tl.float32) * tl.exp2(tl.minimum(b_gl[None, :] - b_g, 0.))
        b_qg = tl.load(q + p_tk, mask=mtk, other=0.).to(tl.float32) * scale * tl.exp2(b_g)
        b_w = tl.load(w + p_tk, mask=mtk, other=0.)
        b_aqk = tl.load(Aqk + p_a, mask=m_t[:, None], other=0.)
        b_do = tl.load(do + p_tv, mask=mtv, other=0.).to(tl.float32)
        b_dd = tl.dot(tl.trans(b_aqk), b_do, input_precision=PREC) + tl.dot(b_kend, b_ds, input_precision=PREC)
        tl.store(ddelta + p_tv, b_dd, mask=mtv)
        b_ds = (b_ds * tl.exp2(b_gl)[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC)
                - tl.dot(tl.trans(b_w), b_dd, input_precision=PREC))
    if STORE_DH0:
        tl.store(dh0 + p_s, b_ds, mask=m_kv)


@triton.jit
def kda_bwd_chunk_kernel(q, k, v, beta, G, Tinv, u, w, delta, h_all, dh_all, do, ddelta,
                         dq_p, dk_p, dg_p, db_p, dv, dAqk, dAkk, cu_seqlens, chunk_indices, scale,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: every gradient that needs the chunk's entering state h and leaving-state grad dh.

    Writes dv, the masked dAqk and dA for the intra kernel, and partial dq, dk, dG, dbeta.
    """
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    o_r = tl.arange(0, BT)
    o_t = t0 + o_r
    m_t = o_t < eos
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    mtk = m_t[:, None] & m_k[None, :]
    p_a = (o_t.to(tl.int64)[:, None] * H + i_h) * BT + o_r[None, :]
    b_inv = tl.load(Tinv + p_a, mask=m_t[:, None], other=0.)
    b_b = tl.load(beta + o_t.to(tl.int64) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    b_dqg = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_dkend = tl.zeros([BT, BK], dtype=tl.float32)
    b_dgl = tl.zeros([BK], dtype=tl.float32)
    b_daqk = tl.zeros([BT, BT], dtype=tl.float32)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        mtv = m_t[:, None] & m_v[None, :]
        p_tv = (o_t.to(tl.int64)[:, None] * H + i_h) * V + o_v[None, :]
        p_h = (i_t.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.load(h_all + p_h, mask=m_k[:, None] & m_v[None, :], other=0.)
        b_dh = tl.load(dh_all + p_h, mask=m_k[:, None] & m_v[None, :], other=0.)
        b_do = tl.load(do + p_tv, mask=mtv, other=0.).to(tl.float32)
        b_dd = tl.load(ddelta + p_tv, mask=mtv, other=0.)
        b_d = tl.load(delta + p_tv, mask=mtv, other=0.)
        b_u = tl.load(u + p_tv, mask=mtv, other=0.)
        b_v = tl.load(v + p_tv, mask=mtv, other=0.).to(tl.float32)
        b_dqg += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dw -= tl.dot(b_dd, tl.trans(b_h), input_precision=PREC)
        b_dkend += tl.dot(b_d, tl.trans(b_dh), input_precision=PREC)
        b_daqk += tl.dot(b_do, tl.trans(b_d), input_precision=PREC)
        b_dgl += tl.sum(b_h * b_dh, 1)
        # u = Tinv (beta v): d(beta v) = Tinv^T du, and dA gets -d(beta v) u^T.
        b_dbv = tl.dot(tl.trans(b_inv), b_dd, input_precision=PREC)
        tl.store(dv + p_tv, (b_dbv * b_b[:, None]).to(dv.dtype.element_ty), mask=mtv)
        b_db += tl.sum(b_dbv * b_v, 1)
        b_da += tl.dot(b_dbv, tl.trans(b_u), input_precision=PREC)
    p_tk = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    b_w = tl.load(w + p_tk, mask=mtk, other=0.)
    b_dkg = tl.dot(tl.trans(b_inv), b_dw, input_precision=PREC)
    b_da += tl.dot(b_dkg, tl.trans(b_w), input_precision=PREC)
    b_da = tl.where(o_r[:, None] > o_r[None, :], -b_da, 0.)
    b_daqk = tl.where(o_r[:, None] >= o_r[None, :], b_daqk, 0.)
    tl.store(dAkk + p_a, b_da, mask=m_t[:, None])
    tl.store(dAqk + p_a, b_daqk, mask=m_t[:, None])

    b_q = tl.load(q + p_tk, mask=mtk, other=0.).to(tl.float32) * scale
    b_k = tl.load(k + p_tk, mask=mtk, other=0.).to(tl.float32)
    b_g = tl.load(G + p_tk, mask=mtk, other=0.)
    r_l = tl.minimum(t0 + BT, eos) - 1
    b_gl = tl.load(G + (r_l.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_eg = tl.exp2(b_g)
    b_eend = tl.exp2(tl.minimum(b_gl[None, :] - b_g, 0.))
    b_dkb = b_dkg * b_eg
    b_kend_term = b_dkend * b_k * b_eend
    b_dg = b_dqg * b_q * b_eg + b_dkb * b_k * b_b[:, None] - b_kend_term
    b_last = tl.sum(b_kend_term, 0) + tl.exp2(b_gl) * b_dgl
    b_dg = tl.where((o_t == r_l)[:, None], b_dg + b_last[None, :], b_dg)
    tl.store(dq_p + p_tk, b_dqg * b_eg, mask=mtk)
    tl.store(dk_p + p_tk, b_dkend * b_eend + b_dkb * b_b[:, None], mask=mtk)
    tl.store(dg_p + p_tk, b_dg, mask=mtk)
    tl.store(db_p + o_t.to(tl.int64) * H + i_h, b_db + tl.sum(b_dkb * b_k, 1), mask=m_t)


@triton.jit
def kda_bwd_intra_kernel(q, k, beta, G, dAqk, dAkk, dq_p, dk_p, dg_p, db_p, dq, dk, dg2, dbeta,
                         cu_seqlens, chunk_indices, scale,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                         BOUNDED: tl.constexpr, PREC: tl.constexpr):
    """Gradients of the pair products for the BC rows of sub-chunk i, added to the partials.

    As the row side: dX_i = sum_j dP_ij Y_j e_ij (j in sub-chunks <= i); as the column side:
    dY_i = sum_r dP_ri X_r e_ri (r in sub-chunks >= i); dG = X dX - Y dY.
    """
    i_t, i_h, i_i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    t0, eos = _chunk_bounds(cu_seqlens, chunk_indices, i_t, BT)
    if t0 + i_i * BC >= eos:
        return
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_i = t0 + i_i * BC + o_c
    m_i = o_i < eos
    mi2 = m_i[:, None] & m_k[None, :]
    p_i = (o_i.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
    b_q = tl.load(q + p_i, mask=mi2, other=0.).to(tl.float32) * scale
    b_k = tl.load(k + p_i, mask=mi2, other=0.).to(tl.float32)
    b_b = tl.load(beta + o_i.to(tl.int64) * H + i_h, mask=m_i, other=0.).to(tl.float32)
    b_kb = b_k * b_b[:, None]
    b_gi = tl.load(G + p_i, mask=mi2, other=0.)
    b_dq = tl.zeros([BC, BK], dtype=tl.float32)
    b_dkb = tl.zeros([BC, BK], dtype=tl.float32)
    b_dk = tl.zeros([BC, BK], dtype=tl.float32)
    # Row side, sub-chunks j < i: anchor at the last token of j.
    for i_j in range(0, i_i):
        o_j = t0 + i_j * BC + o_c
        p_j = (o_j.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
        b_n = tl.load(G + ((t0 + i_j * BC + BC - 1).to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_y = tl.load(k + p_j, mask=m_k[None, :], other=0.).to(tl.float32)
        b_y = b_y * tl.exp2(b_n[None, :] - tl.load(G + p_j, mask=m_k[None, :], other=0.))
        p_a = (o_i.to(tl.int64)[:, None] * H + i_h) * BT + i_j * BC + o_c[None, :]
        b_f = tl.exp2(tl.minimum(b_gi - b_n[None, :], 0.))
        b_dq += tl.dot(tl.load(dAqk + p_a, mask=m_i[:, None], other=0.), b_y, input_precision=PREC) * b_f
        b_dkb += tl.dot(tl.load(dAkk + p_a, mask=m_i[:, None], other=0.), b_y, input_precision=PREC) * b_f
    # Column side, sub-chunks r > i: anchor at the last token of i.
    r_n = tl.minimum(t0 + i_i * BC + BC - 1, eos - 1)
    b_n = tl.load(G + (r_n.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_fy = tl.exp2(tl.minimum(b_n[None, :] - b_gi, 0.))
    for i_r in range(i_i + 1, NC):
        o_r = t0 + i_r * BC + o_c
        m_r = o_r < eos
        mr2 = m_r[:, None] & m_k[None, :]
        p_r = (o_r.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
        b_fr = tl.exp2(tl.minimum(tl.load(G + p_r, mask=mr2, other=0.) - b_n[None, :], 0.))
        b_xq = tl.load(q + p_r, mask=mr2, other=0.).to(tl.float32) * scale * b_fr
        b_br = tl.load(beta + o_r.to(tl.int64) * H + i_h, mask=m_r, other=0.).to(tl.float32)
        b_xk = tl.load(k + p_r, mask=mr2, other=0.).to(tl.float32) * b_br[:, None] * b_fr
        p_a = (o_r.to(tl.int64)[:, None] * H + i_h) * BT + i_i * BC + o_c[None, :]
        b_dpq = tl.load(dAqk + p_a, mask=m_r[:, None], other=0.)
        b_dpk = tl.load(dAkk + p_a, mask=m_r[:, None], other=0.)
        b_dk += (tl.dot(tl.trans(b_dpq), b_xq, input_precision=PREC)
                 + tl.dot(tl.trans(b_dpk), b_xk, input_precision=PREC)) * b_fy
    # The diagonal block.
    p_a = (o_i.to(tl.int64)[:, None] * H + i_h) * BT + i_i * BC + o_c[None, :]
    b_dpq = tl.load(dAqk + p_a, mask=m_i[:, None], other=0.)
    b_dpk = tl.load(dAkk + p_a, mask=m_i[:, None], other=0.)
    if BOUNDED:
        r_m = tl.minimum(t0 + i_i * BC + BC // 2, eos - 1)
        b_m = tl.load(G + (r_m.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
        b_fx = tl.exp2(tl.where(mi2, b_gi - b_m[None, :], 0.))
        b_fy = tl.exp2(tl.where(mi2, b_m[None, :] - b_gi, 0.))
        b_y = b_k * b_fy
        b_dq += tl.dot(b_dpq, b_y, input_precision=PREC) * b_fx
        b_dkb += tl.dot(b_dpk, b_y, input_precision=PREC) * b_fx
        b_dk += (tl.dot(tl.trans(b_dpq), b_q * b_fx, input_precision=PREC)
                 + tl.dot(tl.trans(b_dpk), b_kb * b_fx, input_precision=PREC)) * b_fy
    else:
        for j in range(0, BC):
            r_j = t0 + i_i * BC + j
            p_r = (r_j.to(tl.int64) * H + i_h) * K + o_k
            m_r = o_k < tl.where(r_j < eos, K, 0)  # (a bool vector & bool scalar breaks the interpreter)
            b_kr = tl.load(k + p_r, mask=m_r, other=0.).to(tl.float32)
            b_gr = tl.load(G + p_r, mask=m_r, other=0.)
            b_e = tl.exp2(tl.minimum(b_gi - b_gr[None, :], 0.))  # [BC, BK]: decay from token j to each row
            sel = o_c[None, :] == j
            b_cq = tl.sum(tl.where(sel, b_dpq, 0.), 1)  # column j of dP
            b_ck = tl.sum(tl.where(sel, b_dpk, 0.), 1)
            b_dq += b_cq[:, None] * b_e * b_kr[None, :]
            b_dkb += b_ck[:, None] * b_e * b_kr[None, :]
            b_col = tl.sum((b_cq[:, None] * b_q + b_ck[:, None] * b_kb) * b_e, 0)
            b_dk = tl.where((o_c == j)[:, None], b_dk + b_col[None, :], b_dk)
    b_dqt = tl.load(dq_p + p_i, mask=mi2, other=0.) + b_dq
    b_dkt = tl.load(dk_p + p_i, mask=mi2, other=0.) + b_dk + b_dkb * b_b[:, None]
    b_dg = tl.load(dg_p + p_i, mask=mi2, other=0.) + b_q * b_dq + b_kb * b_dkb - b_k * b_dk
    b_dbt = tl.load(db_p + o_i.to(tl.int64) * H + i_h, mask=m_i, other=0.) + tl.sum(b_dkb * b_k, 1)
    tl.store(dq + p_i, (b_dqt * scale).to(dq.dtype.element_ty), mask=mi2)
    tl.store(dk + p_i, b_dkt.to(dk.dtype.element_ty), mask=mi2)
    tl.store(dg2 + p_i, b_dg, mask=mi2)
    tl.store(dbeta + o_i.to(tl.int64) * H + i_h, b_dbt.to(dbeta.dtype.element_ty), mask=m_i)


@triton.jit
def kda_step_kernel(q, k, v, g, beta, pool, slot_idx, o, scale,
                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One decode token per sequence; its state row of the pool is read and written in place.

    Columns of the state are independent in the delta rule, so V blocks run in parallel.
    """
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_idx + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    p_k = (i_n.to(tl.int64) * H + i_h) * K + o_k
    p_v = (i_n.to(tl.int64) * H + i_h) * V + o_v
    b_s = tl.load(pool + p_s, mask=m_kv, other=0.)
    b_q = tl.load(q + p_k, mask=m_k, other=0.).to(tl.float32) * scale
    b_k = tl.load(k + p_k, mask=m_k, other=0.).to(tl.float32)
    b_g = tl.load(g + p_k, mask=m_k, other=0.).to(tl.float32)
    b_v = tl.load(v + p_v, mask=m_v, other=0.).to(tl.float32)
    b_b = tl.load(beta + i_n.to(tl.int64) * H + i_h).to(tl.float32)
    b_s = b_s * tl.exp(b_g)[:, None]
    b_d = b_b * (b_v - tl.sum(b_k[:, None] * b_s, 0))
    b_s = b_s + b_k[:, None] * b_d[None, :]
    tl.store(pool + p_s, b_s, mask=m_kv)
    tl.store(o + p_v, tl.sum(b_q[:, None] * b_s, 0).to(o.dtype.element_ty), mask=m_v)


# ---------------------------------------------------------------------------------------------
# Launchers.


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _blocks(K: int, V: int) -> tuple[int, int]:
    """BK covers all of K (<= 256); BV keeps the [BK, BV] fp32 state block at <= 8K values."""
    BK = _pow2(K)
    return BK, min(_pow2(V), max(16, 8192 // BK))


# Software pipelining multiplies the shared memory of the state kernels past H100/H200's 227 KB.
_SEQ = dict(num_stages=1)


def _prec(*xs: torch.Tensor) -> str:
    return "tf32x3" if all(x.dtype == torch.float32 for x in xs) else "tf32"


class _Meta:
    """Index tables of a packed batch for chunk size BT: cu [N + 1] int32, chunk_indices
    [NT, 2] int32 (sequence, chunk within it), chunk_offsets [N + 1] int32 (first chunk of each)."""

    def __init__(self, cu_seqlens: torch.Tensor, BT: int) -> None:
        cu = cu_seqlens.to(torch.int32)
        n_chunks = (cu[1:] - cu[:-1] + BT - 1) // BT
        offsets = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)])
        self.NT = int(offsets[-1])
        self.N = cu.numel() - 1
        seq = torch.repeat_interleave(torch.arange(self.N, device=cu.device), n_chunks.long(), output_size=self.NT)
        within = torch.arange(self.NT, device=cu.device) - offsets[:-1].long()[seq]
        self.cu = cu.contiguous()
        self.chunk_indices = torch.stack([seq, within], 1).to(torch.int32).contiguous()
        self.chunk_offsets = offsets.to(torch.int32).contiguous()
        self.BT = BT


def _fwd(q, k, v, g, beta, scale, h0, meta: _Meta, bounded: bool, want_final: bool):
    """q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H] (contiguous). Returns o, final, saved."""
    T, H, K = k.shape
    V = v.shape[-1]
    BT, NT, N = meta.BT, meta.NT, meta.N
    BC = min(16, BT)
    BK, BV = _blocks(K, V)
    prec = _prec(q, k, v)
    dev = k.device
    G = torch.empty(T, H, K, dtype=torch.float32, device=dev)
    Aqk = torch.zeros(T, H, BT, dtype=torch.float32, device=dev)
    Akk = torch.zeros(T, H, BT, dtype=torch.float32, device=dev)
    Tinv = torch.empty(T, H, BT, dtype=torch.float32, device=dev)
    u = torch.empty(T, H, V, dtype=torch.float32, device=dev)
    w = torch.empty(T, H, K, dtype=torch.float32, device=dev)
    o = torch.empty_like(v)
    delta = torch.empty(T, H, V, dtype=torch.float32, device=dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if want_final else None
    if NT:
        kda_cumsum_kernel[(NT, H)](g, G, meta.cu, meta.chunk_indices, LOG2E, H=H, K=K, BT=BT, BK=BK, REVERSE=False)
        kda_intra_kernel[(NT, H, (BT // BC) ** 2)](
            q, k, G, beta, Aqk, Akk, meta.cu, meta.chunk_indices, scale,
            H=H, K=K, BT=BT, BC=BC, BK=BK, BOUNDED=bounded, PREC=prec)
        kda_solve_kernel[(NT, H)](Akk, Tinv, k, v, G, beta, u, w, meta.cu, meta.chunk_indices,
                                  H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, PREC=prec, **_SEQ)
    if N:
        kda_state_kernel[(N, H, triton.cdiv(V, BV))](
            q, k, w, u, G, Aqk, h0 if h0 is not None else w, ht if ht is not None else w, w, delta, o,
            meta.cu, meta.chunk_offsets, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_H0=h0 is not None, STORE_HT=want_final, SAVE_H=False, STORE_O=True, PREC=prec, **_SEQ)
    elif want_final:
        ht.zero_()
    return o, ht, (G, Aqk, Tinv, u, w)


def _bwd(q, k, v, g, beta, scale, h0, meta: _Meta, bounded: bool, saved, do, dht):
    T, H, K = k.shape
    V = v.shape[-1]
    BT, NT, N = meta.BT, meta.NT, meta.N
    BC = min(16, BT)
    BK, BV = _blocks(K, V)
    prec = _prec(q, k, v)
    dev = k.device
    G, Aqk, Tinv, u, w = saved
    f32 = dict(dtype=torch.float32, device=dev)
    h_all = torch.empty(NT, H, K, V, **f32)
    delta = torch.empty(T, H, V, **f32)
    dh_all = torch.empty(NT, H, K, V, **f32)
    ddelta = torch.empty(T, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    grid_s = (N, H, triton.cdiv(V, BV))
    if N:
        # Recompute the state entering every chunk rather than keep [NT, H, K, V] alive since forward.
        kda_state_kernel[grid_s](
            q, k, w, u, G, Aqk, h0 if h0 is not None else w, w, h_all, delta, w,
            meta.cu, meta.chunk_offsets, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_H0=h0 is not None, STORE_HT=False, SAVE_H=True, STORE_O=False, PREC=prec, **_SEQ)
        kda_bwd_state_kernel[grid_s](
            q, k, w, G, Aqk, do, dht if dht is not None else w, dh_all, dh0 if dh0 is not None else w, ddelta,
            meta.cu, meta.chunk_offsets, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
            USE_DHT=dht is not None, STORE_DH0=dh0 is not None, PREC=prec, **_SEQ)
    dq_p, dk_p, dg_p = (torch.empty(T, H, K, **f32) for _ in range(3))
    db_p = torch.empty(T, H, **f32)
    dAqk = torch.empty(T, H, BT, **f32)
    dAkk = torch.empty(T, H, BT, **f32)
    dq, dk, dv, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    dg2 = torch.empty(T, H, K, **f32)
    dg = torch.empty(T, H, K, **f32)
    if NT:
        kda_bwd_chunk_kernel[(NT, H)](
            q, k, v, beta, G, Tinv, u, w, delta, h_all, dh_all, do, ddelta, dq_p, dk_p, dg_p, db_p, dv, dAqk, dAkk,
            meta.cu, meta.chunk_indices, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, PREC=prec, **_SEQ)
        kda_bwd_intra_kernel[(NT, H, BT // BC)](
            q, k, beta, G, dAqk, dAkk, dq_p, dk_p, dg_p, db_p, dq, dk, dg2, dbeta,
            meta.cu, meta.chunk_indices, scale, H=H, K=K, BT=BT, BC=BC, BK=BK, BOUNDED=bounded, PREC=prec)
        kda_cumsum_kernel[(NT, H)](dg2, dg, meta.cu, meta.chunk_indices, 1.0, H=H, K=K, BT=BT, BK=BK, REVERSE=True)
    return dq, dk, dv, dg.to(g.dtype), dbeta, dh0


class _ChunkKDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, meta, scale, bounded, want_final):
        o, ht, saved = _fwd(q, k, v, g, beta, scale, h0, meta, bounded, want_final)
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved)
        ctx.meta, ctx.scale, ctx.bounded = meta, scale, bounded
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _bwd(
            q, k, v, g, beta, ctx.scale, h0, ctx.meta, ctx.bounded, saved, do.contiguous(),
            None if dht is None else dht.contiguous())
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None


def chunk_kda_triton(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, lower_bound):
    """Triton chunked KDA; the contract of `k3.kernels.kda.chunk_kda` (inputs already checked).

    chunk_size: 16, 32 or 64 tokens per chunk (other sizes run with 64; the result is the same).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = chunk_size if chunk_size in (16, 32, 64) else 64
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=k.device)
    meta = _Meta(cu_seqlens, BT)
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o, ht = _ChunkKDATriton.apply(*flat, h0, meta, scale, lower_bound is not None, output_final_state)
    return o.view(B, T, H, V), ht


def kda_step_triton(q, k, v, g, beta, state_pool, slot_idx, scale):
    """Triton decode step over pool slots; the contract of `k3.kernels.kda.kda_step` (inputs checked)."""
    N, H, K = k.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    if N:
        BK, BV = _blocks(K, V)
        kda_step_kernel[(N, H, triton.cdiv(V, BV))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
            slot_idx.contiguous(), o, scale, H=H, K=K, V=V, BK=BK, BV=BV)
    return o
