"""Long prompts served: k3-tiny at 1K, 32K and 128K tokens of context, through the engine and through
the Serve app; JSON out, and a plot.

    python jobs/bench_long_serve.py --out lc.json --plot docs/bench_long_serve.png
    python jobs/bench_long_serve.py --only engine --lengths 1024,32768     # a shorter run

Engine (one fresh process per length, one torch thread): k3-tiny with random weights (the Serve
app's: `k3.model.build(preset, seed=0)`), an engine whose cache is sized by the model's cache
formula for the one request (KDA slots + MLA pages, `k3.model.cache`; prefix caching on with a few
KDA snapshot slots), a random prompt of the length, greedy, 16 new tokens. Measured: TTFT, the
median decode step, the process's peak RSS (VmHWM) over the cold request. Predicted peak: the RSS of the model alone, plus
the engine's cache (its byte budget, what the formula asks for), plus the prefill working set of one
chunk, which does not grow with the context (model/mla.py slices the keys); the working set is
measured once, at the shortest length whose prompt fills two chunks (the second one attends over
a cached context in slices, as every later chunk does), and carried to the longer ones. The same
prompt is then sent again: a prefix hit that resumes from a KDA snapshot and the cached MLA pages,
whose tokens must equal the cold run's; a third time with torch's profiler on, for the working set
(peak live tensor bytes) of a prefill chunk over the whole context and of a decode step.

App (`--only app`): the aggregated app (Ingress -> LLMServer) and the disaggregated one (Ingress ->
DecodeServer -> PrefillServer: the prompt's hybrid cache state handed over through the object
store) on a private local Ray, the same model and engine settings; one streamed request of
`--app-length` tokens to each; TTFT, total time, token counts and the median inter-token time as
the client saw them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from k3.platform.ops.local_ray import json_stdout

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--lengths", default="1024,4096,32768,131072", help="prompt lengths, shortest first")
p.add_argument("--app-length", type=int, help="prompt length sent to the apps (default: the longest of --lengths)")
p.add_argument("--only", default="engine,app", help="sections to run: engine, app")
p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the prefill chunk)")
p.add_argument("--new-tokens", type=int, default=16)
p.add_argument("--page-size", type=int, default=16)
p.add_argument("--snapshot-interval", type=int, default=128,
               help="pages between KDA snapshots (128 x 16 = one 2,048-token chunk: each chunk's end)")
p.add_argument("--snapshot-slots", type=int, default=72, help="KDA snapshot slots the cache is sized for")
p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: one engine run in this process
p.add_argument("--out", type=Path)
p.add_argument("--plot", type=Path)
args = p.parse_args()
RESULT = json_stdout()  # the JSON goes here; anything else printed (Ray's driver messages) to stderr


def rss_mib(field: str = "VmRSS") -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def engine_config(cfg, length: int):
    """An engine whose cache holds one request of `length` + new tokens and the snapshot slots."""
    import torch

    from k3.model.cache import cache_bytes
    from k3.serve.engine import EngineConfig

    fixed = cache_bytes(cfg, 0, torch.float32)
    pages = -(-(length + args.new_tokens) // args.page_size)
    page_bytes = (cache_bytes(cfg, args.page_size, torch.float32) - fixed)
    snapshots = args.snapshot_slots * fixed
    budget = fixed + snapshots + pages * page_bytes
    # eager decode steps: the working sets this bench predicts and records are the eager forward's,
    # and past 64K tokens of context a decode graph compiles once per doubling, inside a timed step
    return EngineConfig(max_num_seqs=1, max_num_batched_tokens=args.chunk, page_size=args.page_size,
                        cache_memory_bytes=budget, snapshot_interval=args.snapshot_interval,
                        snapshot_memory_fraction=snapshots / (budget - fixed) + 1e-9, compile_decode=False)


def peak_live_bytes(fn) -> tuple[object, int]:
    """fn()'s result and the peak of the torch tensor bytes it held live at once (the profiler's
    allocation events: tensors only, none of the allocator's slack)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for e in sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return result, peak


