"""The engine changes nothing about what a request produces: batching, chunking, prefix hits,
preemption. And it rejects bad input without disturbing the requests it is serving."""
from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from k3.model import SamplingConfig, generate
from k3.serve.engine import AsyncEngine, EngineConfig, LLMEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def rand_prompts(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 4096, (L,), generator=g).tolist() for L in lens]


def alone(model, prompt, n=12):
    return generate(model, [prompt], SamplingConfig(max_tokens=n))[0]


def test_sixteen_concurrent_requests_equal_each_alone(tiny_model):
    prompts = rand_prompts(16, 1, 120, seed=1)
    eng = LLMEngine(tiny_model, EngineConfig(max_num_seqs=16, max_num_batched_tokens=96, page_size=8))
    outs = eng.generate(prompts, GREEDY)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o.token_ids == alone(tiny_model, p), f"request {i} (prompt {len(p)} tokens) changed under batching"
    assert eng.stats()["running"] == 0 and eng.stats()["pages_in_use"] == 0


def test_chunked_prefill_equals_one_shot(tiny_model):
    p = rand_prompts(1, 150, 151, seed=2)[0]
    one = LLMEngine(tiny_model, EngineConfig(max_num_batched_tokens=4096)).generate([p], GREEDY)[0]
    for chunk in (7, 16, 64):
        chunked = LLMEngine(tiny_model, EngineConfig(max_num_batched_tokens=chunk)).generate([p], GREEDY)[0]
        assert chunked.token_ids == one.token_ids, f"chunk {chunk}"


def test_preemption_and_recompute_change_nothing(tiny_model):
    prompts = rand_prompts(4, 28, 32, seed=3)
    cfg = EngineConfig(max_num_seqs=4, page_size=8, enable_prefix_caching=False, cache_memory_bytes=1)
    # size the cache: 4 slots + 14 pages of 8 tokens
    from k3.serve.engine.cache_manager import CacheManager
    full = CacheManager(tiny_model.cfg, EngineConfig(max_num_seqs=4, page_size=8, enable_prefix_caching=False))
    cfg = cfg.model_copy(update={"cache_memory_bytes": 4 * full.slot_bytes + 14 * full.page_bytes})
    eng = LLMEngine(tiny_model, cfg)
    assert eng.cache.num_pages == 14
    outs = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
    assert eng.stats()["preemptions"] > 0, "the test did not force a preemption"
    for p, o in zip(prompts, outs):
        assert o.token_ids == alone(tiny_model, p, 20)


@pytest.fixture()
def cached_engine(tiny_model):
    return LLMEngine(tiny_model, EngineConfig(page_size=8, snapshot_interval=2))


def test_prefix_hits_equal_cold_runs(tiny_model, cached_engine):
    eng = cached_engine
    g = torch.Generator().manual_seed(4)
    prefix = torch.randint(0, 4096, (70,), generator=g).tolist()
    first = eng.generate([prefix + [1, 2, 3]], GREEDY)[0]
    assert first.cached_tokens == 0
    cases = {
        "snapshot mid-prompt": prefix + torch.randint(0, 4096, (17,), generator=g).tolist(),
        "prompt ends on a snapshot page": prefix[:64],  # 64 = 8 pages; resumes from 48 (needs 1 token)
        "one token past the prefix": prefix[:65],
    }
    for name, prompt in cases.items():
        out = eng.generate([prompt], GREEDY)[0]
        assert out.cached_tokens > 0, f"{name}: no prefix hit"
        assert out.cached_tokens % 16 == 0 and out.cached_tokens < len(prompt)
        assert out.token_ids == alone(tiny_model, prompt), f"{name}: hit differs from cold"
    # keep only the first 5 pages of the chain: the hit falls back to an earlier snapshot
    pages = eng.export_prefix(prefix + [1, 2, 3])
    assert eng.reset_prefix_cache() > 0 and eng.cached_prefix_tokens(prefix) == 0
    eng.import_prefix(prefix, pages[:5])
    out = eng.generate([prefix + [9, 9]], GREEDY)[0]
    assert out.cached_tokens == 32  # the snapshot at page 4 (interval 2) is the deepest left
    assert out.token_ids == alone(tiny_model, prefix + [9, 9])
    s = eng.stats()
    assert s["prefix_hit_tokens"] > 0 and s["prefix_query_tokens"] >= s["prefix_hit_tokens"]


