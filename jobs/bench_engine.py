"""Engine benchmark on CPU, printed as JSON; each comparison runs side by side in this process.

    python jobs/bench_engine.py [--quick]

1. Output tokens/s at concurrency 1, 4, 16 (128-token prompts, 64 greedy tokens each).
2. Time to first token for a 2K-token shared prefix + 32 new tokens: prefix-cache hit vs miss.
3. Decode step time against context length (1K..32K) for k3-tiny and for the same model with
   every layer MLA. The cache is filled with random latents rather than by prefill: a decode
   step's cost depends on how much it reads, not on the values.
4. Cache bytes per sequence at those context lengths, for both models.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from k3.model import K3ForCausalLM, cache_bytes, get_preset
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.engine.cache_manager import CacheManager

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
p.add_argument("--threads", type=int, default=None,
               help="torch threads (default torch's); on a shared machine 1 avoids threads waiting on a busy core")
args = p.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
torch.manual_seed(0)
gen = torch.Generator().manual_seed(0)
result: dict = {"machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "torch": torch.__version__}}


def rand(n: int) -> list[int]:
    return torch.randint(0, 4096, (n,), generator=gen).tolist()


tiny = K3ForCausalLM(get_preset("k3-tiny")).eval()

# 1. Throughput at several concurrencies.
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
result["throughput"] = thr

# 2. TTFT, prefix hit vs miss.
prefix_len = 512 if args.quick else 2048
prefix = rand(prefix_len)


def ttft(eng: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    rid = eng.add_request(None, prompt, SamplingParams(max_tokens=1, temperature=0))
    t = time.perf_counter()
    while True:
        outs = [o for o in eng.step() if o.request_id == rid]
        if outs:
            return time.perf_counter() - t, outs[0].cached_tokens


ec = EngineConfig(max_num_batched_tokens=4096, block_size=16, checkpoint_interval=4)
miss, hit = [], []
for i in range(3):
    eng = LLMEngine(tiny, ec)
    m, cached = ttft(eng, prefix + rand(32))
    assert cached == 0
    miss.append(m)
    h, cached = ttft(eng, prefix + rand(32))  # same engine: the prefix is now cached
    assert cached == prefix_len, cached
    hit.append(h)
result["ttft_prefix"] = {"prefix_tokens": prefix_len, "new_tokens": 32,
                         "miss_s_median": round(statistics.median(miss), 4),
                         "hit_s_median": round(statistics.median(hit), 4),
                         "speedup": round(statistics.median(miss) / statistics.median(hit), 1)}

# 3 + 4. Decode step time and cache bytes against context length.
contexts = [1024, 4096] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
all_mla_cfg = get_preset("k3-tiny").replace(layer_types=["mla"] * 8)
all_mla = K3ForCausalLM(all_mla_cfg).eval()
decode, nbytes = {}, {}
batch = 4
for label, model in (("k3-tiny", tiny), ("k3-tiny-all-mla", all_mla)):
    rows, sizes = {}, {}
    for ctx in contexts:
        ec = EngineConfig(max_num_seqs=batch, block_size=64, enable_prefix_caching=False,
                          cache_memory_bytes=batch * 2 * cache_bytes(model.cfg, ctx + 64, torch.float32) + 2**20)
        cm = CacheManager(model.cfg, ec)
        for t in cm.mla_kv.values():
            t.normal_()
        for t in cm.kda_state.values():
            t.normal_(0, 0.1)
        pages = cm.pages_for(ctx + 1)
        tables = [[cm.alloc_page() for _ in range(pages)] for _ in range(batch)]
        times = []
        with torch.no_grad():
            for rep in range(6):
                cb = cm.cache_batch([1] * batch, list(range(batch)), tables, [ctx] * batch)
                t = time.perf_counter()
                model(torch.randint(0, 4096, (batch, 1)), cache=cb)
                times.append(time.perf_counter() - t)
        rows[str(ctx)] = round(statistics.median(times[1:]) * 1000, 2)
        sizes[str(ctx)] = cache_bytes(model.cfg, ctx, torch.bfloat16)
    decode[label] = {"batch": batch, "step_ms_by_context": rows}
    nbytes[label] = {"bf16_bytes_per_sequence_by_context": sizes}
result["decode_step"] = decode
result["cache_bytes"] = nbytes
print(json.dumps(result, indent=2))
