"""Continuous batching: which sequences run in the next forward, and with how many tokens.

Every sequence is a list of tokens (prompt, then what it generated) of which `num_computed` are
in the cache. A step feeds each scheduled sequence the next tokens after `num_computed`: a
prefill chunk, or the one token it just sampled; the same code path serves both, so chunked
prefill mixes with decode. Running sequences go first, oldest first; waiting ones are admitted
while the token budget, the sequence cap and memory allow. When a running sequence needs a page
and none is left, the youngest running sequence is preempted: its memory is freed and it waits
to be recomputed from its tokens, so what it already produced is unaffected.

A forward that raises cannot say which request caused it. Every sequence in it is preempted
(recompute is exact) and marked a suspect; a suspect runs alone until it has recomputed past the
point of the failure, so the culprit fails alone and the others continue unchanged.
"""
from __future__ import annotations

import collections.abc
import enum
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache_manager import CacheManager, KDAStates, PrefixHit, SeqCache, page_hashes
from .detokenizer import DetokStream, StopMatcher
from .handoff import Imported
from .prompt_media import SequenceMedia
from .params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    arrival: int = 0  # order of admission to the scheduler (Scheduler.add)
    mem: SeqCache = field(default_factory=SeqCache)  # its KDA slot and MLA pages (CacheManager's)
    num_computed: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full pages: the prompt's, then computed ones
    generator: torch.Generator | None = None
    detok: DetokStream | None = None
    stopper: StopMatcher | None = None
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    preemptions: int = 0
    admitted: bool = False  # admitted at least once (prefix queries are counted once per request)
    prefill_only: bool = False  # export the cache state after the first token (disaggregated prefill)
    suspect_until: int = 0  # run alone until num_computed reaches this (after a failed batch)
    imported: Imported | None = None  # a handed-over state waiting for admission
    media: SequenceMedia | None = None  # images / video chunks of the prompt (prompt_media.py)
    aborted: bool = False  # its caller gave it up: no output of it is delivered any more
    branch: int = 0  # prompt page where it leaves a cached prompt that kept no snapshot there: one is due (0: none)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def first_tokens(self, n: int | None = None) -> "TokenView":
        """Its first n tokens (all by default) as a view: slicing it copies only the slice, so a
        step's bookkeeping does not copy the whole context (`tokens` does)."""
        return TokenView(self.prompt, self.output, self.length if n is None else n)

    def token_slice(self, a: int, b: int) -> list[int]:
        """tokens[a:b] for 0 <= a <= b <= length, without building `tokens`."""
        return _between(self.prompt, self.output, a, b)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def suspect(self) -> bool:
        return self.num_computed < self.suspect_until


def _between(prompt: list[int], output: list[int], a: int, b: int) -> list[int]:
    """(prompt + output)[a:b] for 0 <= a <= b, copying only those tokens."""
    P = len(prompt)
    if b <= P:
        return prompt[a:b]
    if a >= P:
        return output[a - P:b - P]
    return prompt[a:] + output[:b - P]


class TokenView(collections.abc.Sequence):
    """The first n tokens of a prompt followed by its output, read in place: a slice copies
    what it covers and nothing else (`Sequence.tokens` copies every token: ~4 ns each, 1.1 ms
    for 300K tokens, and a decode step read it twice per sequence)."""

    __slots__ = ("prompt", "output", "n")

    def __init__(self, prompt: list[int], output: list[int], n: int) -> None:
        if not 0 <= n <= len(prompt) + len(output):
            raise ValueError(f"TokenView: n must be in [0, {len(prompt) + len(output)}], got {n}")
        self.prompt, self.output, self.n = prompt, output, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(self.n)
            if step != 1:
                return [self[k] for k in range(a, b, step)]
            return _between(self.prompt, self.output, a, max(a, b))
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"TokenView index {i} out of range for {self.n} tokens")
        P = len(self.prompt)
        return self.prompt[i] if i < P else self.output[i - P]


