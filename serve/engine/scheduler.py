"""Continuous batching: which sequences run in the next forward, and with how many tokens.

Every sequence is a list of tokens (prompt, then what it generated) of which `num_computed` are
in the cache. A step feeds each scheduled sequence the next tokens after `num_computed`: a
prefill chunk, or the one token it just sampled; the same code path serves both, so chunked
prefill mixes with decode. Running sequences go first, oldest first; waiting ones are admitted
while the token budget, the sequence cap and memory allow. When a running sequence needs a page
and none is left, the youngest running sequence is preempted: its memory is freed and it waits
to be recomputed from its tokens, so what it already produced is unaffected.
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from .cache_manager import CacheManager, CachedBlock, block_hashes
from .detokenizer import DetokStream, StopMatcher
from .params import SamplingParams

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    arrival: int = field(default_factory=lambda: next(_arrival))
    slot: int | None = None
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    registered_blocks: int = 0  # full prompt blocks made shareable so far
    hashes: list[bytes] = field(default_factory=list)
    generator: torch.Generator | None = None
    detok: DetokStream | None = None
    stopper: StopMatcher | None = None
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int
    snapshot_offsets: list[int]  # KDA checkpoint offsets within this chunk


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool, checkpoint_interval: int) -> None:
        self.cache = cache
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.prefix_caching, self.interval = prefix_caching, checkpoint_interval
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        # Optional debug check of a prefix hit: verifier(prefix tokens, checkpoint slot) -> bool.
        self.verifier = None

    def add(self, seq: Sequence) -> None:
        if self.prefix_caching:
            seq.hashes = block_hashes(seq.prompt, self.cache.bs)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Finish or abort: give back its memory."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        self.cache.release_pages(seq.pages)
        seq.pages = []
        if seq.slot is not None:
            self.cache.free_run_slot(seq.slot)
            seq.slot = None
        seq.registered_blocks = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _grow(self, seq: Sequence, upto_tokens: int) -> bool:
        while len(seq.pages) < self.cache.pages_for(upto_tokens):
            p = self.cache.alloc_page()
            if p is None:
                return False
            seq.pages.append(p)
        return True

    def _snapshots(self, seq: Sequence, n: int) -> list[int]:
        if not self.prefix_caching or not self.cache.num_ckpt_slots:
            return []
        bs, step = self.cache.bs, self.cache.bs * self.interval
        lo, hi = seq.num_computed, min(seq.num_computed + n, (len(seq.prompt) // bs) * bs)
        first = (lo // step + 1) * step
        return [b - lo for b in range(first, hi + 1, step)]

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence a slot and, on a prefix hit, its cached pages and KDA state."""
        slot = self.cache.alloc_run_slot()
        if slot is None:
            return False
        seq.slot = slot
        seq.num_computed = 0
        seq.num_cached_tokens = 0
        if self.prefix_caching and seq.hashes:
            chain, best = self.cache.lookup(seq.tokens, seq.hashes, limit=seq.length)
            if best is not None and self.verifier is not None and \
                    not self.verifier(seq.tokens[: best.depth * self.cache.bs], best.ckpt_slot):
                self.cache.stats["checkpoints_rejected"] += 1
                self.cache._drop_ckpt(best)
                best = None
            if best is not None:
                hit = chain[: best.depth]
                for blk in hit:
                    self.cache.hold(blk)
                seq.pages = [b.page for b in hit]
                seq.registered_blocks = best.depth
                self.cache.copy_slot(best.ckpt_slot, slot)
                seq.num_computed = seq.num_cached_tokens = best.depth * self.cache.bs
        return True

    def schedule(self) -> list[Scheduled]:
        budget = self.max_tokens
        out: list[Scheduled] = []
        for seq in sorted(self.running, key=lambda s: s.arrival):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.length - seq.num_computed, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = max((s for s in self.running if s not in [o.seq for o in out]), key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            out.append(Scheduled(seq, n, self._snapshots(seq, n)))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            n = min(seq.length - seq.num_computed, budget)
            have = len(seq.pages)
            if not self.cache.can_alloc(self.cache.pages_for(seq.num_computed + n) - have) or \
                    not self._grow(seq, seq.num_computed + n):
                self._release(seq)  # not now: wait for memory rather than preempting running work
                break
            self.waiting.popleft()
            if self.prefix_caching:
                self.cache.stats["prefix_query_tokens"] += len(seq.prompt)
                self.cache.stats["prefix_hit_tokens"] += seq.num_cached_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(Scheduled(seq, n, self._snapshots(seq, n)))
            budget -= n
        return out

    def after_step(self, sch: Scheduled, snapshot_states: dict[int, dict[int, tuple]]) -> None:
        """Advance num_computed; share completed prompt blocks; store KDA checkpoints."""
        seq = sch.seq
        seq.num_computed += sch.num_tokens
        if not self.prefix_caching:
            return
        full = min(seq.num_computed, len(seq.prompt)) // self.cache.bs
        for j in range(seq.registered_blocks, full):
            toks = tuple(seq.prompt[j * self.cache.bs:(j + 1) * self.cache.bs])
            self.cache.register(seq.hashes[j], toks, j + 1, seq.pages[j])
        seq.registered_blocks = max(seq.registered_blocks, full)
        start = seq.num_computed - sch.num_tokens
        for off, states in snapshot_states.items():
            depth = (start + off) // self.cache.bs
            blk: CachedBlock | None = self.cache.blocks.get(seq.hashes[depth - 1])
            if blk is not None and blk.page == seq.pages[depth - 1]:
                self.cache.store_checkpoint(blk, states)
