"""The engine's memory: what the model declares, allocated once from a byte budget. The
CacheManager is its only owner: the scheduler, the engine and the handoff connector hold opaque
handles (`SeqCache` per sequence, `PrefixHit` per prefix lookup) and go through its methods; its
tables and pools are its own.

- KDA: per layer a pool of max_num_seqs + reserved snapshot slots, each the fp32 recurrent
  state [H, K, V] plus the conv state, holding running sequences' states and prefix-cache
  snapshots.
- MLA: per layer a pool of pages [num_pages, page_size, latent]; a sequence's page table lists
  its pages. Page ids are shared by all MLA layers.
- Prefix cache: full pages of a sequence's computed tokens (prompt, then generated tokens) are
  hashed in a chain (each hash covers the previous one and the page's tokens). A cached page
  keeps its latents; some pages also keep a KDA snapshot, the exact state of every KDA layer
  after that page (the scheduler says which: every `snapshot_interval` pages, the prompt's last
  full page, the page where the prompt leaves a cached one, the last full page generated so
  far). A hit resumes from the longest prefix that has a snapshot. A page's latents and
  snapshot, once cached, are never overwritten (by a later computation or an import) until the
  page is evicted.
- Snapshots live in the same KDA slots as running sequences and go by worth, not arrival:
  kda_slots.py says which slot holds what.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from k3.model.cache import CacheBatch, KDACacheSpec, KDAPool, MLACacheSpec, layer_cache_specs
from k3.model.config import K3Config
from k3.model.loading import memory_bytes

from .kda_slots import SlotTable
from .params import EngineConfig

KDAStates = dict[int, tuple[torch.Tensor, torch.Tensor]]  # KDA layer -> (conv [3HK, W-1], recurrent [H, K, V])
Latents = dict[int, torch.Tensor]  # MLA layer -> [tokens, latent]


class FreePages:
    """The pages no sequence or cache entry holds, popped last-in first-out. Pages never used yet
    are a counter, not a list: a model without MLA layers counts tokens in pages that hold no
    memory (max_num_seqs x its context of them: millions at a 1M context), so the list grows only
    with pages given back."""

    def __init__(self, num_pages: int) -> None:
        self._fresh, self._total = 0, num_pages  # pages [_fresh, _total) never handed out
        self._back: list[int] = []

    def __len__(self) -> int:
        return len(self._back) + self._total - self._fresh

    def append(self, page: int) -> None:
        self._back.append(page)

    def pop(self) -> int:
        if self._back:
            return self._back.pop()
        if self._fresh == self._total:
            raise IndexError("pop from no free page")
        self._fresh += 1
        return self._fresh - 1


def page_hashes(tokens: list[int], page_size: int, parent: bytes = b"", media: Sequence = (),
                first: int = 0) -> list[bytes]:
    """Chain hashes of the full pages of tokens (each covers every token before it), from page
    `first` on (`parent`: the hash of page first - 1). `media`: the prompt's MediaSpans
    (serve/engine/prompt_media.py); each item's digest is mixed into every page its
    placeholders touch, so same ids with another picture hash differently from there on."""
    out = []
    ids = np.asarray(tokens[first * page_size:len(tokens) // page_size * page_size], dtype=np.int64)
    for i in range(first, len(tokens) // page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(ids[(i - first) * page_size:(i - first + 1) * page_size].data)  # the page's int64 bytes
        for s in media:
            if s.start < (i + 1) * page_size and s.end > i * page_size:
                h.update(s.digest)
        parent = h.digest()
        out.append(parent)
    return out


def int64_tensor(values, device: torch.device) -> torch.Tensor:
    """An int64 tensor of a list (or array) of ints on `device`. Through numpy: `torch.tensor`
    converts a list element by element (a 256-page table row: 22 against 5 us), and a decode
    step builds its page table, lengths and slots anew."""
    t = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return t if device.type == "cpu" else t.to(device)


@dataclass(eq=False)
class _CachedPage:
    hash: bytes
    tokens: tuple[int, ...]
    depth: int  # 1-based page index in its chain
    page: int
    ref: int = 0  # running sequences holding this page
    last_used: int = 0
    snapshot_slot: int | None = None  # the KDA state after this page, when kept
    hits: int = 0  # later requests whose prompt matched this page (each could start after it)
    inherited: int = 0  # hits of the snapshots its conversation continued from (a rolling one's)
    rolling: bool = False  # its snapshot was a sequence's rolling one: where a conversation's next turn resumes
    base: int = 0  # depth of the snapshot a resume would use without this one: a more-used prefix's (kda_slots.py)
    worth: float = 0.0  # of the snapshot, when kept (kda_slots.py)
    parent: bytes | None = None  # the chain's previous page's hash (None for a first page)
    children: int = 0  # cached pages whose chain goes on from this one: more than one where prompts part


@dataclass
class PrefixCopy:
    """Copies of a prompt's cached pages (`CacheManager.copy_prefix`): one tensor per MLA layer
    and KDA part for all of them, so the pages' arrays are made from a few tensors, not one per
    page and layer."""

    hashes: list[bytes]  # each copied page's chain hash
    indices: list[int]  # each copied page's index in the prompt (0-based)
    latents: Latents  # layer -> [pages, page_size, latent]
    snapshot_rows: list[int | None]  # each copied page's row in `snapshots` (None: no snapshot)
    snapshots: KDAStates  # layer -> (conv [snapshots, ...], recurrent [snapshots, ...])

    def __len__(self) -> int:
        return len(self.indices)


@dataclass(eq=False)
class SeqCache:
    """One sequence's memory, lent by the CacheManager for the request's whole life (across
    preemptions). Only the manager reads or changes it; everyone else passes it back."""

    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    shared: int = 0  # pages in the prefix cache (held from a hit, or registered by this sequence)
    added: list[bytes] = field(default_factory=list)  # hashes this sequence put in the prefix cache
    rolling: bytes | None = None  # the page of its latest snapshot that a deeper one supersedes
    reuse: int = 0  # requests its conversation has served so far: hits of the snapshot it started from
    base: int = 0  # the deepest kept snapshot of the cached prefix it matched: its new snapshots save only what lies past it
    # `pages` as int64, for the page tables (`CacheManager._page_row`): the list is only ever
    # appended to or replaced whole, so the row follows it by copying what was appended
    row: np.ndarray | None = field(default=None, repr=False)
    row_of: list[int] | None = field(default=None, repr=False)  # the list object the row holds
    row_len: int = 0  # how many of its pages the row holds


class _IdlePages:
    """The cached pages no running sequence holds, in eviction order: least recently used first,
    and among equals the deepest, so a chain is cut from its end. A served engine's cache is full
    of such pages and every page a new token needs evicts one, so this is a heap (a page is pushed
    again when it goes idle or is touched; entries that no longer match their page are skipped on
    the way out), not a scan of the whole cache per page."""

    def __init__(self, entries: dict[bytes, _CachedPage]) -> None:
        self._entries = entries  # the manager's: a page evicted from it is no longer idle
        self._heap: list[tuple[int, int, int, _CachedPage]] = []
        self._pushed = 0  # tie-break, so heap entries never compare pages
        self.count = 0  # idle pages now

    def add(self, blk: _CachedPage) -> None:
        """blk went idle (registered unheld, or its last holder let go)."""
        self.count += 1
        self.touch(blk)

    def discard(self, blk: _CachedPage) -> None:
        """blk, idle until now, is held again or evicted (its heap entries go stale)."""
        self.count -= 1

    def touch(self, blk: _CachedPage) -> None:
        """blk is idle under a new last_used."""
        self._pushed += 1
        heapq.heappush(self._heap, (blk.last_used, -blk.depth, self._pushed, blk))
        if len(self._heap) > 2 * self.count + 1024:  # stale entries: drop them, keep one per page
            live = {id(item[3]): item for item in self._heap if self._current(item)}
            self._heap = list(live.values())
            heapq.heapify(self._heap)

    def pop(self) -> _CachedPage | None:
        """The idle page to evict next (still cached: the caller evicts it), or None."""
        while self._heap:
            item = heapq.heappop(self._heap)
            if self._current(item):
                return item[3]
        return None

    def clear(self) -> None:
        self._heap.clear()
        self.count = 0

    def _current(self, item: tuple[int, int, int, _CachedPage]) -> bool:
        blk = item[3]
        return blk.ref == 0 and blk.last_used == item[0] and self._entries.get(blk.hash) is blk


@dataclass(frozen=True, eq=False)
class PrefixHit:
    """A cached prefix a sequence can start from: its pages and the KDA snapshot after the last."""

    chain: tuple[_CachedPage, ...]
    num_tokens: int


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
        self.num_pages, self.num_snapshot_slots = self._plan(cfg, ec)
        n_slots = ec.max_num_seqs + self.num_snapshot_slots
        self._kda = {s.layer_idx: KDAPool(torch.zeros(n_slots, *s.state_shape, dtype=torch.float32, device=self.device),
                                          torch.zeros(n_slots, *s.conv_shape, dtype=self.dtype, device=self.device))
                     for s in self.kda_specs}
        pages = self.num_pages if self.page_bytes else 1
        self._mla = {s.layer_idx: torch.zeros(pages, self.page_size, s.latent_dim, dtype=self.dtype, device=self.device)
                     for s in self.mla_specs}
        self._free_pages = FreePages(self.num_pages)
        self._slots = SlotTable(n_slots, ec.max_num_seqs, self.page_size)
        self._entries: dict[bytes, _CachedPage] = {}  # chain hash -> cached page
        self._page_entry: dict[int, _CachedPage] = {}  # page -> its cache entry, when cached
        self._idle = _IdlePages(self._entries)  # the cached pages no sequence holds: the ones a new page may evict
        self._clock = 0
        self.stats = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "evicted_pages": 0,
                      "snapshots_taken": 0, "snapshots_rejected": 0}

    def _plan(self, cfg: K3Config, ec: EngineConfig) -> tuple[int, int]:
        """(MLA pages, snapshot slots) that fit the budget after the running slots."""
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
        max_len = ec.context_length(cfg)
        if self.page_bytes:
            n_pages = rest // self.page_bytes
        else:  # no MLA layer: pages only count tokens
            n_pages = ec.max_num_seqs * (-(-max_len // self.page_size))
        if n_pages < 1:
            raise ValueError(f"cache_memory_bytes={budget} leaves no room for a single {self.page_size}-token MLA page")
        free = memory_bytes(self.device, free=True)  # the cache is zeroed whole when the engine starts
        if free is not None and budget > free:
            raise ValueError(f"cache_memory_bytes={budget:,} is more than the {free:,} bytes free on {self.device}: "
                             f"lower it")
        return int(n_pages), n_snap

    # -- accounting ------------------------------------------------------------------------------
    def nbytes(self) -> int:
        tensors = [t for p in self._kda.values() for t in (p.recurrent, p.conv)] + list(self._mla.values())
        return sum(t.numel() * t.element_size() for t in tensors)

    def usage(self) -> dict:
        cached_idle = self._idle.count
        return {
            "pages_total": self.num_pages, "pages_free": len(self._free_pages), "pages_cached_idle": cached_idle,
            "pages_in_use": self.num_pages - len(self._free_pages) - cached_idle,
            "running_slots_total": self.ec.max_num_seqs,
            "running_slots_free": self.ec.max_num_seqs - self._slots.running,
            "snapshot_slots_total": self.num_snapshot_slots, "snapshot_slots_used": self._slots.snapshots,
            "bytes_total": self.nbytes(), "slot_bytes": self.slot_bytes, "page_bytes": self.page_bytes,
            **self.stats, "snapshots_evicted": self._slots.evicted, "snapshots_declined": self._slots.declined,
        }

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def record_prefix_query(self, query_tokens: int, hit_tokens: int) -> None:
        self.stats["prefix_query_tokens"] += query_tokens
        self.stats["prefix_hit_tokens"] += hit_tokens

    # -- a sequence's memory ---------------------------------------------------------------------
    def take_slot(self, mem: SeqCache, keep: PrefixHit | None = None) -> bool:
        """Give mem a zeroed slot, taken back from the snapshot worth least if none is free
        (`keep`'s, the hit mem is about to start from, only if no other can go); False when
        max_num_seqs sequences hold slots already."""
        slot = self._slots.take_running(keep.chain[-1] if keep is not None else None)
        if slot is None:
            return False
        mem.slot = slot
        self._copy_slot(None, mem.slot)
        return True

    def grow(self, mem: SeqCache, num_tokens: int) -> bool:
        """Pages for num_tokens (evicting idle cached pages if it must); False when none is left."""
        while len(mem.pages) < self.pages_for(num_tokens):
            p = self._alloc_page()
            if p is None:
                return False
            mem.pages.append(p)
        return True

    def can_grow(self, mem: SeqCache, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(mem.pages)
        return len(self._free_pages) + self._idle.count >= need

    def release(self, mem: SeqCache, failed: bool = False) -> None:
        """Give back mem's slot and pages (cached ones lose a reference, private ones are freed).
        `failed`: also forget the pages it put in the prefix cache that no one else holds (computed
        in a step that failed, or imported for a request that failed: not trusted)."""
        self._release_pages(mem)
        if mem.slot is not None:
            self._slots.release_running(mem.slot)
            mem.slot = None
        mem.rolling, mem.reuse = None, 0  # base stays: the request's prompt matched what it matched
        if failed:
            for h in mem.added:
                blk = self._entries.get(h)
                if blk is not None and blk.ref == 0:
                    self._evict(blk)
                    self._free_pages.append(blk.page)
            mem.added = []

    def _release_pages(self, mem: SeqCache) -> None:
        for p in mem.pages:
            blk = self._page_entry.get(p)
            if blk is None:
                self._free_pages.append(p)
            else:
                assert blk.ref > 0, f"page {p} released more often than it was held"
                blk.ref -= 1
                if blk.ref == 0:
                    self._idle.add(blk)
        mem.pages, mem.shared = [], 0

    def share_pages(self, mem: SeqCache, tokens: list[int], hashes: list[bytes], num_computed: int) -> None:
        """Make the full pages of tokens computed so far shareable (`hashes` covers them at least;
        pages whose content is cached already stay private)."""
        ps = self.page_size
        full = min(num_computed, len(tokens), len(hashes) * ps) // ps
        for j in range(mem.shared, full):
            if self._register(hashes[j], tuple(tokens[j * ps:(j + 1) * ps]), j + 1, mem.pages[j], ref=1,
                              parent=hashes[j - 1] if j else None):
                mem.added.append(hashes[j])
        mem.shared = max(mem.shared, full)

    def store_snapshot(self, mem: SeqCache, h: bytes, depth: int, states: KDAStates | None = None,
                       rolling: bool = False) -> None:
        """Keep the KDA state after mem's page `depth` (chain hash h) with the cached page of that
        hash (mem's own, or the same content cached before, kept without a snapshot): `states`
        taken mid-chunk, or mem's slot as it is now. `rolling`: a snapshot at the end of what mem
        has computed, which mem's next rolling one supersedes (given up then, unless a request
        matched its page meanwhile)."""
        blk = self._entries.get(h)
        if blk is None or blk.depth != depth:
            return
        if blk.hits == 0:  # a page no other request matched (note_reuse set the others' base)
            blk.base = mem.base
        if states is None:
            states = self._read_slot(mem.slot)
        old = self._entries.get(mem.rolling) if rolling and mem.rolling is not None else None
        if rolling:  # the conversation's reuse so far counts toward its newest snapshot's worth
            blk.inherited = max(blk.inherited, mem.reuse)
        if self._store_snapshot(blk, states) and rolling:
            blk.rolling = True
            if old is not None and old is not blk and old.hits == 0:
                self._slots.drop(old)
            mem.rolling = h

    def cache_batch(self, lengths: list[int], mems: list[SeqCache], context: list[int],
                    snapshot_offsets: dict[int, list[int]] | None = None,
                    table_width: Callable[[int], int] | None = None) -> CacheBatch:
        """The model's view of one forward over these sequences (model/cache.py). `table_width`
        (a function of the most pages any sequence holds): the page table's width, padded with
        page 0 past every sequence's end (a compiled graph serves one width)."""
        dev = self.device
        width = max(1, max(len(m.pages) for m in mems))
        width = width if table_width is None else max(width, table_width(width))
        table = np.zeros((len(mems), width), dtype=np.int64)
        for i, m in enumerate(mems):
            table[i, :len(m.pages)] = self._page_row(m)
        return CacheBatch(cu_seqlens=int64_tensor(list(itertools.accumulate(lengths, initial=0)), dev),
                          context_lens=int64_tensor(context, dev), kda_slots=int64_tensor([m.slot for m in mems], dev),
                          page_table=int64_tensor(table, dev),
                          kda=self._kda, mla_pages=self._mla, decode=all(n == 1 for n in lengths),
                          max_context=max(context), max_new=max(lengths), snapshot_offsets=snapshot_offsets or {})

    @staticmethod
    def _page_row(mem: SeqCache) -> np.ndarray:
        """mem's pages as int64: a decode step appends a page at most, so the row is extended by
        what was appended (a list of 8K pages converted anew: ~0.13 ms a step); a list replaced
        (released, or taken from a prefix hit or an import) is converted whole. The manager only
        appends to a page list or replaces it (no page in the middle is rewritten in place)."""
        pages, n, k = mem.pages, len(mem.pages), mem.row_len
        # a new list, or one cut short or whose last page changed in place (a copy-on-write of
        # the page being written would do that): read anew
        if mem.row_of is not pages or k > n or (k and mem.row[k - 1] != pages[k - 1]):
            mem.row, mem.row_of, mem.row_len = None, pages, 0
        if mem.row is None or len(mem.row) < n:
            grown = np.empty(max(16, 1 << n.bit_length()), dtype=np.int64)
            grown[:mem.row_len] = mem.row[:mem.row_len] if mem.row is not None else 0
            mem.row = grown
        mem.row[mem.row_len:n] = pages[mem.row_len:]
        mem.row_len = n
        return mem.row[:n]

    def compile_batch(self, n: int, table_width: Callable[[int], int], private: bool) -> CacheBatch:
        """A decode batch of n sequences, a token each over one token of context (slots 0..n-1,
        pages 1..n), to trace and first run a compiled decode graph on. `private`: over scratch
        pools of this cache's shapes, dtypes and strides (left unwritten past the rows it uses:
        memory the OS maps only when written), so the compile touches no slot or page of this
        cache and may run in a thread while steps run; otherwise over this cache's own pools,
        only before any request holds a slot or page (a slot is zeroed when taken, and a page's
        rows are never read past a sequence's length)."""
        if not 1 <= n <= self.ec.max_num_seqs:
            raise ValueError(f"compile_batch: n must be in [1, max_num_seqs={self.ec.max_num_seqs}], got {n}")
        pages = [(i + 1) % (self.num_pages if self.page_bytes else 1) for i in range(n)]  # page 0 pads
        cb = self.cache_batch([1] * n, [SeqCache(slot=i, pages=[p]) for i, p in enumerate(pages)], [1] * n,
                              table_width=table_width)
        if not private:
            return cb

        def scratch(t: torch.Tensor, rows: int) -> torch.Tensor:
            s = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            s[:rows].zero_()
            return s

        return replace(cb, kda={l: KDAPool(scratch(p.recurrent, n), scratch(p.conv, n))
                                 for l, p in self._kda.items()},
                       mla_pages={l: scratch(t, max(pages) + 1) for l, t in self._mla.items()})

    # -- prefix hits -----------------------------------------------------------------------------
    def find_prefix(self, tokens: list[int], hashes: list[bytes], limit: int) -> PrefixHit | None:
        """The longest cached prefix of tokens that ends on a page with a snapshot and covers
        fewer than `limit` tokens. Touches the pages it walks (LRU)."""
        chain, best = [], 0
        self._clock += 1
        for j, blk in enumerate(self._walk(tokens, hashes)):
            blk.last_used = self._clock
            if blk.ref == 0:
                self._idle.touch(blk)
            chain.append(blk)
            if blk.snapshot_slot is not None and (j + 1) * self.page_size < limit:
                best = j + 1
        return PrefixHit(tuple(chain[:best]), best * self.page_size) if best else None

    def snapshot_states(self, hit: PrefixHit) -> KDAStates:
        """The KDA state a hit would start from (views; the debug verifier reads them)."""
        return self._read_slot(hit.chain[-1].snapshot_slot)

    def reject(self, hit: PrefixHit) -> None:
        """The hit's snapshot was found wrong: drop it."""
        self.stats["snapshots_rejected"] += 1
        self._slots.drop(hit.chain[-1])

    def start_from(self, mem: SeqCache, hit: PrefixHit) -> bool:
        """mem (a slot, no pages) takes the hit's pages and its snapshot; False (nothing taken)
        when the snapshot is gone since the hit was found."""
        last = hit.chain[-1]
        if last.snapshot_slot is None:
            return False
        for blk in hit.chain:
            self._hold(blk)
        mem.pages = [b.page for b in hit.chain]
        mem.shared = len(hit.chain)
        self._copy_slot(last.snapshot_slot, mem.slot)
        # a conversation's reuse carries on only from its own earlier turn's snapshot: a shared
        # prefix's (a system prompt's) uses are that prefix's, not the conversation's
        mem.reuse = last.hits + last.inherited if last.rolling else 0
        return True

    def note_reuse(self, mem: SeqCache, tokens: list[int], hashes: list[bytes]) -> int:
        """mem's request starts and its tokens match these cached pages: each served one more
        request (whether or not it resumes there; a snapshot's worth counts them). Each page's
        base becomes the deepest snapshot before it on a page more requests matched (hits fall
        along a chain: a shared prefix's pages have more than the ones past it), and mem's the
        deepest snapshot it matched. Returns the depth of the last page matched when that page
        keeps no snapshot and a cached page goes on from it (0 otherwise): where this request's
        tokens leave an earlier request's, the end of what they share (a system prompt's, often
        between two `snapshot_interval` pages), so a snapshot there lets the next request with
        that prefix resume at its end. Where nothing cached goes on (an earlier request still
        computing its prompt, or the rest of its chain evicted) the prompts may not part there."""
        chain = list(self._walk(tokens, hashes))
        for blk in chain:
            blk.hits += 1
        levels: list[tuple[int, int]] = []  # (hits, depth of the deepest snapshot so far with them), hits falling
        mem.base = 0
        for blk in chain:
            i = len(levels)
            while i and levels[i - 1][0] <= blk.hits:  # a step or two: hits do not rise along a chain
                i -= 1
            blk.base = levels[i - 1][1] if i else 0
            if blk.snapshot_slot is not None:
                self._slots.renew(blk)
                while levels and levels[-1][0] <= blk.hits:
                    levels.pop()
                levels.append((blk.hits, blk.depth))
                mem.base = blk.depth
        last = chain[-1] if chain else None
        return last.depth if last is not None and last.snapshot_slot is None and last.children > 0 else 0

    def _walk(self, tokens: list[int], hashes: list[bytes]):
        """The cached pages of tokens' chain, from the first, while they are cached."""
        ps = self.page_size
        for j, h in enumerate(hashes):
            blk = self._cached(h, tuple(tokens[j * ps:(j + 1) * ps]))
            if blk is None:
                return
            yield blk

    def prefix_depth(self, tokens: list[int], hashes: list[bytes]) -> int:
        """The deepest page tokens could start from here (contiguous cached pages ending on one
        with a snapshot), without touching LRU order."""
        best = 0
        for j, blk in enumerate(self._walk(tokens, hashes)):
            if blk.snapshot_slot is not None:
                best = j + 1
        return best

    def evict_idle(self) -> int:
        """Drop every cached page no running sequence holds (memory pressure, an operator's
        reset). Returns the count."""
        idle = [b for b in self._entries.values() if b.ref == 0]
        for b in idle:
            self._evict(b)
            self._free_pages.append(b.page)
        self._idle.clear()
        return len(idle)

    # -- state in and out (the handoff connector, handoff.py) ----------------------------------------
    def read_sequence(self, mem: SeqCache, num_tokens: int) -> tuple[KDAStates, Latents]:
        """mem's KDA states and its first num_tokens latents in position order (views / gathers)."""
        lat = {}
        if self.page_bytes:
            idx = torch.tensor(mem.pages[: self.pages_for(num_tokens)], dtype=torch.long, device=self.device)
            lat = {l: t[idx].reshape(-1, t.shape[-1])[:num_tokens] for l, t in self._mla.items()}
        return self._read_slot(mem.slot), lat

    def import_sequence(self, mem: SeqCache, prompt: list[int], hashes: list[bytes], latents: Latents,
                        states: KDAStates) -> int | None:
        """Load a prompt another engine computed into mem (which holds a slot): pages this cache
        holds for its prefix (`hashes`; none without prefix caching) are shared, the rest written
        from `latents`; `states` go into the slot. Returns the prompt tokens served from pages
        held here; None (mem unchanged) when the pages do not fit now."""
        reuse = list(self._walk(prompt, hashes))
        for blk in reuse:
            self._hold(blk)
        mem.pages, mem.shared = [b.page for b in reuse], len(reuse)
        if not self.can_grow(mem, len(prompt) + 1):
            self._release_pages(mem)
            return None
        self.grow(mem, len(prompt) + 1)
        self._write_latents(mem.pages, len(reuse), latents)
        self._write_slot(mem.slot, states)
        return len(reuse) * self.page_size

    def copy_prefix(self, tokens: list[int], hashes: list[bytes], only: set[bytes] | None = None,
                    bare: Collection[bytes] = ()) -> PrefixCopy:
        """The pages of tokens' resumable prefix here (prefix_depth) whose hash is in `only` (every
        page when None) and, when it is in `bare` (pages the receiver holds without a snapshot),
        that keep a snapshot here: their latents and snapshots, copied with one gather per layer
        and part: the cache may change as soon as this returns."""
        walk = list(self._walk(tokens, hashes))[: self.prefix_depth(tokens, hashes)]
        bare = bare if isinstance(bare, (set, frozenset)) else set(bare)
        chosen = [(j, blk) for j, blk in enumerate(walk) if (only is None or hashes[j] in only) and
                  (blk.snapshot_slot is not None or hashes[j] not in bare)]
        if not chosen:
            return PrefixCopy([], [], {}, [], {})
        pages = torch.tensor([blk.page for _, blk in chosen], dtype=torch.long, device=self.device)
        latents = {l: t.index_select(0, pages) for l, t in self._mla.items()}
        snapped = [blk for _, blk in chosen if blk.snapshot_slot is not None]
        rows = itertools.count()  # each snapshot's row in `snaps`, in order
        snaps = {}
        if snapped:
            slots = torch.tensor([blk.snapshot_slot for blk in snapped], dtype=torch.long, device=self.device)
            snaps = {l: (p.conv.index_select(0, slots), p.recurrent.index_select(0, slots))
                     for l, p in self._kda.items()}
        return PrefixCopy([hashes[j] for j, _ in chosen], [j for j, _ in chosen], latents,
                          [next(rows) if blk.snapshot_slot is not None else None for _, blk in chosen], snaps)

    def import_prefix_pages(self, hashes: list[bytes], tokens: list[tuple[int, ...]], latents: Latents,
                            snapshots: dict[int, KDAStates]) -> int:
        """Cache a prompt's first pages computed elsewhere (page j: hashes[j], tokens[j], rows
        j * page_size.. of each layer's latents, and snapshots[j] if given): the latents of the
        pages this cache lacks, in one indexed copy per layer, and a snapshot where a page has none
        (what is cached here is never replaced). Pages come from the free list or evict idle pages
        not of this chain; where none is left the chain stops (never evicting its own first pages
        for its last). The chain is then used as one: later evictions cut it from its end. Returns
        the pages of the chain now cached."""
        room = len(self._free_pages) + self._idle.count  # pages a placement may take
        chain: list[_CachedPage] = []
        placed: list[int] = []  # the cache pages written, and the run's page each holds
        rows: list[int] = []
        for j, (h, tok) in enumerate(zip(hashes, tokens)):
            blk = self._cached(h, tok)
            if blk is None:
                page = self._alloc_page() if room else None
                if page is None:
                    break
                room -= 1
                if not self._register(h, tok, j + 1, page, ref=0, parent=hashes[j - 1] if j else None):
                    self._free_pages.append(page)  # the hash is cached with other tokens
                    break
                placed.append(page)
                rows.append(j)
                blk = self._entries[h]
            else:  # cached already: used now, so the placements after it evict older pages first
                self._clock += 1
                blk.last_used = self._clock
                if blk.ref == 0:
                    room -= 1
                    self._idle.touch(blk)
            chain.append(blk)
            if j in snapshots:
                self._store_snapshot(blk, snapshots[j])
        self._clock += 1
        for blk in chain:
            blk.last_used = self._clock
            if blk.ref == 0:
                self._idle.touch(blk)
        if placed:
            ps, n = self.page_size, len(hashes)
            at = torch.tensor(placed, dtype=torch.long, device=self.device)
            pick = torch.tensor(rows, dtype=torch.long, device=self.device)
            for l, lat in latents.items():
                self._mla[l].index_copy_(0, at, lat[: n * ps].view(n, ps, -1).index_select(0, pick))
        return len(chain)

    # -- the tables (private) --------------------------------------------------------------------
    def _cached(self, h: bytes, tokens: tuple[int, ...]) -> _CachedPage | None:
        blk = self._entries.get(h)
        return blk if blk is not None and blk.tokens == tokens else None

    def _register(self, h: bytes, tokens: tuple[int, ...], depth: int, page: int, ref: int,
                  parent: bytes | None = None) -> bool:
        """Make a full, computed page shareable (held by `ref` running sequences; `parent`: the
        hash of the page before it in its chain). False if that content is cached already."""
        if h in self._entries or page in self._page_entry:
            return False
        self._clock += 1
        blk = _CachedPage(h, tokens, depth, page, ref=ref, last_used=self._clock, parent=parent)
        up = self._entries.get(parent) if parent is not None else None
        if up is not None:
            up.children += 1
        self._entries[h] = blk
        self._page_entry[page] = blk
        if ref == 0:
            self._idle.add(blk)
        return True

    def _hold(self, blk: _CachedPage) -> None:
        """One more running sequence holds blk (an idle page no longer is)."""
        if blk.ref == 0:
            self._idle.discard(blk)
        blk.ref += 1

    def _alloc_page(self) -> int | None:
        if self._free_pages:
            return self._free_pages.pop()
        victim = self._idle.pop()
        if victim is None:
            return None
        self._evict(victim)
        return victim.page

    def _store_snapshot(self, blk: _CachedPage, states: KDAStates) -> bool:
        """Keep states as blk's snapshot; False when blk has one already (a kept snapshot is never
        replaced) or no slot can be had for it (kda_slots.py)."""
        if blk.snapshot_slot is not None or self._slots.keep(blk) is None:
            return False
        self._write_slot(blk.snapshot_slot, states)
        self.stats["snapshots_taken"] += 1
        return True

    def _evict(self, blk: _CachedPage) -> None:
        if blk.ref == 0:
            self._idle.discard(blk)
        self._slots.drop(blk)
        del self._entries[blk.hash]
        del self._page_entry[blk.page]
        up = self._entries.get(blk.parent) if blk.parent is not None else None
        if up is not None and up.children > 0:  # (a parent cached anew after blk counts it not)
            up.children -= 1
        self.stats["evicted_pages"] += 1

    def _copy_slot(self, src: int | None, dst: int) -> None:
        """dst <- src for every KDA layer (zeros when src is None)."""
        for p in self._kda.values():
            for t in (p.recurrent, p.conv):
                if src is None:
                    t[dst].zero_()
                else:
                    t[dst].copy_(t[src])

    def _read_slot(self, slot: int) -> KDAStates:
        return {l: (p.conv[slot], p.recurrent[slot]) for l, p in self._kda.items()}

    def _write_slot(self, slot: int, states: KDAStates) -> None:
        for l, (conv, rec) in states.items():
            self._kda[l].conv[slot].copy_(conv)
            self._kda[l].recurrent[slot].copy_(rec)

    def _write_latents(self, pages: list[int], first_page: int, latents: Latents) -> None:
        """Fill pages[first_page:] with latents[layer][first_page * page_size:] (the rest are
        shared pages that already hold them)."""
        ps = self.page_size
        for l, lat in latents.items():
            j0, full = first_page, min(len(pages), lat.shape[0] // ps)
            if full - j0 > 1:  # several pages the rows fill whole: one indexed copy, not one per page
                at = torch.tensor(pages[j0:full], dtype=torch.long, device=lat.device)
                self._mla[l].index_copy_(0, at, lat[j0 * ps:full * ps].view(full - j0, ps, -1))
                j0 = full
            for j in range(j0, len(pages)):
                rows = lat[j * ps:(j + 1) * ps]
                self._mla[l][pages[j], : rows.shape[0]].copy_(rows)
