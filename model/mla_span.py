"""MLA over latents, in key slices with an online softmax: the keys never exist all at once.

Attention for MLA needs per-head keys and values, which are the latents expanded through
kv_b_proj: H x (nope + rope + v) values a key against the latent's kv_lora + rope. Expanding a
whole span of keys costs that much memory per key, and when autograd keeps it for the backward
it is kept per key for the whole step. Here the keys are expanded one slice at a time:

- forward: for each key slice, expand it, then for each block of queries that sees any of it,
  scores in fp32 and an online softmax (a running max and sum rescale what came before). Keeps
  only the queries, the latents, the output and each query's log-sum-exp.
- backward (`LatentSpanAttention`): the slices again, each expanded again, the softmax
  recomputed from the log-sum-exp (the flash-attention backward): gradients of the queries,
  of the latents and of kv_b_proj's weight, without any [queries, keys] tensor beyond one tile.

Users: a context-parallel piece's queries over the latents of every piece before it
(`GatedMLA.forward_shard`: the last of C ranks reaches back over the whole sequence), and a
prefill chunk over a long cached context (`GatedMLA._sliced_chunk`, no gradient).

Spans say who sees what: (q0, q1, k0, k1) = queries [q0, q1) see keys [k0, k1), causally aligned
at the bottom right (query q0 + i sees keys k0 .. k1 - (q1 - q0) + i), one span per document.
"""
from __future__ import annotations

from typing import Callable

import torch

Span = tuple[int, int, int, int]
# A tile's scores are [H, q_block, k_slice] fp32 values, at most TILE_SCORES of them (2 MiB: on a
# CPU, tiles of 1-8 MiB ran about as fast as SDPA's fused kernel over the same span, 16-64 MiB
# tiles 1.2-1.7x slower; docs/benchmarks.md). A slice of K_SLICE keys is expanded at once.
TILE_SCORES = 2**19
K_SLICE = 512


