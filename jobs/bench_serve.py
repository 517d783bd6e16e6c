"""Disaggregated vs aggregated serving, and the prefix pool vs recomputing, side by side in one run
on a private local Ray (127.0.0.1); JSON out.

    python jobs/bench_serve.py                      # k3-tiny, random weights, 2K-token prompts
    python jobs/bench_serve.py --model-path runs/demo/model --prompt-words 2000 --out serve.json
    python jobs/bench_serve.py --output-len 64 --no-pool   # pd without the prefix pool
    python jobs/bench_serve.py --eager              # every decode step eager (compile_decode: false)
    python jobs/bench_serve.py --thread-engine      # engines stepped in the replicas' threads

Both applications are deployed on one Serve instance, with the same engine settings: "pd"
(Ingress -> DecodeServer -> PrefillServer, one replica each, the hybrid cache state handed over
through the object store, the prefix pool on unless --no-pool) and "agg" (Ingress -> LLMServer).
Then:

1. `serve_bench`'s workload (random prompts of --prompt-words words, streamed) against each app
   in turn, with the Ray node's metrics scraped before and after each run: the handoff's mean
   seconds (export + object-store fetch + check/import) as a share of the mean TTFT the client saw.
2. The pool (skipped with --no-pool or --pool-groups 0): for each of --pool-groups long prefixes,
   one request at a time and greedy: a miss (nothing cached anywhere), then, after the prefill
   replica's local prefix cache is dropped, a request with the same prefix and another suffix (a
   hit only in the pool: the replica loads the prefix's pages and KDA snapshot instead of
   recomputing them), then a third (a local hit). TTFT of each, as the client measured it; the
   pool's hit tokens are read back from the replica to show the hits were pool hits.

Each app's run is also measured process by process (`cpu_ms_per_output_token`): the CPU time every
process of this private Ray took during it (the replicas, their engine processes, Serve's proxy and
controller, Ray's own, this driver) over the run's output tokens. The window holds the prompts'
prefill too (in pd the prefill replica's, in agg the engine's); with --output-len in the hundreds
the decode dominates.

Every request is traced (header X-K3-Trace: 1): the servers stamp the wall clock at each point on
the way to the first token and send the stamps back, so `trace_ms` says, per app and per pool
case, where the time to first token went hop by hop, the engine's own share, and the overhead
(TTFT minus the engine's time). One host, one clock.

Everything runs on this machine: one torch thread per replica; the 1-minute load average is
written beside the numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from k3.platform.ops.local_ray import direct_ingress_env, free_port, init_local_ray, json_stdout
from k3.serve.bench import (BenchConfig, cpu_ms_per_token, make_prompts, process_cpu_seconds, request_body, run_side_by_side,
                            stream_request, trace_summary)
from k3.serve.engine.params import EngineConfig

SERVED = EngineConfig.model_fields  # the engine settings a served app gets unless its config says otherwise

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--model-path", default=None, help="a k3 model directory (default: k3-tiny, random weights)")
p.add_argument("--prompt-words", type=int, default=2000, help="words per prompt (about one token each)")
p.add_argument("--output-len", type=int, default=16, help="max_tokens per request")
p.add_argument("--num-prompts", type=int, default=12, help="requests per app in the side-by-side run")
p.add_argument("--max-concurrency", type=int, default=1, help="requests in flight in the side-by-side run")
p.add_argument("--pool-groups", type=int, default=4, help="distinct long prefixes in the pool run (0: no pool run)")
p.add_argument("--no-pool", action="store_true",
               help="the pd app without the prefix pool (prefix_pool_bytes: 0), and no pool run: what the prefill "
                    "replica's publishing costs the decode beside it")
p.add_argument("--suffix-words", type=int, default=16, help="pool run: words after the shared prefix")
p.add_argument("--page-size", type=int, default=SERVED["page_size"].default, help="tokens per page (default: the engine's)")
p.add_argument("--snapshot-interval", type=int, default=SERVED["snapshot_interval"].default,
               help="pages between saved KDA states (default: the engine's; a pool hit recomputes from the deepest one)")
p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
p.add_argument("--in-loop", action="store_true",
               help="run each replica's request path in its own event loop: RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 "
                    "and RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 in every k3 replica's environment")
p.add_argument("--eager", action="store_true",
               help="compile_decode: false in both apps: every decode step eager. Without it the decode and LLM "
                    "replicas run decode steps through graphs (the served default on CPU), compiled before the "
                    "replicas take traffic (compile_decode_wait: true), so no timed step is eager")
p.add_argument("--compile-decode", action="store_true",
               help="decode graphs in the decode and LLM replicas: the default now (kept so that the commands "
                    "docs/benchmarks.md records still run)")
p.add_argument("--thread-engine", action="store_true",
               help="engine_process: false in both apps: each decode and LLM replica steps its engine in a thread "
                    "of its own process (the default before the engine core), for a side-by-side")
p.add_argument("--ray-stream", action="store_true",
               help="direct_stream: false in both apps: every output back through the Serve calls (one Ray "
                    "streaming item per output at the server -> ingress hop), for a side-by-side with the token "
                    "stream (the default)")
p.add_argument("--direct-ingress", action="store_true",
               help="the private Ray's processes under RAY_SERVE_ENABLE_DIRECT_INGRESS=1: each app's ingress replica "
                    "serves HTTP itself on a port of its own (Ray Serve's direct ingress) and the requests go there, "
                    "not through Serve's HTTP proxy")
p.add_argument("--haproxy", action="store_true",
               help="the private Ray's processes under RAY_SERVE_ENABLE_HA_PROXY=1: direct ingress with HAProxy (the "
                    "binary ray[serve] installs on Linux) on Serve's HTTP port in place of the Python proxy, forwarding "
                    "each request to an ingress replica's own server; the requests go to that port as by default")
args = p.parse_args()
RESULT = json_stdout()  # the JSON goes here; anything else printed (Ray's driver messages) to stderr
if args.direct_ingress and args.haproxy:
    p.error("--direct-ingress and --haproxy are two ways to reach the ingress replicas: give one")
if args.eager and args.compile_decode:
    p.error("--eager and --compile-decode contradict each other: give one")
if args.pool_groups < 0:
    p.error(f"--pool-groups must be >= 0, got {args.pool_groups}")


def tokenizer_path(workdir: Path) -> str:
    """The model directory's tokenizer, or a BPE tokenizer trained here on Python's stdlib text
    (the tiny preset's 4096-token vocabulary; a few seconds)."""
    if args.model_path:
        return str(Path(args.model_path) / "tokenizer.json")
    from k3.platform.train.corpus import stdlib_corpus
    from k3.model.tokenizer import train_bpe

    path = workdir / "tokenizer.json"
    train_bpe(stdlib_corpus(3_000_000).texts(), vocab_size=4096).save(str(path))
    return str(path)


def app_config(tok: str, disaggregated: bool) -> dict:
    one = {"num_replicas": 1, "max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 0.1}}
    if args.in_loop:
        one["ray_actor_options"]["runtime_env"] = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                                                                "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}}
    model = {"path": args.model_path} if args.model_path else {"preset": "k3-tiny", "seed": 0, "tokenizer_path": tok}
    return {"model_id": "k3", "model": model, "disaggregated": disaggregated,
            "engine": {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "page_size": args.page_size,
                       "snapshot_interval": args.snapshot_interval, "cache_memory_bytes": 256 * 2**20,
                       "compile_decode": not args.eager, "compile_decode_wait": True},
            **({"prefix_pool_bytes": 0} if args.no_pool else {}), "engine_process": not args.thread_engine,
            "direct_stream": not args.ray_stream, "prefill": one, "decode": one, "llm": one, "ingress": one}


async def pool_run(base: str, prefill) -> dict:
    """TTFT of a miss, a pool-only hit and a local hit per prefix group (greedy, one at a time)."""
    cfg = BenchConfig(base_url=base, dataset="shared-prefix", prefix_len=args.prompt_words,
                      input_len=args.suffix_words, num_prefix_groups=args.pool_groups,
                      num_prompts=3 * args.pool_groups, output_len=args.output_len, ignore_eos=True, seed=7)
    prompts = make_prompts(cfg)  # prompt i is group i % groups: three prompts per group, other suffixes
    ttft: dict[str, list[float]] = {"miss": [], "pool_hit": [], "local_hit": []}
    traces: dict[str, list[dict]] = {k: [] for k in ttft}
    pool_tokens = []
    async with httpx.AsyncClient(timeout=600) as client:
        url = f"{base}/v1/completions"
        for g in range(args.pool_groups):
            for kind, i in (("miss", g), ("pool_hit", g + args.pool_groups), ("local_hit", g + 2 * args.pool_groups)):
                if kind == "pool_hit":
                    await asyncio.sleep(1.5)  # the replica publishes to the pool after replying
                    before = (await prefill.pool_stats.remote())["pool_hit_tokens"]
                    await prefill.reset_prefix_cache.remote()
                r = await stream_request(client, url, request_body(cfg, "k3", prompts[i]), {}, trace=True)
                if not r.ok:
                    raise SystemExit(f"pool run: {kind} request of group {g} failed: {r.error}")
                ttft[kind].append(r.ttft_s * 1e3)
                if r.trace:
                    traces[kind].append(r.trace)
                if kind == "pool_hit":
                    pool_tokens.append((await prefill.pool_stats.remote())["pool_hit_tokens"] - before)
    med = {k: round(statistics.median(v), 1) for k, v in ttft.items()}
    return {"ttft_ms": {k: [round(x, 1) for x in v] for k, v in ttft.items()}, "ttft_ms_median": med,
            "pool_hit_tokens_per_request": pool_tokens,
            "miss_over_pool_hit": round(med["miss"] / med["pool_hit"], 2),
            "miss_over_local_hit": round(med["miss"] / med["local_hit"], 2),
            "trace_ms": {k: trace_summary(v) for k, v in traces.items() if v}}


def ingress_urls(proxy: str) -> dict[str, str]:
    """{app: the base URL of its ingress replica's own HTTP server} under direct ingress (the target
    groups Serve's REST API lists), waiting until every app's replica has its port."""
    import ray
    from ray.serve._private.api import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    controller = _get_global_client()._controller
    deadline = time.monotonic() + 60
    while True:
        details = ServeInstanceDetails(**ray.get(controller.get_serve_instance_details.remote()))
        urls = {g.app_name: f"http://{g.targets[0].ip}:{g.targets[0].port}{g.route_prefix.rstrip('/')}"
                for g in details.target_groups if g.protocol == "HTTP" and g.targets and g.app_name}
        if {"pd", "agg"} <= urls.keys() and not any(u.startswith(proxy) for u in urls.values()):
            return urls
        if time.monotonic() > deadline:
            raise SystemExit(f"--direct-ingress: no ingress replica port for every app after 60 s: {details.target_groups}")
        time.sleep(0.5)


def main() -> dict:
    import ray
    from ray import serve

    from k3.serve.builder import build_app, build_pd_app

    metrics_port = free_port()
    if args.direct_ingress or args.haproxy:  # read by Serve's controller, proxy and replicas: they inherit it
        os.environ.update(direct_ingress_env(haproxy=args.haproxy, drain_s=0))
    init_local_ray(num_cpus=2, _metrics_export_port=metrics_port, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryDirectory() as d:
            tok = tokenizer_path(Path(d))
            serve.run(build_pd_app(app_config(tok, True)), name="pd", route_prefix="/pd")
            serve.run(build_app(app_config(tok, False)), name="agg", route_prefix="/agg")
        prefill = serve.get_deployment_handle("PrefillServer", app_name="pd")
        urls = ingress_urls(base) if args.direct_ingress else {name: f"{base}/{name}" for name in ("pd", "agg")}
        load_before = os.getloadavg()[0]
        cfg = BenchConfig(base_url=base, num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                          input_len=args.prompt_words, output_len=args.output_len, ignore_eos=True,
                          metrics_urls=[f"http://127.0.0.1:{metrics_port}/metrics"], trace=True)
        t0 = time.perf_counter()
        side: dict = {"runs": {}}
        cpu = {}
        for name in ("pd", "agg"):  # one app after the other, each with the CPU its run took, process by process
            before = process_cpu_seconds()
            side["runs"] |= asyncio.run(run_side_by_side(cfg, {name: urls[name]}))["runs"]
            cpu[name] = cpu_ms_per_token(before, process_cpu_seconds(), max(1, side["runs"][name]["total_output_tokens"]))
        out = {"side_by_side": side, "cpu_ms_per_output_token": cpu}
        if args.pool_groups and not args.no_pool:
            out["pool"] = asyncio.run(pool_run(urls["pd"], prefill))
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        out["load_avg_1m"] = {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)}
        serve.shutdown()
    finally:
        ray.shutdown()
    return out


summary = main()
summary["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
summary["machine"] = {"cpu_count": os.cpu_count()}
summary["args"] = vars(args) | {"out": str(args.out) if args.out else None}
text = json.dumps(summary, indent=2)
print(text, file=RESULT, flush=True)
if args.out is not None:
    args.out.write_text(text + "\n")
sys.exit(0)
