"""Kimi Delta Attention layer: short convs, per-channel decay gate, delta-rule state, gated output.

Three entry points:
- `forward`: the chunkwise form (`k3.kernels.kda.chunk_kda`) for training and cache-free use,
  optionally continuing from a carried state and over packed sequences (`cu_seqlens`);
- `forward_shard`: this process's piece of a stream split over a group (context parallelism,
  model/shard.py): the conv continues from the previous piece's inputs, the state from the
  pieces before (`k3.kernels.kda.shards`);
- `forward_cached`: against a `CacheBatch` whose owner holds the state in slots: the recurrent
  step (`k3.kernels.kda.kda_step`) for a decode batch, the chunkwise form otherwise (prefill,
  chunked prefill, mixed batches), with snapshots of the state at asked-for offsets read in the
  same chunkwise pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from k3.kernels.dispatch import use_triton
from k3.kernels.kda import chunk_kda, kda_step
from k3.kernels.kda.shards import chunk_kda_shard, fold_shard_states, shard_output

from .cache import CacheBatch, KDAPool, KDASnapshot
from .config import K3Config
from .norm import rms_norm
from .shard import SequenceShard

# A cached forward whose sequences all have at most SHORT_PREFILL new tokens runs SHORT_CHUNK-token
# chunks on the torch path, which pads every chunk to the chunk size: k3-tiny's KDA (4 heads of
# 32) took 2.2-3.1 ms per call for 8-96 tokens at 16 against 3.6-4.5 ms at 64 (and lost at 128);
# a prefix hit's 32-token prefill over 2K cached tokens, 47.8 against 51.6 ms (docs/benchmarks.md).
SHORT_PREFILL, SHORT_CHUNK = 96, 16


@dataclass
class KDAState:
    """What one KDA layer carries per sequence: conv [N, 3*H*K, W-1] and recurrent [N, H, K, V] fp32."""

    conv: torch.Tensor
    recurrent: torch.Tensor


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # x / sqrt(sum x^2 + eps): the convention of fla and transformers' Kimi Linear (not F.normalize).
    xf = x.float()
    return (xf / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _by_taps(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def _depthwise(x: torch.Tensor, weight: torch.Tensor, taps: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y[.., t, :] = sum_w x[.., t + w, :] * weight[:, w]: x [..., L, C], weight [C, W] -> [..., L - W + 1, C].
    On CPU in fp32 as W multiply-adds over token-major rows (`taps`: weight.T made contiguous, if
    the caller has it): the sums conv1d makes, in the same order, 4-9x faster than its kernel on
    this layout (docs/benchmarks.md); conv1d elsewhere (a GPU's, and low precision, which conv1d
    accumulates in fp32)."""
    L, C = x.shape[-2:]
    W = weight.shape[1]
    if not _by_taps(x):
        y = F.conv1d(x.reshape(-1, L, C).transpose(1, 2), weight[:, None, :], groups=C).transpose(1, 2)
        return y.reshape(*x.shape[:-2], L - W + 1, C)
    n = L - W + 1
    taps = weight.T.contiguous() if taps is None else taps  # [W, C]: each tap a contiguous row
    y = torch.mul(x.narrow(-2, 0, n), taps[0], out=out)  # `out` (no autograd): where the rows go
    for w in range(1, W):
        y.addcmul_(x.narrow(-2, w, n), taps[w])
    return y


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over packed sequences, each continuing from its own state.

    x: [T, C] packed tokens; weight: [C, W]; state: [N, C, W-1] (the previous W-1 inputs,
    oldest first) or None for zeros; cu_seqlens: [N + 1]. Returns (y [T, C], new state [N, C, W-1]).
    One conv runs over the whole stream (W-1 zeros before it); only each sequence's first W-1
    rows reach back past its start, and those are redone from windows that begin in its state.
    No host sync.
    """
    T, C = x.shape
    W = weight.shape[1]
    N = cu_seqlens.numel() - 1
    P = W - 1
    w = weight.to(x.dtype)
    taps = w.T.contiguous() if _by_taps(x) else None  # one copy for both convs below
    state = x.new_zeros(N, C, P) if state is None else state.to(x.dtype)
    prev = state.transpose(1, 2)  # [N, P, C]: each sequence's last P inputs before it, oldest first
    if T == 0:
        return x.new_zeros(0, C), state.clone()
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    j = torch.arange(P, device=x.device)
    # the stream, and a spare last row that takes the redone rows a sequence does not have
    if taps is not None and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        # each row before P is among its sequence's first P rows, all redone below: the rest are
        # made in place, with no padded copy of the stream (the same sums; 8 x 128 tokens of
        # kimi8: two passes over a [1,028, 768] tensor a layer fewer)
        y = x.new_empty(T + 1, C)
        if T > P:
            _depthwise(x, w, taps, out=y[P:T])
    else:
        y = _depthwise(F.pad(x, (0, 0, P, 1)), w, taps)  # [T + 1, C]
    # windows of each sequence's first P rows: its state, then its first P tokens (zeros past its end)
    pos = starts[:, None] + j  # [N, P]
    inside = j < lengths[:, None]
    head = torch.where(inside[..., None], x[pos.clamp(max=T - 1)], 0.0)
    redone = _depthwise(torch.cat([prev, head], dim=1), w, taps)  # [N, P, C]
    y.index_copy_(0, torch.where(inside, pos, T).flatten(), redone.flatten(0, 1))
    # the new state: each sequence's last P inputs, from its tokens or, for a short one, its state
    back = lengths[:, None] - P + j  # [N, P]: offset of each in the sequence (< 0: in the state)
    from_x = x[(starts[:, None] + back).clamp(0, T - 1)]
    slot = (back + P).clamp(0, P - 1) + P * torch.arange(N, device=x.device)[:, None]  # a row of prev's N * P
    from_state = prev.reshape(N * P, C).index_select(0, slot.flatten()).view(N, P, C)
    new_state = torch.where((back >= 0)[..., None], from_x, from_state)
    return y[:T], new_state.transpose(1, 2).contiguous()


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3Config, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        self.num_heads, self.head_dim = H, K
        self.qkv_dim = H * K
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * K, bias=False)
        # Depthwise conv weights for q, k and v, stacked: [3*H*K, W].
        self.conv_weight = nn.Parameter(torch.empty(3 * H * K, cfg.kda_conv_size))
        # Decay gate: low rank D -> K -> H*K, per-head rate A, per-channel bias.
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, H * K, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.b_proj = nn.Linear(D, H, bias=False)
        if cfg.kda_output_gate == "full":
            self.g_proj = nn.Linear(D, H * K, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, H * K, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(K))
        self.o_proj = nn.Linear(H * K, D, bias=False)

    def reset_parameters(self) -> None:
        std = self.cfg.initializer_range
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
        nn.init.kaiming_uniform_(self.conv_weight, a=math.sqrt(5))
        with torch.no_grad():
            # Decay rates spread over [1, 16] and dt in [1e-3, 1e-1] (inverse softplus), as in Mamba/fla.
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        nn.init.ones_(self.o_norm_weight)

    def decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log-decay g [..., H, K] in fp32, always < 0."""
        z = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        z = z.unflatten(-1, (self.num_heads, self.head_dim))
        rate = self.A_log.float().exp()[:, None]
        if self.cfg.kda_gate == "bounded":
            return self.cfg.kda_gate_lower_bound * torch.sigmoid(rate * z)
        return -rate * F.softplus(z)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.g_proj(x) if self.cfg.kda_output_gate == "full" else self.g_b_proj(self.g_a_proj(x))
        return gate.unflatten(-1, (self.num_heads, self.head_dim))

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, state: KDAState | None = None,
    ) -> tuple[torch.Tensor, KDAState]:
        """Chunkwise form, no cache owner: x [B, T, D] (or [1, T, D] packed with cu_seqlens [N + 1]),
        each sequence starting from `state` (conv [N, 3HK, W-1], recurrent [N, H, K, V]) or zeros.
        Returns (y [B, T, D], the final state of each sequence)."""
        return self._chunkwise(x, cu_seqlens, state, None)

    def forward_cached(self, x: torch.Tensor, cache: CacheBatch) -> torch.Tensor:
        """x [1, T, D] packed per cache.cu_seqlens: read each sequence's state from its slot in
        this layer's pool, run, write the new state back (in place), record asked-for snapshots.
        A decode batch (one token each) takes the recurrent step; anything else the chunkwise form."""
        pool = cache.kda[self.layer_idx]
        slots = cache.kda_slots
        if cache.decode:
            return self._decode(x.reshape(-1, 1, x.shape[-1]), pool, slots).reshape(x.shape)
        start = KDAState(pool.conv.index_select(0, slots), pool.recurrent.index_select(0, slots))
        y, final = self._chunkwise(x, cache.cu_seqlens, start, cache)
        pool.conv.index_copy_(0, slots, final.conv.to(pool.conv.dtype))
        pool.recurrent.index_copy_(0, slots, final.recurrent)
        return y

    def forward_shard(self, x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        """x [1, n, D]: this process's piece of the stream (see model/shard.py). Every process of
        the group calls it for the same layer; y [1, n, D] is what the whole stream's forward gives
        on these tokens."""
        P = self.cfg.kda_conv_size - 1
        cu = shard.local_cu_seqlens(x.device)
        qkv_in = self._qkv_in(x[0])
        # The first document piece's conv window reaches into the previous piece's last inputs.
        prev = shard.previous_rows(qkv_in, P).T[None]  # [1, 3HK, P]
        conv0 = torch.cat([prev, prev.new_zeros(cu.numel() - 2, *prev.shape[1:])])
        qkv, _ = causal_conv1d(qkv_in, self.conv_weight, conv0, cu)
        q, k, v, g, beta = self._inputs(qkv, x)
        piece = chunk_kda_shard(q, k, v, g, beta, cu_seqlens=cu, continues=shard.continues,
                                chunk_size=self.cfg.kda_chunk_size, lower_bound=self._lower_bound())
        V = v.shape[-1]
        every = shard.gather(torch.cat([piece.state, piece.transition], dim=-1))  # [C, H, K, V + K] fp32
        h_in = fold_shard_states(every[..., :V], every[..., V:], shard.rank)
        return self._out(shard_output(piece, h_in, v.dtype), x)

    def _qkv_in(self, xt: torch.Tensor) -> torch.Tensor:
        """[N, D] -> the pre-conv q, k, v projections side by side [N, 3HK]. Without autograd and
        past D rows (a prefill chunk) one matmul over the three weights side by side:
        concatenating them costs less than concatenating the outputs (1,024 rows of kimi8: 3.0 ->
        2.4 ms, the same values). Training keeps three (autograd would keep the concatenated
        weight for the backward, a [3HK, D] tensor a layer), and so do a decode batch and any
        traced graph."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        # dynamo first: under a trace the row count is symbolic, and comparing it would add a guard
        if not torch.compiler.is_dynamo_compiling() and not torch.is_grad_enabled() and xt.shape[0] > xt.shape[1]:
            return F.linear(xt, torch.cat([p.weight for p in projs]))
        return torch.cat([p(xt) for p in projs], dim=-1)

    def _inputs(self, qkv: torch.Tensor, x: torch.Tensor):
        """Post-conv qkv [B*T, 3HK] and x [B, T, D] -> chunk_kda's q, k (L2-normalised), v, g, beta."""
        B, T, _ = x.shape
        q, k, v = F.silu(qkv).reshape(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        return l2norm(q), l2norm(k), v, self.decay(x), torch.sigmoid(self.b_proj(x).float())

    def _lower_bound(self) -> float | None:
        return self.cfg.kda_gate_lower_bound if self.cfg.kda_gate == "bounded" else None

    def _chunkwise(self, x, cu_seqlens, state, cache: CacheBatch | None):
        """The chunkwise form over x [B, T, D] (packed when cu_seqlens is given); with a cache, the
        snapshots it asks for are read in the same pass (chunk_kda's states_at) and recorded."""
        B, T, D = x.shape
        conv_cu = torch.arange(0, (B + 1) * T, T, device=x.device) if cu_seqlens is None else cu_seqlens
        qkv_in = self._qkv_in(x.reshape(B * T, D))
        qkv, conv_state = causal_conv1d(qkv_in, self.conv_weight, None if state is None else state.conv, conv_cu)
        q, k, v, g, beta = self._inputs(qkv, x)
        o, final, snapshots = chunk_kda(
            q, k, v, g, beta, initial_state=None if state is None else state.recurrent, output_final_state=True,
            cu_seqlens=cu_seqlens, chunk_size=self._chunk_size(cache), lower_bound=self._lower_bound(),
            states_at=cache.snapshot_offsets if cache is not None else None,
        )
        starts, pre_conv = (conv_cu.tolist(), qkv_in.detach()) if snapshots else ([], None)
        for (i, c), recurrent in sorted(snapshots.items()):
            conv = self._snapshot_window(i, c, starts[i], pre_conv, state)
            cache.record_snapshot(self.layer_idx, KDASnapshot(i, c, recurrent, conv))
        return self._out(o, x), KDAState(conv=conv_state, recurrent=final)

    def _chunk_size(self, cache: CacheBatch | None) -> int:
        """The config's chunk size, but SHORT_CHUNK for a cached forward of short sequences on the
        torch path (a prefix hit's tail, a conversation's new turn: tens of tokens that paid for a
        64-token chunk each). Only rounding differs."""
        if cache is not None and 0 < cache.max_new <= SHORT_PREFILL and \
                self.cfg.kda_chunk_size > SHORT_CHUNK and not use_triton("kda", cache.cu_seqlens, None):
            return SHORT_CHUNK
        return self.cfg.kda_chunk_size

    def _snapshot_window(self, i: int, c: int, a: int, qkv_in: torch.Tensor, state) -> torch.Tensor:
        """The conv state of sequence i (starting at flat token a) after its first c new tokens:
        the last W-1 pre-conv inputs, reaching into the state it came in with."""
        W1 = self.cfg.kda_conv_size - 1
        conv0 = qkv_in.new_zeros(qkv_in.shape[1], W1) if state is None else state.conv[i].to(qkv_in.dtype)
        return torch.cat([conv0, qkv_in[a:a + c].T], dim=-1)[:, -W1:].clone()

    def _decode(self, x: torch.Tensor, pool: KDAPool, slot_idx: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        H, K = self.num_heads, self.head_dim
        xt = x[:, 0]
        qkv = self._qkv_in(xt)  # [B, 3HK]
        conv = pool.conv.index_select(0, slot_idx)  # [B, C, W-1]
        window = torch.cat([conv, qkv[..., None].to(conv.dtype)], dim=-1)  # [B, C, W]
        y = (window * self.conv_weight.to(window.dtype)).sum(-1).to(x.dtype)
        pool.conv.index_copy_(0, slot_idx, window[..., 1:])
        q, k, v = F.silu(y).reshape(B, 3, H, K).unbind(1)
        q, k = l2norm(q), l2norm(k)
        g = self.decay(xt)
        beta = torch.sigmoid(self.b_proj(xt).float())
        o = kda_step(q, k, v, g, beta, pool.recurrent, slot_idx)
        return self._out(o[:, None], x)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm, times sigmoid(output gate), then o_proj. o: [B, T, H, V]."""
        gate = self.output_gate(x)
        o = rms_norm(o.float(), self.o_norm_weight, self.cfg.rms_norm_eps) * torch.sigmoid(gate.float())
        return self.o_proj(o.to(x.dtype).flatten(-2))