@dataclass
class Scheduled:
    seq: Sequence
    num_tokens: int
    snapshot_offsets: list[int]  # page boundaries inside this chunk that get a KDA snapshot
    snapshot_at_end: bool  # the chunk ends on such a boundary: the slot itself is the snapshot


class Scheduler:
    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefix_caching: bool, snapshot_interval: int) -> None:
        self.cache = cache
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.prefix_caching, self.interval = prefix_caching, snapshot_interval
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self._arrival = itertools.count()
        # Optional debug check of a prefix hit: verifier(sequence, hit) -> bool.
        self.verifier: Callable[[Sequence, PrefixHit], bool] | None = None

    def add(self, seq: Sequence) -> None:
        if self.prefix_caching and not seq.hashes:
            spans = seq.media.spans if seq.media is not None else ()
            seq.hashes = page_hashes(seq.prompt, self.cache.page_size, media=spans)
        seq.arrival = next(self._arrival)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, failed: bool = False) -> None:
        """Finish or abort: give back its memory. `failed`: also forget the pages it made
        shareable (they were computed or imported for a request that failed)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.release(seq.mem, failed=failed)

    def preempt_for_recompute(self, seqs: list[Sequence], until: dict[int, int]) -> None:
        """After a failed forward: every sequence in it goes back to wait, marked suspect."""
        for seq in sorted(seqs, key=lambda s: s.arrival, reverse=True):
            target = until[id(seq)]
            self._preempt(seq)
            seq.suspect_until = max(seq.suspect_until, target)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.release(seq.mem)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _plan(self, seq: Sequence, n: int) -> Scheduled:
        """The chunk, with the prompt page boundaries in it that are due a KDA snapshot: every
        `snapshot_interval` pages (shared prefixes such as system prompts end somewhere among
        them), the prompt's last full page (the next turn of a conversation resends the
        whole prompt) and its branch page (where it leaves a cached prompt: the end of the prefix
        they share, so later requests with it resume there, not up to an interval short)."""
        offsets, at_end = [], False
        if self.prefix_caching:
            ps = self.cache.page_size
            step = ps * self.interval
            last = (len(seq.prompt) // ps) * ps
            lo, hi = seq.num_computed, min(seq.num_computed + n, last)
            ends = {b for b in (last, seq.branch * ps) if lo < b <= hi}
            due = sorted(set(range((lo // step + 1) * step, hi + 1, step)) | ends)
            for b in due:
                if b - lo == n:
                    at_end = True
                else:
                    offsets.append(b - lo)
        return Scheduled(seq, n, offsets, at_end)

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence a slot and, on a prefix hit, its cached pages and KDA state."""
        hit = None
        if self.prefix_caching and seq.hashes and seq.imported is None:
            hit = self.cache.find_prefix(seq.tokens, seq.hashes, limit=seq.length)
        if not self.cache.take_slot(seq.mem, keep=hit):
            return False
        seq.num_computed = 0
        if seq.imported is not None:
            return self._import(seq)
        if self.prefix_caching and seq.hashes and not seq.admitted:
            branch = self.cache.note_reuse(seq.mem, seq.tokens, seq.hashes)
            # inside the prompt only: its last full page is due a (rolling) snapshot anyway
            seq.branch = branch if branch < len(seq.prompt) // self.cache.page_size else 0
        if hit is not None and self.verifier is not None and not self.verifier(seq, hit):
            self.cache.reject(hit)
            hit = None
        if hit is not None and self.cache.start_from(seq.mem, hit):
            seq.num_computed = hit.num_tokens
        if not seq.admitted:
            seq.num_cached_tokens = seq.num_computed
        return True

    def _import(self, seq: Sequence) -> bool:
        """Admit a handed-over prompt: shared pages where this cache has them, the rest written
        from the state; the KDA state into the slot; the sequence goes on from its first output
        token."""
        n, ps = len(seq.prompt), self.cache.page_size
        imp = seq.imported
        reused = self.cache.import_sequence(seq.mem, seq.prompt, seq.hashes, imp.latents, imp.states)
        if reused is None:
            self.cache.release(seq.mem)
            return False
        seq.imported = None
        seq.num_computed = n
        if not seq.admitted:
            seq.num_cached_tokens = reused
        if self.prefix_caching:
            self.cache.share_pages(seq.mem, seq.prompt, seq.hashes, n)
            depth = n // ps
            if n % ps == 0 and depth > 0:  # the prompt's last page is due one
                self.cache.store_snapshot(seq.mem, seq.hashes[depth - 1], depth, rolling=depth % self.interval != 0)
        return True

    def schedule(self) -> list[Scheduled]:
        running = sorted(self.running, key=lambda s: s.arrival)
        suspects = [s for s in running if s.suspect]
        if suspects:  # isolation after a failed batch: one suspect alone
            return self._schedule_running(suspects[:1])
        if self.waiting and self.waiting[0].suspect:
            return self._schedule_waiting(self.max_tokens, alone=True)
        out = self._schedule_running(running)
        budget = self.max_tokens - sum(s.num_tokens for s in out)
        return out + self._schedule_waiting(budget, alone=False)

    def _schedule_running(self, seqs: list[Sequence]) -> list[Scheduled]:
        budget = self.max_tokens
        out: list[Scheduled] = []
        for seq in seqs:
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            n = min(seq.length - seq.num_computed, budget)
            while not self.cache.grow(seq.mem, seq.num_computed + n):
                victim = max((s for s in self.running if s not in [o.seq for o in out]), key=lambda s: s.arrival)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            out.append(self._plan(seq, n))
            budget -= n
        return out

    def _schedule_waiting(self, budget: int, alone: bool) -> list[Scheduled]:
        out: list[Scheduled] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if out and (alone or seq.suspect):
                break
            if not self._admit(seq):
                break
            n = min(seq.length - seq.num_computed, budget)
            if not self.cache.can_grow(seq.mem, seq.num_computed + n) or \
                    not self.cache.grow(seq.mem, seq.num_computed + n):
                self.cache.release(seq.mem)  # not now: wait for memory rather than preempting running work
                break
            self.waiting.popleft()
            if self.prefix_caching and not seq.admitted:  # a re-admission is not a new query
                self.cache.record_prefix_query(len(seq.prompt), seq.num_cached_tokens)
            seq.admitted = True
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(self._plan(seq, n))
            budget -= n
            if alone:
                break
        return out

    def after_step(self, sch: Scheduled, snapshots: dict[int, KDAStates]) -> None:
        """Advance num_computed; share completed prompt pages; store KDA snapshots (`snapshots`
        {offset: states} for mid-chunk ones; the slot for the end)."""
        seq = sch.seq
        seq.num_computed += sch.num_tokens
        if not self.prefix_caching:
            return
        ps, end = self.cache.page_size, seq.num_computed
        self._extend_hashes(seq)
        self.cache.share_pages(seq.mem, seq.first_tokens(), seq.hashes, end)
        start = end - sch.num_tokens
        prompt_pages = len(seq.prompt) // ps
        due = [(off, snapshots.get(off)) for off in sch.snapshot_offsets]
        # The slot is the state after `end`: a snapshot at the chunk's end if it is due, or if it
        # ends a generated page (what the conversation's next turn resumes from)
        if sch.snapshot_at_end or (end % ps == 0 and end // ps > prompt_pages):
            due.append((sch.num_tokens, None))
        for off, states in due:
            depth = (start + off) // ps
            rolling = depth > prompt_pages or (depth % self.interval != 0 and depth != seq.branch)
            self.cache.store_snapshot(seq.mem, seq.hashes[depth - 1], depth, states, rolling=rolling)

    def _extend_hashes(self, seq: Sequence) -> None:
        """seq.hashes covers every full page of its computed tokens (prompt, then output)."""
        ps = self.cache.page_size
        full = seq.num_computed // ps
        if len(seq.hashes) < full:
            spans = seq.media.spans if seq.media is not None else ()
            parent = seq.hashes[-1] if seq.hashes else b""
            seq.hashes += page_hashes(seq.first_tokens(full * ps), ps, parent, spans, first=len(seq.hashes))
