"""Load-test an OpenAI-compatible server over HTTP, in the manner of `vllm bench serve`; JSON out.

    python jobs/serve_bench.py --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 8
    python jobs/serve_bench.py --base-url ... --dataset shared-prefix --prefix-len 2000 --input-len 32 \
        --max-concurrency 4 --slo-ttft-ms 500 --slo-tpot-ms 50 --out bench.json
    python jobs/serve_bench.py --target disagg=http://127.0.0.1:8000 --target agg=http://127.0.0.1:8001 ...

Every request streams; TTFT, TPOT, ITL and end-to-end latency are reported at mean/p50/p90/p99
(ms) with request and token throughput, goodput under the SLOs, and failed requests by message.
With --target (repeated) the same workload runs against each server in turn, side by side in one
JSON ({"runs": {name: summary}}). A progress bar goes to stderr, the JSON to stdout (and --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
from pydantic import ValidationError
from tqdm import tqdm

from k3.serve.bench import BenchConfig, run_benchmark, run_side_by_side

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
               help="compare servers: run the workload against each (repeat; replaces --base-url)")
p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default $OPENAI_API_KEY)")
p.add_argument("--num-prompts", type=int, default=100)
p.add_argument("--request-rate", type=float, default=float("inf"),
               help="Poisson arrivals per second; inf (default) sends everything at once")
p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
p.add_argument("--input-len", type=int, default=128,
               help="words per prompt (random) or per unique suffix (shared-prefix); ~1 token each")
p.add_argument("--output-len", type=int, default=64, help="max_tokens per request")
p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: words of the shared prefix")
p.add_argument("--num-prefix-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens (vLLM/k3 extension)")
p.add_argument("--temperature", type=float, default=0.0)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
p.add_argument("--metrics-url", dest="metrics_urls", action="append", default=[], metavar="URL",
               help="a Prometheus endpoint of the servers (Ray's per-node metrics export; repeat per node): "
                    "the k3_serve_* deltas and the handoff's share of TTFT join the JSON")
p.add_argument("--metrics-settle-s", type=float, default=12.0, help="wait before the last scrape")
p.add_argument("--trace", action="store_true",
               help="a k3 server: ask for each request's path (X-K3-Trace: 1); trace_ms says where TTFT went per hop")
p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
p.add_argument("--no-progress", action="store_true", help="no progress bar")
args = p.parse_args()

targets = {}
for t in args.target:
    name, sep, url = t.partition("=")
    if not sep or not name or not url:
        p.error(f"--target wants NAME=URL, got {t!r}")
    targets[name] = url
try:
    cfg = BenchConfig(**{k: v for k, v in vars(args).items() if k not in ("out", "no_progress", "target")})
except ValidationError as e:
    err = e.errors()[0]
    p.error(f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']} (got {err['input']!r})")
if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
    p.error(f"--out {args.out}: {'is a directory' if args.out.is_dir() else 'its directory does not exist'}")
bar = tqdm(total=cfg.num_prompts * max(1, len(targets)), file=sys.stderr, disable=args.no_progress, desc="requests")
try:
    if targets:
        summary = asyncio.run(run_side_by_side(cfg, targets, progress=bar.update))
    else:
        summary = asyncio.run(run_benchmark(cfg, progress=bar.update))
except (RuntimeError, httpx.HTTPError) as e:  # the server's model list could not be read
    sys.exit(f"serve_bench: {e}")
finally:
    bar.close()
summary["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
summary["machine"] = {"cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
text = json.dumps(summary, indent=2)
print(text)
if args.out is not None:
    args.out.write_text(text + "\n")
dead = [name for name, run in (summary["runs"].items() if targets else [("", summary)]) if not run["completed"]]
if dead:  # every request failed: no measurement, whatever the JSON holds
    sys.exit(f"serve_bench: no request completed{' on ' + ', '.join(dead) if targets else ''}: "
             f"{next(iter((summary['runs'][dead[0]] if targets else summary)['errors']), 'no request sent')}")