def timed_request(eng, prompt: list[int], params, profile: bool = False) -> dict:
    """TTFT, the median decode step and the tokens of one request run alone; with profile, instead
    of times, the working set (peak live tensor bytes) of its first step and of a decode step."""
    t0 = time.perf_counter()
    rid = eng.add_request(None, prompt, params)
    ttft, steps, tokens, cached, work = None, [], [], 0, {}
    while eng.has_unfinished():
        t = time.perf_counter()
        if profile and len(work) < 2:
            outs, work["first_step" if not work else "decode_step"] = peak_live_bytes(eng.step)
        else:
            outs = eng.step()
        outs = [o for o in outs if o.request_id == rid]
        if ttft is None and outs and outs[0].new_token_ids:
            ttft = time.perf_counter() - t0
        elif ttft is not None:
            steps.append(time.perf_counter() - t)
        for o in outs:
            tokens, cached = o.token_ids, o.cached_tokens
    if profile:
        return {"working_set_bytes": work, "cached_tokens": cached}
    return {"ttft_s": round(ttft, 3), "decode_step_ms": round(1e3 * statistics.median(steps), 2),
            "tokens": tokens, "cached_tokens": cached}


def one_engine_run(length: int) -> dict:
    """In a fresh process: the model, the engine sized for `length`, a cold request, the same prompt
    again (a prefix hit: it resumes from the last KDA snapshot before the end), and once more with
    the profiler on (the working set of a last prefill chunk over the whole context)."""
    import torch

    torch.set_num_threads(1)
    import k3.model
    from k3.model.cache import cache_bytes
    from k3.serve.engine import LLMEngine, SamplingParams

    cfg = k3.model.get_preset("k3-tiny")
    model = k3.model.build(cfg, seed=0).eval()
    rss_model = rss_mib()
    eng = LLMEngine(model, engine_config(cfg, length))
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here
    cold = timed_request(eng, prompt, params)
    peak = rss_mib("VmHWM")
    hit = timed_request(eng, prompt, params)
    work = timed_request(eng, prompt, params, profile=True)
    return {"length": length, "rss_model_mib": round(rss_model, 1), "peak_rss_mib": round(peak, 1),
            "cache_bytes_allocated": eng.cache.nbytes(), "cache_formula_bytes": cache_bytes(cfg, length, torch.float32),
            "snapshot_slots": eng.cache.num_snapshot_slots, "pages": eng.cache.num_pages, "cold": cold,
            "hit": hit | {"tokens_equal_cold": hit["tokens"] == cold["tokens"]}, "working_set": work,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def engine_section(lengths: list[int]) -> list[dict]:
    runs = []
    for n in lengths:
        cmd = [sys.executable, __file__, "--one", str(n), "--chunk", str(args.chunk), "--new-tokens",
               str(args.new_tokens), "--page-size", str(args.page_size), "--snapshot-interval",
               str(args.snapshot_interval), "--snapshot-slots", str(args.snapshot_slots), "--lengths", args.lengths]
        p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        if p.returncode:
            raise SystemExit(f"engine run at {n} tokens failed:\n{p.stderr[-3000:]}")
        runs.append(json.loads(p.stdout.splitlines()[-1]))
        print(f"engine {n}: {json.dumps({k: v for k, v in runs[-1].items() if k not in ('cold', 'hit')})} "
              f"ttft {runs[-1]['cold']['ttft_s']} s, hit {runs[-1]['hit']['ttft_s']} s", flush=True)
    # the working set of one chunk over a cached context: the first prompt of two chunks or more
    base = next((r for r in runs if r["length"] >= 2 * args.chunk), runs[0])
    work = base["peak_rss_mib"] - base["rss_model_mib"] - base["cache_bytes_allocated"] / 2**20
    for r in runs:
        r["predicted_peak_rss_mib"] = round(r["rss_model_mib"] + r["cache_bytes_allocated"] / 2**20 + work, 1)
        r["peak_error"] = round(r["predicted_peak_rss_mib"] / r["peak_rss_mib"] - 1, 4)
        r["growth_over_shortest_mib"] = round(r["peak_rss_mib"] - base["peak_rss_mib"], 1)
        r["formula_growth_mib"] = round((r["cache_bytes_allocated"] - base["cache_bytes_allocated"]) / 2**20, 1)
    return runs


def app_section(length: int) -> dict:
    """One streamed request of `length` tokens to the aggregated and to the disaggregated app, timed
    by the client."""
    import asyncio

    import httpx
    import ray
    import torch
    from ray import serve

    import k3.model
    from k3.platform.ops.local_ray import free_port, init_local_ray
    from k3.serve.bench import stream_request
    from k3.serve.builder import build_app, build_pd_app

    cfg = k3.model.get_preset("k3-tiny")
    ec = engine_config(cfg, length).model_dump(mode="json") | {"handoff_key": "bench-long-serve-key"}
    out = {}
    one = {"num_replicas": 1, "max_ongoing_requests": 4, "ray_actor_options": {"num_cpus": 0.1}}
    app = {"model_id": "k3", "model": {"preset": "k3-tiny", "seed": 0},
           "engine": ec, "prefill": one, "decode": one, "llm": one, "ingress": one, "prefix_pool_bytes": 0,
           "handoff_timeout_s": 3600}
    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        g = torch.Generator().manual_seed(length)
        prompt = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
        body = {"model": "k3", "prompt": prompt, "max_tokens": args.new_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        for name, build in (("aggregated", build_app), ("disaggregated", build_pd_app)):
            serve.run(build(app | {"disaggregated": name == "disaggregated"}), name=name, route_prefix=f"/{name}")
            t0 = time.perf_counter()

            async def go():
                async with httpx.AsyncClient(timeout=7200) as client:
                    return await stream_request(client, f"http://127.0.0.1:{port}/{name}/v1/completions", body, {})

            r = asyncio.run(go())
            if not r.ok:
                raise SystemExit(f"{name} app: the {length}-token request failed: {r.error}")
            out[name] = {"ttft_s": round(r.ttft_s, 2), "total_s": round(time.perf_counter() - t0, 2),
                         "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                         "median_inter_token_ms": round(1e3 * statistics.median(r.itl_s), 1) if r.itl_s else None}
            print(f"app {name}: {json.dumps(out[name])}", flush=True)
            serve.delete(name)
        serve.shutdown()
    finally:
        ray.shutdown()
    return out | {"length": length, "load_avg_1m": round(os.getloadavg()[0], 2)}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["length"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [r["peak_rss_mib"] for r in runs], "o-", label="measured peak RSS")
    a.plot(xs, [r["predicted_peak_rss_mib"] for r in runs], "s--", label="model + cache formula + chunk working set")
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt tokens")
    a.set_ylabel("MiB")
    a.set_title("k3-tiny engine memory")
    a.legend()
    b.plot(xs, [r["cold"]["ttft_s"] for r in runs], "o-", label="TTFT (s)")
    b.plot(xs, [r["cold"]["decode_step_ms"] / 1e3 for r in runs], "s-", label="decode step (s)")
    b.plot(xs, [r["hit"]["ttft_s"] for r in runs], "r*--", markersize=10, label="TTFT, prefix hit")
    b.set_xscale("log", base=2)
    b.set_yscale("log")
    b.set_xlabel("prompt tokens")
    b.set_title("one thread, 2,048-token chunks")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if args.one is not None:
    print(json.dumps(one_engine_run(args.one)), file=RESULT, flush=True)
    sys.exit(0)
lengths = [int(x) for x in args.lengths.split(",")]
only = set(args.only.split(","))
summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "args": {
    k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "load_avg_1m_start": round(os.getloadavg()[0], 2)}
if "engine" in only:
    summary["engine"] = engine_section(lengths)
if "app" in only:
    app_length = args.app_length or lengths[-1]
    summary["app"] = app_section(app_length)
summary["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
if args.plot and "engine" in summary:
    plot(summary["engine"], args.plot)
text = json.dumps(summary, indent=2)
print(text, file=RESULT, flush=True)
if args.out:
    args.out.write_text(text + "\n")
