"""The cache contract between the model and whoever owns memory.

Each layer declares what it caches (`layer_cache_specs`): a KDA layer a fixed-size state per
sequence (the fp32 recurrent state [H, K, V] and the conv state [3*H*K, W-1]); an MLA layer a
latent of `kv_lora_rank + qk_rope_head_dim` values per token. The owner allocates that memory
and hands the model a `CacheBatch` per forward: which KDA slots and which MLA pages belong to
each sequence, and how many tokens each already has.

`HybridCache` is the simple contiguous owner used by `generate()` and the tests: one slot per
batch row and one page of `max_len` tokens per row. The serving engine owns paged memory with
the same `CacheBatch` contract.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import K3Config


@dataclass(frozen=True)
class KDACacheSpec:
    layer_idx: int
    state_shape: tuple[int, int, int]  # [H, K, V], always fp32
    conv_shape: tuple[int, int]  # [3*H*K, W-1], model dtype

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
class CacheBatch:
    """Memory views and bookkeeping for one cached forward over N sequences.

    cu_seqlens [N + 1]: the new (query) tokens of each sequence, packed.
    kda_slots [N]: each sequence's slot in the KDA pools; kda_state[layer] [P, H, K, V] fp32 and
    kda_conv[layer] [P, 3HK, W-1] are the pools (updated in place).
    mla_kv[layer] [num_blocks, block_size, latent]: paged latents; block_table [N, max_blocks];
    context_lens [N]: tokens cached before this forward.
    """

    cu_seqlens: torch.Tensor
    kda_slots: torch.Tensor
    kda_state: dict[int, torch.Tensor]
    kda_conv: dict[int, torch.Tensor]
    mla_kv: dict[int, torch.Tensor]
    block_table: torch.Tensor
    context_lens: torch.Tensor
    # Prefix caching: the owner may set extras["kda_snapshot_offsets"] = {sequence index: [offsets
    # into its new tokens]}; each KDA layer then leaves extras["kda_snapshots"][layer] =
    # [(sequence index, offset, KDAState)] with the exact state after that many new tokens.
    extras: dict = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.cu_seqlens.numel() - 1 == int(self.cu_seqlens[-1])


class HybridCache:
    """Contiguous cache for `batch_size` sequences of up to `max_len` tokens each."""

    def __init__(self, cfg: K3Config, batch_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"HybridCache: batch_size must be >= 1, got {batch_size}")
        if not 1 <= max_len <= cfg.max_position_embeddings:
            raise ValueError(f"HybridCache: max_len must be in [1, {cfg.max_position_embeddings}], got {max_len}")
        self.cfg, self.batch_size, self.max_len = cfg, batch_size, max_len
        self.specs = layer_cache_specs(cfg)
        self.kda_state, self.kda_conv, self.mla_kv = {}, {}, {}
        for s in self.specs:
            if isinstance(s, KDACacheSpec):
                self.kda_state[s.layer_idx] = torch.zeros(batch_size, *s.state_shape, dtype=torch.float32, device=device)
                self.kda_conv[s.layer_idx] = torch.zeros(batch_size, *s.conv_shape, dtype=dtype, device=device)
            else:
                self.mla_kv[s.layer_idx] = torch.zeros(batch_size, max_len, s.latent_dim, dtype=dtype, device=device)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.device = torch.device(device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.kda_state, self.kda_conv, self.mla_kv) for t in d.values())

    def batch(self, query_lens: list[int]) -> CacheBatch:
        """The CacheBatch for a forward that appends query_lens[i] tokens to row i."""
        if len(query_lens) != self.batch_size:
            raise ValueError(f"HybridCache: query_lens has {len(query_lens)} entries, cache holds {self.batch_size} rows")
        new_len = self.lengths + torch.tensor(query_lens, device=self.device)
        if int(new_len.max()) > self.max_len:
            raise ValueError(f"HybridCache: a sequence would reach {int(new_len.max())} tokens > max_len {self.max_len}")
        cu = torch.zeros(self.batch_size + 1, dtype=torch.long, device=self.device)
        cu[1:] = torch.tensor(query_lens, device=self.device).cumsum(0)
        return CacheBatch(
            cu_seqlens=cu,
            kda_slots=torch.arange(self.batch_size, device=self.device),
            kda_state=self.kda_state, kda_conv=self.kda_conv, mla_kv=self.mla_kv,
            block_table=torch.arange(self.batch_size, device=self.device)[:, None],
            context_lens=self.lengths.clone(),
        )

    def advance(self, query_lens: list[int]) -> None:
        self.lengths += torch.tensor(query_lens, device=self.device)
