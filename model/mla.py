"""Gated Multi-head Latent Attention with NoPE.

Keys and values come from a compressed latent c_kv (kv_lora_rank) plus one shared key slice
(qk_rope_head_dim) that exists but is never rotated (NoPE): 576 values per token in K3, which is
all the cache holds. Two forms:

- naive: expand the latents through kv_b_proj into per-head keys and values, then softmax
  attention (training and cache-free prefill; packed sequences get a block-diagonal causal mask);
  over a piece of a stream split over processes (`forward_shard`, context parallelism), the
  latents of every piece are all-gathered and expanded here;
- absorbed: fold W_uk into the query and W_uv after the softmax, attending over the latents
  themselves: decode (`k3.kernels.mla_decode`) and short chunks over a cache (every head's
  queries against the shared latents, slice by slice);
- expanded over a cache: a prefill chunk over cached context expands the context's latents
  per chunk (cheaper than absorbed once the chunk has a few dozen tokens): one SDPA call while
  the keys fit one slice, else slice by slice with an online softmax, so a chunk's working
  memory does not grow with the context.

The K3 output gate multiplies each head's output by sigmoid(g_proj x) before o_proj.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.mla_decode import mla_decode

from .cache import CacheBatch
from .config import K3Config
from .mla_span import expand_latents, latent_span_attention, sliced_attention
from .norm import RMSNorm
from .shard import SequenceShard

# The expanded form over a long context runs in slices of whole pages with an online softmax
# (model/mla_span.py), so a chunk's working memory stays bounded whatever the context: fp32 scores
# [H, n, slice] of at most SCORE_BUDGET values, and at most SLICE_MAX_TOKENS context rows expanded
# at once. (One SDPA call over 128K tokens of context would materialise its lower-right causal
# mask, [n, S] as bool and as float: 1.3 GB for a 2,048-token chunk on CPU, 16x the k3-tiny cache
# it attends over.)
SCORE_BUDGET = 2**22
SLICE_MAX_TOKENS = 4096


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        D, H = cfg.hidden_size, cfg.num_heads
        self.num_heads = H
        self.nope, self.rope, self.vdim, self.lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.lora, cfg.mla_norm_eps)
        self.kv_b_proj = nn.Linear(self.lora, H * (self.nope + self.vdim), bias=False)
        if cfg.mla_output_gate:
            self.g_proj = nn.Linear(D, H * self.vdim, bias=False)
        self.o_proj = nn.Linear(H * self.vdim, D, bias=False)
        # Where a chunk over a cached context costs the same in both forms: per key, n * H * (2L + R)
        # multiply-adds in the absorbed form against L * H * (nope + v) to expand the key plus
        # n * H * (nope + rope + v) to attend in the expanded form (n = 64 for k3-tiny, 170 for K3).
        wide = 2 * self.lora + self.rope - (self.nope + self.rope + self.vdim)
        self.absorb_below = self.lora * (self.nope + self.vdim) // wide if wide > 0 else 2**31

    def reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.cfg.initializer_range)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q_nope [..., H, nope], q_rope [..., H, rope]."""
        q = self.q_proj(x) if self.cfg.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.unflatten(-1, (self.num_heads, self.cfg.qk_head_dim))
        return q[..., : self.nope], q[..., self.nope:]

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache stores per token: [..., kv_lora + rope] = normalised c_kv, then the rope key."""
        c, r = self.kv_a_proj_with_mqa(x).split([self.lora, self.rope], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), r], dim=-1)

    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope + self.vdim))  # [H, nope + v, L]
        return w[:, : self.nope], w[:, self.nope:]  # W_uk [H, nope, L], W_uv [H, v, L]

    def _finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o: [..., H, v] -> gated, projected [..., D]."""
        if self.cfg.mla_output_gate:
            gate = self.g_proj(x).unflatten(-1, (self.num_heads, self.vdim))
            o = o * torch.sigmoid(gate.float()).to(o.dtype)
        return self.o_proj(o.flatten(-2))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """Cache-free (training, tests): x [B, T, D], or [1, T, D] packed with cu_seqlens [N + 1]."""
        return self._naive(x, self.latent(x), cu_seqlens)

    def forward_cached(self, x: torch.Tensor, cache: CacheBatch) -> torch.Tensor:
        """x [1, T, D] packed per cache.cu_seqlens. Writes the new latents into this layer's pages
        at positions context_len, context_len + 1, ... of each sequence, then attends:
        - no sequence has a context: the naive form over the new tokens (one fused SDPA);
        - a decode batch: the absorbed form over the pages (`mla_decode`, one call);
        - otherwise per sequence: one-token rows in one `mla_decode` call, chunks of a few dozen
          tokens or more (`absorbs`) over a context in the expanded form (the cached latents expanded
          through kv_b_proj once for the chunk; one SDPA call with lower-right causal masking, or
          slices with an online softmax over a long context), shorter chunks in the absorbed form
          (the queries in the latent width against the cached latents themselves, in slices).
        """
        B, T, _ = x.shape
        pages = cache.mla_pages[self.layer_idx]
        cu, context = cache.cu_seqlens, cache.context_lens
        lat = self.latent(x)  # [B, T, L + R]
        xt, latt = x.reshape(B * T, -1), lat.reshape(B * T, -1)
        N = cu.numel() - 1
        if cache.decode:
            seq = torch.arange(N, device=x.device)
            pos = context
        else:
            lengths = cu[1:] - cu[:-1]
            seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=B * T)
            pos = torch.arange(B * T, device=x.device) - cu[:-1][seq] + context[seq]
        ps = pages.shape[1]
        pages[cache.page_table[seq, pos // ps], pos % ps] = latt.detach().to(pages.dtype)
        if not cache.decode and cache.max_context == 0:  # fresh prefill: the naive form is cheaper
            return self._naive(x, lat, cu if B == 1 else None)
        q_nope, q_rope = self.query(xt)  # [BT, H, *]
        W_uk, W_uv = self._w_kv()
        if cache.decode:
            q_lat = torch.einsum("nhd,hdl->nhl", q_nope, W_uk)  # [N, H, L]
            ctx = mla_decode(q_lat, q_rope, pages, cache.page_table, pos + 1, self.scale)
            return self._finish(torch.einsum("nhl,hvl->nhv", ctx, W_uv), xt).reshape(B, T, -1)
        out = torch.empty(B * T, self.num_heads, self.vdim, dtype=x.dtype, device=x.device)
        cu_h, ctx_h = cu.tolist(), context.tolist()
        ones = [i for i in range(N) if cu_h[i + 1] - cu_h[i] == 1]
        if ones:
            rows = torch.tensor([cu_h[i] for i in ones], device=x.device)
            q_lat = torch.einsum("nhd,hdl->nhl", q_nope[rows], W_uk)
            ctx = mla_decode(q_lat, q_rope[rows], pages, cache.page_table[ones], pos[rows] + 1, self.scale)
            out[rows] = torch.einsum("nhl,hvl->nhv", ctx, W_uv).to(x.dtype)
        for i in range(N):
            a, b = cu_h[i], cu_h[i + 1]
            if b - a < 2:
                continue
            table = cache.page_table[i]
            if ctx_h[i] == 0 or not self.absorbs(b - a, ctx_h[i] + b - a, pages.shape[1]):
                out[a:b] = self._expanded_chunk(q_nope[a:b], q_rope[a:b], pages, table, ctx_h[i])
            else:
                q_lat = torch.einsum("nhd,hdl->nhl", q_nope[a:b], W_uk)
                ctx = self._absorbed_chunk(q_lat, q_rope[a:b], pages, table, ctx_h[i])
                out[a:b] = torch.einsum("nhl,hvl->nhv", ctx, W_uv).to(x.dtype)
        return self._finish(out, xt).reshape(B, T, -1)

    def _expanded_chunk(self, q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor,
                        table: torch.Tensor, context: int) -> torch.Tensor:
        """n new tokens of one sequence over context + n cached latents, in the expanded form.

        Expanding the context through kv_b_proj costs context x L x H(nope + v) once per chunk, and
        the attention then runs at the per-head widths (qk nope + rope, v) instead of the latent
        width (L + R): for a chunk of more than a few dozen tokens that is far cheaper than the
        absorbed form (K3: 192 + 128 per head against 576 + 512). One SDPA call when the keys fit
        one slice, else slices with an online softmax (`_sliced_chunk`). Returns [n, H, v]."""
        n = q_nope.shape[0]
        S = context + n
        slice_len = self.slice_tokens(n, pages.shape[1])
        if S > slice_len:
            return self._sliced_chunk(q_nope, q_rope, pages, table, context, slice_len)
        k, v = self._expand(self._gather(pages, table, 0, S).to(q_nope.dtype))
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)[None]  # [1, H, n, dqk]
        k, v = k[None], v[None]
        dqk = q.shape[-1]
        if self.vdim < dqk:  # equal head dims keep SDPA on its fused kernel (see _naive)
            v = F.pad(v, (0, dqk - self.vdim))
        # Query i (0-based in the chunk) sees keys 0 .. context + i: causal, aligned bottom-right.
        o = sdpa_bottom_right(q, k, v, self.scale)
        return o[0, :, :, : self.vdim].transpose(0, 1)

    def absorbs(self, n: int, keys: int, page_size: int) -> bool:
        """Whether a chunk of n new tokens over `keys` keys (its context and itself) runs in the
        absorbed form: below `absorb_below` tokens where the expanded form would run in slices too,
        below half that where it would be one fused SDPA call, which computes about twice as fast
        as the slices' unfused softmax over fp32 scores (k3-tiny on a CPU: docs/benchmarks.md)."""
        return n < (self.absorb_below if keys > self.slice_tokens(n, page_size) else self.absorb_below // 2)

    def slice_tokens(self, n: int, page_size: int) -> int:
        """Keys per slice of the sliced expanded form: whole pages, within the score budget."""
        keys = min(SLICE_MAX_TOKENS, SCORE_BUDGET // (self.num_heads * n))
        return max(page_size, keys // page_size * page_size)

    @property
    def _dims(self) -> tuple[int, int, int, int]:
        return self.num_heads, self.nope, self.rope, self.vdim

    def _expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [S, L + R] -> per-head keys [H, S, nope + rope] and values [H, S, v]."""
        return expand_latents(rows, self.kv_b_proj.weight, self._dims)

    def _sliced_chunk(self, q_nope: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor, table: torch.Tensor,
                      context: int, slice_len: int) -> torch.Tensor:
        """The expanded form over the keys in slices of slice_len (whole pages): each slice's
        latents expanded on their own, scores in fp32, an online softmax across slices
        (model/mla_span.py). Returns [n, H, v] in q's dtype."""
        n = q_nope.shape[0]
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(0, 1)  # [H, n, dqk]
        out, _ = sliced_attention(q, lambda s0, s1: self._gather(pages, table, s0, s1).to(q.dtype), self._expand,
                                  [(0, n, 0, context + n)], self.scale, self.vdim, q_block=n, k_slice=slice_len)
        return out.transpose(0, 1).to(q_nope.dtype)

    def _gather(self, pages: torch.Tensor, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Latents [end - start, L + R] of positions start .. end - 1 of a sequence (start on a
        page boundary), from its pages in table order."""
        ps = pages.shape[1]
        p0, p1 = start // ps, -(-end // ps)
        return pages[table[p0:p1].long()].reshape((p1 - p0) * ps, -1)[: end - start]

    def _absorbed_chunk(self, q_lat: torch.Tensor, q_rope: torch.Tensor, pages: torch.Tensor,
                        table: torch.Tensor, context: int) -> torch.Tensor:
        """A few new tokens of one sequence over its cached latents (context tokens before them),
        in the absorbed form: every head's queries in the latent width (q_nope W_uk, q_rope)
        against the latents as they are cached, which serve all heads as keys (latent and rope
        parts) and values (latent part): each score slice and its values one matmul for all heads,
        slices of whole pages within the score budget, an online softmax across them, causal
        bottom-right. Returns [n, H, L] in q_lat's dtype."""
        n = q_lat.shape[0]
        S = context + n
        L = q_lat.shape[-1]
        q = torch.cat([q_lat, q_rope], dim=-1).transpose(0, 1)  # [H, n, L + R]
        out, _ = sliced_attention(q, lambda s0, s1: self._gather(pages, table, s0, s1).to(q.dtype),
                                  lambda rows: (rows, rows[:, :L]), [(0, n, 0, S)], self.scale, L, q_block=n,
                                  k_slice=self.slice_tokens(n, pages.shape[1]))
        return out.transpose(0, 1).to(q_lat.dtype)

    def _naive(self, x: torch.Tensor, lat: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, (k, v) = self._q_heads(x), self._kv_heads(lat)
        if cu_seqlens is None or cu_seqlens.numel() <= 2:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        elif T > 4096 or x.device.type == "cpu":
            # Fused causal calls over the sequences, no [T, T] mask: on CPU the masked kernel costs
            # the whole T x T product (8 x 128 tokens: 11 ms against 1.4 ms, the same values).
            o = self._packed_causal(q, k, v, cu_seqlens.tolist())
        else:
            seg = torch.repeat_interleave(
                torch.arange(cu_seqlens.numel() - 1, device=x.device), cu_seqlens[1:] - cu_seqlens[:-1], output_size=T
            )
            idx = torch.arange(T, device=x.device)
            mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self._finish(o[..., : self.vdim].transpose(1, 2), x)

    def forward_shard(self, x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        """x [1, n, D]: this process's piece of the stream (model/shard.py). Queries are this
        piece's; keys and values expand from every piece's latents, all-gathered (kv_lora + rope
        values a token, far less than per-head keys and values; their gradients go back to the
        pieces that own them). Each document piece attends causally at its stream offset, over the
        keys in slices, each expanded in the forward and again in the backward
        (model/mla_span.py): the step keeps the latents of the keys it reaches, never their
        per-head keys and values."""
        every = shard.gather_stream(self.latent(x)[0])  # [total, L + R]
        spans = shard.attention_spans()
        k0 = min(span[2] for span in spans)  # no query of this piece sees a key before k0
        lat = every[k0:shard.end]
        if lat.shape[0] < every.shape[0]:  # keep only the latents this piece reads, not the whole gather
            lat = lat.clone()
        q = self._q_heads(x)[0]  # [H, n, dqk]
        o = latent_span_attention(q, lat, self.kv_b_proj.weight,
                                  [(a, b, c - k0, d - k0) for a, b, c, d in spans], self._dims, self.scale)
        return self._finish(o.transpose(0, 1)[None], x)

    def _q_heads(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] -> queries [B, H, T, nope + rope]."""
        q_nope, q_rope = self.query(x)
        return torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)

    def _kv_heads(self, lat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [B, S, L + R] -> keys [B, H, S, nope + rope] and values [B, H, S, nope + rope]
        (v zero-padded past v_head_dim)."""
        B, S, _ = lat.shape
        H = self.num_heads
        c, r = lat.split([self.lora, self.rope], dim=-1)
        k_nope, v = self.kv_b_proj(c).unflatten(-1, (H, self.nope + self.vdim)).split([self.nope, self.vdim], -1)
        k = torch.cat([k_nope, r[:, :, None, :].expand(B, S, H, self.rope)], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        dqk = k.shape[-1]
        if self.vdim < dqk:
            # SDPA's fused (flash) kernels need equal q/k/v head dims; without them it materialises
            # the [T, T] scores (16 GB at 32K tokens). Zero columns leave the output unchanged.
            v = F.pad(v, (0, dqk - self.vdim))
        return k, v

    def _packed_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """q, k, v [1, H, T, d] packed per the offsets cu (a list, cu[-1] = T): each sequence
        attends causally to itself. A run of consecutive sequences of one length is one batched
        fused call (a view as [n, H, length, d]); a lone one its own. Returns [1, H, T, d]."""
        H, d = q.shape[1], q.shape[-1]
        outs, a = [], 0
        for length, run in itertools.groupby(end - start for start, end in zip(cu, cu[1:])):
            n = len(list(run))
            if length:
                views = [t[0, :, a:a + n * length].unflatten(1, (n, length)).transpose(0, 1) for t in (q, k, v)]
                o = F.scaled_dot_product_attention(*views, is_causal=True, scale=self.scale)  # [n, H, length, d]
                outs.append(o.transpose(0, 1).reshape(1, H, n * length, d))
            a += n * length
        return torch.cat(outs, dim=2) if outs else q.new_zeros(1, H, 0, d)


def sdpa_bottom_right(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA where the n queries are the last n of the S keys' positions: query i sees keys 0 .. S - n + i.

    What torch's `causal_lower_right` bias does, without importing it off a GPU: importing
    torch.nn.attention.bias imports torch._dynamo, ~2 s in every process that imports the model
    (a CLI, a job's driver, each worker). Off a GPU that bias is the boolean mask built here (its
    fused kernels take it unmaterialised on CUDA only); with n == S it is plain `is_causal`.
    """
    n, S = q.shape[-2], k.shape[-2]
    if n == S:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if q.device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(n, S)
    else:
        mask = torch.ones(n, S, dtype=torch.bool, device=q.device).tril(S - n)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
