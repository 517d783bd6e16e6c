"""The prefix pool shared by prefill engines: pages and KDA snapshots published by one engine
load into another, which then resumes the prompt there exactly as if it had computed it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.prefix_pool import PrefixPool, pack_pages, unpack_pages

CFG = EngineConfig(page_size=8, snapshot_interval=2)
GREEDY = SamplingParams(max_tokens=6, temperature=0)


def rand(n, seed):
    return torch.randint(0, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def through(eng, fn):
    """Run fn in the engine's step thread, as the Serve replica does."""
    fut = eng.call(fn)
    eng.step()
    return fut.result(timeout=0)


def test_a_pool_hit_resumes_exactly_and_skips_the_pages(tiny_model):
    prefix = rand(48, 1)
    a, b = LLMEngine(tiny_model, CFG), LLMEngine(tiny_model, CFG)
    a.generate([prefix + [7]], GREEDY)
    pool = PrefixPool(budget_bytes=64 * 2**20)
    pages = through(a, lambda: a.export_prefix(prefix + [9, 9, 9]))
    assert [p.depth for p in pages] == list(range(1, 7)) and pages[-1].snapshot is not None
    assert pool.publish(pages) == 6 and pool.wanted([p.hash for p in pages])[0] == []
    prompt = prefix + [9, 9, 9]
    from k3.serve.engine.cache_manager import page_hashes

    depth = pool.lookup(page_hashes(prompt, 8))
    assert depth == 6  # 6 pages, snapshots at 2, 4 and 6
    assert through(b, lambda: b.cached_prefix_tokens(prompt)) == 0
    fetched = pool.fetch(page_hashes(prompt, 8)[:depth], last_snapshot_only=True)
    assert [p.snapshot is not None for p in fetched] == [False] * 5 + [True]  # resuming needs only the last
    assert [p.snapshot is not None for p in pool.fetch(page_hashes(prompt, 8)[:depth])] == [False, True] * 3
    got = through(b, lambda: b.import_prefix(prompt, fetched))
    assert got == 48
    out = b.generate([prompt], GREEDY)[0]
    cold = LLMEngine(tiny_model, CFG).generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 48 and out.token_ids == cold.token_ids
    assert b.stats()["pages_in_use"] == 0


def test_a_publisher_sends_only_what_the_pool_lacks(tiny_model):
    from k3.serve.engine.cache_manager import page_hashes

    prefix = rand(48, 4)
    a = LLMEngine(tiny_model, CFG)
    a.generate([prefix + [7]], GREEDY)
    hashes = page_hashes(prefix + [9], 8)
    pool = PrefixPool(budget_bytes=64 * 2**20)
    assert pool.wanted(hashes) == (hashes, [])
    every = through(a, lambda: a.export_prefix(prefix + [9]))
    bare = [dataclasses.replace(p, snapshot=None) for p in every[:4]]  # held, but without snapshots
    pool.publish(bare)
    missing, snapshotless = pool.wanted(hashes)
    assert missing == hashes[4:] and snapshotless == hashes[:4]
    only = through(a, lambda: a.export_prefix(prefix + [9], only=set(missing) | set(snapshotless)))
    assert [p.hash for p in only] == hashes
    # `bare`: of the pages the pool holds without a snapshot, only those that keep one here
    sent = through(a, lambda: a.export_prefix(prefix + [9], only=set(missing) | set(snapshotless), bare=snapshotless))
    assert [p.hash for p in sent] == [p.hash for p in only if p.hash in missing or p.snapshot is not None]
    assert [p.depth for p in sent] == [2, 4, 5, 6]
    pool.publish(sent)
    assert pool.wanted(hashes) == ([], [h for h, p in zip(hashes, every) if p.snapshot is None])
    assert through(a, lambda: a.export_prefix(prefix + [9], only=set())) == []


