"""The engine's memory: what the model declares, allocated once from a byte budget. The
CacheManager is its only owner: the scheduler and the engine go through its methods.

- KDA: per layer a pool of slots, each the fp32 recurrent state [H, K, V] plus the conv state.
  Slots [0, max_num_seqs) serve running sequences; the rest hold prefix-cache snapshots.
- MLA: per layer a pool of pages [num_pages, page_size, latent]; a sequence's page table lists
  its pages. Page ids are shared by all MLA layers.
- Prefix cache: full prompt pages are hashed in a chain (each hash covers the previous one and
  the page's tokens). A cached page keeps its latents; every `snapshot_interval` pages it also
  keeps a KDA snapshot, the exact state of every KDA layer after that page, recorded with the
  chain hash and token count it belongs to. A hit resumes from the longest prefix that has a
  snapshot, so a restored KDA state always belongs to exactly that prefix.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from k3.model.cache import CacheBatch, KDACacheSpec, KDAPool, MLACacheSpec, layer_cache_specs
from k3.model.config import K3Config

from .params import EngineConfig


def page_hashes(tokens: list[int], page_size: int, parent: bytes = b"", media: Sequence = ()) -> list[bytes]:
    """Chain hashes of the full pages of tokens (each covers every token before it). `media`:
    the prompt's MediaSpans (serve/engine/media.py); each item's digest is mixed into every page
    its placeholders touch, so same ids with another picture hash differently from there on."""
    out = []
    for i in range(len(tokens) // page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(torch.tensor(tokens[i * page_size:(i + 1) * page_size], dtype=torch.int64).numpy().tobytes())
        for s in media:
            if s.start < (i + 1) * page_size and s.end > i * page_size:
                h.update(s.digest)
        parent = h.digest()
        out.append(parent)
    return out


@dataclass
class CachedPage:
    hash: bytes
    tokens: tuple[int, ...]
    depth: int  # 1-based page index in its chain
    page: int
    ref: int = 0  # running sequences holding this page
    last_used: int = 0
    snapshot_slot: int | None = None
    snapshot_hash: bytes | None = None  # the chain hash the snapshot was taken for
    snapshot_tokens: int = 0  # tokens the snapshot state has consumed


class CacheManager:
    def __init__(self, cfg: K3Config, ec: EngineConfig, device: torch.device | str = "cpu") -> None:
        self.cfg, self.ec = cfg, ec
        self.device = torch.device(device)
        self.dtype = torch.float32 if ec.dtype == "float32" else torch.bfloat16
        self.page_size = ec.page_size
        specs = layer_cache_specs(cfg)
        self.kda_specs = [s for s in specs if isinstance(s, KDACacheSpec)]
        self.mla_specs = [s for s in specs if isinstance(s, MLACacheSpec)]
        self.slot_bytes = sum(s.bytes_per_sequence(self.dtype) for s in self.kda_specs)
        self.page_bytes = sum(s.bytes_per_token(self.dtype) for s in self.mla_specs) * self.page_size
        budget = ec.cache_memory_bytes
        running = ec.max_num_seqs * self.slot_bytes
        if running >= budget:
            raise ValueError(f"cache_memory_bytes={budget} cannot hold max_num_seqs={ec.max_num_seqs} KDA slots "
                             f"of {self.slot_bytes} bytes each")
        rest = budget - running
        n_snap = 0
        if ec.enable_prefix_caching and self.slot_bytes:
            n_snap = int(rest * ec.snapshot_memory_fraction) // self.slot_bytes
        rest -= n_snap * self.slot_bytes
        max_len = ec.max_model_len or cfg.max_position_embeddings
        if self.page_bytes:
            n_pages = rest // self.page_bytes
        else:  # no MLA layer: pages only count tokens
            n_pages = ec.max_num_seqs * (-(-max_len // self.page_size))
        if n_pages < 1:
            raise ValueError(f"cache_memory_bytes={budget} leaves no room for a single {self.page_size}-token MLA page")
        self.num_pages, self.num_snapshot_slots = int(n_pages), n_snap
        n_slots = ec.max_num_seqs + n_snap
        self.kda = {s.layer_idx: KDAPool(torch.zeros(n_slots, *s.state_shape, dtype=torch.float32, device=self.device),
                                         torch.zeros(n_slots, *s.conv_shape, dtype=self.dtype, device=self.device))
                    for s in self.kda_specs}
        pages = self.num_pages if self.page_bytes else 1
        self.mla_pages = {s.layer_idx: torch.zeros(pages, self.page_size, s.latent_dim, dtype=self.dtype,
                                                   device=self.device) for s in self.mla_specs}
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.free_run_slots = list(range(ec.max_num_seqs - 1, -1, -1))
        self.free_snapshot_slots = list(range(n_slots - 1, ec.max_num_seqs - 1, -1))
        self.entries: dict[bytes, CachedPage] = {}  # chain hash -> cached page
        self.page_entry: dict[int, CachedPage] = {}  # page -> its cache entry, when cached
        self.clock = 0
        self.stats = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "evicted_pages": 0,
                      "snapshots_taken": 0, "snapshots_rejected": 0}

    # -- accounting ------------------------------------------------------------------------------
    def _tensors(self) -> list[torch.Tensor]:
        return [t for p in self.kda.values() for t in (p.recurrent, p.conv)] + list(self.mla_pages.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def expected_nbytes(self) -> int:
        """The analytical size: slots x slot bytes + pages x page bytes."""
        n_slots = self.ec.max_num_seqs + self.num_snapshot_slots
        return n_slots * self.slot_bytes + (self.num_pages * self.page_bytes if self.page_bytes else 0)

    def usage(self) -> dict:
        cached_idle = sum(1 for b in self.entries.values() if b.ref == 0)
        return {
            "pages_total": self.num_pages, "pages_free": len(self.free_pages), "pages_cached_idle": cached_idle,
            "pages_in_use": self.num_pages - len(self.free_pages) - cached_idle,
            "running_slots_total": self.ec.max_num_seqs, "running_slots_free": len(self.free_run_slots),
            "snapshot_slots_total": self.num_snapshot_slots,
            "snapshot_slots_used": self.num_snapshot_slots - len(self.free_snapshot_slots),
            "bytes_total": self.nbytes(), "slot_bytes": self.slot_bytes, "page_bytes": self.page_bytes,
            **self.stats,
        }

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.stats["prefix_query_tokens"] += query_tokens
        self.stats["prefix_hit_tokens"] += hit_tokens

    # -- pages -----------------------------------------------------------------------------------
    def alloc_page(self) -> int | None:
        if self.free_pages:
            return self.free_pages.pop()
        victim = self._lru([b for b in self.entries.values() if b.ref == 0])
        if victim is None:
            return None
        self._evict(victim)
        return victim.page

    def can_alloc(self, n: int) -> bool:
        return len(self.free_pages) + sum(1 for b in self.entries.values() if b.ref == 0) >= n

    def release_pages(self, pages: list[int]) -> None:
        """A sequence lets go of its pages: cached ones lose a reference, private ones are freed."""
        for p in pages:
            blk = self.page_entry.get(p)
            if blk is None:
                self.free_pages.append(p)
            else:
                assert blk.ref > 0, f"page {p} released more often than it was held"
                blk.ref -= 1

    def forget(self, hashes: list[bytes]) -> None:
        """Drop these cached pages if no one holds them (what a failed request registered:
        computed in a step that failed, its latents are not trusted)."""
        for h in hashes:
            blk = self.entries.get(h)
            if blk is not None and blk.ref == 0:
                self._evict(blk)
                self.free_pages.append(blk.page)

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
        for p in self.kda.values():
            for t in (p.recurrent, p.conv):
                if src is None:
                    t[dst].zero_()
                else:
                    t[dst].copy_(t[src])

    # -- prefix cache ----------------------------------------------------------------------------
    def lookup(self, tokens: list[int], hashes: list[bytes], limit: int) -> tuple[list[CachedPage], CachedPage | None]:
        """Longest cached chain of pages for tokens, and the deepest page on it whose snapshot
        can be resumed from (covering fewer than `limit` tokens). Touches what it walks."""
        chain, best = [], None
        self.clock += 1
        ps = self.page_size
        for j, h in enumerate(hashes):
            blk = self.entries.get(h)
            if blk is None or blk.tokens != tuple(tokens[j * ps:(j + 1) * ps]):
                break
            blk.last_used = self.clock
            chain.append(blk)
            if blk.snapshot_slot is not None and (j + 1) * ps < limit:
                if blk.snapshot_hash != h or blk.snapshot_tokens != (j + 1) * ps:
                    # A snapshot that was not taken for exactly this prefix: never restore it.
                    self.reject_snapshot(blk)
                    continue
                best = blk
        return chain, best

    def register(self, h: bytes, tokens: tuple[int, ...], depth: int, page: int, ref: int = 1) -> bool:
        """Make a full, computed page shareable (held by `ref` running sequences: 1 for the one
        that computed it, 0 for a page loaded from elsewhere). False if that content is cached."""
        if h in self.entries or page in self.page_entry:
            return False
        self.clock += 1
        blk = CachedPage(h, tokens, depth, page, ref=ref, last_used=self.clock)
        self.entries[h] = blk
        self.page_entry[page] = blk
        return True

    def cached(self, h: bytes, tokens: tuple[int, ...]) -> CachedPage | None:
        blk = self.entries.get(h)
        return blk if blk is not None and blk.tokens == tokens else None

    def resume_depth(self, tokens: list[int], hashes: list[bytes]) -> int:
        """The deepest page a prompt could resume from here (contiguous cached pages ending on a
        valid snapshot), without touching LRU order: what a pool lookup must beat."""
        best, ps = 0, self.page_size
        for j, h in enumerate(hashes):
            blk = self.cached(h, tuple(tokens[j * ps:(j + 1) * ps]))
            if blk is None:
                break
            if blk.snapshot_slot is not None and blk.snapshot_hash == h and blk.snapshot_tokens == (j + 1) * ps:
                best = j + 1
        return best

    def hold(self, blk: CachedPage) -> None:
        blk.ref += 1

    def store_snapshot(self, blk: CachedPage, states: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                       from_slot: int | None = None) -> None:
        """Keep blk's snapshot: {kda layer: (conv [C, W-1], recurrent [H, K, V])}, or a copy of a
        running slot whose state is exactly after blk's last token."""
        if blk.snapshot_slot is None:
            if not self.free_snapshot_slots:
                victim = self._lru([b for b in self.entries.values() if b.snapshot_slot is not None])
                if victim is None:
                    return
                self._drop_snapshot(victim)
            blk.snapshot_slot = self.free_snapshot_slots.pop()
        if from_slot is not None:
            self.copy_slot(from_slot, blk.snapshot_slot)
        else:
            for layer, (conv, rec) in states.items():
                self.kda[layer].conv[blk.snapshot_slot].copy_(conv)
                self.kda[layer].recurrent[blk.snapshot_slot].copy_(rec)
        blk.snapshot_hash, blk.snapshot_tokens = blk.hash, blk.depth * self.page_size
        self.stats["snapshots_taken"] += 1

    def reject_snapshot(self, blk: CachedPage) -> None:
        self.stats["snapshots_rejected"] += 1
        self._drop_snapshot(blk)

    def _lru(self, cands: list[CachedPage]) -> CachedPage | None:
        # Oldest first; among equals the deepest, so a chain is cut from its end.
        return min(cands, key=lambda b: (b.last_used, -b.depth), default=None)

    def _drop_snapshot(self, blk: CachedPage) -> None:
        if blk.snapshot_slot is not None:
            self.free_snapshot_slots.append(blk.snapshot_slot)
        blk.snapshot_slot, blk.snapshot_hash, blk.snapshot_tokens = None, None, 0

    def _evict(self, blk: CachedPage) -> None:
        self._drop_snapshot(blk)
        del self.entries[blk.hash]
        del self.page_entry[blk.page]
        self.stats["evicted_pages"] += 1

    def evict_idle(self, min_depth: int = 1) -> int:
        """Drop every unreferenced cached page at chain depth >= min_depth (memory pressure; the
        hook tests use to force a shallower hit)."""
        idle = [b for b in self.entries.values() if b.ref == 0 and b.depth >= min_depth]
        for b in idle:
            self._evict(b)
            self.free_pages.append(b.page)
        return len(idle)

    # -- state in and out (the prefill/decode handoff) ----------------------------------------------
    def read_latents(self, pages: list[int], num_tokens: int) -> dict[int, torch.Tensor]:
        """{mla layer: [num_tokens, latent]} of a sequence, in position order."""
        if not self.page_bytes:
            return {}
        idx = torch.tensor(pages[: self.pages_for(num_tokens)], dtype=torch.long, device=self.device)
        return {l: t[idx].reshape(-1, t.shape[-1])[:num_tokens] for l, t in self.mla_pages.items()}

    def write_latents(self, pages: list[int], first_page: int, latents: dict[int, torch.Tensor]) -> None:
        """Fill pages[first_page:] with latents[layer][first_page * page_size:] (the rest are
        shared pages that already hold them)."""
        ps = self.page_size
        for l, lat in latents.items():
            for j in range(first_page, len(pages)):
                rows = lat[j * ps:(j + 1) * ps]
                self.mla_pages[l][pages[j], : rows.shape[0]].copy_(rows)

    def read_slot(self, slot: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {l: (p.conv[slot], p.recurrent[slot]) for l, p in self.kda.items()}

    def write_slot(self, slot: int, states: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        for l, (conv, rec) in states.items():
            self.kda[l].conv[slot].copy_(conv)
            self.kda[l].recurrent[slot].copy_(rec)

    # -- the model's view -------------------------------------------------------------------------
    def cache_batch(self, lengths: list[int], slots: list[int], tables: list[list[int]], context: list[int],
                    snapshot_offsets: dict[int, list[int]] | None = None) -> CacheBatch:
        dev = self.device
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        width = max(1, max(len(t) for t in tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        return CacheBatch(cu_seqlens=torch.tensor(cu, dtype=torch.long, device=dev),
                          context_lens=torch.tensor(context, dtype=torch.long, device=dev),
                          kda_slots=torch.tensor(slots, dtype=torch.long, device=dev), page_table=table,
                          kda=self.kda, mla_pages=self.mla_pages, decode=all(n == 1 for n in lengths),
                          max_context=max(context), snapshot_offsets=snapshot_offsets or {})
