"""Gated Multi-head Latent Attention with NoPE.

Keys and values come from a compressed latent c_kv (kv_lora_rank) plus one shared key slice
(qk_rope_head_dim) that exists but is never rotated (NoPE): 576 values per token in K3, which is
all the cache holds. Two forms:

- naive: expand the latents through kv_b_proj into per-head keys and values, then softmax
  attention (training and cache-free prefill; packed sequences get a block-diagonal causal mask);
- absorbed: fold W_uk into the query and W_uv after the softmax, attending over the latents
  themselves (`k3.kernels.mla_decode`), used whenever there is a cache to read.

The K3 output gate multiplies each head's output by sigmoid(g_proj x) before o_proj.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.mla_decode import mla_decode

from .config import K3Config
from .norm import RMSNorm


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

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        context_lens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, D], or [1, T, D] packed with cu_seqlens [N + 1].

        With a cache (kv_cache [blocks, block_size, L + R], block_table [N, max_blocks],
        context_lens [N] tokens cached before this call) the new latents are written at positions
        context_len, context_len + 1, ... of each sequence and attention runs in the absorbed form;
        a sequence with no context and more than one token uses the naive form instead.
        """
        B, T, _ = x.shape
        lat = self.latent(x)  # [B, T, L + R]
        if kv_cache is None:
            return self._naive(x, lat, cu_seqlens)
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (B + 1) * T, T, device=x.device)
        xt, latt = x.reshape(B * T, -1), lat.reshape(B * T, -1)
        N = cu_seqlens.numel() - 1
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=B * T)
        pos = torch.arange(B * T, device=x.device) - cu_seqlens[:-1][seq] + context_lens[seq]
        bs = kv_cache.shape[1]
        blocks = block_table[seq, pos // bs].long()
        kv_cache[blocks, pos % bs] = latt.detach().to(kv_cache.dtype)
        if int(context_lens.max()) == 0:  # fresh prefill: the naive form is cheaper
            return self._naive(x, lat, cu_seqlens if B == 1 else None)
        q_nope, q_rope = self.query(xt)  # [BT, H, *]
        W_uk, W_uv = self._w_kv()
        q_lat = torch.einsum("nhd,hdl->nhl", q_nope, W_uk)  # [BT, H, L]
        if int(lengths.max()) == 1:  # pure decode: one paged-attention call for the whole batch
            ctx = mla_decode(q_lat, q_rope, kv_cache, block_table, pos + 1, self.scale)
        else:
            ctx = torch.empty_like(q_lat)
            one = (lengths == 1).nonzero().flatten()
            if one.numel():
                rows = cu_seqlens[:-1][one]
                ctx[rows] = mla_decode(q_lat[rows], q_rope[rows], kv_cache, block_table[one], pos[rows] + 1, self.scale)
            for i in (lengths > 1).nonzero().flatten().tolist():
                a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
                ctx[a:b] = self._absorbed_chunk(q_lat[a:b], q_rope[a:b], kv_cache, block_table[i], int(context_lens[i]))
        o = torch.einsum("nhl,hvl->nhv", ctx, W_uv)
        return self._finish(o, xt).reshape(B, T, -1)

    def _absorbed_chunk(self, q_lat: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                        table: torch.Tensor, context: int, tile: int = 512) -> torch.Tensor:
        """Several new tokens of one sequence over its cached latents (context tokens before them).

        Reads the sequence's pages once and tiles the queries so memory stays at
        H x tile x (context + n) scores, however long the context."""
        n = q_lat.shape[0]
        total = context + n
        bs = kv_cache.shape[1]
        pos = torch.arange(total, device=q_lat.device)
        rows = kv_cache[table[pos // bs].long(), pos % bs].float()  # [S, L + R]
        c, r = rows[:, : self.lora], rows[:, self.lora:]
        out = torch.empty(n, self.num_heads, self.lora, dtype=torch.float32, device=q_lat.device)
        for a in range(0, n, tile):
            b = min(n, a + tile)
            score = (torch.einsum("nhl,sl->nhs", q_lat[a:b].float(), c)
                     + torch.einsum("nhr,sr->nhs", q_rope[a:b].float(), r)) * self.scale
            visible = pos[None, :] <= (context + torch.arange(a, b, device=q_lat.device))[:, None]  # [tile, S]
            score = score.masked_fill(~visible[:, None, :], float("-inf"))
            out[a:b] = torch.einsum("nhs,sl->nhl", torch.softmax(score, dim=-1), c)
        return out.to(q_lat.dtype)

    def _naive(self, x: torch.Tensor, lat: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        H = self.num_heads
        q_nope, q_rope = self.query(x)
        c, r = lat.split([self.lora, self.rope], dim=-1)
        kv = self.kv_b_proj(c).unflatten(-1, (H, self.nope + self.vdim))
        k_nope, v = kv.split([self.nope, self.vdim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # [B, H, T, dqk]
        k = torch.cat([k_nope, r[:, :, None, :].expand(B, T, H, self.rope)], dim=-1).transpose(1, 2)
        v = v.transpose(1, 2)
        dqk = q.shape[-1]
        if self.vdim < dqk:
            # SDPA's fused (flash) kernels need equal q/k/v head dims; without them it materialises
            # the [T, T] scores (16 GB at 32K tokens). Zero columns leave the output unchanged.
            v = F.pad(v, (0, dqk - self.vdim))
        if cu_seqlens is None or cu_seqlens.numel() <= 2:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        elif T > 4096:  # long packed batch: one causal (fused) call per sequence, no [T, T] mask
            o = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                          scale=self.scale)
                           for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if b > a], dim=2)
        else:
            seg = torch.repeat_interleave(
                torch.arange(cu_seqlens.numel() - 1, device=x.device), cu_seqlens[1:] - cu_seqlens[:-1], output_size=T
            )
            idx = torch.arange(T, device=x.device)
            mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self._finish(o[..., : self.vdim].transpose(1, 2), x)
