"""Triton absorbed MLA decode over the paged latent cache (flash-decoding).

Grid (sequence, block of BH heads, split of the context). Every program walks its share of the
sequence's pages through the page table, TS tokens at a time, with an online softmax: the
latent tile is loaded once and serves all BH heads (the cache is shared by every head, as in
MQA). Splits write unnormalised partial contexts with their running max and sum; a second
kernel merges them. W_uv and the output gate run after, in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BH = 16  # heads per program: tl.dot needs >= 16 rows


@triton.jit
def mla_decode_split_kernel(q_lat, q_rope, kv, page_table, seq_lens, acc_out, ml_out, scale,
                            stride_kp, stride_kt, stride_pt, n_splits,
                            H: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PS: tl.constexpr,
                            BH: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, TS: tl.constexpr,
                            PREC: tl.constexpr):
    i_n, i_hb, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + i_n).to(tl.int32)
    n_pages = tl.cdiv(seq_len, PS)
    per_split = tl.cdiv(n_pages, n_splits)
    p_lo = i_s * per_split
    p_hi = tl.minimum(p_lo + per_split, n_pages)
    o_h = i_hb * BH + tl.arange(0, BH)
    o_l, o_r, o_t = tl.arange(0, BL), tl.arange(0, BR), tl.arange(0, TS)
    m_h, m_l, m_r = o_h < H, o_l < L, o_r < R
    p_q = (i_n.to(tl.int64) * H + o_h[:, None])
    b_ql = tl.load(q_lat + p_q * L + o_l[None, :], mask=m_h[:, None] & m_l[None, :], other=0.).to(tl.float32)
    b_qr = tl.load(q_rope + p_q * R + o_r[None, :], mask=m_h[:, None] & m_r[None, :], other=0.).to(tl.float32)
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BL], dtype=tl.float32)
    for i_p in range(p_lo, p_hi):
        page = tl.load(page_table + i_n.to(tl.int64) * stride_pt + i_p).to(tl.int64)
        for t0 in range(0, PS, TS):
            pos = i_p * PS + t0 + o_t
            m_t = (t0 + o_t < PS) & (pos < seq_len)
            p_row = kv + page * stride_kp + (t0 + o_t).to(tl.int64)[:, None] * stride_kt
            b_c = tl.load(p_row + o_l[None, :], mask=m_t[:, None] & m_l[None, :], other=0.).to(tl.float32)
            b_r = tl.load(p_row + L + o_r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.).to(tl.float32)
            b_s = tl.dot(b_ql, tl.trans(b_c), input_precision=PREC) + tl.dot(b_qr, tl.trans(b_r), input_precision=PREC)
            b_s = tl.where(m_t[None, :], b_s * scale, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, 1))
            # A tile can be all padding (t0 past a short last page): keep its max finite for exp.
            b_mn = tl.where(b_mn == float("-inf"), 0., b_mn)
            b_a = tl.exp(b_m - b_mn)
            b_p = tl.exp(b_s - b_mn[:, None])
            b_l = b_l * b_a + tl.sum(b_p, 1)
            b_acc = b_acc * b_a[:, None] + tl.dot(b_p, b_c, input_precision=PREC)
            b_m = tl.where(tl.sum(b_p, 1) > 0, b_mn, b_m)
    p_o = ((i_n.to(tl.int64) * n_splits + i_s) * H + o_h)
    tl.store(acc_out + p_o[:, None] * L + o_l[None, :], b_acc, mask=m_h[:, None] & m_l[None, :])
    tl.store(ml_out + p_o * 2, b_m, mask=m_h)
    tl.store(ml_out + p_o * 2 + 1, b_l, mask=m_h)


@triton.jit
def mla_decode_merge_kernel(acc_in, ml_in, out, n_splits, H: tl.constexpr, L: tl.constexpr, BL: tl.constexpr):
    """ctx = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the splits of one (sequence, head)."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    o_l = tl.arange(0, BL)
    m_l = o_l < L
    b_big = float("-inf")
    for i_s in range(0, n_splits):
        b_big = tl.maximum(b_big, tl.load(ml_in + ((i_n.to(tl.int64) * n_splits + i_s) * H + i_h) * 2))
    b_acc = tl.zeros([BL], dtype=tl.float32)
    b_sum = 0.
    for i_s in range(0, n_splits):
        p = (i_n.to(tl.int64) * n_splits + i_s) * H + i_h
        b_ms = tl.load(ml_in + p * 2)
        b_w = tl.where(b_ms == float("-inf"), 0., tl.exp(b_ms - b_big))  # empty splits weigh nothing
        b_sum += b_w * tl.load(ml_in + p * 2 + 1)
        b_acc += b_w * tl.load(acc_in + p * L + o_l, mask=m_l, other=0.)
    tl.store(out + (i_n.to(tl.int64) * H + i_h) * L + o_l, b_acc / b_sum, mask=m_l)


def mla_decode_triton(q_lat, q_rope, kv_cache, page_table, seq_lens, scale, num_splits: int | None = None,
                      max_len: int | None = None):
    """ctx [N, H, L] fp32 (inputs already checked; kv_cache's last dim contiguous).

    num_splits: context splits per (sequence, head block); default fills ~2 waves of 132 SMs.
    max_len: seq_lens' max, when the caller already has it on the host (saves a device sync).
    """
    N, H, L = q_lat.shape
    R = q_rope.shape[-1]
    PS = kv_cache.shape[1]
    q_lat, q_rope = q_lat.contiguous(), q_rope.contiguous()
    page_table, seq_lens = page_table.contiguous(), seq_lens.contiguous()
    n_hb = triton.cdiv(H, BH)
    if N and max_len is None:
        max_len = int(seq_lens.max())
    max_pages = max(1, triton.cdiv(max_len, PS)) if N else 1
    if num_splits is None:
        num_splits = min(max_pages, max(1, 264 // max(N * n_hb, 1)))
    acc = torch.empty(N, num_splits, H, L, dtype=torch.float32, device=q_lat.device)
    ml = torch.empty(N, num_splits, H, 2, dtype=torch.float32, device=q_lat.device)
    ctx = torch.empty(N, H, L, dtype=torch.float32, device=q_lat.device)
    if N == 0:
        return ctx
    BL, BR = max(16, triton.next_power_of_2(L)), max(16, triton.next_power_of_2(R))
    TS = min(32 if BL <= 256 else 16, max(16, triton.next_power_of_2(PS)))
    prec = "tf32x3" if q_lat.dtype == torch.float32 and kv_cache.dtype == torch.float32 else "tf32"
    mla_decode_split_kernel[(N, n_hb, num_splits)](
        q_lat, q_rope, kv_cache, page_table, seq_lens, acc, ml, scale,
        kv_cache.stride(0), kv_cache.stride(1), page_table.stride(0), num_splits,
        H=H, L=L, R=R, PS=PS, BH=BH, BL=BL, BR=BR, TS=TS, PREC=prec, num_stages=1)
    mla_decode_merge_kernel[(N, H)](acc, ml, ctx, num_splits, H=H, L=L, BL=BL)
    return ctx