@pytest.mark.parametrize("batched_tokens", [4096, 96])
def test_snapshots_on_kda_chunk_boundaries_equal_cold_runs(tiny_model, batched_tokens):
    # page 16 x interval 4 = 64 = k3-tiny's KDA chunk: the snapshots are read where one chunkwise
    # pass crosses them; with 96-token prefill chunks the offsets fall off the boundaries and the
    # piece-by-piece path takes them. verify_prefix_hits recomputes every hit cold and compares.
    eng = LLMEngine(tiny_model, EngineConfig(page_size=16, snapshot_interval=4, verify_prefix_hits=True,
                                             max_num_batched_tokens=batched_tokens))
    g = torch.Generator().manual_seed(8)
    prefix = torch.randint(0, 4096, (200,), generator=g).tolist()
    eng.generate([prefix + [5]], GREEDY)
    for tail in ([6, 7], torch.randint(0, 4096, (70,), generator=g).tolist()):
        out = eng.generate([prefix + tail], GREEDY)[0]
        assert out.cached_tokens == 192  # the snapshot after 3 chunks of 64
        assert out.token_ids == alone(tiny_model, prefix + tail)


def test_a_planted_wrong_snapshot_is_caught(tiny_model):
    # A holder of the handoff key plants, through the prefix pool, page 4 of prompt a carrying
    # b's KDA state (well formed, correctly sealed: only recomputing can tell it is wrong).
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 4096, (40,), generator=g).tolist()
    b = torch.randint(0, 4096, (40,), generator=g).tolist()
    query = a[:32] + [7, 7, 7]
    cold = alone(tiny_model, query)
    cfg = EngineConfig(page_size=8, snapshot_interval=2)
    src = LLMEngine(tiny_model, cfg)
    src.generate([a + [1], b + [1]], GREEDY)
    pa, pb = src.export_prefix(a + [1]), src.export_prefix(b + [1])
    forged = pa[:3] + [dataclasses.replace(pa[3], snapshot=pb[3].snapshot).seal(cfg.handoff_key.get_secret_value())]

    def planted(verify):
        eng = LLMEngine(tiny_model, cfg.model_copy(update={"verify_prefix_hits": verify}))
        assert eng.import_prefix(query, forged) == 32
        return eng

    # Without a check, the wrong state is restored and the answer changes: the plant has teeth.
    wrong = planted(False).generate([query], GREEDY)[0]
    assert wrong.cached_tokens == 32 and wrong.token_ids != cold
    # The content check (verify_prefix_hits) recomputes the prefix and catches the swapped state.
    eng = planted(True)
    out = eng.generate([query], GREEDY)[0]
    assert eng.stats()["snapshots_rejected"] == 1 and out.token_ids == cold


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model):
    p = rand_prompts(3, 5, 30, seed=6)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=100, seed=42)
    eng = LLMEngine(tiny_model)
    a = [o.token_ids for o in eng.generate(p, sp)]
    b = [LLMEngine(tiny_model).generate([q], sp)[0].token_ids for q in p]
    assert a == b


