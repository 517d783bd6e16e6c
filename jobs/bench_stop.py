"""How long stopping a local Ray head takes (`LocalRayHead.stop`, what `k3 cluster down` runs),
idle and with a Serve app up, with k3's setting of Ray's SIGTERM drain and with Ray's default,
side by side in one run. Prints JSON.

    python jobs/bench_stop.py [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from k3.platform.ops.local_ray import DRAIN_ENV, LocalRayHead, free_port

SERVE_APP = """
import sys
import ray
from ray import serve

ray.init(address=sys.argv[1])

@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Echo:
    def __call__(self, request):
        return "ok"

serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
serve.run(Echo.bind(), name="echo", route_prefix="/")
print("serve up")
"""


def one(serve_app: bool, drain_s: str | None) -> dict:
    env = {DRAIN_ENV: drain_s} if drain_s is not None else {}
    head = LocalRayHead(num_cpus=1, env=env).start()
    try:
        if serve_app:
            run = subprocess.run([sys.executable, "-c", SERVE_APP, head.gcs_address, str(free_port())],
                                 env=head.env, capture_output=True, text=True, timeout=300)
            if "serve up" not in run.stdout:
                raise RuntimeError(f"the Serve app did not start:\n{run.stderr[-2000:]}")
    finally:
        t0 = time.perf_counter()
        head.stop()
        stop_s = time.perf_counter() - t0
    return {"serve_app": serve_app, DRAIN_ENV: head.env[DRAIN_ENV], "stop_s": round(stop_s, 2),
            "drained": "Draining for up to" in head.log_path.read_text()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    rows = []
    for _ in range(args.repeats):
        for serve_app, drain in ((False, None), (True, None), (True, "30")):
            rows.append(one(serve_app, drain))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"rows": rows, "loadavg": os.getloadavg(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
                     indent=1))


if __name__ == "__main__":
    main()
