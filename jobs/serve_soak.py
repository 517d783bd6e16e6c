"""Soak an OpenAI-compatible server: concurrent streaming clients for a while, zero errors expected,
and (with --ray-address) the Serve replicas' resident memory sampled every second; JSON out.

    python jobs/serve_soak.py --base-url http://127.0.0.1:8000 --ray-address auto --clients 32 --duration 60

The replica processes are found through Ray's state API (every live `ServeReplica:*` actor and its
pid, looked up again at each sample, so a replaced replica shows as a new curve) and measured with
psutil, each with its engine process where the engine steps in one of its own (`engine_process`,
the default: the model and its cache live there), and the prefix pool less the pages it holds
(it fills its byte budget by design): the replicas must run on this machine. The verdict is per
process: no process's RSS, after its own --warmup-s (--added-warmup-s for one that appears during
the run), grows by more than --max-rss-growth from the first to the last fifth of its samples; a
replica that autoscaling adds or removes is listed (rss.added / rss.removed), not counted as
growth. Exit status 1 on any failed request or a growing process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from k3.serve.soak import SoakConfig, run_soak, serve_process_rss

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
p.add_argument("--endpoint", choices=["completions", "chat"], default="chat")
p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default $OPENAI_API_KEY)")
p.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
p.add_argument("--duration", type=float, default=60.0, help="seconds")
p.add_argument("--input-len", type=int, default=64, help="words per prompt")
p.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
p.add_argument("--warmup-s", type=float, default=10.0,
               help="a process's RSS samples in its first seconds (from the start, or from when it appeared) are not judged")
p.add_argument("--added-warmup-s", type=float, default=60.0,
               help="the warm-up of a process that appears during the run (an autoscaled replica and its engine "
                    "process build the model and compile graphs first)")
p.add_argument("--max-rss-growth", type=float, default=0.05, help="largest growth of one process still called flat")
p.add_argument("--ray-address", default=None, help="sample the Serve replicas of this Ray cluster (its GCS address)")
p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
args = p.parse_args()


def replica_rss() -> dict[str, int]:
    """RSS bytes of every live Serve replica on this machine and of its engine process
    (`serve_process_rss`: "<actor class> <pid>", "<actor class> <pid> engine <child pid>")."""
    from ray.util.state import list_actors

    # the connected cluster's exact GCS address: without one the state API picks the newest Ray
    # on the machine, which need not be this one
    actors = [a for a in list_actors(address=gcs_address, filters=[("state", "=", "ALIVE")], limit=10_000,
                                     raise_on_missing_output=False) if a.class_name.startswith("ServeReplica") and a.pid]
    return serve_process_rss([(a.class_name, a.pid) for a in actors], pool_bytes(actors))


def pool_bytes(actors) -> dict[int, int]:
    """{pid: bytes of pages held} of each k3 prefix pool (its deployment's one replica): the pool
    fills its byte budget by design, so it is judged on its memory less what it holds."""
    from ray import serve

    out = {}
    for a in actors:
        _, app, deployment = a.class_name.split(":", 2)
        if deployment == "PrefixPool":
            try:
                _pool_held[a.pid] = serve.get_deployment_handle("PrefixPool", app_name=app).stats.remote().result(
                    timeout_s=10)["bytes"]
            except Exception as e:  # noqa: BLE001 - a pool busy or going away: its last answer stands
                print(f"prefix pool of {app!r}: no stats this time ({type(e).__name__}: {e})", file=sys.stderr)
            if a.pid in _pool_held:  # (never answered yet: measured whole, under its own label)
                out[a.pid] = _pool_held[a.pid]
    return out


_pool_held: dict[int, int] = {}  # each pool's last answer (pid -> bytes held)


sampler = None
if args.ray_address is not None:
    import ray

    ray.init(address=args.ray_address, log_to_driver=False)
    gcs_address = ray.get_runtime_context().gcs_address
    if not replica_rss():
        sys.exit(f"no live Serve replica on this machine in the Ray cluster at {args.ray_address}")
    sampler = replica_rss

cfg = SoakConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
                 clients=args.clients, duration_s=args.duration, input_len=args.input_len,
                 output_len=args.output_len, warmup_s=args.warmup_s, added_warmup_s=args.added_warmup_s,
                 max_rss_growth=args.max_rss_growth)
summary = asyncio.run(run_soak(cfg, sampler))
summary["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
summary["machine"] = {"cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
text = json.dumps(summary, indent=2)
print(text)
if args.out is not None:
    args.out.write_text(text + "\n")
flat = summary.get("rss", {}).get("flat")
sys.exit(0 if summary["zero_errors"] and flat is not False else 1)
