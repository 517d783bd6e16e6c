"""Absorbed MLA attention for decode over the paged latent cache.

`mla_decode` checks its inputs and dispatches: Triton (flash-decoding over the page table) on
CUDA, a batched torch path on CPU. `naive_mla_decode` is the per-sequence reference with the
same signature. With `w_uv` the value projection is applied after the softmax, and with `gate`
the output gate after that, so a layer can hand over everything between q_lat and o_proj.
"""
from __future__ import annotations

from typing import NoReturn

import torch

from ..dispatch import check_scale, eager, fail, use_triton
from .cpu import finish, mla_decode_torch
from .reference import naive_mla_decode

__all__ = ["mla_decode", "naive_mla_decode"]

MAX_TRITON_LATENT = 1024  # L and R each held as one block per program
MAX_TRITON_ROPE = 256


def _fail(name: str, msg: str) -> NoReturn:
    fail("mla_decode", name, msg)


def _use_triton(x: torch.Tensor, backend: str | None, L: int, R: int) -> bool:
    if not use_triton("mla_decode", x, backend):
        return False
    if L > MAX_TRITON_LATENT:
        _fail("q_lat", f"latent dim {L} is not supported by the Triton kernel (max {MAX_TRITON_LATENT})")
    if R > MAX_TRITON_ROPE:
        _fail("q_rope", f"rope dim {R} is not supported by the Triton kernel (max {MAX_TRITON_ROPE})")
    return True


def mla_decode(
    q_lat: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_uv: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """One query per sequence over its cached latents.

    Args:
        q_lat: [N, H, L] query with W_uk absorbed; q_rope: [N, H, R].
        kv_cache: [num_pages, page_size, L + R] latents (c_kv then the rope key); any strides
            with the last dim contiguous.
        page_table: [N, max_pages] int page ids, in any order; positions p of sequence n live
            at kv_cache[page_table[n, p // page_size], p % page_size].
        seq_lens: [N] tokens cached per sequence (>= 1, the current token included).
        scale: softmax scale (qk_head_dim ** -0.5), finite and > 0; required.
        w_uv: optional [H, Vd, L]; then o = W_uv ctx per head.
        gate: optional [N, H, Vd] output-gate logits (needs w_uv); then o = sigmoid(gate) * o.
        backend: None (Triton on CUDA, torch on CPU), "torch" or "triton".
    Returns:
        ctx [N, H, L], or o [N, H, Vd] with w_uv; in q_lat's dtype (fp32 softmax and sums).
    """
    _check_shapes(q_lat, q_rope, kv_cache, page_table, seq_lens, w_uv, gate)
    scale = check_scale("mla_decode", scale, None)  # no default: the qk head dim is not L + R
    N, H, L = q_lat.shape
    if N == 0:
        return q_lat.new_zeros(N, H, L if w_uv is None else w_uv.shape[1])
    # In a captured graph the longest sequence is not known on the host: attend over the page
    # table's whole capacity (masked past each sequence's length).
    hi = _check_pages(kv_cache, page_table, seq_lens) if eager() else page_table.shape[1] * kv_cache.shape[1]
    if _use_triton(q_lat, backend, L, q_rope.shape[2]):
        from .triton import mla_decode_triton

        ctx = mla_decode_triton(q_lat, q_rope, kv_cache, page_table, seq_lens, scale, max_len=hi)
        return finish(ctx, q_lat.dtype, w_uv, gate)
    return mla_decode_torch(q_lat, q_rope, kv_cache, page_table, seq_lens, scale, w_uv, gate, max_len=hi)


def _check_shapes(q_lat, q_rope, kv_cache, page_table, seq_lens, w_uv, gate) -> None:
    for name, x in (("q_lat", q_lat), ("q_rope", q_rope), ("kv_cache", kv_cache), ("page_table", page_table),
                    ("seq_lens", seq_lens)):
        if not isinstance(x, torch.Tensor):
            _fail(name, f"must be a tensor, got {type(x).__name__}")
    if q_lat.dim() != 3 or not q_lat.is_floating_point():
        _fail("q_lat", f"must be a floating [N, H, L] tensor, got {tuple(q_lat.shape)} {q_lat.dtype}")
    N, H, L = q_lat.shape
    if q_rope.dim() != 3 or q_rope.shape[:2] != (N, H) or not q_rope.is_floating_point():
        _fail("q_rope", f"must be a floating [N, H, R] = [{N}, {H}, R] tensor, got {tuple(q_rope.shape)}")
    R = q_rope.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != L + R or not kv_cache.is_floating_point():
        _fail("kv_cache", f"must be a floating [num_pages, page_size, {L + R}] tensor, got {tuple(kv_cache.shape)}")
    if kv_cache.stride(2) != 1:
        _fail("kv_cache", f"must be contiguous in its last dim, got strides {kv_cache.stride()}")
    if page_table.dim() != 2 or page_table.shape[0] != N or page_table.dtype not in (torch.int32, torch.int64):
        _fail("page_table", f"must be an integer [N={N}, max_pages] tensor, got {tuple(page_table.shape)} {page_table.dtype}")
    if seq_lens.shape != (N,) or seq_lens.dtype not in (torch.int32, torch.int64):
        _fail("seq_lens", f"must be an integer [N={N}] tensor, got {tuple(seq_lens.shape)} {seq_lens.dtype}")
    if w_uv is not None:
        if not isinstance(w_uv, torch.Tensor) or w_uv.dim() != 3 or w_uv.shape[0] != H or w_uv.shape[2] != L:
            _fail("w_uv", f"must be a [H={H}, Vd, L={L}] tensor, got {getattr(w_uv, 'shape', type(w_uv).__name__)}")
    if gate is not None:
        if w_uv is None:
            _fail("gate", "is applied after W_uv; pass w_uv too")
        if not isinstance(gate, torch.Tensor) or gate.shape != (N, H, w_uv.shape[1]):
            _fail("gate", f"must be [N, H, Vd] = [{N}, {H}, {w_uv.shape[1]}], got {getattr(gate, 'shape', None)}")
    for name, x in (("q_rope", q_rope), ("kv_cache", kv_cache), ("page_table", page_table), ("seq_lens", seq_lens),
                    ("w_uv", w_uv), ("gate", gate)):
        if x is not None and x.device != q_lat.device:
            _fail(name, f"is on {x.device} but q_lat is on {q_lat.device}")


def _check_pages(kv_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor) -> int:
    """Every cached position has a page in the cache; returns max(seq_lens) (one host sync)."""
    ps = kv_cache.shape[1]
    lens = seq_lens.long()
    lo, hi = (int(x) for x in torch.aminmax(lens))
    if lo < 1:
        _fail("seq_lens", f"must be >= 1, got min {lo}")
    if hi > page_table.shape[1] * ps:
        _fail("seq_lens", f"max {hi} exceeds page_table capacity {page_table.shape[1]} pages x {ps}")
    n_pages = (hi + ps - 1) // ps
    used = page_table[:, :n_pages].long()
    cached = torch.arange(n_pages, device=lens.device)[None] * ps < lens[:, None]
    if bool(((used < 0) | (used >= kv_cache.shape[0]))[cached].any()):
        _fail("page_table", f"holds a page id outside [0, {kv_cache.shape[0]}) for a cached position")
    return hi
