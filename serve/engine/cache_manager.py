"""The engine's memory: what the model declares, allocated once from a byte budget.

- KDA: per layer a pool of slots, each the fp32 recurrent state [H, K, V] plus the conv state.
  Slots [0, max_num_seqs) serve running sequences; the rest hold prefix-cache checkpoints.
- MLA: per layer a pool of pages [num_pages, block_size, latent]; a sequence's block table
  lists its pages. Page ids are shared by all MLA layers.
- Prefix cache: full prompt blocks are hashed in a chain (each hash covers the previous one and
  the block's tokens). A cached block keeps its page; every `checkpoint_interval` blocks it also
  keeps a KDA checkpoint, the exact state of every KDA layer after that block, recorded with
  the chain hash and token count it belongs to. A hit resumes from the longest prefix that has
  a checkpoint, so a restored KDA state always belongs to exactly that prefix.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from k3.model.cache import CacheBatch, KDACacheSpec, MLACacheSpec, layer_cache_specs
from k3.model.config import K3Config

from .params import EngineConfig


def block_hashes(tokens: list[int], block_size: int) -> list[bytes]:
    """Chain hashes of the full blocks of tokens."""
    out, parent = [], b""
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(torch.tensor(tokens[i * block_size:(i + 1) * block_size], dtype=torch.int64).numpy().tobytes())
        parent = h.digest()
        out.append(parent)
    return out


@dataclass
class CachedBlock:
    hash: bytes
    tokens: tuple[int, ...]
    depth: int  # 1-based block index in its chain
    page: int
    ref: int = 0  # running sequences holding this page
    last_used: int = 0
    ckpt_slot: int | None = None
    ckpt_hash: bytes | None = None  # the chain hash the checkpoint was taken for
    ckpt_tokens: int = 0  # tokens the checkpoint state has consumed


class CacheManager:
    def __init__(self, cfg: K3Config, ec: EngineConfig, device: torch.device | str = "cpu") -> None:
        self.cfg, self.ec = cfg, ec
        self.device = torch.device(device)
        self.dtype = torch.float32 if ec.dtype == "float32" else torch.bfloat16
        self.bs = ec.block_size
        specs = layer_cache_specs(cfg)
        self.kda_specs = [s for s in specs if isinstance(s, KDACacheSpec)]
        self.mla_specs = [s for s in specs if isinstance(s, MLACacheSpec)]
        self.slot_bytes = sum(s.bytes_per_sequence(self.dtype) for s in self.kda_specs)
        self.page_bytes = sum(s.bytes_per_token(self.dtype) for s in self.mla_specs) * self.bs
        budget = ec.cache_memory_bytes
        running = ec.max_num_seqs * self.slot_bytes
        if running >= budget:
            raise ValueError(f"cache_memory_bytes={budget} cannot hold max_num_seqs={ec.max_num_seqs} KDA slots "
                             f"of {self.slot_bytes} bytes each")
        rest = budget - running
        n_ckpt = 0
        if ec.enable_prefix_caching and self.slot_bytes:
            n_ckpt = int(rest * ec.checkpoint_memory_fraction) // self.slot_bytes
        rest -= n_ckpt * self.slot_bytes
        max_len = ec.max_model_len or cfg.max_position_embeddings
        if self.page_bytes:
            n_pages = rest // self.page_bytes
        else:  # no MLA layer: pages only count tokens
            n_pages = ec.max_num_seqs * (-(-max_len // self.bs))
        if n_pages < 1:
            raise ValueError(f"cache_memory_bytes={budget} leaves no room for a single {self.bs}-token MLA page")
        self.num_pages, self.num_ckpt_slots = int(n_pages), n_ckpt
        n_slots = ec.max_num_seqs + n_ckpt
        self.kda_state = {s.layer_idx: torch.zeros(n_slots, *s.state_shape, dtype=torch.float32, device=self.device)
                          for s in self.kda_specs}
        self.kda_conv = {s.layer_idx: torch.zeros(n_slots, *s.conv_shape, dtype=self.dtype, device=self.device)
                         for s in self.kda_specs}
        pages = self.num_pages if self.page_bytes else 1
        self.mla_kv = {s.layer_idx: torch.zeros(pages, self.bs, s.latent_dim, dtype=self.dtype, device=self.device)
                       for s in self.mla_specs}
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.free_run_slots = list(range(ec.max_num_seqs - 1, -1, -1))
        self.free_ckpt_slots = list(range(n_slots - 1, ec.max_num_seqs - 1, -1))
        self.blocks: dict[bytes, CachedBlock] = {}
        self.page_block: dict[int, CachedBlock] = {}  # page -> its cache entry, when cached
        self.clock = 0
        self.stats = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "evicted_blocks": 0,
                      "checkpoints_taken": 0, "checkpoints_rejected": 0}

    # -- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.kda_state, self.kda_conv, self.mla_kv) for t in d.values())

    def expected_nbytes(self) -> int:
        """The analytical size: slots x slot bytes + pages x page bytes."""
        n_slots = self.ec.max_num_seqs + self.num_ckpt_slots
        return n_slots * self.slot_bytes + (self.num_pages * self.page_bytes if self.page_bytes else 0)

    def usage(self) -> dict:
        cached_idle = sum(1 for b in self.blocks.values() if b.ref == 0)
        return {
            "pages_total": self.num_pages, "pages_free": len(self.free_pages), "pages_cached_idle": cached_idle,
            "pages_in_use": self.num_pages - len(self.free_pages) - cached_idle,
            "running_slots_total": self.ec.max_num_seqs, "running_slots_free": len(self.free_run_slots),
            "checkpoint_slots_total": self.num_ckpt_slots,
            "checkpoint_slots_used": self.num_ckpt_slots - len(self.free_ckpt_slots),
            "bytes_total": self.nbytes(), "slot_bytes": self.slot_bytes, "page_bytes": self.page_bytes,
            **self.stats,
        }

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.bs)

    # -- pages -----------------------------------------------------------------------------------
    def alloc_page(self) -> int | None:
        if self.free_pages:
            return self.free_pages.pop()
        victim = self._lru([b for b in self.blocks.values() if b.ref == 0])
        if victim is None:
            return None
        self._evict(victim)
        return victim.page

    def can_alloc(self, n: int) -> bool:
        return len(self.free_pages) + sum(1 for b in self.blocks.values() if b.ref == 0) >= n

    def release_pages(self, pages: list[int]) -> None:
        """A sequence lets go of its pages: cached ones lose a reference, private ones are freed."""
        for p in pages:
            blk = self.page_block.get(p)
            if blk is None:
                self.free_pages.append(p)
            else:
                assert blk.ref > 0, f"page {p} released more often than it was held"
                blk.ref -= 1

    # -- KDA slots -------------------------------------------------------------------------------
    def alloc_run_slot(self) -> int | None:
        if not self.free_run_slots:
            return None
        slot = self.free_run_slots.pop()
        self.copy_slot(None, slot)
        return slot

    def free_run_slot(self, slot: int) -> None:
        self.free_run_slots.append(slot)

    def copy_slot(self, src: int | None, dst: int) -> None:
        """dst <- src for every KDA layer (zeros when src is None)."""
        for d in (self.kda_state, self.kda_conv):
            for t in d.values():
                if src is None:
                    t[dst].zero_()
                else:
                    t[dst].copy_(t[src])

    # -- prefix cache ----------------------------------------------------------------------------
    def lookup(self, tokens: list[int], hashes: list[bytes], limit: int) -> tuple[list[CachedBlock], CachedBlock | None]:
        """Longest cached chain of blocks for tokens, and the deepest block on it whose checkpoint
        can be resumed from (covering fewer than `limit` tokens). Touches what it walks."""
        chain, best = [], None
        self.clock += 1
        for j, h in enumerate(hashes):
            blk = self.blocks.get(h)
            if blk is None or blk.tokens != tuple(tokens[j * self.bs:(j + 1) * self.bs]):
                break
            blk.last_used = self.clock
            chain.append(blk)
            if blk.ckpt_slot is not None and (j + 1) * self.bs < limit:
                if blk.ckpt_hash != h or blk.ckpt_tokens != (j + 1) * self.bs:
                    # A checkpoint that was not taken for exactly this prefix: never restore it.
                    self.stats["checkpoints_rejected"] += 1
                    self._drop_ckpt(blk)
                    continue
                best = blk
        return chain, best

    def register(self, h: bytes, tokens: tuple[int, ...], depth: int, page: int) -> bool:
        """Make a full, computed block shareable. False if that content is cached already."""
        if h in self.blocks or page in self.page_block:
            return False
        self.clock += 1
        blk = CachedBlock(h, tokens, depth, page, ref=1, last_used=self.clock)
        self.blocks[h] = blk
        self.page_block[page] = blk
        return True

    def hold(self, blk: CachedBlock) -> None:
        blk.ref += 1

    def store_checkpoint(self, blk: CachedBlock, states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep {kda layer: (conv [C, W-1], recurrent [H, K, V])} as blk's checkpoint."""
        if blk.ckpt_slot is None:
            if not self.free_ckpt_slots:
                victim = self._lru([b for b in self.blocks.values() if b.ckpt_slot is not None])
                if victim is None:
                    return
                self._drop_ckpt(victim)
            blk.ckpt_slot = self.free_ckpt_slots.pop()
        for layer, (conv, rec) in states.items():
            self.kda_conv[layer][blk.ckpt_slot].copy_(conv)
            self.kda_state[layer][blk.ckpt_slot].copy_(rec)
        blk.ckpt_hash, blk.ckpt_tokens = blk.hash, blk.depth * self.bs
        self.stats["checkpoints_taken"] += 1

    def _lru(self, cands: list[CachedBlock]) -> CachedBlock | None:
        # Oldest first; among equals the deepest, so a chain is cut from its end.
        return min(cands, key=lambda b: (b.last_used, -b.depth), default=None)

    def _drop_ckpt(self, blk: CachedBlock) -> None:
        if blk.ckpt_slot is not None:
            self.free_ckpt_slots.append(blk.ckpt_slot)
        blk.ckpt_slot, blk.ckpt_hash, blk.ckpt_tokens = None, None, 0

    def _evict(self, blk: CachedBlock) -> None:
        self._drop_ckpt(blk)
        del self.blocks[blk.hash]
        del self.page_block[blk.page]
        self.stats["evicted_blocks"] += 1

    def evict_all_idle(self) -> int:
        """Drop every unreferenced cached block (tests; memory pressure)."""
        idle = [b for b in self.blocks.values() if b.ref == 0]
        for b in idle:
            self._evict(b)
            self.free_pages.append(b.page)
        return len(idle)

    # -- the model's view -------------------------------------------------------------------------
    def cache_batch(self, lengths: list[int], slots: list[int], tables: list[list[int]], context: list[int]) -> CacheBatch:
        dev = self.device
        cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
        cu[1:] = torch.tensor(lengths).cumsum(0)
        width = max(1, max(len(t) for t in tables))
        table = torch.zeros(len(tables), width, dtype=torch.long)
        for i, t in enumerate(tables):
            table[i, :len(t)] = torch.tensor(t, dtype=torch.long)
        return CacheBatch(cu_seqlens=cu.to(dev), kda_slots=torch.tensor(slots, dtype=torch.long, device=dev),
                          kda_state=self.kda_state, kda_conv=self.kda_conv, mla_kv=self.mla_kv,
                          block_table=table.to(dev), context_lens=torch.tensor(context, dtype=torch.long, device=dev))
