"""Absorbed MLA decode in batched torch: the CPU path.

All sequences at once, the context in slices of CHUNK tokens with an online softmax (as the
Triton kernel does with its tiles), so memory stays at one slice's fp32 copy of the latents
whatever the context: 32K tokens of 576 values would otherwise be a 75 MB fp32 copy per step.
Each slice is one page gather, one matmul for the scores against [q_lat | q_rope] (the latent
and its rope key are adjacent in the cache row) and one matmul for the context.
"""
from __future__ import annotations

import torch

CHUNK = 4096  # tokens per slice
# Traced by torch.compile (the engine's decode graphs), a context of up to this many tokens is read
# in one slice: the table's width stays a symbolic size, so one graph serves every width up to
# it (a loop over slices would fix the width in the graph). Its fp32 copy of the latents is
# 64K x (L + R) x 4 bytes per sequence at most, per MLA layer's step, with the masked copy and the
# scores beside it: 21 MB a sequence for k3-tiny's 80 values a token (336 MB for a batch of 16),
# 151 MB for K3's 576 (on a GPU K3 decodes through the Triton kernel, not this path).
TRACED_SLICE = 1 << 16


def mla_decode_torch(q_lat, q_rope, kv_cache, page_table, seq_lens, scale, w_uv=None, gate=None, max_len=None):
    """The contract of `k3.kernels.mla_decode.mla_decode` (inputs already checked; max_len is
    seq_lens' max when the caller already has it on the host)."""
    N, H, L = q_lat.shape
    ps = kv_cache.shape[1]
    lens = seq_lens.long()
    T = int(lens.max()) if max_len is None else max_len
    q = torch.cat([q_lat, q_rope], dim=-1).float()  # [N, H, L + R]
    m = q.new_full((N, H, 1), float("-inf"))
    s = q.new_zeros(N, H, 1)
    acc = q.new_zeros(N, H, L)
    step = max(ps, CHUNK // ps * ps)  # whole pages per slice
    if torch.compiler.is_dynamo_compiling() and T <= TRACED_SLICE:
        slices = [(0, page_table.shape[1])]
    else:
        slices = [(t0 // ps, min((T + ps - 1) // ps, (t0 + step) // ps)) for t0 in range(0, T, step)]
    for p0, p1 in slices:
        t0 = p0 * ps
        # Pages past a sequence's end may hold any id (they are masked); clamp so the gather is safe.
        ids = page_table[:, p0:p1].long().clamp(0, kv_cache.shape[0] - 1)
        rows = kv_cache[ids].reshape(N, (p1 - p0) * ps, -1).float()  # [N, tokens, L + R]
        pos = t0 + torch.arange(rows.shape[1], device=lens.device)
        valid = pos[None, :] < lens[:, None]  # [N, tokens]
        # Rows past a sequence's end may hold anything (a reused page, NaN): mask them to zero, as
        # a zero softmax weight times NaN would still be NaN.
        rows = rows.masked_fill(~valid[..., None], 0.0)
        score = torch.matmul(q, rows.transpose(1, 2)).mul_(scale)  # [N, H, tokens]
        score.masked_fill_(~valid[:, None, :], float("-inf"))
        m_new = torch.maximum(m, score.amax(-1, keepdim=True))
        # A slice wholly past a short sequence's end leaves its row at -inf: keep exp() finite.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(score - m_safe)
        alpha = torch.exp(m - m_safe)
        s = s * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, rows[..., :L])
        m = m_new
    return finish(acc / s, q_lat.dtype, w_uv, gate)


def finish(ctx: torch.Tensor, dtype: torch.dtype, w_uv, gate) -> torch.Tensor:
    """ctx [N, H, L] fp32 -> W_uv, then the output gate (both optional), in `dtype`."""
    if w_uv is not None:
        ctx = torch.einsum("nhl,hvl->nhv", ctx, w_uv.float())
        if gate is not None:
            ctx = ctx * torch.sigmoid(gate.float())
    return ctx.to(dtype)
