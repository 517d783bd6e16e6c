"""KDA's chunked backward in Triton: state recompute -> bwd state -> bwd chunk -> bwd intra -> reverse cumsum.

- state recompute (triton_fwd's state kernel): h, the state entering every chunk, rather than
  keep [NT, H, K, V] alive since the forward.
- bwd state: reverse over a sequence's chunks: dh (the gradient of the state leaving each
  chunk) and ddelta.
- bwd chunk: per chunk, everything that needs h and dh: dv, dA, dAqk and partial dq, dk, dg, dbeta.
- bwd intra: the pair-product gradients by sub-chunk, added to the partials.
- reverse cumsum: dg from the gradient of the cumulative decay.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunks import ChunkTable
from .triton_fwd import SEQUENTIAL, block_sizes, chunk_span, dot_precision, kda_cumsum_kernel, kda_state_kernel


@triton.jit
def kda_bwd_state_kernel(q, k, w, G, Aqk, do, dht, dh_all, dh0, ddelta, chunks, seq_chunks, scale,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr):
    """Reverse hand-off: dS (gradient of the state leaving each chunk) and ddelta per chunk."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    c_lo = tl.load(seq_chunks + i_n).to(tl.int64)  # int64: h offsets reach NT * H * K * V
    c_hi = tl.load(seq_chunks + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_r = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_n.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    b_ds = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_ds += tl.load(dht + p_s, mask=m_kv, other=0.).to(tl.float32)
    for i_c in range(c_hi - 1, c_lo - 1, -1):
        t0, t1 = chunk_span(chunks, i_c)
        o_t = t0 + o_r
        m_t = o_t < t1
        mtk, mtv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        p_h = (i_c * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(dh_all + p_h, b_ds, mask=m_kv)
        p_tk = (o_t.to(tl.int64)[:, None] * H + i_h) * K + o_k[None, :]
        p_tv = (o_t.to(tl.int64)[:, None] * H + i_h) * V + o_v[None, :]
        p_a = (o_t.to(tl.int64)[:, None] * H + i_h) * BT + o_r[None, :]
        b_g = tl.load(G + p_tk, mask=mtk, other=0.)
        r_l = t1 - 1
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
                         dq_p, dk_p, dg_p, db_p, dv, dAqk, dAkk, chunks, scale,
                         H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                         BV: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: every gradient that needs the chunk's entering state h and leaving-state grad dh.

    Writes dv, the masked dAqk and dA for the intra kernel, and partial dq, dk, dG, dbeta.
    """
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    t0, t1 = chunk_span(chunks, i_t)
    o_r = tl.arange(0, BT)
    o_t = t0 + o_r
    m_t = o_t < t1
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
    r_l = t1 - 1
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
                         chunks, scale,
                         H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                         BOUNDED: tl.constexpr, PREC: tl.constexpr):
    """Gradients of the pair products for the BC rows of sub-chunk i, added to the partials.

    As the row side: dX_i = sum_j dP_ij Y_j e_ij (j in sub-chunks <= i); as the column side:
    dY_i = sum_r dP_ri X_r e_ri (r in sub-chunks >= i); dG = X dX - Y dY.
    """
    i_t, i_h, i_i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    t0, t1 = chunk_span(chunks, i_t)
    if t0 + i_i * BC >= t1:
        return
    o_c = tl.arange(0, BC)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_i = t0 + i_i * BC + o_c
    m_i = o_i < t1
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
    r_n = tl.minimum(t0 + i_i * BC + BC - 1, t1 - 1)
    b_n = tl.load(G + (r_n.to(tl.int64) * H + i_h) * K + o_k, mask=m_k, other=0.)
    b_fy = tl.exp2(tl.minimum(b_n[None, :] - b_gi, 0.))
    for i_r in range(i_i + 1, NC):
        o_r = t0 + i_r * BC + o_c
        m_r = o_r < t1
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
        r_m = tl.minimum(t0 + i_i * BC + BC // 2, t1 - 1)
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
            m_r = o_k < tl.where(r_j < t1, K, 0)  # (a bool vector & bool scalar breaks the interpreter)
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


def chunk_bwd(q, k, v, g, beta, scale: float, h0, table: ChunkTable, bounded: bool, saved, do, dht):
    """Gradients of `chunk_fwd` (same inputs, `saved` its third result, do and dht contiguous or
    dht None): dq, dk, dv, dg, dbeta in the inputs' dtypes and dh0 (None without h0)."""
    T, H, K = k.shape
    V = v.shape[-1]
    BT, NT, N = table.size, table.num_chunks, table.num_seqs
    BC = min(16, BT)
    BK, BV = block_sizes(K, V)
    prec = dot_precision(q, k, v)
    G, Aqk, Tinv, u, w = saved
    f32 = dict(dtype=torch.float32, device=k.device)
    h_all, dh_all = torch.empty(NT, H, K, V, **f32), torch.empty(NT, H, K, V, **f32)
    delta, ddelta = torch.empty(T, H, V, **f32), torch.empty(T, H, V, **f32)
    dh0 = torch.empty(N, H, K, V, **f32) if h0 is not None else None
    grid_s = (N, H, triton.cdiv(V, BV))
    every = torch.arange(NT, dtype=torch.int32, device=k.device)
    kda_state_kernel[grid_s](
        q, k, w, u, G, Aqk, h0 if h0 is not None else w, w, h_all, every, delta, w,
        table.bounds, table.first, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_H0=h0 is not None, STORE_HT=False, SAVE_H=True, STORE_O=False, PREC=prec, **SEQUENTIAL)
    kda_bwd_state_kernel[grid_s](
        q, k, w, G, Aqk, do, dht if dht is not None else w, dh_all, dh0 if dh0 is not None else w, ddelta,
        table.bounds, table.first, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
        USE_DHT=dht is not None, STORE_DH0=dh0 is not None, PREC=prec, **SEQUENTIAL)
    dq_p, dk_p, dg_p, dg2, dg = (torch.empty(T, H, K, **f32) for _ in range(5))
    db_p = torch.empty(T, H, **f32)
    dAqk, dAkk = torch.empty(T, H, BT, **f32), torch.empty(T, H, BT, **f32)
    dq, dk, dv, dbeta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta)
    kda_bwd_chunk_kernel[(NT, H)](
        q, k, v, beta, G, Tinv, u, w, delta, h_all, dh_all, do, ddelta, dq_p, dk_p, dg_p, db_p, dv, dAqk, dAkk,
        table.bounds, scale, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV, PREC=prec, **SEQUENTIAL)
    kda_bwd_intra_kernel[(NT, H, BT // BC)](
        q, k, beta, G, dAqk, dAkk, dq_p, dk_p, dg_p, db_p, dq, dk, dg2, dbeta,
        table.bounds, scale, H=H, K=K, BT=BT, BC=BC, BK=BK, BOUNDED=bounded, PREC=prec)
    kda_cumsum_kernel[(NT, H)](dg2, dg, table.bounds, 1.0, H=H, K=K, BT=BT, BK=BK, REVERSE=True)
    return dq, dk, dv, dg.to(g.dtype), dbeta, dh0