def test_memory_accounting_and_usage(tiny_model):
    eng = LLMEngine(tiny_model, EngineConfig(max_num_seqs=3, cache_memory_bytes=8 * 2**20))
    slots, pages = 3 + eng.cache.num_snapshot_slots, eng.cache.num_pages  # running + snapshot slots
    assert eng.cache.nbytes() == slots * eng.cache.slot_bytes + pages * eng.cache.page_bytes <= 8 * 2**20
    cfg = tiny_model.cfg
    kda = cfg.layer_types.count("kda")
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    assert eng.cache.slot_bytes == kda * (H * K * K * 4 + 3 * H * K * (W - 1) * 4)
    assert eng.cache.page_bytes == cfg.layer_types.count("mla") * cfg.mla_latent_dim * 4 * 16
    rid = eng.add_request(None, list(range(40)), SamplingParams(max_tokens=5, temperature=0))
    eng.step()
    assert eng.stats()["pages_in_use"] == 3  # 40 tokens in 16-token pages
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["pages_in_use"] == 0 and rid not in eng.seqs


def test_a_cache_larger_than_the_free_memory_is_refused_naming_the_field(tiny_model):
    import psutil

    too_big = 2 * psutil.virtual_memory().total
    with pytest.raises(ValueError, match=f"cache_memory_bytes={too_big:,} is more than the .* bytes free on cpu"):
        LLMEngine(tiny_model, EngineConfig(cache_memory_bytes=too_big))


def test_a_model_without_mla_counts_its_pages_without_a_list_of_them():
    """Pages of a KDA-only model hold no memory: 4 sequences of a 1M context in 1-token pages are
    4M page numbers, which were a 4M-entry list (+225 MB here; ~14 GB at 256 sequences)."""
    import tracemalloc

    from k3.model import get_preset
    from k3.serve.engine.cache_manager import CacheManager

    cfg = get_preset("k3-tiny", num_layers=2, layer_types=["kda", "kda"], mlp_types=["dense", "moe"])
    tracemalloc.start()
    cache = CacheManager(cfg, EngineConfig(max_num_seqs=4, page_size=1))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert cache.num_pages == 4 * cfg.max_position_embeddings and cache.usage()["pages_free"] == cache.num_pages
    assert peak < 32 << 20, f"{peak:,} bytes traced building the cache"
    free = cache._free_pages  # last in, first out; pages never used in order after those given back
    assert [free.pop() for _ in range(3)] == [0, 1, 2]
    free.append(1)
    assert free.pop() == 1 and free.pop() == 3 and len(free) == cache.num_pages - 4


def test_a_request_that_can_never_fit_is_rejected_while_others_continue(tiny_model):
    eng = LLMEngine(tiny_model, EngineConfig(max_num_seqs=2, cache_memory_bytes=2 * 2**20, page_size=16))
    ok = eng.add_request("ok", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    eng.step()
    too_big = eng.cache.num_pages * 16
    with pytest.raises(ValueError, match="cache pages"):
        eng.add_request("big", [1] * 10, SamplingParams(max_tokens=too_big))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [o for o in outs if o.request_id == ok][-1].finished


def test_a_max_model_len_past_the_models_positions_is_refused(tiny_model):
    limit = tiny_model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len={limit + 1} is more than the model's max_position_embeddings"):
        LLMEngine(tiny_model, EngineConfig(max_model_len=limit + 1))
    assert LLMEngine(tiny_model, EngineConfig(max_model_len=limit)).max_len == limit


def test_max_tokens_none_runs_to_the_end_of_a_cache_smaller_than_the_context(tiny_model):
    probe = LLMEngine(tiny_model, EngineConfig(max_num_seqs=2, page_size=16, enable_prefix_caching=False))
    eng = LLMEngine(tiny_model, EngineConfig(max_num_seqs=2, page_size=16, enable_prefix_caching=False,
                                             cache_memory_bytes=2 * probe.cache.slot_bytes + 10 * probe.cache.page_bytes))
    assert eng.cache.num_pages == 10 and eng.room(3) == 157 < eng.max_len - 3
    to_end = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    out = eng.generate([[1, 2, 3]], to_end)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 157
    assert to_end.max_tokens is None  # the caller's params are not changed
    with pytest.raises(ValueError, match="the whole cache holds 160"):
        eng.add_request(None, [1] * 160, to_end)
    with pytest.raises(ValueError, match="min_tokens"):
        eng.add_request(None, [1] * 150, SamplingParams(max_tokens=None, min_tokens=20))
    with pytest.raises(ValueError, match="cache pages"):  # asked for more than the cache holds: refused
        eng.add_request(None, [1, 2, 3], SamplingParams(max_tokens=200))


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "non-empty"),
    ([1, 5000], SamplingParams(), "out of range"),
    ([1, -1], SamplingParams(), "out of range"),
    ([1, 2.0], SamplingParams(), "must be integers"),
    ([1, True], SamplingParams(), "must be integers"),
    ([1, "2"], SamplingParams(), "must be integers"),
    ([1, np.int64(2)], SamplingParams(), "must be integers"),
    ([1] * 2**20, SamplingParams(), "max_model_len"),  # k3-tiny's max positions
    ([1] * 500_000, SamplingParams(), "cache pages"),  # fits the positions, not the default 256 MiB cache
    ([1, 2], SamplingParams(stop_token_ids=[99999]), "stop_token_ids"),
    ([1, 2], SamplingParams(logit_bias={3: 1.0, 4096: -1.0}), "logit_bias"),
])
def test_bad_requests_name_the_problem(tiny_model, prompt, params, match):
    eng = LLMEngine(tiny_model)
    with pytest.raises(ValueError, match=match):
        eng.add_request(None, prompt, params)
    assert eng.generate([[1, 2, 3]], GREEDY)[0].finished  # still serving


