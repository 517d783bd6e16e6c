"""The autoscaling + monitoring scenario, run as its own process by test_autoscaling_monitoring.py.

    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=DIR/head/ray_token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
        python tests/platform/autoscaling_scenario.py --data DATA --work DIR --out result.json

(Ray reads the token settings when its core library loads, so the driver here gets them from its
environment: the head writes its token to DIR/head/ray_token.)

On cluster/local-autoscaling.yaml (idle timeout shortened): start the autoscaling head and a
Prometheus scraping it; submit the pretraining job with more workers than the head holds and watch
worker nodes come; wait until they go; deploy a Serve app whose autoscaling asks for more replicas
than the head holds (k3's disaggregated Serve app on k3-tiny, whose replicas export the
k3_serve_* metrics of k3.platform.ops.metrics.SERVE_METRICS) and make requests over HTTP; evaluate every panel query of the
shipped dashboards (cluster/grafana/*.json) through Prometheus's HTTP API; write `k3 report` for
the run; stop everything it started. The observations go to --out as JSON; the test asserts.

A process of its own because the driver here connects to a cluster of its own (a test session's
`ray.init` is another one), and it touches no other Ray process on the machine.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from k3.platform.ops.local_ray import LocalRayHead, free_port
from k3.platform.ops.dashboards import RATE, panel_queries
from k3.platform.ops.prometheus import Prometheus
from k3.platform.ops.report import write_report

REPO = Path(__file__).resolve().parents[2]
p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--work", required=True)
p.add_argument("--out", required=True)
p.add_argument("--idle-timeout-min", type=float, default=0.2)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()
work = Path(args.work)
work.mkdir(parents=True, exist_ok=True)
if os.environ.get("RAY_AUTH_TOKEN_PATH") != str(work / "head" / "ray_token"):
    sys.exit(f"set RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={work / 'head' / 'ray_token'} (see the docstring)")
result: dict = {"events": []}


def event(msg: str) -> None:
    result["events"].append(f"{time.time() - T0:6.1f}s {msg}")
    print(result["events"][-1], flush=True)


T0 = time.time()
# SIGTERM (the test's timeout) ends the scenario through `finally`, which stops the head and Prometheus
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
cfg = yaml.safe_load((REPO / "cluster" / "local-autoscaling.yaml").read_text())
cfg["idle_timeout_minutes"] = args.idle_timeout_min
# two worker nodes at most: enough to show scale-up (training needs 2 CPUs, the head has 1) with
# fewer raylets on a 2-core machine
cfg["max_workers"] = cfg["available_node_types"]["cpu.worker"]["max_workers"] = 2
(work / "cluster.yaml").write_text(yaml.safe_dump(cfg))
head = LocalRayHead(autoscaling_config=work / "cluster.yaml", workdir=work / "head", autoscaler_update_s=1,
                    env={"RAY_metrics_report_interval_ms": "2000", "DS_ACCELERATOR": "cpu",
                         "TORCH_EXTENSIONS_DIR": str(REPO / ".cache" / "torch_extensions")})
prom = Prometheus(head.session_dir, work / "prometheus", scrape_interval_s=2)


def alive_nodes() -> int:
    import ray

    return sum(1 for n in ray.nodes() if n["Alive"])


class NodeWatch:
    """Largest number of live nodes seen while a phase runs (polled every second)."""

    def __init__(self):
        self.max, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.max = max(self.max, alive_nodes())
            self._stop.wait(1.0)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def check_panels(dashboard: str, start: float) -> dict:
    """Series with at least one finite value, per (panel, query), over [start, now]."""
    d = json.loads((REPO / "cluster" / "grafana" / f"{dashboard}.json").read_text())
    out = {}
    for title, expr in panel_queries(d):
        series = prom.client.query_range(expr.replace(RATE, "30s"), start, time.time(), step=2)
        out[f"{title} :: {expr}"] = sum(1 for s in series if any(math.isfinite(float(v)) for _, v in s["values"]))
    return out


def wait_for(cond, timeout_s: float, what: str) -> float:
    t = time.time()
    while not cond():
        if time.time() - t > timeout_s:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(1.0)
    return time.time() - t


try:
    head.start()
    event(f"head up on {head.gcs_address}")
    prom.start()
    event(f"prometheus up on {prom.url}")
    import ray
    import ray._private.ray_constants as ray_constants
    from ray import serve

    ray_constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 (see k3.platform.ops.local_ray.init_local_ray)
    ray.init(address=head.gcs_address, _node_ip_address="127.0.0.1", log_to_driver=False)
    result["nodes_at_start"] = alive_nodes()

    # 1. Training: 2 workers of 1 CPU each on a head of 1 CPU.
    t_train = time.time()
    run_name = "autoscale"
    (work / "train.json").write_text(json.dumps({"warmup_steps": 2}))  # a short job whose loss falls early
    entry = ["python", "jobs/pretrain.py", "--config", str(work / "train.json"), "--data", args.data,
             "--num-workers", "2", "--ep-size", "2",
             "--balance", "quantile_hist", "--steps", str(args.steps), "--micro-batch", "4", "--log-every", "2",
             "--checkpoint-every", "4", "--lr", "3e-3", "--storage-path", str(work / "runs"), "--name", run_name,
             "--sample", "0"]
    with NodeWatch() as w:
        job = head.submit_job(entry, working_dir=REPO, echo=False)
    t_job_end = time.time()
    logs = job.stdout
    result["train"] = {"rc": job.returncode, "max_nodes": w.max, "nodes_at_end": alive_nodes(),
                       "log_tail": logs[-3000:],
                       "losses": [float(line.split("loss")[1].split()[0]) for line in logs.splitlines()
                                  if "step " in line and f"/{args.steps} " in line and " loss " in line]}
    event(f"training done rc={job.returncode}, max nodes {w.max}")
    time.sleep(5)  # one more metrics report and scrape
    result["train_panels"] = check_panels("k3-training", t_train)
    result["report"] = str(write_report(work / "runs" / run_name))

    # 2. Scale-down after the idle timeout.
    wait_for(lambda: alive_nodes() == 1, 180, "worker nodes removed")
    result["scale_down_s"] = time.time() - t_job_end
    event(f"scaled down to the head {result['scale_down_s']:.0f} s after the job ended")

    # 3. Serve: the real disaggregated app (k3-tiny, random weights); the decode deployment's
    # autoscaling asks for 2 replicas of 1 CPU, and the head has 1.
    from k3.serve.builder import build_pd_app

    small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.2}}
    app = build_pd_app({
        "model_id": "k3-tiny", "model": {"preset": "k3-tiny"}, "prefill": small, "ingress": small,
        "engine": {"max_num_seqs": 4, "page_size": 16, "snapshot_interval": 1, "cache_memory_bytes": 16 * 2**20},
        "decode": {"ray_actor_options": {"num_cpus": 1},
                   "autoscaling_config": {"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 2}}})
    http_port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    t_serve = time.time()
    with NodeWatch() as w:
        serve.run(app, name="k3", route_prefix="/")
        event("serve app running")
        shared = list(range(100, 164))  # every request shares 4 pages: local prefix hits
        for i in range(12):
            body = {"model": "k3-tiny", "prompt": shared + [7 + i], "max_tokens": 8, "temperature": 0}
            req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", method="POST",
                                         data=json.dumps(body).encode(), headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                assert json.loads(r.read())["usage"]["completion_tokens"] == 8
            time.sleep(0.5)
        time.sleep(8)  # metrics report + scrape
    result["serve"] = {"max_nodes": w.max}
    event(f"serve requests done, max nodes {w.max}")
    result["serve_panels"] = check_panels("k3-serving", t_serve)
    result["k3_metric_names"] = prom.client.metric_names("ray_k3_")
    serve.shutdown()
    ray.shutdown()
finally:
    prom.stop()
    head.stop()
    result["left_running"] = {"ray_head": head.alive(), "prometheus": prom.alive()}
    event("stopped")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
sys.exit(0)
