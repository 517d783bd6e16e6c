"""One request's failure is its own: sampling that cannot work, a forward that raises, reused
ids, bad batches of prompts. Each case here failed before the engine was made exception-safe."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from torch import nn

from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine, RequestFailed, SamplingParams
from k3.serve.engine.detokenizer import StopMatcher
from serve_apps import POISON, Poisoned

GREEDY = SamplingParams(max_tokens=10, temperature=0, logprobs=2)


def prompts(n, seed, lo=5, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4000, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run_all(eng, reqs):
    """reqs: [(prompt, params)] -> {request id: final output}, stepping until all end."""
    ids = [eng.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(reqs)]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    return [final[r] for r in ids]


def same_output(a, b):
    assert a.token_ids == b.token_ids
    assert [e["token"] for e in a.logprobs] == [e["token"] for e in b.logprobs]
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x["logprob"] - y["logprob"]) < 1e-4


@pytest.mark.parametrize("mode", ["raise", "nan"])
@pytest.mark.parametrize("where", ["prompt", "late in a long prompt"])
def test_a_failing_request_fails_alone(tiny_model, mode, where):
    good = prompts(5, seed=1)
    bad = prompts(1, seed=2, lo=30, hi=31)[0]
    bad[5 if where == "prompt" else 28] = POISON
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=24, page_size=8, snapshot_interval=1)
    eng = LLMEngine(Poisoned(tiny_model, mode), cfg)
    before = eng.stats()
    reqs = [(p, GREEDY) for p in good[:2]] + [(bad, GREEDY)] + [(p, GREEDY) for p in good[2:]]
    outs = run_all(eng, reqs)
    failed = outs[2]
    assert failed.finish_reason == "error" and failed.error and not failed.token_ids
    ref = run_all(LLMEngine(tiny_model, cfg), [(p, GREEDY) for p in good])
    for got, want in zip(outs[:2] + outs[3:], ref):
        assert got.finish_reason == "length"
        same_output(got, want)
    after = eng.stats()
    assert after["pages_in_use"] == 0 and after["running_slots_free"] == before["running_slots_free"]
    assert after["running"] == after["waiting"] == 0
    # the engine keeps serving, and the failed id is free again
    assert run_all(eng, [(good[0], GREEDY)])[0].token_ids == ref[0].token_ids


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_vanishing_temperature_is_greedy(tiny_model, temperature):
    p = prompts(3, seed=3)
    eng = LLMEngine(tiny_model)
    want = [o.token_ids for o in eng.generate(p, SamplingParams(max_tokens=8, temperature=0))]
    got = [o.token_ids for o in eng.generate(p, SamplingParams(max_tokens=8, temperature=temperature))]
    assert got == want


@pytest.mark.parametrize("field,value", [("temperature", float("inf")), ("temperature", float("nan")),
                                         ("temperature", 1e9), ("top_p", float("nan")), ("seed", 2**64),
                                         ("seed", -1), ("max_tokens", True), ("logprobs", False)])
def test_unusable_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_every_token_banned_is_refused_up_front_and_at_the_draw_fails_alone(tiny_model):
    # min_tokens bans the stop ids: a request that bans the whole vocabulary could never sample,
    # which is the request's own mistake (a 400 at the API), said before it runs
    eng = LLMEngine(tiny_model)
    V = tiny_model.cfg.vocab_size
    with pytest.raises(ValueError, match="stop_token_ids.*min_tokens=2"):
        eng.add_request(None, [1, 2, 3], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=list(range(V))))
    eng.add_request(None, [1, 2, 3], SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=[0] * V))  # not all
    # a row with nothing left at the draw (the sampler's own check) fails alone, saying why
    from k3.serve.engine.sampler import SampleRow, sample
    logits = torch.randn(2, V)
    logits[0] = float("-inf")
    draws = sample(logits, [SampleRow(SamplingParams(), None, [], []), SampleRow(GREEDY, None, [], [])],
                   torch.Generator())
    assert draws[0].token is None and "no token is left" in draws[0].error
    assert draws[1].token == int(logits[1].argmax()) and draws[1].error is None


def test_a_top_p_below_float32s_range_keeps_the_top_token_and_fails_no_one(tiny_model):
    # 1e-300 passes top_p's (0, 1] check and is 0 in float32: every token was dropped, the batch's
    # draw raised out of step() for every request, step after step
    good, tiny = prompts(3, seed=4), SamplingParams(max_tokens=6, top_p=1e-300)
    eng = LLMEngine(tiny_model)
    outs = run_all(eng, [(good[0], GREEDY), (good[1], tiny), (good[2], SamplingParams(max_tokens=6, top_p=1e-300,
                                                                                         seed=5))])
    want = LLMEngine(tiny_model).generate(good, SamplingParams(max_tokens=6, temperature=0))
    same_output(outs[0], LLMEngine(tiny_model).generate([good[0]], GREEDY)[0])
    assert [o.token_ids for o in outs[1:]] == [w.token_ids for w in want[1:]]  # the nucleus is the top token


def test_a_sampler_that_raises_fails_that_steps_rows_and_nothing_else(tiny_model, monkeypatch):
    """The engine's last line of defence: a draw that raises (a sampler bug) fails the requests it
    was drawing for; the engine, the chunks of longer prompts in the same step and later requests
    go on, and no request takes a token computed for another (the chunk was counted before the
    draw: stepping on without one sampled from the wrong row)."""
    import k3.serve.engine.engine as engine_module

    def sample(logits, rows, shared):
        if any(r.params.top_k == 7 for r in rows):
            raise RuntimeError("a sampler bug")
        return real(logits, rows, shared)

    real = engine_module.sample
    monkeypatch.setattr(engine_module, "sample", sample)
    short, marked, long_ = [5, 6, 7, 8], [1, 2, 3, 4], list(range(100, 200))
    cfg = EngineConfig(max_num_batched_tokens=16)
    ref = LLMEngine(tiny_model, cfg).generate([short, long_], GREEDY)
    eng = LLMEngine(tiny_model, cfg)
    before = eng.stats()
    outs = run_all(eng, [(short, GREEDY), (marked, SamplingParams(max_tokens=6, top_k=7)), (long_, GREEDY)])
    assert [o.finish_reason for o in outs[:2]] == ["error", "error"] and "a sampler bug" in outs[1].error
    same_output(outs[2], ref[1])  # its chunk rode in the failed step
    assert eng.stats()["pages_in_use"] == 0 and eng.stats()["running_slots_free"] == before["running_slots_free"]
    same_output(run_all(eng, [(short, GREEDY)])[0], ref[0])


def test_params_changed_after_they_were_given_change_nothing(tiny_model):
    """pydantic checks SamplingParams when built, not when a field is set later: the engine keeps a
    checked copy, so a caller's later change neither reaches a running request nor gets past the
    checks."""
    eng = LLMEngine(tiny_model)
    sp = SamplingParams(max_tokens=3, temperature=0)
    eng.add_request("a", [1, 2, 3], sp)
    eng.step()
    sp.max_tokens, sp.stop_token_ids = 8, [5]
    sp.stop_token_ids.append(10**9)
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add_request("b", [1, 2, 3], sp)
    sp.stop_token_ids.pop()
    sp.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature"):
        eng.add_request("b", [1, 2, 3], sp)
    rest = []
    while eng.has_unfinished():  # nothing queued but "a"
        rest += eng.step()
    assert {o.request_id for o in rest} == {"a"} and rest[-1].finished and len(rest[-1].token_ids) == 3


@pytest.mark.timeout(120)
def test_generate_returns_when_another_thread_aborts_one_of_its_requests(tiny_model):
    # it waited for every request's final output, and an aborted request has none: it stepped forever
    model = AbortsMidForward(tiny_model, at=4, action=lambda eng: eng.abort_request("req-0"))
    eng = model.engine = LLMEngine(model, EngineConfig(compile_decode=False))
    p = prompts(2, seed=6)
    outs = eng.generate(p, SamplingParams(max_tokens=30, temperature=0))
    alone = LLMEngine(tiny_model).generate(p, SamplingParams(max_tokens=30, temperature=0))
    assert outs[0].finish_reason == "abort" and outs[0].finished and outs[0].prompt_tokens == len(p[0])
    assert 0 < len(outs[0].token_ids) < 30 and outs[0].token_ids == alone[0].token_ids[:len(outs[0].token_ids)]
    assert outs[1].token_ids == alone[1].token_ids and not eng.has_unfinished()


def test_empty_request_id_and_bad_generate_batches_change_nothing(tiny_model):
    eng = LLMEngine(tiny_model)
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("", [1, 2], GREEDY)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        eng.generate([[1, 2], [99999], [3]], GREEDY)
    assert not eng.has_unfinished()
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        eng.generate([[1], [2], [3]], [GREEDY, GREEDY])
    assert not eng.has_unfinished()
    assert eng.step_seconds.maxlen is not None  # a long-lived server keeps a bounded history


def test_concurrent_duplicate_ids_are_refused(tiny_model):
    eng = LLMEngine(tiny_model)
    accepted, barrier = [], threading.Barrier(4)

    def add():
        barrier.wait()
        for _ in range(50):
            try:
                eng.add_request("same", [1, 2, 3], SamplingParams(max_tokens=2))
                accepted.append(1)
            except ValueError:
                pass

    def stepper():  # applies the pending queue while the others add
        barrier.wait()
        for _ in range(50):
            eng.step()

    threads = [threading.Thread(target=add) for _ in range(3)] + [threading.Thread(target=stepper)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while eng.has_unfinished():
        eng.step()
    # "same" may be reused only after its previous request ended; never two at once
    assert 1 <= len(accepted) and eng.stats()["running"] == 0


def test_async_reused_id_never_touches_the_new_stream(tiny_model):
    aeng = AsyncEngine(LLMEngine(tiny_model))

    async def run():
        old = aeng.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0), request_id="x")
        outs = [o async for o in _take_until_finished(old)]
        assert outs[-1].finished
        # the old stream has delivered its last output but is not closed yet: "x" is still held
        with pytest.raises(ValueError, match="already in use"):
            await aeng.generate([4, 5], SamplingParams(max_tokens=2), request_id="x").__anext__()
        await old.aclose()
        new = [o async for o in aeng.generate([4, 5, 6], SamplingParams(max_tokens=5, temperature=0),
                                              request_id="x")]
        return new

    new = asyncio.run(asyncio.wait_for(run(), 60))
    assert new[-1].finished and len(new[-1].token_ids) == 5


async def _take_until_finished(agen):
    while True:
        o = await agen.__anext__()
        yield o
        if o.finished:
            return


def test_async_error_reaches_only_its_own_stream(tiny_model):
    aeng = AsyncEngine(LLMEngine(Poisoned(tiny_model, "raise"), EngineConfig(max_num_seqs=4)))

    async def one(prompt):
        return [o async for o in aeng.generate(prompt, SamplingParams(max_tokens=6, temperature=0))]

    async def run():
        return await asyncio.gather(one([1, 2, 3]), one([5, POISON, 7]), one([8, 9]), return_exceptions=True)

    ok1, bad, ok2 = asyncio.run(asyncio.wait_for(run(), 60))
    assert isinstance(bad, RequestFailed)
    assert ok1[-1].finished and ok2[-1].finished and len(ok1[-1].token_ids) == 6


def test_stop_strings_match_the_earliest_position():
    m = StopMatcher(["s", " "], include=False)
    text, hit = m.feed("ab cs")
    assert hit and text == "ab"
    m = StopMatcher(["bc", "abcd"], include=True)  # both could end at once: the earliest start wins
    text, hit = m.feed("xabcd")
    assert hit and text == "xabcd"


def test_snapshot_due_in_an_all_decode_step_is_taken(tiny_model):
    # 16-token prompt, page 8, a snapshot every page, a 15-token budget: the 16th prompt token
    # arrives alone, in a step that is all decode.
    cfg = EngineConfig(page_size=8, snapshot_interval=1, max_num_batched_tokens=15)
    eng = LLMEngine(tiny_model, cfg)
    p = prompts(1, seed=4, lo=16, hi=17)[0]
    eng.generate([p], SamplingParams(max_tokens=2, temperature=0))
    hit = eng.generate([p + [7, 7]], SamplingParams(max_tokens=2, temperature=0))[0]
    assert hit.cached_tokens == 16


def test_readmission_after_preemption_is_not_a_new_prefix_query(tiny_model):
    from k3.serve.engine.cache_manager import CacheManager

    full = CacheManager(tiny_model.cfg, EngineConfig(max_num_seqs=4, page_size=8))
    cfg = EngineConfig(max_num_seqs=4, page_size=8, snapshot_memory_fraction=0.0,
                       cache_memory_bytes=4 * full.slot_bytes + 14 * full.page_bytes)
    eng = LLMEngine(tiny_model, cfg)
    ps = prompts(4, seed=5, lo=28, hi=32)
    eng.generate(ps, SamplingParams(max_tokens=20, temperature=0))
    s = eng.stats()
    assert s["preemptions"] > 0
    assert s["prefix_query_tokens"] == sum(len(p) for p in ps)


def test_an_aborted_id_is_free_at_once_and_nothing_of_the_old_request_comes_back(tiny_model):
    eng = LLMEngine(tiny_model)
    eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    eng.step()
    eng.abort_request("x")
    eng.add_request("x", [4, 5, 6], SamplingParams(max_tokens=5, temperature=0))  # no step in between
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    fresh = LLMEngine(tiny_model).generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0))[0]
    assert [t for o in outs for t in o.new_token_ids] == fresh.token_ids
    assert outs[-1].finished and outs[-1].token_ids == fresh.token_ids


class AbortsMidForward(nn.Module):
    """The tiny model; during its forward number `at`, another thread runs action(engine) (by
    default: aborts "x" and takes the id for a new request, as an asyncio front end may while a
    step runs)."""

    def __init__(self, model, at, action=None):
        super().__init__()
        self.inner, self.cfg, self.at, self.calls = model, model.cfg, at, 0
        self.engine: LLMEngine | None = None
        self.action = action or (lambda eng: (eng.abort_request("x"), eng.add_request(
            "x", [4, 5, 6], SamplingParams(max_tokens=5, temperature=0))))

    def forward(self, *args, **kw):
        self.calls += 1
        if self.calls == self.at:
            t = threading.Thread(target=self.action, args=(self.engine,))
            t.start()
            t.join()
        return self.inner(*args, **kw)


def test_an_abort_during_a_step_drops_that_steps_outputs_of_the_request(tiny_model):
    model = AbortsMidForward(tiny_model, at=3)
    eng = model.engine = LLMEngine(model)
    eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    old = LLMEngine(tiny_model).generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0]
    fresh = LLMEngine(tiny_model).generate([[4, 5, 6]], SamplingParams(max_tokens=5, temperature=0))[0]
    # the first two steps' tokens were the old request's; the aborted step's token is not delivered
    assert [t for o in outs for t in o.new_token_ids] == old.token_ids + fresh.token_ids
    assert outs[-1].token_ids == fresh.token_ids


class HeldEngine(LLMEngine):
    """An engine whose step, once `hold` is cleared, waits after delivering its outputs: the
    window in which an asyncio stream may leave and a new one take its id."""

    def __init__(self, model):
        super().__init__(model)
        self.hold, self.waiting = threading.Event(), threading.Event()
        self.hold.set()

    def step(self):
        outs = super().step()
        if not self.hold.is_set():
            self.waiting.set()
            self.hold.wait()
        return outs


def test_async_stream_left_early_frees_its_id_and_its_last_outputs_go_nowhere(tiny_model):
    eng = HeldEngine(tiny_model)
    aeng = AsyncEngine(eng)
    new_params = SamplingParams(max_tokens=5, temperature=0)

    async def run():
        old = aeng.generate([1, 2, 3], SamplingParams(max_tokens=50, temperature=0), request_id="x")
        await old.__anext__()
        eng.hold.clear()
        await asyncio.to_thread(eng.waiting.wait)  # a step has delivered an output of "x", not yet routed
        await old.aclose()
        new = aeng.generate([4, 5, 6], new_params, request_id="x")  # the id is free now
        first = asyncio.ensure_future(new.__anext__())
        eng.hold.set()
        return [await first] + [o async for o in new]

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    fresh = LLMEngine(tiny_model).generate([[4, 5, 6]], new_params)[0]
    assert [t for o in outs for t in o.new_token_ids] == fresh.token_ids and outs[-1].finished