def test_the_snapshot_where_two_prompts_part_reaches_the_pool(tiny_model):
    # Snapshots every 2 pages; prompts share 5 pages. The second request keeps a snapshot at page
    # 5, where it leaves the first, and its publish sends it to the pool (which held page 5
    # without one): another engine then resumes a third such prompt after all 5 shared pages.
    from k3.serve.engine.cache_manager import page_hashes

    shared = rand(40, 11)
    first, second, third = (shared + rand(20, 12 + i) for i in range(3))
    a, b = LLMEngine(tiny_model, CFG), LLMEngine(tiny_model, CFG)
    pool = PrefixPool(budget_bytes=64 * 2**20)
    for prompt in (first, second):
        a.generate([prompt], GREEDY)
        missing, bare = pool.wanted(page_hashes(prompt, 8))
        pool.publish(through(a, lambda p=prompt: a.export_prefix(p, only=set(missing) | set(bare), bare=bare)))
    hashes = page_hashes(third, 8)
    assert pool.lookup(hashes[:len(third) // 8 - 1]) == 5
    fetched = pool.fetch_deeper(hashes[:(len(third) - 1) // 8], 0)
    assert through(b, lambda: b.import_prefix(third, fetched)) == 40
    out = b.generate([third], GREEDY)[0]
    assert out.cached_tokens == 40
    assert out.token_ids == LLMEngine(tiny_model, CFG).generate([third], GREEDY)[0].token_ids


class _Remote:
    """A Ray actor method as a prefill replica calls it (`.remote(...)`, awaited), run in place."""

    def __init__(self, fn):
        self.fn = fn

    async def _call(self, *args):
        return self.fn(*args)

    def remote(self, *args):
        return self._call(*args)


def test_a_prefill_replica_publishes_the_snapshot_where_prompts_part_and_nothing_twice(tiny_model):
    # `PrefillServer._publish` against a pool as its server receives a publish (packed bytes):
    # the first prompt's resumable pages (1-6: its last full page's snapshot gave way to its
    # answer's); the second's page 6 and the snapshot where it leaves the first (page 5, off the
    # 2-page grid); the second once more: nothing the pool lacks, nothing sent
    import asyncio
    import types

    from k3.serve.engine import AsyncEngine
    from k3.serve.engine.cache_manager import page_hashes
    from k3.serve.servers import PrefillServer

    pool = PrefixPool(budget_bytes=64 * 2**20)
    sent: list[int] = []

    def publish(blob):
        pages = unpack_pages(blob)
        sent.append(len(pages))
        return pool.publish(pages, copy=False)

    shared = rand(40, 21)
    first, second = shared + rand(20, 22), shared + rand(20, 23)
    eng = LLMEngine(tiny_model, CFG)
    server = PrefillServer.__new__(PrefillServer)  # no Serve replica: the parts _publish uses
    server.config = types.SimpleNamespace(engine=CFG)
    server.pool = types.SimpleNamespace(wanted=_Remote(pool.wanted), publish=_Remote(publish))
    for prompt in (first, second):
        eng.generate([prompt], GREEDY)
        server.engine = AsyncEngine(eng)
        asyncio.run(server._publish(prompt, []))
    assert sent == [6, 2]
    hashes = page_hashes(second, 8)
    assert pool.lookup(hashes[:6]) == 6 and pool.lookup(hashes[:5]) == 5
    assert pool.wanted(hashes)[1] == [hashes[0], hashes[2]]  # held without a snapshot, as here
    asyncio.run(server._publish(second, []))
    assert sent == [6, 2]


def test_the_pages_copied_between_steps_seal_the_same_after_the_cache_moves_on(tiny_model):
    # the step thread takes copies (copy_prefix); the sealing, in another thread in a replica, may
    # run after the engine has dropped and reused those pages: the same pages, bytes and digests
    # as an export in one go, none of them sharing memory with the cache
    prefix = rand(48, 5)
    a = LLMEngine(tiny_model, CFG)
    a.generate([prefix + [7]], GREEDY)
    want = through(a, lambda: a.export_prefix(prefix + [9]))
    copied = through(a, lambda: a.copy_prefix(prefix + [9]))
    cache = [t.numpy() for t in a.cache._mla.values()] + [t.numpy() for p in a.cache._kda.values()
                                                          for t in (p.conv, p.recurrent)]
    assert a.reset_prefix_cache() > 0
    a.generate([rand(48, 6) + [7], rand(40, 7)], GREEDY)  # the freed pages and slots written over
    got = a.seal_prefix(*copied)
    assert [p.hash for p in got] == [p.hash for p in want] and len(got) == 6
    for g, w in zip(got, want):
        assert (g.digest, g.snapshot_digest, g.tokens) == (w.digest, w.snapshot_digest, w.tokens)
        arrays = [*g.latents.values(), *(a for cr in (g.snapshot or {}).values() for a in cr)]
        assert not any(np.shares_memory(x, c) for x in arrays for c in cache)
    b = LLMEngine(tiny_model, CFG)
    assert through(b, lambda: b.import_prefix(prefix + [9], got)) == 48


def test_a_replica_seals_its_pages_in_a_background_thread(tiny_model):
    # AsyncEngine.export_prefix: the copy between two steps, the sealing in a thread of its own
    # below the caller's priority (on Linux); the pages those of an export in one go
    import asyncio
    import os
    import sys
    import threading

    from k3.serve.engine.async_engine import BACKGROUND_NICE, AsyncEngine

    prefix = rand(48, 8)
    eng = LLMEngine(tiny_model, CFG)
    eng.generate([prefix + [7]], GREEDY)
    want = eng.export_prefix(prefix + [9])
    seen, real = {}, eng.seal_prefix

    def spy(*args):
        seen["thread"] = threading.current_thread().name
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else None
        return real(*args)

    eng.seal_prefix = spy
    got = asyncio.run(AsyncEngine(eng).export_prefix(prefix + [9]))
    assert [(p.hash, p.digest, p.snapshot_digest) for p in got] == [(p.hash, p.digest, p.snapshot_digest) for p in want]
    assert seen["thread"].startswith("k3-pool-seal")
    if sys.platform == "linux":
        assert seen["nice"] == min(19, os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)


def test_pages_of_another_prompt_are_refused(tiny_model):
    a = LLMEngine(tiny_model, CFG)
    p1, p2 = rand(32, 2), rand(32, 3)
    a.generate([p1 + [1]], GREEDY)
    pages = through(a, lambda: a.export_prefix(p1 + [1]))
    b = LLMEngine(tiny_model, CFG)
    before = b.stats()
    with pytest.raises(ValueError, match="does not belong"):
        through(b, lambda: b.import_prefix(p2 + [1], pages))
    assert b.stats() == {**before, "steps": b.stats()["steps"]}


def test_budget_and_lru(tiny_model):
    a = LLMEngine(tiny_model, CFG)
    prompts = [rand(32, 10 + i) for i in range(3)]
    pages = []
    for p in prompts:
        a.generate([p + [1]], GREEDY)
        pages.append(through(a, lambda p=p: a.export_prefix(p + [1])))
    one = sum(pg.nbytes for pg in pages[0])
    pool = PrefixPool(budget_bytes=2 * one)
    pool.publish(pages[0])
    pool.publish(pages[1])
    pool.fetch([pg.hash for pg in pages[0]])  # prompt 0 is used again: prompt 1 is now the oldest
    pool.publish(pages[2])
    s = pool.stats()
    assert s["bytes"] <= 2 * one and s["evicted"] == len(pages[1])
    assert pool.lookup([pg.hash for pg in pages[0]]) == 4 and pool.lookup([pg.hash for pg in pages[1]]) == 0
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixPool(0)


def test_the_pool_keeps_copies_not_views_of_what_it_was_sent(tiny_model):
    # as Ray delivers a publish: every array a read-only view of one buffer of the whole call
    pages = pages_of(tiny_model, rand(32, 4) + [1])
    arrays = [a for p in pages for a in [*p.latents.values(), *(x for cr in (p.snapshot or {}).values() for x in cr)]]
    buf = np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])
    buf.flags.writeable = False
    ends = np.cumsum([a.nbytes for a in arrays])
    views = iter([buf[e - a.nbytes:e].view(a.dtype).reshape(a.shape) for a, e in zip(arrays, ends)])
    sent_pages = [dataclasses.replace(p, latents={k: next(views) for k in p.latents},
                                      snapshot=None if p.snapshot is None else
                                      {k: (next(views), next(views)) for k in p.snapshot}) for p in pages]
    pool = PrefixPool(budget_bytes=64 * 2**20)
    assert pool.publish(sent_pages) == len(pages)
    held = pool.fetch([p.hash for p in pages])
    for p, h in zip(pages, held):
        for k in p.latents:
            assert np.array_equal(h.latents[k], p.latents[k]) and not np.shares_memory(h.latents[k], buf)
        for k in (p.snapshot or {}):
            assert all(not np.shares_memory(x, buf) for x in h.snapshot[k])
        assert h.verified(KEY)  # the same bytes: the seals hold


def test_packed_pages_unpack_as_pages_of_their_own_and_the_pool_server_stores_them(tiny_model):
    """A prefill replica sends its publish packed (made in its background thread); the pool's
    server unpacks it in its own background thread and stores the pages without another copy."""
    import asyncio
    import pickle

    from k3.serve.servers import PrefixPoolServer

    pages = pages_of(tiny_model, rand(32, 5) + [1])
    blob = pack_pages(pages)
    got = unpack_pages(blob)
    assert [p.hash for p in got] == [p.hash for p in pages] and all(p.verified(KEY) for p in got)
    arrays = [a for p in got for a in [*p.latents.values(), *(x for cr in (p.snapshot or {}).values() for x in cr)]]
    assert all(not np.shares_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1:])
    server = PrefixPoolServer(budget_bytes=64 * 2**20)
    assert asyncio.run(server.publish(blob)) == len(pages)
    held = server.pool.fetch([p.hash for p in pages])
    assert [h.depth for h in held] == [p.depth for p in pages] and all(h.verified(KEY) for h in held)
    assert asyncio.run(server.publish(pages)) == 0  # a list of pages still goes; all are held already
    for bad, why in [(b"not a pickle", "not packed pool pages"), (pickle.dumps({"a": 1}), "expected a list of PoolPage"),
                     (pickle.dumps([pages[0], 3]), "PoolPage, int")]:
        with pytest.raises(ValueError, match=why):
            asyncio.run(server.publish(bad))
    assert server.pool.stats()["pages"] == len(pages)  # a refused publish stores nothing


@pytest.mark.parametrize("have_pages, fetched", [(0, 4), (2, 4), (3, 4), (4, 0), (9, 0)])
def test_fetch_deeper_brings_the_resumable_prefix_only_when_it_is_deeper(tiny_model, have_pages, fetched):
    prompt = rand(32, 3) + [1]
    pool = PrefixPool(budget_bytes=64 * 2**20)
    pool.publish(pages_of(tiny_model, prompt))  # 4 pages, snapshots at 2 and 4
    hashes = [p.hash for p in pages_of(tiny_model, prompt)]
    got = pool.fetch_deeper(hashes + [b"not held"], have_pages)
    if not fetched:
        assert got is None
        return
    assert got.hashes == hashes[:fetched] and got.tokens.shape == (fetched, 8)
    assert [j for j, _, _ in got.snapshots] == [fetched - 1]  # only the last page's snapshot travels



KEY = CFG.handoff_key.get_secret_value()  # what a holder of the key could reseal a changed page with


def pages_of(model, prompt, cfg=CFG):
    eng = LLMEngine(model, cfg)
    eng.generate([prompt], GREEDY)
    return eng.export_prefix(prompt)


def changed_latents(p, value=None):
    return {k: a + 0.5 if value is None else np.full_like(a, value) for k, a in p.latents.items()}


def changed_snapshot(p, value=None):
    return {k: (c, r + 0.5) if value is None else (np.full_like(c, value), r) for k, (c, r) in p.snapshot.items()}


BAD_PAGES = {  # case -> f(model, prompt, its good last page) -> (the page to import instead, the error)
    "another key": lambda m, prompt, p: (
        pages_of(m, prompt, EngineConfig(page_size=8, snapshot_interval=2, handoff_key="x" * 20))[-1], "not verify"),
    "latents changed": lambda m, prompt, p: (dataclasses.replace(p, latents=changed_latents(p)), "not verify"),
    "snapshot changed": lambda m, prompt, p: (dataclasses.replace(p, snapshot=changed_snapshot(p)), "not verify"),
    "latents not finite": lambda m, prompt, p: (
        dataclasses.replace(p, latents=changed_latents(p, np.nan)).seal(KEY), "latents holds non-finite"),
    "conv state not finite": lambda m, prompt, p: (
        dataclasses.replace(p, snapshot=changed_snapshot(p, np.inf)).seal(KEY), "conv state holds non-finite"),
}


def test_a_non_finite_page_inside_the_prefix_is_named_and_nothing_is_loaded(tiny_model):
    prompt = rand(32, 6) + [1]
    pages = pages_of(tiny_model, prompt)
    pages[1] = dataclasses.replace(pages[1], latents=changed_latents(pages[1], np.inf)).seal(KEY)
    b = LLMEngine(tiny_model, CFG)
    before = b.stats()
    with pytest.raises(ValueError, match="pool page 2: .*latents holds non-finite"):
        b.import_prefix(prompt, pages)
    assert b.stats() == before and b.cached_prefix_tokens(prompt) == 0


@pytest.mark.parametrize("case", list(BAD_PAGES))
def test_pool_pages_the_engine_cannot_trust_are_refused_and_nothing_is_loaded(tiny_model, case):
    prompt = rand(32, 6) + [1]
    pages = pages_of(tiny_model, prompt)
    bad, error = BAD_PAGES[case](tiny_model, prompt, pages[-1])
    b = LLMEngine(tiny_model, CFG)
    before = b.stats()
    with pytest.raises(ValueError, match=f"pool page 4: .*{error}"):
        b.import_prefix(prompt, pages[:-1] + [bad])
    assert b.stats() == before and b.cached_prefix_tokens(prompt) == 0
    assert b.import_prefix(prompt, pages) == 32  # the good pages still load


def run_of(model, prompt):
    """The prompt's pages as the pool sends a fetch: one run, through pickle as through Ray."""
    import pickle

    from k3.serve.engine.handoff import PoolRun

    return pickle.loads(pickle.dumps(PoolRun.of(pages_of(model, prompt)), protocol=5))


def moved_snapshot(run):
    j, snap, digest = run.snapshots[-1]
    return dataclasses.replace(run, snapshots=[(0, snap, digest)])


BAD_RUNS = {  # case -> f(a good run of 4 pages) -> (the run to import instead, the error)
    "tokens of another page": lambda r: (
        dataclasses.replace(r, tokens=np.where(np.arange(4)[:, None] == 2, 7, r.tokens)),
        "pool page 3: it does not belong"),
    "tokens cut short": lambda r: (
        dataclasses.replace(r, tokens=r.tokens[:, :4]), r"tokens \(4, 4\), expected \(4, 8\)"),
    "a digest missing": lambda r: (dataclasses.replace(r, digests=r.digests[:-1]), "a digest per page"),
    "pages reordered": lambda r: (
        dataclasses.replace(r, latents={k: np.roll(a, 8, axis=0) for k, a in r.latents.items()}),
        "pool page 1: its digest does not verify"),
    "a snapshot moved to another page": lambda r: (moved_snapshot(r), "pool page 1: its digest does not verify"),
    "a snapshot past the run": lambda r: (dataclasses.replace(r, snapshots=[(4, *r.snapshots[-1][1:])]),
                                          "snapshots must be"),
    "a snapshot twice": lambda r: (
        dataclasses.replace(r, snapshots=r.snapshots + r.snapshots[-1:]), "snapshots must be"),
    "latents not arrays": lambda r: (dataclasses.replace(r, latents={k: a.tolist() for k, a in r.latents.items()}),
                                     "latents must be a dict of numeric numpy arrays"),
    "latents of another width": lambda r: (dataclasses.replace(r, latents={k: a[:, :-1] for k, a in r.latents.items()}),
                                           "pool pages: MLA layer .* expected"),
}


@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_a_pool_run_the_engine_cannot_trust_is_refused_and_nothing_is_loaded(tiny_model, case):
    prompt = rand(32, 6) + [1]
    good = run_of(tiny_model, prompt)
    assert len(good) == 4 and [j for j, _, _ in good.snapshots] == [1, 3]
    bad, error = BAD_RUNS[case](good)
    b = LLMEngine(tiny_model, CFG)
    before = b.stats()
    with pytest.raises(ValueError, match=error):
        b.import_prefix(prompt, bad)
    assert b.stats() == before and b.cached_prefix_tokens(prompt) == 0
    assert b.import_prefix(prompt, good) == 32  # the run as sent loads, and resumes as a cold run
    out = b.generate([prompt], GREEDY)[0]
    cold = LLMEngine(tiny_model, CFG).generate([prompt], GREEDY)[0]
    assert out.cached_tokens == 32 and out.token_ids == cold.token_ids


def test_pages_that_do_not_make_a_run_are_named(tiny_model):
    from k3.serve.engine.handoff import PoolRun

    pages = pages_of(tiny_model, rand(32, 6) + [1])
    with pytest.raises(ValueError, match="pool page 2: it does not belong"):
        PoolRun.of([pages[0], pages[2]])  # page 3 where page 2 should be
    with pytest.raises(ValueError, match="pool page 3: it does not belong"):
        PoolRun.of(pages[:2] + ["not a page"])
    wide = dataclasses.replace(pages[1], latents={k: np.zeros((8, a.shape[1] + 1), a.dtype)
                                                  for k, a in pages[1].latents.items()})
    with pytest.raises(ValueError, match="pool page 2: its latents .* are not laid out as page 1's"):
        PoolRun.of([pages[0], wide])
    with pytest.raises(ValueError, match="a non-empty list of pool pages"):
        PoolRun.of([])


def test_a_run_longer_than_the_cache_keeps_its_first_pages_and_resumes_exactly(tiny_model):
    prompt = rand(160, 8) + [1]  # 20 pages, a snapshot every 2
    run = run_of(tiny_model, prompt)
    probe = LLMEngine(tiny_model, CFG).cache
    rest = 12 * probe.page_bytes + 6 * probe.slot_bytes  # after one running slot: 12 pages, 6 snapshot slots
    small = CFG.model_copy(update={"max_num_seqs": 1, "cache_memory_bytes": probe.slot_bytes + rest,
                                   "snapshot_memory_fraction": (6.5 * probe.slot_bytes) / rest})
    b = LLMEngine(tiny_model, small)
    assert (b.cache.num_pages, b.cache.num_snapshot_slots) == (12, 6)
    b.generate([rand(40, 9)], GREEDY)  # idle pages of another prompt: the import evicts those, not its own
    assert b.import_prefix(prompt, run) == 96  # pages 1-12 (the snapshot at 12), not the run's last pages
    shorter = prompt[:80] + [5, 5, 5]  # 11 pages: resumes at page 10 and evicts the chain from its end
    out = b.generate([shorter], GREEDY)[0]
    assert out.cached_tokens == 80
    assert out.token_ids == LLMEngine(tiny_model, CFG).generate([shorter], GREEDY)[0].token_ids
