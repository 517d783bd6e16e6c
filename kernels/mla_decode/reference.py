"""Readable absorbed MLA decode over a paged latent cache.

With W_uk folded into the query (q_lat = W_uk^T q_nope, done by the caller), one decode query
per sequence attends over the cached latents directly:

    score_s = scale * (q_lat . c_s + q_rope . r_s),   ctx = sum_s softmax(score)_s c_s

The caller maps ctx through W_uv and applies the output gate.
"""
from __future__ import annotations

import torch


def naive_mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q_lat [N, H, L], q_rope [N, H, R], kv_cache [num_blocks, block_size, L + R],
    block_table [N, max_blocks], seq_lens [N] -> ctx [N, H, L] in q_lat's dtype (fp32 softmax)."""
    N, H, L = q_lat.shape
    bs = kv_cache.shape[1]
    out = []
    for n in range(N):
        T = int(seq_lens[n])
        pos = torch.arange(T, device=kv_cache.device)
        rows = kv_cache[block_table[n, pos // bs], pos % bs].float()  # [T, L + R]
        c, r = rows[:, :L], rows[:, L:]
        score = (q_lat[n].float() @ c.T + q_rope[n].float() @ r.T) * scale  # [H, T]
        out.append(torch.softmax(score, dim=-1) @ c)
    return torch.stack(out).to(q_lat.dtype)