def test_penalties_break_a_greedy_loop(tiny_model):
    # the model favours one token far above the rest (here through logit_bias): greedy repeats it
    # forever; a frequency or presence penalty lets the next-best tokens through once it has been said
    prompt = rand_prompts(1, 12, 13, seed=8)[0]
    loop = SamplingParams(max_tokens=24, temperature=0, logit_bias={7: 1.0})
    eng = LLMEngine(tiny_model)
    looped = eng.generate([prompt], loop)[0].token_ids
    assert looped == [7] * 24
    for damp in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        damped = eng.generate([prompt], loop.model_copy(update=damp))[0].token_ids
        assert damped[0] == 7 and damped.count(7) == 1 and len(set(damped)) == 24, damp


def test_zero_penalties_and_an_empty_bias_change_nothing(tiny_model):
    prompts = rand_prompts(3, 5, 40, seed=9)
    plain = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    zero = plain.model_copy(update={"presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {}})
    a = LLMEngine(tiny_model).generate(prompts, plain)
    b = LLMEngine(tiny_model).generate(prompts, [zero, plain, zero])
    assert [(o.token_ids, o.logprobs) for o in a] == [(o.token_ids, o.logprobs) for o in b]
    assert [o.token_ids for o in a] == [alone(tiny_model, p, 10) for p in prompts]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5),
                                         ("top_k", -1), ("min_tokens", 99)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_strings_min_tokens_logprobs_and_detokenization(tiny_model, tokenizer):
    eng = LLMEngine(tiny_model, tokenizer=tokenizer)
    prompt = tokenizer.encode("def main():\n    return").ids
    free = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0]
    assert free.text == tokenizer.decode(free.token_ids)
    stop = free.text[5:8]
    assert stop
    cut = eng.generate([prompt], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == free.text[: free.text.index(stop)]
    lp = eng.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3))[0]
    assert len(lp.logprobs) == 1  # the final output carries its own step's entries
    eos = tiny_model.cfg.eos_token_id or 2
    mt = eng.generate([prompt], SamplingParams(max_tokens=6, min_tokens=6, temperature=0, stop_token_ids=[
        free.token_ids[0]]))[0]
    assert len(mt.token_ids) == 6 and free.token_ids[0] not in mt.token_ids[:6] or len(mt.token_ids) == 6
    del eos


