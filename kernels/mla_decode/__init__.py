"""Absorbed MLA attention for decode over the paged latent cache.

`mla_decode` checks its inputs and runs a batched torch path (gather the pages of every
sequence, masked softmax); `naive_mla_decode` is the per-sequence reference.
"""
from __future__ import annotations

import torch

from .reference import naive_mla_decode

__all__ = ["mla_decode", "naive_mla_decode"]


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"mla_decode: {name} {msg}")


def mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its cached latents.

    Args:
        q_lat: [N, H, L] query with W_uk absorbed; q_rope: [N, H, R].
        kv_cache: [num_blocks, block_size, L + R] latents (c_kv then the rope key).
        block_table: [N, max_blocks] int block ids; positions p of sequence n live at
            kv_cache[block_table[n, p // block_size], p % block_size].
        seq_lens: [N] tokens cached per sequence (>= 1, the current token included).
        scale: softmax scale (qk_head_dim ** -0.5).
    Returns:
        ctx: [N, H, L] in q_lat's dtype.
    """
    if q_lat.dim() != 3:
        _fail("q_lat", f"must be [N, H, L], got {tuple(q_lat.shape)}")
    N, H, L = q_lat.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (N, H):
        _fail("q_rope", f"must be [N, H, R] = [{N}, {H}, R], got {tuple(q_rope.shape)}")
    R = q_rope.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != L + R:
        _fail("kv_cache", f"must be [num_blocks, block_size, {L + R}], got {tuple(kv_cache.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] != N or block_table.dtype not in (torch.int32, torch.int64):
        _fail("block_table", f"must be an integer [N={N}, max_blocks] tensor, got {tuple(block_table.shape)} {block_table.dtype}")
    if seq_lens.shape != (N,):
        _fail("seq_lens", f"must be [N={N}], got {tuple(seq_lens.shape)}")
    for name, x in (("q_rope", q_rope), ("kv_cache", kv_cache), ("block_table", block_table), ("seq_lens", seq_lens)):
        if x.device != q_lat.device:
            _fail(name, f"is on {x.device} but q_lat is on {q_lat.device}")
    if N == 0:
        return q_lat.new_zeros(N, H, L)
    bs = kv_cache.shape[1]
    lens = seq_lens.long()
    if int(lens.min()) < 1:
        _fail("seq_lens", f"must be >= 1, got min {int(lens.min())}")
    if int(lens.max()) > block_table.shape[1] * bs:
        _fail("seq_lens", f"max {int(lens.max())} exceeds block_table capacity {block_table.shape[1] * bs}")
    T = int(lens.max())
    n_blk = (T + bs - 1) // bs
    used = block_table[:, :n_blk].long()
    valid_blocks = torch.arange(n_blk, device=lens.device)[None] * bs < lens[:, None]
    if bool(((used < 0) | (used >= kv_cache.shape[0]))[valid_blocks].any()):
        _fail("block_table", f"holds a block id outside [0, {kv_cache.shape[0]})")
    rows = kv_cache[used.clamp(0, kv_cache.shape[0] - 1)].reshape(N, n_blk * bs, L + R)[:, :T].float()
    c, r = rows[..., :L], rows[..., L:]
    score = (torch.einsum("nhl,ntl->nht", q_lat.float(), c) + torch.einsum("nhr,ntr->nht", q_rope.float(), r)) * scale
    mask = torch.arange(T, device=lens.device)[None, :] < lens[:, None]
    score = score.masked_fill(~mask[:, None, :], float("-inf"))
    ctx = torch.einsum("nht,ntl->nhl", torch.softmax(score, dim=-1), c)
    return ctx.to(q_lat.dtype)
