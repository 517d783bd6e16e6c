"""The cache contract between the model and whoever owns memory (vLLM's shape: the model
declares, the owner allocates).

Each layer declares what it caches (`layer_cache_specs`): a KDA layer a fixed-size state per
sequence (the fp32 recurrent state [H, K, V] and the conv state [3*H*K, W-1]); an MLA layer a
latent of `kv_lora_rank + qk_rope_head_dim` values per token, kept in pages of `page_size`
tokens. The owner allocates that memory and hands the model one `CacheBatch` per forward: the
pools, which KDA slot and which MLA pages belong to each sequence, and how many tokens each
already has. Layers read and write only through it (`forward_cached` on KDA and MLA layers).

A saved KDA state (prefix caching, the prefill/decode handoff) is a *snapshot*; the owner asks
for snapshots at token offsets inside a chunk and the KDA layers record them in the batch.

`HybridCache` is the simple contiguous owner used by `generate()` and the tests: one slot per
batch row and one page of `max_len` tokens per row. The serving engine owns paged memory with
the same contract.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import K3Config


@dataclass(frozen=True)
class KDACacheSpec:
    layer_idx: int
    state_shape: tuple[int, int, int]  # [H, K, V], always fp32
    conv_shape: tuple[int, int]  # [3*H*K, W-1], cache dtype

    def bytes_per_sequence(self, dtype: torch.dtype) -> int:
        H, K, V = self.state_shape
        C, P = self.conv_shape
        return H * K * V * 4 + C * P * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MLACacheSpec:
    layer_idx: int
    latent_dim: int  # values per token

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.latent_dim * torch.empty((), dtype=dtype).element_size()


def layer_cache_specs(cfg: K3Config) -> list[KDACacheSpec | MLACacheSpec]:
    specs: list[KDACacheSpec | MLACacheSpec] = []
    for i, kind in enumerate(cfg.layer_types):
        if kind == "kda":
            H, K = cfg.kda_num_heads, cfg.kda_head_dim
            specs.append(KDACacheSpec(i, (H, K, K), (3 * H * K, cfg.kda_conv_size - 1)))
        else:
            specs.append(MLACacheSpec(i, cfg.mla_latent_dim))
    return specs


def cache_bytes(cfg: K3Config, num_tokens: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes one sequence of num_tokens occupies: fixed KDA state plus per-token MLA latents."""
    total = 0
    for s in layer_cache_specs(cfg):
        total += s.bytes_per_sequence(dtype) if isinstance(s, KDACacheSpec) else s.bytes_per_token(dtype) * num_tokens
    return total


@dataclass
class KDAPool:
    """One KDA layer's per-sequence memory, indexed by slot: recurrent [P, H, K, V] fp32 and
    conv [P, 3HK, W-1] (the last W-1 conv inputs, oldest first)."""

    recurrent: torch.Tensor
    conv: torch.Tensor


@dataclass
class KDASnapshot:
    """The exact state of one KDA layer for one sequence after `offset` of its new tokens."""

    seq: int  # index of the sequence in the batch
    offset: int
    recurrent: torch.Tensor  # [H, K, V] fp32
    conv: torch.Tensor  # [3HK, W-1]


@dataclass
class CacheBatch:
    """Memory views and bookkeeping for one cached forward over N sequences.

    cu_seqlens [N + 1]: the new (query) tokens of each sequence, packed.
    context_lens [N]: tokens cached before this forward; `max_context` is its maximum and
    `max_new` the most new tokens of any sequence, both known on the host (no device sync inside
    layers; 0: not known).
    kda_slots [N]: each sequence's slot in every KDA layer's pool; kda {layer: KDAPool} is
    updated in place.
    page_table [N, max_pages]: each sequence's MLA pages; mla_pages {layer: [num_pages,
    page_size, latent]} gets the new latents written at positions context, context + 1, ...
    decode: every sequence has exactly one new token (the owner knows; set it, don't infer).
    snapshot_offsets {sequence index: [offsets inside its new tokens, each < its count]}: the KDA
    layers record the state after those many tokens in `snapshots` {layer: [KDASnapshot]}.
    The state after a whole chunk is the slot itself after the forward, so it is never asked for.
    """

    cu_seqlens: torch.Tensor
    context_lens: torch.Tensor
    kda_slots: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    kda: dict[int, KDAPool] = field(default_factory=dict)
    mla_pages: dict[int, torch.Tensor] = field(default_factory=dict)
    decode: bool = False
    max_context: int = 0
    max_new: int = 0
    snapshot_offsets: dict[int, list[int]] = field(default_factory=dict)
    snapshots: dict[int, list[KDASnapshot]] = field(default_factory=dict)

    def record_snapshot(self, layer: int, snap: KDASnapshot) -> None:
        self.snapshots.setdefault(layer, []).append(snap)


class HybridCache:
    """Contiguous cache for `batch_size` sequences of up to `max_len` tokens each."""

    def __init__(self, cfg: K3Config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"HybridCache: batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_len <= cfg.max_position_embeddings:
            raise ValueError(f"HybridCache: max_len must be in [1, {cfg.max_position_embeddings}], got {max_len}")
        # The conv states and latents are stored in dtype: an integer, bool or complex one would
        # truncate (or refuse) what the layers write, and decode would go on from the wrong state.
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"HybridCache: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self.cfg, self.batch_size, self.max_len = cfg, batch_size, max_len
        self.specs = layer_cache_specs(cfg)
        self.kda: dict[int, KDAPool] = {}
        self.mla_pages: dict[int, torch.Tensor] = {}
        for s in self.specs:
            if isinstance(s, KDACacheSpec):
                self.kda[s.layer_idx] = KDAPool(
                    torch.zeros(batch_size, *s.state_shape, dtype=torch.float32, device=device),
                    torch.zeros(batch_size, *s.conv_shape, dtype=dtype, device=device))
            else:  # one page of max_len tokens per row
                self.mla_pages[s.layer_idx] = torch.zeros(batch_size, max_len, s.latent_dim, dtype=dtype, device=device)
        self.lengths = [0] * batch_size
        self.device = torch.device(device)

    def batch(self, query_lens: list[int]) -> CacheBatch:
        """The CacheBatch for a forward that appends query_lens[i] tokens to row i."""
        if len(query_lens) != self.batch_size:
            raise ValueError(f"HybridCache: query_lens has {len(query_lens)} entries, cache holds {self.batch_size} rows")
        longest = max(n + q for n, q in zip(self.lengths, query_lens))
        if longest > self.max_len:
            raise ValueError(f"HybridCache: a sequence would reach {longest} tokens > max_len {self.max_len}")
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        rows = torch.arange(self.batch_size, device=self.device)
        return CacheBatch(
            cu_seqlens=torch.tensor(cu, device=self.device),
            context_lens=torch.tensor(self.lengths, device=self.device),
            kda_slots=rows, page_table=rows[:, None], kda=self.kda, mla_pages=self.mla_pages,
            decode=all(q == 1 for q in query_lens), max_context=max(self.lengths), max_new=max(query_lens),
        )

    def advance(self, query_lens: list[int]) -> None:
        self.lengths = [n + q for n, q in zip(self.lengths, query_lens)]
