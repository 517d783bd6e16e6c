"""KDA's decode step in Triton: one token per sequence, its state row of the slot pool updated in place."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_fwd import block_sizes


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


def kda_step_triton(q, k, v, g, beta, state_pool, slot_idx, scale):
    """Triton decode step over pool slots; the contract of `k3.kernels.kda.kda_step` (inputs checked)."""
    N, H, K = k.shape
    V = v.shape[-1]
    o = torch.empty_like(v)
    if N:
        BK, BV = block_sizes(K, V)
        kda_step_kernel[(N, H, triton.cdiv(V, BV))](
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state_pool,
            slot_idx.contiguous(), o, scale, H=H, K=K, V=V, BK=BK, BV=BV)
    return o
