"""Engine benchmark on CPU, printed as JSON; each comparison runs side by side in this process.

    python jobs/bench_engine.py [--quick]

    python jobs/bench_engine.py --only handoff,chunk,vs_transformers --threads 1

1. Output tokens/s at concurrency 1, 4, 16 (128-token prompts, 64 greedy tokens each).
2. Time to first token for a 2K-token shared prefix + 32 new tokens: prefix-cache hit vs miss.
3. Decode step time against context length (1K..32K) for k3-tiny and for the same model with
   every layer MLA. The cache is filled with random latents rather than by prefill: a decode
   step's cost depends on how much it reads, not on the values.
4. Cache bytes per sequence at those context lengths, for both models.
5. handoff: exporting a prompt's hybrid cache state (prefill-only) and importing it into a second
   engine, time and bytes per prompt length; and the state's trip through Ray's object store as
   numpy arrays vs torch tensors (the latter zero-copy only with RAY_ENABLE_ZERO_COPY_TORCH_TENSORS);
   and the same prompt's pages as the prefix pool takes them: copied, sealed, loaded elsewhere.
6. chunk: a 512-token prefill chunk over 8K and 32K tokens of cached context (the MLA layers'
   absorbed form, which short chunks take, vs the expanded form, which a chunk this long takes),
   beside that chunk's share of a one-shot prefill of the whole sequence; and both forms for
   chunks of 2-48 tokens over 2K and 8K, with the one the layer takes.
7. snapshots: cold TTFT of a 2K-token prompt with KDA snapshots every 64 tokens (on the KDA
   chunk boundaries), every 48 (off them), and with no snapshots.
8. vs_transformers: on one Kimi-Linear-shaped model built by transformers and imported, engine
   decode tokens/s at 1, 8 and 32 sequences against transformers' `generate` with the same batch,
   tokens compared (jobs/bench_vs_transformers.py has the full comparison).
9. multiturn: conversations that share system prompts, each turn resending the conversation so
   far plus a new user message: prefix hit rate and TTFT per turn, with the default cache and
   with 3 reserved snapshot slots. Uses only the engine's public API, so the same section runs on
   an older tree for a before/after comparison.
10. full: a long-running server's cache, where every page holds some earlier prompt's cached
   prefix and each new page evicts one: TTFT of a 2K-token prompt and decode tokens/s at 8
   sequences, on an engine whose prefix cache is full (filled with random idle pages, as section
   3 fills context) beside a fresh one, alternating.
11. bookkeeping (not in the default list): the host work of a decode step that grows with the
   context, at 2K-128K tokens for 1 and 8 sequences: the step's token read and the page table,
   lengths and slots built (`CacheManager.cache_batch`), as the engine does them now, beside
   the way it did them until 2026-12-06 (the whole context copied as `Sequence.tokens`, twice a
   step, and the page table converted by `torch.tensor` from padded lists), restated here; and
   one streamed output's pickle round trip (a Serve hop) after 256-32K generated tokens, with the
   cumulative token ids and text (before) and as the servers send it now.
12. long_graph (not in the default list): a one-sequence decode step of k3-tiny at 4K-64K tokens of
   context through the decode graph and eagerly, on the same filled cache, best of 5 each; the
   graph's first call (its trace) timed apart.
13. shared_prefix: requests over three system prompts of 1,000-2,000 tokens (lengths no snapshot
   interval divides), each with a question of its own: tokens served from the cache, the system
   prompt's tokens computed again, and TTFT once each prompt has been seen twice. Uses only the
   engine's public API, so the same section runs on an older tree.

The sections about prefill, TTFT, snapshots and the handoff (ttft, snapshots, handoff, chunk,
multiturn, shared_prefix) run eager engines (`compile_decode=False`: their numbers are the
prefill's, and every cache shape would compile decode graphs of its own); throughput,
vs_transformers and full take the default engine (decode graphs on CPU, compiled when each engine starts, outside the timing).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from k3.model import K3ForCausalLM, cache_bytes, get_preset
from k3.platform.ops.local_ray import json_stdout
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.engine.cache_manager import CacheManager, SeqCache

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
p.add_argument("--only", help="comma-separated sections to run",
               default="throughput,ttft,snapshots,decode,handoff,chunk,vs_transformers,multiturn,shared_prefix,full")
p.add_argument("--threads", type=int, default=None,
               help="torch threads (default torch's); on a shared machine 1 avoids threads waiting on a busy core")
args = p.parse_args()
RESULT = json_stdout()  # the JSON goes here; anything else printed (Ray's driver messages) to stderr
if args.threads:
    torch.set_num_threads(args.threads)
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
result: dict = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__, "load_average_at_start": os.getloadavg()}}
only = set(args.only.split(","))


def rand(n: int) -> list[int]:
    return torch.randint(0, 4096, (n,), generator=gen).tolist()


tiny = K3ForCausalLM(get_preset("k3-tiny")).eval()



def median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def throughput() -> dict:
    """Output tokens/s at several concurrencies."""
    out_tokens = 16 if args.quick else 64
    thr = {}
    for conc in (1, 4, 16):
        eng = LLMEngine(tiny, EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048))
        eng.generate([rand(16)], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        prompts = [rand(128) for _ in range(conc)]
        t = time.perf_counter()
        outs = eng.generate(prompts, SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True))
        dt = time.perf_counter() - t
        n = sum(len(o.token_ids) for o in outs)
        thr[str(conc)] = {"requests": conc, "output_tokens": n, "seconds": round(dt, 3),
                          "output_tokens_per_s": round(n / dt, 1)}
    return thr


def first_token_time(eng: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    rid = eng.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while True:
        outs = [o for o in eng.step() if o.request_id == rid]
        if outs:
            return time.perf_counter() - t, outs[0].cached_tokens


def ttft() -> dict:
    """TTFT, prefix hit vs miss; the hit also with the KDA layers' 64-token chunks for its short
    tail (model/kda.py SHORT_PREFILL off), alternating with the default."""
    import k3.model.kda as kda_layer

    prefix_len = 512 if args.quick else 2048
    prefix = rand(prefix_len)
    ec = EngineConfig(max_num_batched_tokens=4096, page_size=16, snapshot_interval=4, compile_decode=False)
    miss, hit, hit64 = [], [], []
    short = kda_layer.SHORT_PREFILL
    for rep in range(3 if args.quick else 8):
        eng = LLMEngine(tiny, ec)
        m, cached = first_token_time(eng, prefix + rand(32))
        assert cached == 0
        miss.append(m)
        for side in (hit, hit64) if rep % 2 == 0 else (hit64, hit):  # same engine: the prefix is now cached
            kda_layer.SHORT_PREFILL = short if side is hit else 0
            h, cached = first_token_time(eng, prefix + rand(32))
            assert cached == prefix_len, cached
            side.append(h)
    kda_layer.SHORT_PREFILL = short
    return {"prefix_tokens": prefix_len, "new_tokens": 32, "miss_s_median": round(statistics.median(miss), 4),
            "hit_s_median": round(statistics.median(hit), 4),
            "hit_with_64_token_kda_chunks_s_median": round(statistics.median(hit64), 4),
            "speedup": round(statistics.median(miss) / statistics.median(hit), 1)}


def snapshots() -> dict:
    """Cold TTFT of a 2,048-token prompt, pages of 16, with a KDA snapshot every 4 pages (on the
    64-token KDA chunk boundaries), every 3 pages (48 tokens: most cut a chunk), and with no
    snapshots at all (prefix caching off); every snapshot is read in the one chunkwise pass.
    Medians of 3."""
    prompt_len = 512 if args.quick else 2048
    out = {}
    for name, interval, caching in (("every_64", 4, True), ("every_48", 3, True), ("no_snapshots", 4, False)):
        ec = EngineConfig(max_num_batched_tokens=4096, page_size=16, snapshot_interval=interval,
                          enable_prefix_caching=caching, compile_decode=False)
        times = [first_token_time(LLMEngine(tiny, ec), rand(prompt_len))[0] for _ in range(3)]
        out[f"{name}_ttft_s_median"] = round(statistics.median(times), 4)
    out["prompt_tokens"] = prompt_len
    return out


def decode_and_bytes() -> tuple[dict, dict]:
    """Decode step time and cache bytes against context length, hybrid vs all-MLA."""
    contexts = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
    all_mla = K3ForCausalLM(get_preset("k3-tiny").replace(layer_types=["mla"] * 8)).eval()
    decode, nbytes = {}, {}
    batch = 4
    for label, model in (("k3-tiny", tiny), ("k3-tiny-all-mla", all_mla)):
        rows, sizes = {}, {}
        for ctx in contexts:
            ec = EngineConfig(max_num_seqs=batch, page_size=64, enable_prefix_caching=False,
                              cache_memory_bytes=batch * 2 * cache_bytes(model.cfg, ctx + 64, torch.float32) + 2**20)
            cm = CacheManager(model.cfg, ec)
            seqs = [SeqCache() for _ in range(batch)]
            for m in seqs:
                cm.take_slot(m)
                cm.grow(m, ctx + 1)
            view = cm.cache_batch([1] * batch, seqs, [ctx] * batch)  # the model's view of the memory: fill it
            for t in view.mla_pages.values():
                t.normal_()
            for pool in view.kda.values():
                pool.recurrent.normal_(0, 0.1)
            times = []
            with torch.no_grad():
                for _ in range(6):
                    cb = cm.cache_batch([1] * batch, seqs, [ctx] * batch)
                    t = time.perf_counter()
                    model(torch.randint(0, 4096, (batch, 1)).reshape(1, batch), cache=cb)
                    times.append(time.perf_counter() - t)
            rows[str(ctx)] = round(statistics.median(times[1:]) * 1000, 2)
            sizes[str(ctx)] = cache_bytes(model.cfg, ctx, torch.bfloat16)
        decode[label] = {"batch": batch, "step_ms_by_context": rows}
        nbytes[label] = {"bf16_bytes_per_sequence_by_context": sizes}
    return decode, nbytes


def handoff() -> dict:
    """Export (prefill-only) and import time and bytes per prompt length, and the object store trip."""
    import ray

    from k3.platform.ops.local_ray import init_local_ray

    lengths = [1024, 4096] if args.quick else [1024, 4096, 16384, 32768]
    out: dict = {}
    ec = EngineConfig(max_num_seqs=2, max_num_batched_tokens=32768, page_size=64, enable_prefix_caching=False,
                      cache_memory_bytes=2 * cache_bytes(tiny.cfg, max(lengths) + 64, torch.float32) + 2**22,
                      compile_decode=False)
    sp = SamplingParams(max_tokens=3, temperature=0)
    init_local_ray(num_cpus=1, log_to_driver=False)
    try:
        for n in lengths:
            prompt = rand(n)
            a, b = LLMEngine(tiny, ec), LLMEngine(tiny, ec)
            rid = a.add_request("x", prompt, sp)
            while a.seqs.get(rid) is None or a.seqs[rid].num_computed < n:
                a.step()  # the prompt is computed and its first token sampled; the request is resident
            seq = a.seqs[rid]
            export_s = median_time(lambda: a.handoff.export_state(seq, 0, None))
            state = a.handoff.export_state(seq, 0, None)
            check_s = median_time(lambda: b.handoff.check_state(state, prompt, sp))
            b.import_request(None, prompt, state, sp)
            t = time.perf_counter()
            b.step()  # applies the import (first output) and admits it: pages and slot written, one decode
            admit_s = time.perf_counter() - t
            while b.has_unfinished():
                b.step()
            trip = {}
            for kind in ("numpy", "torch"):
                payload = state if kind == "numpy" else dict(state.arrays())
                if kind == "torch":
                    payload = {k: torch.from_numpy(v) for k, v in payload.items()}
                put_s = median_time(lambda: ray.put(payload))
                ref = ray.put(payload)
                get_s = median_time(lambda: ray.get(ref))
                got = ray.get(ref)
                if kind == "numpy":
                    zero_copy = not got.mla_latents[min(got.mla_latents)].flags.writeable  # a view of the store
                else:
                    zero_copy = None  # torch tensors are copied unless RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1
                trip[kind] = {"put_ms": round(put_s * 1000, 3), "get_ms": round(get_s * 1000, 3),
                              "zero_copy_get": zero_copy}
            pool = pool_pages(n, ec)
            out[str(n)] = {"state_bytes": state.nbytes, "export_ms": round(export_s * 1000, 2),
                           "state_seal_ms": round(median_time(lambda: state.seal(a.handoff._secret), 9) * 1000, 3),
                           "import_check_ms": round(check_s * 1000, 2), "pool_pages": pool,
                           "import_admit_step_ms": round(admit_s * 1000, 2), "object_store": trip,
                           "zero_copy_torch_env": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "")}
    finally:
        ray.shutdown()
    return out


def pool_pages(n: int, ec: EngineConfig) -> dict:
    """A prompt's pages as the prefix pool takes them: copied out of the cache (the step thread's
    share), sealed (a keyed MAC per page and per snapshot), packed as the run a pool fetch sends, and
    loaded into a second engine (every page checked first), as the prefill replicas do
    (serve/servers.py)."""
    import pickle

    from k3.serve.engine.handoff import PoolRun
    from k3.serve.prefix_pool import pack_pages, unpack_pages

    ec = ec.model_copy(update={"enable_prefix_caching": True, "page_size": 16, "snapshot_interval": 4})
    src, dst = LLMEngine(tiny, ec), LLMEngine(tiny, ec)
    prompt = rand(n)
    src.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    h = src.handoff
    copied = h.copy_prefix(prompt)
    pages = h.seal_prefix(*copied)
    held = unpack_pages(pack_pages(pages))  # as a publish travels to the pool
    sent = pickle.dumps(PoolRun.of(held), protocol=5)  # and a fetch of the whole prefix back

    def load() -> int:
        dst.reset_prefix_cache()
        return dst.handoff.import_prefix(prompt, pickle.loads(sent))

    resumable = load()
    assert resumable > 0, "the pages load"
    return {"pages": len(pages), "resumable_tokens": resumable, "snapshots": sum(p.snapshot is not None for p in pages),
            "bytes": sum(p.nbytes for p in pages),
            "copy_ms": round(median_time(lambda: h.copy_prefix(prompt), 15) * 1000, 2),
            "seal_ms": round(median_time(lambda: h.seal_prefix(*copied), 15) * 1000, 2),
            "run_pack_ms": round(median_time(lambda: PoolRun.of(held), 15) * 1000, 2),
            "import_ms": round(median_time(load, 15) * 1000, 2)}


def chunk() -> dict:
    """A 512-token chunk over cached context: absorbed vs expanded (what it takes), and the one-shot share."""
    from k3.model.mla import GatedMLA

    out: dict = {}
    layer = next(l.self_attn for l in tiny.model.layers if isinstance(l.self_attn, GatedMLA))
    n = 512
    for ctx in ([2048] if args.quick else [8192, 32768]):
        S = ctx + n
        ec = EngineConfig(max_num_seqs=1, max_num_batched_tokens=S, page_size=64, enable_prefix_caching=False,
                          cache_memory_bytes=cache_bytes(tiny.cfg, S + 64, torch.float32) + 2**22, compile_decode=False)
        prompt = rand(S)
        eng = LLMEngine(tiny, ec)
        cm, seq = eng.cache, SeqCache()
        cm.take_slot(seq)
        cm.grow(seq, S)
        with torch.no_grad():
            # one-shot prefill of all S tokens (the whole model), then the chunk alone over ctx
            one_shot = median_time(lambda: tiny(torch.tensor([prompt]), cache=cm.cache_batch([S], [seq], [0]),
                                                logits_at=torch.tensor([S - 1])), reps=2)
            chunk_model = median_time(lambda: tiny(torch.tensor([prompt[ctx:]]),
                                                   cache=cm.cache_batch([n], [seq], [ctx]),
                                                   logits_at=torch.tensor([n - 1])), reps=2)
            # the MLA attention alone, both forms, same queries and pages
            x = torch.randn(n, tiny.cfg.hidden_size)
            q_nope, q_rope = layer.query(x)
            W_uk, _ = layer._w_kv()
            view = cm.cache_batch([n], [seq], [ctx])
            pages, tab = view.mla_pages[layer.layer_idx], view.page_table[0]
            q_lat = torch.einsum("nhd,hdl->nhl", q_nope, W_uk)
            absorbed = median_time(lambda: layer._absorbed_chunk(q_lat, q_rope, pages, tab, ctx), reps=2)
            expanded = median_time(lambda: layer._expanded_chunk(q_nope, q_rope, pages, tab, ctx), reps=2)
        share = one_shot * n / S
        out[str(ctx)] = {"chunk_tokens": n, "one_shot_prefill_s": round(one_shot, 3),
                         "chunk_share_of_one_shot_s": round(share, 4), "chunk_forward_s": round(chunk_model, 4),
                         "chunk_over_share": round(chunk_model / share, 2),
                         "mla_attention_absorbed_s": round(absorbed, 4), "mla_attention_expanded_s": round(expanded, 4),
                         "attention_speedup": round(absorbed / expanded, 1)}
    out["short"] = short_chunks(layer)
    return out


def short_chunks(layer) -> dict:
    """The MLA attention of a few new tokens over a cached context, both forms on the same queries
    and pages (random latents), and the form the layer takes (`GatedMLA.absorbs`), in ms."""
    out: dict = {"absorb_below": layer.absorb_below}
    for ctx in ([2048] if args.quick else [2048, 8192]):
        S = ctx + 64
        ec = EngineConfig(max_num_seqs=1, page_size=16, enable_prefix_caching=False, compile_decode=False,
                          cache_memory_bytes=cache_bytes(tiny.cfg, S + 16, torch.float32) + 2**22)
        cm, seq = LLMEngine(tiny, ec).cache, SeqCache()
        cm.take_slot(seq)
        cm.grow(seq, S)
        view = cm.cache_batch([1], [seq], [ctx])
        pages, tab = view.mla_pages[layer.layer_idx], view.page_table[0]
        pages.copy_(torch.randn_like(pages))
        rows = {}
        with torch.no_grad():
            W_uk, _ = layer._w_kv()
            for n in (2, 8, 16, 31, 48):
                q_nope, q_rope = layer.query(torch.randn(n, tiny.cfg.hidden_size))
                q_lat = torch.einsum("nhd,hdl->nhl", q_nope, W_uk)
                absorbed = median_time(lambda: layer._absorbed_chunk(q_lat, q_rope, pages, tab, ctx), reps=15)
                expanded = median_time(lambda: layer._expanded_chunk(q_nope, q_rope, pages, tab, ctx), reps=15)
                rows[str(n)] = {"absorbed_ms": round(absorbed * 1e3, 3), "expanded_ms": round(expanded * 1e3, 3),
                                "takes": "absorbed" if layer.absorbs(n, ctx + n, 16) else "expanded"}
        out[str(ctx)] = rows
    return out


def vs_transformers() -> dict:
    """Engine decode vs transformers' generate on the same Kimi-Linear-shaped weights."""
    import tempfile

    from k3.model.hf_kimi import kimi_linear_torch_only

    kimi_linear_torch_only()  # transformers' own torch path (never fla's GPU kernels)
    import transformers

    from k3.model.hf_kimi import load_kimi_linear

    cfg = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128,
               qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, num_local_experts=16, num_experts_per_tok=4,
               n_shared_experts=1, linear_head_dim=64, linear_num_heads=4, routed_scaling_factor=2.446,
               layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0, bos_token_id=1,
               eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**cfg)).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = load_kimi_linear(d).eval()
    new = 16 if args.quick else 64
    res: dict = {"params_million": round(sum(p.numel() for p in hf.parameters()) / 1e6, 2), "prompt_tokens": 128,
                 "new_tokens": new}
    for batch in (1, 8, 32):
        prompts = [torch.randint(3, 4096, (128,), generator=gen).tolist() for _ in range(batch)]
        ids = torch.tensor(prompts)
        with torch.no_grad():
            hf.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            t = time.perf_counter()
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[:, 128:].tolist()
            hf_s = time.perf_counter() - t
        eng = LLMEngine(ours, EngineConfig(max_num_seqs=32, max_num_batched_tokens=8192, enable_prefix_caching=False))
        eng.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        t = time.perf_counter()
        got = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=new, temperature=0,
                                                                        ignore_eos=True))]
        k3_s = time.perf_counter() - t
        same = sum(g == w for g, w in zip(got, want))
        res[str(batch)] = {"transformers_tokens_per_s": round(batch * new / hf_s, 1),
                           "k3_tokens_per_s": round(batch * new / k3_s, 1), "speedup": round(hf_s / k3_s, 2),
                           "sequences_identical": f"{same}/{batch}"}
    return res