def test_streaming_never_splits_a_utf8_character(tokenizer):
    from k3.serve.engine.detokenizer import Detokenizer
    text = "naïve café — ☃ 日本語 🙂 done"
    ids = tokenizer.encode(text).ids
    stream = Detokenizer(tokenizer).stream()
    pieces = [stream.push(t) for t in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # byte-level BPE splits the emoji over several tokens: some pushes must have returned ""
    assert any(p == "" for p in pieces[:-1])


def test_a_stop_string_completed_by_the_last_flush_is_a_stop(tiny_model, tokenizer):
    """A lone UTF-8 lead byte as the last token is held back, and the final flush makes it U+FFFD:
    a stop string matched there ends the answer as "stop" (it said "length")."""
    from k3.serve.engine.detokenizer import Detokenizer
    lead = Detokenizer(tokenizer).table.index(b"\xc3")
    sp = SamplingParams(max_tokens=1, temperature=0, logit_bias={lead: 100.0})
    eng = LLMEngine(tiny_model, tokenizer=tokenizer)
    plain = eng.generate([[1, 2, 3]], sp)[0]
    assert plain.token_ids == [lead] and plain.text == "\ufffd" and plain.finish_reason == "length"
    stopped = eng.generate([[1, 2, 3]], SamplingParams(**{**sp.model_dump(), "stop": ["\ufffd"]}))[0]
    assert stopped.token_ids == [lead] and stopped.text == "" and stopped.finish_reason == "stop"


def test_async_engine_streams_and_aborts(tiny_model):
    aeng = AsyncEngine(LLMEngine(tiny_model))

    async def run():
        got = []
        async for o in aeng.generate([1, 2, 3], SamplingParams(max_tokens=6, temperature=0)):
            got.append(o)
        # an abandoned stream aborts its request
        agen = aeng.generate([4, 5, 6], SamplingParams(max_tokens=500, temperature=0), request_id="gone")
        first = await agen.__anext__()
        await agen.aclose()
        # the abort is applied at the start of the step after the one under way
        deadline = asyncio.get_running_loop().time() + 60
        while "gone" in aeng.engine.seqs or aeng.engine.has_unfinished():
            assert asyncio.get_running_loop().time() < deadline, "the abandoned request was never aborted"
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="out of range"):
            async for _ in aeng.generate([99999], SamplingParams()):
                pass
        return got, first

    got, first = asyncio.run(run())
    assert [t for o in got for t in o.new_token_ids] == got[-1].token_ids and got[-1].finished
    assert len(got) == 6 and not first.finished
    assert "gone" not in aeng.engine.seqs


def test_a_reader_that_falls_behind_gets_the_steps_it_missed_as_one_output(tiny_model, tokenizer):
    aeng = AsyncEngine(LLMEngine(tiny_model, tokenizer=tokenizer))
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=2)

    async def run():
        stream = aeng.generate([5, 6, 7, 8], params)
        outs = [await stream.__anext__()]
        # every later step ends while nobody reads: wait until the step loop has gone idle, which it
        # does only after queueing the last step's outputs (the engine itself reports no unfinished
        # request while that step's outputs are still on their way back from the worker thread)
        while aeng._wake.is_set():
            await asyncio.sleep(0.01)
        assert not aeng.engine.has_unfinished()
        outs += [o async for o in stream]
        return outs

    outs = asyncio.run(run())
    ref = LLMEngine(tiny_model, tokenizer=tokenizer).generate([[5, 6, 7, 8]], params)[0]
    assert len(outs) == 2 and len(outs[0].new_token_ids) == 1  # the first token is never held back
    assert [t for o in outs for t in o.new_token_ids] == ref.token_ids == outs[-1].token_ids
    assert "".join(o.text_delta for o in outs) == ref.text == outs[-1].text
    assert [e["token"] for o in outs for e in o.logprobs] == ref.token_ids and outs[-1].finished
    with pytest.raises(ValueError, match="cannot merge"):
        outs[0].followed_by(dataclasses.replace(outs[1], request_id="other"))


