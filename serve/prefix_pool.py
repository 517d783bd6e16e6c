"""A prefix cache shared by the prefill replicas: pages of prompt latents and the KDA snapshots at
page boundaries, published under their chain hashes, indexed and held by one named actor with a
byte budget and LRU eviction.

A prefill replica that misses locally but finds a longer resumable prefix in the pool loads those
pages (and the snapshot at the last one) into its own cache instead of recomputing them. Resuming
needs every page from the first to a page with a snapshot, so `lookup` answers the deepest such
page. The pool holds the arrays itself (they were sent to it): a publisher that dies takes nothing
with it. It holds no key: pages stay sealed by their publisher, and an importer checks the seal
(handoff.py), so the pool cannot hand a replica anything the replicas did not make.
"""
from __future__ import annotations

import pickle
from collections import OrderedDict

from k3.serve.engine.handoff import PoolPage, PoolRun


def pack_pages(pages: list[PoolPage]) -> bytes:
    """A publish's pages as one bytes object (pickle, the arrays in band). A publisher packs them
    in a background thread (`AsyncEngine.in_background`), so neither its event loop nor Ray's
    pickling of the call's arguments walks the pages' objects at normal priority (4.5 ms for the
    140 pages of a 2K-token prompt of k3-tiny, docs/benchmarks.md)."""
    return pickle.dumps(list(pages), protocol=pickle.HIGHEST_PROTOCOL)


def unpack_pages(blob: bytes) -> list[PoolPage]:
    """`pack_pages`' inverse; ValueError for bytes that are not a list of pool pages. Unpickling
    trusts the caller as far as Ray does, which unpickles every actor call's arguments; a page's
    content is not trusted here (the pool holds no key: importers check the seals)."""
    try:
        pages = pickle.loads(blob)
    except Exception as e:  # noqa: BLE001 - whatever the bytes make pickle raise
        raise ValueError(f"publish: the bytes are not packed pool pages ({type(e).__name__}: {e})") from None
    if not isinstance(pages, list) or not all(isinstance(p, PoolPage) for p in pages):
        kinds = sorted({type(p).__name__ for p in pages}) if isinstance(pages, list) else [type(pages).__name__]
        raise ValueError(f"publish: expected a list of PoolPage, got {', '.join(kinds)}")
    return pages


class PrefixPool:
    """The index and store (run as a named Ray actor; plain methods, so tests call it directly)."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
        self.budget = budget_bytes
        self.pages: OrderedDict[bytes, PoolPage] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.counts = {"published": 0, "evicted": 0, "fetched": 0, "lookups": 0}

    def wanted(self, hashes: list[bytes]) -> tuple[list[bytes], list[bytes]]:
        """What a publisher of these pages should send: (the hashes the pool does not hold, the
        hashes it holds without a snapshot). A prefix the pool already has whole costs the
        publisher one call and no copying."""
        missing, bare = [], []
        for h in hashes:
            p = self.pages.get(h)
            if p is None:
                missing.append(h)
            elif p.snapshot is None:
                bare.append(h)
        return missing, bare

    def publish(self, pages: list[PoolPage], copy: bool = True) -> int:
        """Store pages (a page already held keeps its data but may gain a snapshot); evict the
        least recently used past the budget. Returns how many were stored or updated.

        What is stored is a copy (`PoolPage.owned`): the arrays a Ray call delivers are views of
        that call's one argument buffer, held in the object store while any of them lives, so a
        single surviving page would keep a whole publish's bytes (6 MB for a 2K-token prompt of
        k3-tiny) outside the budget. `copy=False` stores pages whose arrays are their own
        (`unpack_pages` makes each array a buffer of its own) as they are."""
        stored = 0
        for p in pages:
            have = self.pages.get(p.hash)
            if have is not None:
                if have.snapshot is None and p.snapshot is not None:
                    self.bytes += p.nbytes - have.nbytes
                    self.pages[p.hash] = p.owned() if copy else p
                    stored += 1
                self.pages.move_to_end(p.hash)
                continue
            if p.nbytes > self.budget:
                continue
            self.pages[p.hash] = p.owned() if copy else p
            self.bytes += p.nbytes
            stored += 1
        self.counts["published"] += stored
        while self.bytes > self.budget:
            _, old = self.pages.popitem(last=False)
            self.bytes -= old.nbytes
            self.counts["evicted"] += 1
        return stored

    def lookup(self, hashes: list[bytes]) -> int:
        """The deepest d such that pages 1..d are all held and page d has a snapshot (0: none)."""
        self.counts["lookups"] += 1
        best = 0
        for d, h in enumerate(hashes, start=1):
            p = self.pages.get(h)
            if p is None:
                break
            if p.snapshot is not None:
                best = d
        return best

    def fetch(self, hashes: list[bytes], last_snapshot_only: bool = False) -> list[PoolPage]:
        """The pages for these hashes, in order, up to the first one the pool no longer holds.
        With last_snapshot_only, only the last page keeps its KDA snapshot: resuming needs just
        that one, and the snapshots are most of a page's bytes on a hybrid model."""
        out = []
        for h in hashes:
            p = self.pages.get(h)
            if p is None:
                break
            self.pages.move_to_end(h)
            out.append(p)
        self.counts["fetched"] += len(out)
        if last_snapshot_only:
            out = [p.without_snapshot() if i < len(out) - 1 and p.snapshot is not None else p
                   for i, p in enumerate(out)]
        return out

    def fetch_deeper(self, hashes: list[bytes], have_pages: int) -> PoolRun | None:
        """For a replica that holds the first `have_pages` of these pages itself, in one round
        trip: the pages of the deepest resumable prefix (`lookup`) when it is deeper than that, with
        only the last page's snapshot (`fetch`), packed as one run; else None."""
        depth = self.lookup(hashes)
        if depth <= have_pages:
            return None
        return PoolRun.of(self.fetch(hashes[:depth], last_snapshot_only=True))

    def stats(self) -> dict:
        return {"pages": len(self.pages), "bytes": self.bytes, "budget_bytes": self.budget, **self.counts}
