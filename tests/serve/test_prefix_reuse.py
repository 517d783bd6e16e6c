"""What the prefix cache keeps: a conversation's next turn resumes after the whole previous
conversation (its generated pages are cached, with a KDA snapshot at the last full page), a
much-used shared prefix outlives a stream of one-off prompts, and snapshots borrow the KDA slots
no running sequence needs. Hits are exact: a resumed request gives the tokens of a cold run."""
from __future__ import annotations

import pytest
import torch

from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.engine.cache_manager import CacheManager

PS = 16


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def budget(cfg, max_num_seqs: int, snapshots: int, pages: int) -> dict:
    """EngineConfig fields for exactly this many running slots, reserved snapshot slots and pages."""
    probe = CacheManager(cfg, EngineConfig(max_num_seqs=1, page_size=PS))
    rest = snapshots * probe.slot_bytes + pages * probe.page_bytes
    return dict(max_num_seqs=max_num_seqs, page_size=PS, snapshot_memory_fraction=(snapshots + 0.5) * probe.slot_bytes / rest,
                cache_memory_bytes=max_num_seqs * probe.slot_bytes + rest)


def converse(eng, conversations: int, turns: int, reply: int) -> list[list[tuple[int, int]]]:
    """Interleaved conversations, each turn resending the conversation so far plus a new user
    message. Per conversation and turn: (tokens served from the cache, the previous
    conversation's tokens that a resumed turn can skip: its full pages of computed tokens)."""
    history = [tokens(40 + 7 * c, seed=c) for c in range(conversations)]
    seen = [[] for _ in range(conversations)]
    for t in range(turns):
        for c in range(conversations):
            prev = len(history[c])
            out = eng.generate([history[c]], greedy(reply))[0]
            # computed: everything but the last output token (never fed back)
            seen[c].append((out.cached_tokens, (prev + reply - 1) // PS * PS))
            history[c] = history[c] + out.token_ids + tokens(11 + t, seed=100 * c + t)
    return seen


@pytest.mark.parametrize("conversations,reply", [(1, 20), pytest.param(3, 37, marks=pytest.mark.slow)])
def test_each_turn_resumes_after_the_whole_previous_conversation(tiny_model, conversations, reply):
    eng = LLMEngine(tiny_model, EngineConfig(page_size=PS, snapshot_interval=4))
    for turns in converse(eng, conversations, 4, reply):
        assert turns[0][0] == 0
        for t in range(1, len(turns)):
            assert turns[t][0] == turns[t - 1][1], f"turn {t + 1}: {turns}"


def test_resumed_turns_give_the_cold_tokens(tiny_model):
    first = tokens(45, seed=7)
    eng = LLMEngine(tiny_model, EngineConfig(page_size=PS))
    reply = eng.generate([first], greedy(23))[0].token_ids
    second = first + reply + tokens(9, seed=8)
    warm = eng.generate([second], greedy(12))[0]
    cold = LLMEngine(tiny_model, EngineConfig(page_size=PS, enable_prefix_caching=False)).generate([second],
                                                                                                  greedy(12))[0]
    assert warm.cached_tokens == (45 + 23 - 1) // PS * PS and warm.token_ids == cold.token_ids


def test_requests_resume_where_their_prompts_part_not_an_interval_short(tiny_model):
    # A shared prefix of 6 pages with snapshots every 4: the first request keeps them at 4 and at
    # its end; the second matches 6 pages, resumes at 4, and keeps one at 6, where it leaves the
    # first (before: none there, and every later request recomputed pages 5 and 6); the third
    # resumes at 6. The tokens are a cold run's.
    eng = LLMEngine(tiny_model, EngineConfig(page_size=PS, snapshot_interval=4))
    shared = tokens(6 * PS, seed=21)
    prompts = [shared + tokens(40 + 3 * i, seed=30 + i) for i in range(4)]
    outs = [eng.generate([p], greedy(5))[0] for p in prompts[:3]]
    assert [o.cached_tokens for o in outs] == [0, 4 * PS, 6 * PS]
    # it stays for later requests, a conversation going on from the third one in between
    eng.generate([prompts[2] + outs[2].token_ids + tokens(20, seed=40)], greedy(20))
    outs.append(eng.generate([prompts[3]], greedy(5))[0])
    assert outs[3].cached_tokens == 6 * PS
    cold = LLMEngine(tiny_model, EngineConfig(page_size=PS, enable_prefix_caching=False)).generate(prompts, greedy(5))
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]


def test_no_snapshot_where_an_earlier_request_has_only_got_so_far(tiny_model):
    # A is in the middle of its prefill (chunks of 160 tokens: 10 of the 11 pages both prompts
    # share computed) when B arrives. B matches A's 10 pages, but nothing cached goes on from page
    # 10 yet: it is not where the prompts part, and B keeps no snapshot there (one would enter as
    # used and outbid the real part's). C shares exactly those 10 pages, parts there from A and B
    # and keeps one; D resumes after it. The tokens are a cold run's.
    eng = LLMEngine(tiny_model, EngineConfig(page_size=PS, snapshot_interval=4, max_num_batched_tokens=160))
    shared = tokens(11 * PS, seed=50)
    a, b = shared + tokens(40, seed=51), shared + tokens(40, seed=52)
    c, d = shared[:10 * PS] + tokens(30, seed=53), shared[:10 * PS] + tokens(30, seed=54)
    eng.add_request("a", a, greedy(4))
    eng.step()
    eng.add_request("b", b, greedy(4))
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    outs = [done["a"], done["b"], eng.generate([c], greedy(4))[0], eng.generate([d], greedy(4))[0]]
    assert [o.cached_tokens for o in outs] == [0, 8 * PS, 8 * PS, 10 * PS]
    cold = LLMEngine(tiny_model, EngineConfig(page_size=PS, enable_prefix_caching=False)).generate([a, b, c, d],
                                                                                                  greedy(4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in cold]


def test_a_shared_prefix_outlives_one_off_prompts(tiny_model):
    # 1 running slot, 3 reserved snapshot slots: every one-off prompt (100 tokens) brings two
    # snapshots (64 tokens, and its last full page at 96). By arrival order (LRU) the system
    # prompt's snapshot is gone two one-offs later; by worth it stays.
    eng = LLMEngine(tiny_model, EngineConfig(**budget(tiny_model.cfg, 1, 3, 64), snapshot_interval=4))
    system = tokens(128, seed=1)
    hits = []
    for i in range(8):
        hits.append(eng.generate([system + tokens(20, seed=10 + i)], greedy(4))[0].cached_tokens)
        for j in range(2):
            eng.generate([tokens(100, seed=100 + 10 * i + j)], greedy(4))
    assert hits[0] == 0 and hits[2:] == [128] * 6, hits  # the second request may find it gone
    assert eng.stats()["snapshots_evicted"] > 0


def test_snapshots_borrow_idle_running_slots(tiny_model):
    # No reserved snapshot slot; 4 running slots, one request at a time: 3 slots hold snapshots,
    # and a request that arrives takes one back.
    eng = LLMEngine(tiny_model, EngineConfig(**budget(tiny_model.cfg, 4, 0, 64)))
    assert eng.cache.num_snapshot_slots == 0
    a = tokens(64, seed=3)
    eng.generate([a], greedy(2))
    assert eng.stats()["snapshot_slots_used"] >= 1
    assert eng.generate([a + tokens(5, seed=4)], greedy(2))[0].cached_tokens == 64
    outs = eng.generate([tokens(70, seed=5 + i) for i in range(4)], greedy(3))  # all 4 slots run at once
    assert all(len(o.token_ids) == 3 for o in outs)
    assert eng.stats()["running_slots_free"] == 4


def test_shared_system_prompts_survive_interleaved_conversations_in_few_slots(tiny_model):
    # 2 running slots + 2 reserved, one request at a time: 3 slots for snapshots, and each prompt
    # brings 4-6 (every 2 pages, its last full page, its generated pages). 4 conversations over 2
    # system prompts, turns interleaved. Untried snapshots must not push out the system prompts'
    # (before: none survived to the next request on the same prompt), and a conversation's own
    # snapshot saves only what lies past its system prompt, so it does not outbid one.
    eng = LLMEngine(tiny_model, EngineConfig(**budget(tiny_model.cfg, 2, 2, 96), snapshot_interval=2))
    systems = [tokens(64, seed=200 + s) for s in range(2)]
    history = [systems[c % 2] + tokens(21 + 5 * c, seed=300 + c) for c in range(4)]
    cached = []
    for t in range(3):
        for c in range(4):
            out = eng.generate([history[c]], greedy(6))[0]
            cached.append(out.cached_tokens)
            history[c] = history[c] + out.token_ids + tokens(13, seed=400 + 10 * c + t)
    # a prompt's snapshots enter as used once a second request has matched its pages: from the
    # third request on each system prompt, every request resumes at least after it
    later = cached[4:]
    assert all(n >= 64 for n in later), cached
    assert eng.stats()["snapshots_evicted"] > 0


def test_an_unused_snapshot_never_displaces_a_used_one():
    from dataclasses import dataclass

    from k3.serve.engine.kda_slots import SlotTable

    @dataclass(eq=False)
    class Page:
        depth: int
        base: int = 0
        hits: int = 0
        inherited: int = 0
        snapshot_slot: int | None = None
        worth: float = 0.0

    table = SlotTable(num_slots=2, max_running=1, page_size=16)
    shared, oneoff = Page(depth=4, hits=3), Page(depth=40)
    assert table.keep(shared) is not None and table.keep(oneoff) is not None  # 2 free slots
    deeper = Page(depth=400)  # unused, worth far more by depth: takes only the unused one's slot
    assert table.keep(deeper) is not None and oneoff.snapshot_slot is None and shared.snapshot_slot is not None
    assert table.keep(Page(depth=800)) is not None and deeper.snapshot_slot is None
    # a used snapshot saving only what lies past the shared prefix's (base) is worth that part
    past = Page(depth=6, base=4, hits=1)
    assert table.worth(past) - table.worth(Page(depth=2, hits=1)) == 0
    assert table.keep(past) is not None and shared.snapshot_slot is not None  # the unused one went
    assert table.keep(Page(depth=3000)) is None  # unused, and every kept one has served a request


def test_a_full_cache_evicts_its_least_recently_used_idle_page_first():
    """Idle cached pages leave in LRU order (the deepest first among equals) through random
    prompts, hits, holds and releases on a cache that is always full: the order a scan of every
    page gives, and the idle count usage() reports (kept incrementally: a served cache is full of
    idle pages and every new page evicts one)."""
    import random

    from k3.model import get_preset
    from k3.serve.engine.cache_manager import SeqCache, page_hashes

    cache = CacheManager(get_preset("k3-tiny"), EngineConfig(**budget(get_preset("k3-tiny"), 3, 4, pages=24)))
    assert cache.num_pages == 24
    rng, prompts, running = random.Random(0), [tokens(PS * 6, seed=s) for s in range(8)], []

    def idle() -> list:
        return [b for b in cache._entries.values() if b.ref == 0]

    evictions = 0
    for step in range(400):
        assert cache.usage()["pages_cached_idle"] == len(idle()), step
        op, prompt = rng.random(), rng.choice(prompts)
        n = PS * rng.randint(1, 6)
        hashes = page_hashes(prompt[:n], PS)
        if op < 0.4 and len(running) < 3:  # a prompt computed: new pages evict the idle ones, LRU first
            mem = SeqCache()
            assert cache.take_slot(mem)
            need = cache.pages_for(n) - len(cache._free_pages)
            order = sorted(idle(), key=lambda b: (b.last_used, -b.depth))
            expect_gone = {b.hash for b in order[:max(0, need)]}
            assert cache.grow(mem, n)
            gone = {b.hash for b in order} - set(cache._entries)
            assert gone == expect_gone, step
            evictions += len(gone)
            cache.share_pages(mem, prompt[:n], hashes, n)
            cache.store_snapshot(mem, hashes[-1], len(hashes))
            running.append(mem)
        elif op < 0.7:  # a lookup touches the pages it walks
            hit = cache.find_prefix(prompt[:n], hashes, limit=n + 1)
            if hit is not None and len(running) < 3 and rng.random() < 0.5:
                mem = SeqCache()
                assert cache.take_slot(mem)
                if cache.start_from(mem, hit):
                    running.append(mem)
                else:
                    cache.release(mem)
        elif running:
            cache.release(running.pop(rng.randrange(len(running))))
    assert evictions > 50  # the cache was full most of the time
    for mem in running:
        cache.release(mem)
    cached = len(cache._entries)
    assert cache.usage()["pages_cached_idle"] == len(idle()) == cached > 0
    assert cache.evict_idle() == cached and cache.usage()["pages_cached_idle"] == 0
    assert cache.usage()["pages_free"] == 24