@pytest.mark.slow
def test_long_context_32k_memory_grows_only_with_mla(tiny_model):
    # One-shot prefill (chunked prefill over a cache is covered above at smaller sizes; at 32K its
    # tiled attention over the context costs minutes on 2 cores).
    eng = LLMEngine(tiny_model, EngineConfig(max_num_seqs=1, max_num_batched_tokens=32768, page_size=64,
                                             cache_memory_bytes=64 * 2**20, enable_prefix_caching=False))
    before = eng.cache.nbytes()
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 4096, (32768,), generator=g).tolist()
    eng.add_request("long", prompt, SamplingParams(max_tokens=2, temperature=0))
    out = []
    while eng.has_unfinished():
        out += eng.step()
        if eng.scheduler.running:
            used = eng.stats()["pages_in_use"]
            computed = eng.scheduler.running[0].num_computed
            assert used == -(-computed // 64)  # pages track the tokens cached, nothing else
    assert out[-1].finished and len(out[-1].token_ids) == 2
    assert eng.cache.nbytes() == before  # nothing allocated beyond the budget


def test_a_token_view_reads_the_prompt_then_the_output_in_place():
    from k3.serve.engine.scheduler import Sequence, TokenView

    seq = Sequence("r", [10, 11, 12, 13], GREEDY)
    seq.output += [20, 21, 22]
    whole = seq.tokens
    for n in range(len(whole) + 1):
        view = seq.first_tokens(n)
        assert len(view) == n and list(view) == whole[:n]
        for a in range(-n - 1, n + 2):
            for b in range(-n - 1, n + 2):
                assert view[a:b] == whole[:n][a:b], (n, a, b)
        assert view[::2] == whole[:n][::2] and view[::-1] == whole[:n][::-1]
        if n:
            assert view[-1] == whole[n - 1] and view[0] == whole[0]
        with pytest.raises(IndexError, match=f"out of range for {n} tokens"):
            view[n]
    for a in range(len(whole) + 1):
        for b in range(a, len(whole) + 1):
            assert seq.token_slice(a, b) == whole[a:b]
    with pytest.raises(ValueError, match=r"n must be in \[0, 7\], got 8"):
        TokenView(seq.prompt, seq.output, 8)
    with pytest.raises(ValueError, match=r"n must be in \[0, 7\], got -1"):
        seq.first_tokens(-1)


def test_decode_steps_never_copy_the_whole_context(tiny_model, monkeypatch):
    # A decode step's bookkeeping (its input token, the pages it shares, the hashes of a page it
    # completes) slices the prompt and output where it reads them: `Sequence.tokens` (the whole
    # context, copied) is read at admission, never in a step, whatever the context's length.
    from k3.serve.engine.scheduler import Sequence

    eng = LLMEngine(tiny_model, EngineConfig(page_size=16, max_num_seqs=2, compile_decode=False))
    prompts = rand_prompts(2, 40, 60, seed=5)
    want = [eng.generate([p], SamplingParams(max_tokens=40, temperature=0))[0].token_ids for p in prompts]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, temperature=0))
    eng.step()  # both admitted and prefilled
    reads = []
    monkeypatch.setattr(Sequence, "tokens", property(lambda s: reads.append(s) or s.prompt + s.output))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert reads == []
    assert [outs[f"r{i}"].token_ids for i in range(2)] == want  # 40 tokens: pages completed and shared