def one_turn(eng: LLMEngine, prompt: list[int], reply: int) -> tuple[float, int, list[int]]:
    """(TTFT, cached prompt tokens, the reply) of one request run alone to the end."""
    rid = eng.add_request(None, prompt, SamplingParams(max_tokens=reply, temperature=0, ignore_eos=True))
    t, ttft = time.perf_counter(), None
    while True:
        for o in eng.step():
            if o.request_id != rid:
                continue
            if ttft is None:
                ttft = time.perf_counter() - t
            if o.finished:
                return ttft, o.cached_tokens, o.token_ids


def multiturn() -> dict:
    """Hit rate and TTFT per turn: 12 conversations over 3 shared 256-token system prompts, 4 turns
    of 32 greedy tokens each, turns interleaved across conversations (turn t of every
    conversation, then turn t + 1), every request run alone."""
    convs, turns, reply, ps = (6, 3, 16, 16) if args.quick else (12, 4, 32, 16)
    systems = [rand(256) for _ in range(3)]
    budget = EngineConfig().cache_memory_bytes
    probe = CacheManager(tiny.cfg, EngineConfig(max_num_seqs=4))
    tight_rest = budget - 4 * probe.slot_bytes
    configs = {"default": EngineConfig(page_size=ps, compile_decode=False),
               "3_snapshot_slots": EngineConfig(page_size=ps, max_num_seqs=4, compile_decode=False,
                                                snapshot_memory_fraction=3.5 * probe.slot_bytes / tight_rest)}
    out: dict = {}
    for name, ec in configs.items():
        eng = LLMEngine(tiny, ec)
        eng.generate([rand(16)], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        history = [systems[c % 3] + rand(40 + (13 * c) % 40) for c in range(convs)]
        resumable = [0] * convs  # the previous conversation's full pages of computed tokens
        per_turn = []
        for t in range(turns):
            ttfts, cached, prompt_tokens, whole = [], 0, 0, 0
            for c in range(convs):
                ttft, hit, got = one_turn(eng, history[c], reply)
                ttfts.append(ttft)
                cached, prompt_tokens = cached + hit, prompt_tokens + len(history[c])
                whole += t > 0 and hit >= resumable[c]
                resumable[c] = (len(history[c]) + len(got) - 1) // ps * ps  # the last token is never fed
                history[c] = history[c] + got + rand(20 + (7 * c + t) % 20)
            per_turn.append({"turn": t + 1, "hit_rate": round(cached / prompt_tokens, 3),
                             "mean_prompt_tokens": round(prompt_tokens / convs, 1),
                             "ttft_ms_mean": round(1000 * statistics.mean(ttfts), 2),
                             "ttft_ms_median": round(1000 * statistics.median(ttfts), 2),
                             "resumed_after_whole_previous_conversation": f"{whole}/{convs}" if t else None})
        s = eng.stats()
        out[name] = {"snapshot_slots_reserved": eng.cache.num_snapshot_slots, "per_turn": per_turn,
                     "overall_hit_rate": round(s["prefix_hit_rate"], 3),
                     "snapshots_taken": s["snapshots_taken"], "evicted_pages": s["evicted_pages"]}
    return out


def shared_prefix() -> dict:
    """Users sharing system prompts whose lengths no snapshot interval divides (1,000, 1,500 and
    2,000 tokens; snapshots every 4 pages of 16): each request a system prompt and a question of
    its own (24-71 tokens), 8 greedy tokens, the system prompts taken in turn, every request run
    alone. Prompt tokens served from the cache, the system prompt's tokens computed again, and
    TTFT, over the requests after each system prompt's first two (by then a request may resume
    where two prompts part). Uses only the engine's public API, so it runs on an older tree."""
    n, ps = (12, 16) if args.quick else (30, 16)
    systems = [rand(k) for k in (1000, 1500, 2000)]
    eng = LLMEngine(tiny, EngineConfig(page_size=ps, compile_decode=False))
    eng.generate([rand(16)], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    rows = []  # (system prompt's tokens, TTFT, cached tokens)
    for i in range(n):
        system = systems[i % 3]
        ttft, hit, _ = one_turn(eng, system + rand(24 + (17 * i) % 48), 8)
        rows.append((len(system), ttft, hit))
    steady = rows[6:]
    return {"requests": n, "system_prompt_tokens": [len(x) for x in systems], "steady_requests": len(steady),
            "cached_tokens_mean": round(statistics.mean(hit for _, _, hit in steady), 1),
            "system_tokens_recomputed_mean": round(statistics.mean(k - min(hit, k) for k, _, hit in steady), 1),
            "ttft_ms_mean": round(1000 * statistics.mean(t for _, t, _ in steady), 2),
            "ttft_ms_median": round(1000 * statistics.median(t for _, t, _ in steady), 2),
            "first_requests_ttft_ms_median": round(1000 * statistics.median(t for _, t, _ in rows[:3]), 2)}


def fill_prefix_cache(eng: LLMEngine) -> int:
    """Fill every free page with idle cached pages (random chains of 128 pages, random latents,
    a snapshot-less prefix cache as a served engine's looks after many prompts). Returns the
    pages filled."""
    from k3.serve.engine.cache_manager import page_hashes

    cache, ps, n = eng.cache, eng.cache.page_size, 0
    while n < cache.num_pages:  # a fresh engine: every page free
        tokens = rand(128 * ps)
        hashes = page_hashes(tokens, ps)[: cache.num_pages - n]
        lat = {s.layer_idx: torch.randn(len(hashes) * ps, s.latent_dim).to(cache.dtype) for s in cache.mla_specs}
        pages = [tuple(tokens[j * ps:(j + 1) * ps]) for j in range(len(hashes))]
        assert cache.import_prefix_pages(hashes, pages, lat, {}) == len(hashes)
        n += len(hashes)
    assert cache.usage()["pages_free"] == 0
    return n


def best_us(fn, reps: int) -> float:
    """The best of `reps` timed calls of fn (after one untimed), in µs."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return round(min(ts) * 1e6, 1)


def bookkeeping() -> dict:
    """Per decode step and sequence count: the context-dependent host work, now and before; then
    what a running request's output costs (`stream_output_costs`)."""
    from k3.serve.engine.graphs import DecodeGraph
    from k3.serve.engine.scheduler import Sequence

    out = {}
    for ctx in ([2048, 32768] if args.quick else [2048, 32768, 131072]):
        for n in (1, 8):
            ec = EngineConfig(max_num_seqs=n, page_size=16, enable_prefix_caching=False,
                              cache_memory_bytes=n * cache_bytes(tiny.cfg, ctx + 16, torch.float32) + 2**20)
            cm = CacheManager(tiny.cfg, ec)
            mems = [SeqCache() for _ in range(n)]
            for m in mems:
                cm.take_slot(m)
                cm.grow(m, ctx + 1)
            seqs = [Sequence(f"s{i}", rand(ctx), SamplingParams(max_tokens=8)) for i in range(n)]
            for s in seqs:
                s.output.append(1)

            def now():
                for s in seqs:  # the step's input token (_build) and the pages it shares (after_step)
                    s.token_slice(ctx, ctx + 1), len(s.first_tokens())
                cm.cache_batch([1] * n, mems, [ctx] * n, table_width=DecodeGraph.table_width)

            def before():
                for s in seqs:
                    s.tokens[ctx:ctx + 1], len(s.tokens)
                w = DecodeGraph.table_width(max(len(m.pages) for m in mems))
                torch.tensor([m.pages + [0] * (w - len(m.pages)) for m in mems], dtype=torch.long)
                for values in ([0, *range(1, n + 1)], [ctx] * n, [m.slot for m in mems]):
                    torch.tensor(values, dtype=torch.long)

            reps = 20 if ctx > 32768 else 200
            out[f"{ctx}x{n}"] = {"now_us": best_us(now, reps), "before_us": best_us(before, reps),
                                 "pages_per_sequence": len(mems[0].pages)}
    return out | stream_output_costs()


def stream_output_costs() -> dict:
    """A running request's output after 256 / 4K / 32K generated tokens: its Serve hop and the
    engine's own making of it, cumulative and as deltas."""
    from k3.serve.engine.scheduler import Sequence

    out = {}
    # what one streamed output of a running request costs to pickle and unpickle (a Serve hop)
    # after `generated` tokens: with the cumulative token ids and text (before), as the servers
    # send it now (the step's delta; `k3.serve.servers.engine_stream`)
    import pickle

    from k3.serve.engine import RequestOutput

    for generated in (256, 4096, 32768):
        full = RequestOutput("r", [7], rand(generated), "ab", "ab" * generated)
        delta = RequestOutput("r", [7], [], "ab", "")
        out[f"stream_output_after_{generated}_tokens"] = {
            "before_us": best_us(lambda: pickle.loads(pickle.dumps(full)), 200),
            "now_us": best_us(lambda: pickle.loads(pickle.dumps(delta)), 200),
            "before_bytes": len(pickle.dumps(full)), "now_bytes": len(pickle.dumps(delta))}
        # the engine's own output of a running request's step at that length: with the answer so
        # far copied in (cumulative_outputs, the default) and without (the servers' engines)
        eng = LLMEngine(tiny, EngineConfig(max_num_seqs=1, compile_decode=False))
        seq = Sequence("r", rand(16), SamplingParams(max_tokens=generated + 8))
        seq.output.extend(rand(generated))
        seq.text = "ab" * generated

        def emit(cumulative: bool) -> None:
            eng.cumulative_outputs = cumulative
            eng._output(seq, [7], [], False, "ab")
            eng._produced.clear()

        out[f"stream_output_after_{generated}_tokens"] |= {"engine_cumulative_us": best_us(lambda: emit(True), 200),
                                                           "engine_delta_us": best_us(lambda: emit(False), 200)}
    return out


def long_graph() -> dict:
    """A one-sequence decode step of k3-tiny at long contexts through the engine's decode graph
    and eagerly, side by side on the same filled cache (as section 3 fills it): what a graph
    saves where the attention over the context is most of a step."""
    from k3.serve.engine.graphs import DecodeGraph

    out = {}
    for ctx in ([4096, 16384] if args.quick else [4096, 16384, 65535]):
        ec = EngineConfig(max_num_seqs=1, page_size=16, enable_prefix_caching=False,
                          cache_memory_bytes=2 * cache_bytes(tiny.cfg, ctx + 16, torch.float32) + 2**20)
        cm = CacheManager(tiny.cfg, ec)
        mem = SeqCache()
        cm.take_slot(mem)
        cm.grow(mem, ctx + 1)
        view = cm.cache_batch([1], [mem], [ctx])
        for t in view.mla_pages.values():
            t.normal_()
        for pool in view.kda.values():
            pool.recurrent.normal_(0, 0.1)
        g = DecodeGraph(tiny, torch.device("cpu"))
        ids = torch.randint(0, 4096, (1, 1))
        sides = {"graph": lambda cb: g.logits(ids, cb), "eager": lambda cb: tiny(ids, cache=cb).logits}
        times: dict = {name: [] for name in sides}
        with torch.no_grad():
            t = time.perf_counter()
            sides["graph"](cm.cache_batch([1], [mem], [ctx], table_width=DecodeGraph.table_width))  # traced here
            compile_s = time.perf_counter() - t
            for _ in range(5):
                for name, step in sides.items():
                    cb = cm.cache_batch([1], [mem], [ctx], table_width=DecodeGraph.table_width)
                    t = time.perf_counter()
                    step(cb)
                    times[name].append(time.perf_counter() - t)
        out[str(ctx)] = {name: round(min(ts) * 1000, 2) for name, ts in times.items()} | {
            "first_graph_call_s": round(compile_s, 1), "graph_served": g.error is None}
    return out


def full_cache() -> dict:
    """A full prefix cache against a fresh one: 2K-token TTFT and 8-sequence decode tokens/s."""
    reps, prompt_len, out_tokens = (1, 512, 16) if args.quick else (3, 2048, 64)
    sides: dict[str, dict[str, list[float]]] = {k: {"ttft_s": [], "decode_tokens_per_s": []} for k in ("fresh", "full")}
    filled = pages_total = 0
    LLMEngine(tiny, EngineConfig()).generate([rand(64)], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    for rep in range(reps):
        for name in ("fresh", "full") if rep % 2 == 0 else ("full", "fresh"):
            eng = LLMEngine(tiny, EngineConfig())
            pages_total = eng.cache.num_pages
            if name == "full":
                filled = fill_prefix_cache(eng)
            sides[name]["ttft_s"].append(first_token_time(eng, rand(prompt_len))[0])
            prompts = [rand(128) for _ in range(8)]
            t = time.perf_counter()
            outs = eng.generate(prompts, SamplingParams(max_tokens=out_tokens, temperature=0, ignore_eos=True))
            sides[name]["decode_tokens_per_s"].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
    out = {"pages_total": pages_total, "pages_filled": filled,
           "prompt_tokens": prompt_len, "decode_sequences": 8, "decode_tokens": out_tokens}
    for name, side in sides.items():
        out[name] = {"ttft_s_median": round(statistics.median(side["ttft_s"]), 4),
                     "decode_tokens_per_s_median": round(statistics.median(side["decode_tokens_per_s"]), 1)}
    return out


if "throughput" in only:
    result["throughput"] = throughput()
if "ttft" in only:
    result["ttft_prefix"] = ttft()
if "snapshots" in only:
    result["snapshots"] = snapshots()
if "decode" in only:
    result["decode_step"], result["cache_bytes"] = decode_and_bytes()
if "handoff" in only:
    result["handoff"] = handoff()
if "chunk" in only:
    result["chunk_over_cached_context"] = chunk()
if "vs_transformers" in only:
    result["vs_transformers"] = vs_transformers()
if "multiturn" in only:
    result["multiturn"] = multiturn()
if "shared_prefix" in only:
    result["shared_prefix"] = shared_prefix()
if "full" in only:
    result["full_prefix_cache"] = full_cache()
if "bookkeeping" in only:
    result["decode_step_bookkeeping"] = bookkeeping()
if "long_graph" in only:
    result["decode_step_graph_vs_eager_ms"] = long_graph()
result["machine"]["load_average_at_end"] = os.getloadavg()
print(json.dumps(result, indent=2), file=RESULT, flush=True)