def expand_latents(rows: torch.Tensor, w_kv: torch.Tensor, dims: tuple[int, int, int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents [s, L + R] -> keys [H, s, nope + rope], values [H, s, v], with kv_b_proj's
    weight w_kv [H * (nope + v), L]; dims = (H, nope, rope, v). The rope key is shared by every
    head."""
    H, nope, rope, vdim = dims
    c, r = rows.split([rows.shape[-1] - rope, rope], dim=-1)
    k_nope, v = (c @ w_kv.t()).unflatten(-1, (H, nope + vdim)).split([nope, vdim], -1)
    k = torch.cat([k_nope, r[:, None, :].expand(-1, H, rope)], dim=-1)
    return k.transpose(0, 1), v.transpose(0, 1)


def _tiles(span: Span, q_block: int, k_slice: int):
    """The (key slice, query block, needs a mask) tiles of one span that see anything: per key
    slice [s0, s1), each query block [a, b) whose last query reaches s0."""
    q0, q1, k0, k1 = span
    diag = k1 - (q1 - q0)  # query q0 + i sees keys up to diag + i
    for s0 in range(k0, k1, k_slice):
        s1 = min(k1, s0 + k_slice)
        blocks = [(a, min(q1, a + q_block)) for a in range(q0, q1, q_block)]
        yield s0, s1, [(a, b, s1 - 1 > diag + (a - q0)) for a, b in blocks if diag + (b - 1 - q0) >= s0]


def _hidden(span: Span, a: int, b: int, s0: int, s1: int, device: torch.device) -> torch.Tensor:
    """[b - a, s1 - s0] True where query a.. cannot see key s0.. (past the bottom-right diagonal)."""
    q0, q1, k0, k1 = span
    diag = k1 - (q1 - q0)
    return torch.arange(s0, s1, device=device)[None, :] > diag + torch.arange(a - q0, b - q0, device=device)[:, None]


def acc_dtype(q: torch.Tensor) -> torch.dtype:
    """Scores, softmax and sums in fp32 at least (fp64 inputs stay fp64)."""
    return torch.promote_types(q.dtype, torch.float32)


def block_sizes(heads: int, queries: int, keys: int) -> tuple[int, int]:
    """(q_block, k_slice): key slices of K_SLICE, query blocks for a tile of at most TILE_SCORES
    fp32 scores."""
    k_slice = max(1, min(K_SLICE, keys))
    return max(1, min(queries, TILE_SCORES // (heads * k_slice))), k_slice


def sliced_attention(q: torch.Tensor, rows: Callable[[int, int], torch.Tensor], expand, spans: list[Span],
                     scale: float, vdim: int, q_block: int, k_slice: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, n, dqk]; rows(s0, s1) -> latents [s1 - s0, L + R]; expand(latents) -> (keys, values)
    per head ([H, s, *]), or one pair every head shares ([s, *]: one matmul for all heads). Returns
    the output [H, n, v] and the log-sum-exp [H, n], both in fp32 (fp64 for fp64 q). Every query of a
    span sees at least one key (k1 - k0 >= q1 - q0), rows outside every span stay zero."""
    H, n, _ = q.shape
    f = acc_dtype(q)
    qf = q.to(f)
    m = q.new_full((H, n, 1), float("-inf"), dtype=f)
    total = torch.zeros(H, n, 1, dtype=f, device=q.device)
    acc = torch.zeros(H, n, vdim, dtype=f, device=q.device)
    for span in spans:
        for s0, s1, blocks in _tiles(span, q_block, k_slice):
            if not blocks:
                continue
            k, v = expand(rows(s0, s1))
            kt, vf = k.to(f).transpose(-2, -1), v.to(f)
            for a, b, masked in blocks:
                score = torch.matmul(qf[:, a:b], kt).mul_(scale)  # [H, b - a, s1 - s0]
                if masked:
                    score.masked_fill_(_hidden(span, a, b, s0, s1, q.device)[None], float("-inf"))
                m_new = torch.maximum(m[:, a:b], score.amax(-1, keepdim=True))  # finite: key k0 is seen
                p = score.sub_(m_new).exp_()
                alpha = torch.exp(m[:, a:b] - m_new)
                total[:, a:b] = total[:, a:b] * alpha + p.sum(-1, keepdim=True)
                acc[:, a:b] = acc[:, a:b] * alpha + torch.matmul(p, vf)
                m[:, a:b] = m_new
    seen = total > 0
    out = torch.where(seen, acc / total.clamp_min(1e-30), 0.0)
    lse = torch.where(seen, m + torch.log(total.clamp_min(1e-30)), 0.0).squeeze(-1)
    return out, lse


class LatentSpanAttention(torch.autograd.Function):
    """q [H, n, dqk], lat [S, L + R], w_kv [H * (nope + v), L] -> [H, n, v] in q's dtype, the
    keys and values expanded slice by slice in the forward and again in the backward."""

    @staticmethod
    def forward(ctx, q, lat, w_kv, spans, dims, scale):
        H, _, _, vdim = dims
        q_block, k_slice = block_sizes(H, q.shape[1], lat.shape[0])
        out, lse = sliced_attention(q, lambda s0, s1: lat[s0:s1], lambda r: expand_latents(r, w_kv, dims),
                                    spans, scale, vdim, q_block, k_slice)
        ctx.save_for_backward(q, lat, w_kv, out, lse)
        ctx.spans, ctx.dims, ctx.scale, ctx.blocks = spans, dims, scale, (q_block, k_slice)
        return out.to(q.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out):
        q, lat, w_kv, out, lse = ctx.saved_tensors
        q_block, k_slice = ctx.blocks
        f = acc_dtype(q)
        qf, do = q.to(f), d_out.to(f)
        delta = (do * out).sum(-1, keepdim=True)  # [H, n, 1]: rowsum(dO * O)
        dq = torch.zeros_like(qf)
        d_lat = torch.zeros(lat.shape, dtype=f, device=lat.device)
        d_w = torch.zeros(w_kv.shape, dtype=f, device=w_kv.device)
        for span in ctx.spans:
            for s0, s1, blocks in _tiles(span, q_block, k_slice):
                if not blocks:
                    continue
                with torch.enable_grad():
                    rows, w = lat[s0:s1].detach().requires_grad_(), w_kv.detach().requires_grad_()
                    k, v = expand_latents(rows, w, ctx.dims)
                kf, vf = k.detach().to(f), v.detach().to(f)
                dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
                for a, b, masked in blocks:
                    score = torch.matmul(qf[:, a:b], kf.transpose(1, 2)).mul_(ctx.scale)
                    p = score.sub_(lse[:, a:b, None]).exp_()  # the forward's softmax, recomputed
                    if masked:
                        p.masked_fill_(_hidden(span, a, b, s0, s1, q.device)[None], 0.0)
                    dv += torch.matmul(p.transpose(1, 2), do[:, a:b])
                    ds = p.mul_(torch.matmul(do[:, a:b], vf.transpose(1, 2)).sub_(delta[:, a:b]))
                    dq[:, a:b] += torch.matmul(ds, kf).mul_(ctx.scale)
                    dk += torch.matmul(ds.transpose(1, 2), qf[:, a:b]).mul_(ctx.scale)
                g_rows, g_w = torch.autograd.grad((k, v), (rows, w), (dk.to(k.dtype), dv.to(v.dtype)))
                d_lat[s0:s1] += g_rows.to(f)
                d_w += g_w.to(f)
        return dq.to(q.dtype), d_lat.to(lat.dtype), d_w.to(w_kv.dtype), None, None, None


def latent_span_attention(q: torch.Tensor, lat: torch.Tensor, w_kv: torch.Tensor, spans: list[Span],
                          dims: tuple[int, int, int, int], scale: float) -> torch.Tensor:
    """Queries [H, n, nope + rope] over latents [S, L + R] by spans (module docstring) ->
    [H, n, v] in q's dtype; differentiable in q, lat and w_kv."""
    H, nope, rope, vdim = dims
    if q.dim() != 3 or q.shape[0] != H or q.shape[2] != nope + rope:
        raise ValueError(f"latent_span_attention: q has shape {tuple(q.shape)}, expected [{H}, n, {nope + rope}]")
    if lat.dim() != 2 or lat.shape[1] != w_kv.shape[1] + rope:
        raise ValueError(f"latent_span_attention: lat has shape {tuple(lat.shape)}, expected [S, {w_kv.shape[1] + rope}]")
    for q0, q1, k0, k1 in spans:
        if not (0 <= q0 <= q1 <= q.shape[1] and 0 <= k0 <= k1 <= lat.shape[0] and k1 - k0 >= q1 - q0):
            raise ValueError(f"latent_span_attention: span {(q0, q1, k0, k1)} does not fit {q.shape[1]} queries "
                             f"and {lat.shape[0]} keys (each query needs its own key)")
    return LatentSpanAttention.apply(q, lat, w_kv, spans, dims, scale)