def test_a_cache_batch_holds_int64_lengths_slots_and_zero_padded_pages(tiny_model):
    from k3.serve.engine.cache_manager import SeqCache

    eng = LLMEngine(tiny_model, EngineConfig(page_size=16, compile_decode=False))
    mems = [SeqCache(slot=3, pages=[5, 6, 7]), SeqCache(slot=1, pages=[9])]
    cb = eng.cache.cache_batch([2, 1], mems, [30, 4], table_width=lambda w: 8)
    assert cb.cu_seqlens.tolist() == [0, 2, 3] and cb.context_lens.tolist() == [30, 4]
    assert cb.kda_slots.tolist() == [3, 1]
    assert cb.page_table.tolist() == [[5, 6, 7, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0, 0, 0]]
    assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (cb.cu_seqlens, cb.context_lens, cb.kda_slots,
                                                                       cb.page_table))
    assert (cb.max_context, cb.max_new, cb.decode) == (30, 2, False)
    assert eng.cache.cache_batch([1, 1], mems, [30, 4]).page_table.shape == (2, 3)  # no padding asked


def test_page_table_rows_follow_their_pages_as_they_grow_or_are_replaced(tiny_model):
    # a step's page table row is kept beside the sequence's page list and extended by what was
    # appended; a list replaced whole (released, a prefix hit, an import) is read anew
    from k3.serve.engine.cache_manager import SeqCache

    eng = LLMEngine(tiny_model, EngineConfig(page_size=16, compile_decode=False))
    mem = SeqCache(slot=0, pages=[4])
    table = lambda: eng.cache.cache_batch([1], [mem], [1]).page_table[0].tolist()  # noqa: E731
    assert table() == [4]
    for p in range(5, 60):  # past the row's first capacity: it grows and keeps what it held
        mem.pages.append(p)
        assert table() == list(range(4, p + 1))
    mem.pages = [9, 8]
    assert table() == [9, 8]
    mem.pages.pop()  # the manager never cuts a list short or rewrites its last page in place; if it did,
    mem.pages.append(7)  # the row is read anew
    assert table() == [9, 7]
    mem.pages.pop()
    assert table() == [9]


def test_a_served_stream_sends_deltas_and_the_whole_answer_once(tiny_model, tokenizer):
    # Across the Serve hop a running request's outputs carry what the step added; the cumulative
    # token ids and text (a pickle of everything so far, every token) come with the last output
    from k3.serve.servers import engine_stream

    eng = LLMEngine(tiny_model, EngineConfig(compile_decode=False), tokenizer=tokenizer)
    want = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    aeng = AsyncEngine(eng)

    async def run():
        return [o async for o in engine_stream(aeng.generate([1, 2, 3], SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True)))]

    got = asyncio.run(run())
    assert len(got) > 1 and got[-1].finished and not any(o.finished for o in got[:-1])
    assert all(o.token_ids == [] and o.text == "" for o in got[:-1])
    assert got[-1].token_ids == want.token_ids and got[-1].text == want.text != ""
    assert [t for o in got for t in o.new_token_ids] == want.token_ids
    assert "".join(o.text_delta for o in got) == want.text


def test_delta_outputs_carry_the_step_and_the_finished_one_the_whole_answer(tiny_model, tokenizer):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=9, temperature=0, logprobs=1, stop=["zz"])

    def stream(cumulative):
        eng = LLMEngine(tiny_model, tokenizer=tokenizer)
        eng.cumulative_outputs = cumulative
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params)
        outs = []
        while eng.has_unfinished():
            outs += eng.step()
        return outs

    full, delta = stream(True), stream(False)
    assert len(full) == len(delta) == 18
    for f, d in zip(full, delta):
        assert (d.request_id, d.new_token_ids, d.text_delta, d.finished, d.logprobs) == \
            (f.request_id, f.new_token_ids, f.text_delta, f.finished, f.logprobs)
        if d.finished:  # the whole answer, as the cumulative output says it
            assert (d.token_ids, d.text) == (f.token_ids, f.text) and len(d.token_ids) == 9
        else:
            assert (d.token_ids, d.text) == ([], "") and len(f.token_ids) >= 1
