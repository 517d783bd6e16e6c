"""Readable absorbed MLA decode over a paged latent cache.

With W_uk folded into the query (q_lat = W_uk^T q_nope, done by the caller), one decode query
per sequence attends over the cached latents directly:

    score_s = scale * (q_lat . c_s + q_rope . r_s),   ctx = sum_s softmax(score)_s c_s

and the value projection and the output gate come after the softmax:

    o = sigmoid(gate) * (W_uv ctx)            (each optional; the gate needs W_uv)
"""
from __future__ import annotations

import torch


def naive_mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_uv: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """q_lat [N, H, L], q_rope [N, H, R], kv_cache [num_pages, page_size, L + R],
    page_table [N, max_pages], seq_lens [N], w_uv [H, Vd, L], gate [N, H, Vd] (pre-sigmoid)
    -> ctx [N, H, L], or o [N, H, Vd] with w_uv; in q_lat's dtype (fp32 math)."""
    N, H, L = q_lat.shape
    ps = kv_cache.shape[1]
    out = []
    for n in range(N):
        T = int(seq_lens[n])
        pos = torch.arange(T, device=kv_cache.device)
        rows = kv_cache[page_table[n, pos // ps].long(), pos % ps].float()  # [T, L + R]
        c, r = rows[:, :L], rows[:, L:]
        score = (q_lat[n].float() @ c.T + q_rope[n].float() @ r.T) * scale  # [H, T]
        o = torch.softmax(score, dim=-1) @ c  # [H, L]
        if w_uv is not None:
            o = torch.einsum("hl,hvl->hv", o, w_uv.float())
            if gate is not None:
                o = o * torch.sigmoid(gate[n].float())
        out.append(o)
    if not out:
        return q_lat.new_zeros(0, H, L if w_uv is None else w_uv.shape[1])
    return torch.stack(out).to(q_lat.dtype)
