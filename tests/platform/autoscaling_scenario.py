"""The autoscaling + monitoring scenario, run as its own process by test_autoscaling_monitoring.py.

    RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=DIR/head/ray_token RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
        python tests/platform/autoscaling_scenario.py --data DATA --work DIR --out result.json

(Ray reads the token settings when its core library loads, so the driver here gets them from its
environment: the head writes its token to DIR/head/ray_token.)

On cluster/local-autoscaling.yaml (idle timeout shortened): start the autoscaling head and a
Prometheus scraping it with k3's alerting rules; submit the pretraining job with more workers
than the head holds and watch worker nodes come, while every panel of the shipped k3 dashboards
is queried at random moments; wait until the nodes go; deploy k3's disaggregated Serve app with
its prefill replicas on worker nodes and the decode replica on the head, so each request's hybrid
cache state moves between two object stores; check its tokens against one engine in this
process, measure the handoff, then remove a prefill replica's node (its raylet and workers killed,
as the fake provider removes a node) at a moment its replica has a request in flight (long prompts
are sent just before, so a prefill takes seconds), recording how many it had and how many handoffs
the decode replica retried; write `k3 report` for the run;
stop everything it started. The observations go to --out as JSON; the test asserts.

A process of its own because the driver here connects to a cluster of its own (a test session's
`ray.init` is another one), and it touches no other Ray process on the machine.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scenario_tools import (  # noqa: E402
    WINDOW, NodeWatch, PanelSampler, Since, Traffic, alive_nodes, dashboard_get, kill_processes, node_processes,
    panels_over, sessions_seen)

from k3.platform.ops import cluster  # noqa: E402
from k3.platform.ops.cli import main  # noqa: E402
from k3.platform.ops.local_ray import LocalRayHead, free_port  # noqa: E402
from k3.platform.ops.prometheus import Prometheus  # noqa: E402
from k3.platform.ops.report import write_report  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
p = argparse.ArgumentParser()
p.add_argument("--data", required=True)
p.add_argument("--work", required=True)
p.add_argument("--out", required=True)
p.add_argument("--idle-timeout-min", type=float, default=0.2)
# enough steps for 8 and more sampled moments and three log lines whose loss falls: a step of
# this job took 3-8 s on 2 cores (48 steps: 312 s of the suite's 637 s on a slow day), 0.6 s on a
# quiet one (2026-12-04: the phase lasted ~10 s; the sampler's first moments are closer together)
p.add_argument("--steps", type=int, default=24)
args = p.parse_args()
work = Path(args.work)
work.mkdir(parents=True, exist_ok=True)
if os.environ.get("RAY_AUTH_TOKEN_PATH") != str(work / "head" / "ray_token"):
    sys.exit(f"set RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={work / 'head' / 'ray_token'} (see the docstring)")
result: dict = {"events": []}
T0 = time.time()


def event(msg: str) -> None:
    result["events"].append(f"{time.time() - T0:6.1f}s {msg}")
    print(result["events"][-1], flush=True)


def wait_for(cond, timeout_s: float, what: str) -> float:
    t = time.time()
    while not cond():
        if time.time() - t > timeout_s:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(1.0)
    return time.time() - t


# SIGTERM (the test's timeout) ends the scenario through `finally`, which stops the head and Prometheus
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
cfg = yaml.safe_load((REPO / "cluster" / "local-autoscaling.yaml").read_text())
cfg["idle_timeout_minutes"] = args.idle_timeout_min
# two worker nodes at most: enough to show scale-up (training needs 2 CPUs, the head has 1) and to
# hold two prefill replicas, with fewer raylets on a 2-core machine
cfg["max_workers"] = cfg["available_node_types"]["cpu.worker"]["max_workers"] = 2
# where each Serve deployment goes: prefill on worker nodes only, ingress and decode on the head
cfg["available_node_types"]["cpu.worker"]["resources"]["worker_node"] = 1
cfg["available_node_types"]["ray.head.default"]["resources"]["head_node"] = 10
(work / "cluster.yaml").write_text(yaml.safe_dump(cfg))
# gauges live two export intervals (4 s here) unless set again: a panel that blanks between the
# trainer's reports shows up in the samples
# Serve's controller re-sets its replica-health gauge every RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S
# (10 s): under 4 s here, or Ray drops it between two
ENV = {"RAY_metrics_report_interval_ms": "2000", "RAY_SERVE_STATUS_GAUGE_REPORT_INTERVAL_S": "1",
       "DS_ACCELERATOR": "cpu"}
CLUSTER, MONITOR = work / "cluster-state.json", work / "monitor-state.json"


def k3(*argv: str) -> tuple[int, str]:
    """`k3 ARGV` in this process: (status, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(argv))
    return rc, out.getvalue()


def start() -> tuple[LocalRayHead, Prometheus]:
    """The way a user does it: `k3 cluster up` (the head told where Prometheus will be), then
    `k3 monitor up` (Prometheus there, with k3's alerting rules)."""
    cluster.up(work / "cluster.yaml", CLUSTER, env=ENV, autoscaler_update_s=1, workdir=work / "head")
    rc, out = k3("monitor", "up", "--cluster-state", str(CLUSTER), "--state", str(MONITOR), "--scrape-interval", "1")
    if rc != 0:
        raise RuntimeError(f"k3 monitor up failed: {out}")
    return cluster.recorded_head(CLUSTER), Prometheus.from_state(json.loads(MONITOR.read_text()))


def train() -> None:
    """2 workers of 1 CPU each on a head of 1 CPU; a report every 8 steps (longer than a gauge
    lives unless set again)."""
    run_name = "autoscale"
    (work / "train.json").write_text(json.dumps({"warmup_steps": 2}))  # a short job whose loss falls early
    entry = ["python", "jobs/pretrain.py", "--config", str(work / "train.json"), "--data", args.data,
             "--num-workers", "2", "--ep-size", "2", "--balance", "quantile_hist", "--steps", str(args.steps),
             "--micro-batch", "4", "--log-every", "8", "--checkpoint-every", "16", "--lr", "3e-3",
             "--storage-path", str(work / "runs"), "--name", run_name, "--sample", "0"]
    t_train = time.time()
    # moments from two scrapes after the first step (a rate needs two samples) to the last step
    first_step = Since(lambda: bool(prom.client.query("ray_k3_train_step")))
    sampler = PanelSampler(prom, ["k3-training", "k3-cluster"], started=lambda: first_step.for_s(2.0),
                           finished=lambda: bool(prom.client.query(f"ray_k3_train_step >= {args.steps}")), dense=10)
    with NodeWatch() as w, sampler:
        job = head.submit_job(entry, working_dir=REPO, echo=False)
    logs = job.stdout
    (work / "runs" / run_name / "job.log").write_text(logs)  # `k3 report` shows its tail
    result["train"] = {"rc": job.returncode, "max_nodes": w.max, "nodes_at_end": alive_nodes(),
                       "log_tail": logs[-3000:], "log_lines": logs.splitlines(),
                       "losses": [float(line.split("loss")[1].split()[0]) for line in logs.splitlines()
                                  if "step " in line and f"/{args.steps} " in line and " loss " in line]}
    result["train_moments"] = sampler.moments
    event(f"training done rc={job.returncode}, max nodes {w.max}, {len(sampler.moments)} moments sampled")
    result["train_panels"] = panels_over(prom, ["k3-training", "k3-cluster"], t_train)
    result["report"] = str(write_report(work / "runs" / run_name))


def deploy():
    """k3's disaggregated app: prefill replicas of 1 CPU (worker nodes only: the head's CPU is
    taken by ingress and decode), decode on the head."""
    from ray import serve

    from k3.serve.builder import build_pd_app

    config = {"model_id": "k3-tiny", "model": {"preset": "k3-tiny", "tokenizer_path": f"{args.data}/tokenizer.json"},
              "engine": {"max_num_seqs": 4, "page_size": 16, "snapshot_interval": 1, "cache_memory_bytes": 16 * 2**20},
              "ingress": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.2, "resources": {"head_node": 1}}},
              "decode": {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5, "resources": {"head_node": 1}}},
              "prefill": {"ray_actor_options": {"num_cpus": 1, "resources": {"worker_node": 1}},
                          "autoscaling_config": {"min_replicas": 2, "max_replicas": 2}},
              # room for Serve to notice the removed node and route around it
              "handoff_attempts": 6, "handoff_timeout_s": 60}
    http_port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    serve.run(build_pd_app(config), name="k3", route_prefix="/")
    return config, f"http://127.0.0.1:{http_port}"


def placement() -> dict:
    """Node of each live replica of the k3 app, by deployment."""
    from ray.util.state import list_actors

    where: dict[str, list[str]] = {}
    # this head's dashboard by name: without an address the state API asks the cluster named in
    # /tmp/ray, another agent's on a shared machine
    for a in list_actors(address=head.address, filters=[("state", "=", "ALIVE")], limit=1000, timeout=60):
        if a.class_name.startswith("ServeReplica:k3:"):
            where.setdefault(a.class_name.split(":")[-1], []).append(a.node_id)
    return where


def prefill_replicas() -> dict[str, str]:
    """The k3 app's PrefillServer replica actors by node id (their names end with the replica's
    unique id, the one the prefill router hashes)."""
    from ray.util.state import list_actors

    return {a.node_id: a.name for a in list_actors(address=head.address, filters=[("state", "=", "ALIVE")],
                                                    limit=1000, timeout=60)
            if a.class_name == "ServeReplica:k3:PrefillServer"}


def handoff_retries() -> int:
    """Prefill attempts the decode replica (one, on the head) made again after one failed."""
    from ray import serve

    return serve.get_deployment_handle("DecodeServer", app_name="k3").handoff_stats.remote().result(
        timeout_s=60)["handoff_retries"]


def remove_mid_request(victim: str, traffic: Traffic) -> dict:
    """Remove the node victim at a moment its prefill replica works on a request: send the long
    prompts, wait until the replica reports one in flight (Serve's own count, read the way its router
    reads it), then kill the node's processes (found beforehand: the kill is a few signals). Returns
    the evidence: requests in flight there at the removal, the decode side's retries before."""
    import ray

    names = prefill_replicas()
    if victim not in names:
        raise RuntimeError(f"no PrefillServer replica on node {victim}: {names}")
    replica = ray.get_actor(names[victim], namespace="serve")
    retries_before = handoff_retries()
    # the long prompts whose prefix the router sends to the victim's replica (random prompts split
    # between the replicas by their hashes: a burst of four once all went to the other one, and the
    # kill found only a short request there, finishing)
    sent = traffic.burst(to_replica=names[victim].rsplit("#", 1)[-1],
                         replica_ids=[n.rsplit("#", 1)[-1] for n in names.values()])
    time.sleep(1.0)  # the long prompts reach the prefill replicas (each prefill then takes seconds)
    pids = node_processes(head.pid, victim, head_node_id())
    in_flight, deadline = 0, time.time() + 60
    while in_flight == 0 and time.time() < deadline:
        in_flight = ray.get(replica.get_num_ongoing_requests.remote(), timeout=30)
        if in_flight == 0:
            time.sleep(0.02)
    t_read = time.time()
    kill_processes(pids)
    t_kill = time.time()
    return {"node": victim, "pids": pids, "in_flight": in_flight, "read_to_kill_s": round(t_kill - t_read, 4),
            "long_prompts_sent": sent, "retries_before": retries_before, "t": t_kill}


def head_node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()  # this driver runs on the head


def handoff_stats() -> dict:
    q = prom.client.query
    out = {}
    for name in ("bytes", "seconds"):
        s, c = (f"sum(ray_k3_serve_handoff_{name}_{x})" for x in ("sum", "count"))
        vals = q(f"{s} / {c}")
        out[f"mean_{name}"] = float(vals[0]["value"][1]) if vals else None
    count = q("sum(ray_k3_serve_handoff_bytes_count)")
    out["count"] = float(count[0]["value"][1]) if count else 0.0
    return out


def serve_phase(before_traffic) -> None:
    config, url = deploy()
    before_traffic()
    where = placement()
    result["placement"] = where
    event(f"serve app running: {where}")
    traffic = Traffic(url, config)  # reference tokens from one engine in this process
    # moments from when a rate of the HTTP requests exists (Ray exports the counter every 2 s and a
    # rate needs two of its samples; before that "no data" is the true answer) plus two scrapes
    http_rate = Since(lambda: bool(prom.client.query(
        f'sum(rate(ray_serve_num_http_requests_total{{route!~"/-/.*"}}[{WINDOW}]))')))
    sampler = PanelSampler(prom, ["k3-serving", "k3-cluster"],
                           started=lambda: traffic.finished > 0 and http_rate.for_s(2.0))
    t_serve = time.time()
    with NodeWatch() as w, sampler, traffic.running(clients=3):
        wait_for(lambda: traffic.finished >= 24, 600, "24 requests through the handoff")
        result["handoff"] = handoff_stats()
        victim = where["PrefillServer"][0]
        result["killed"] = remove_mid_request(victim, traffic)
        t_kill = result["killed"].pop("t")
        event(f"prefill node {victim[-5:]} removed ({len(result['killed']['pids'])} processes, "
              f"{result['killed']['in_flight']} requests in flight on its replica)")
        # recovered: Serve replaced the replica (on a node the autoscaler added) and it answers again
        result["recovery_s"] = wait_for(lambda: len(set(placement().get("PrefillServer", [])) - {victim}) == 2,
                                        600, "a second prefill replica again")
        event(f"prefill replica replaced {result['recovery_s']:.0f} s after the removal")
        time.sleep(8)  # traffic on the replaced replica, a metrics report (2 s apart) and a scrape
        result["killed"]["retries_after"] = handoff_retries()
    result["serve"] = {"max_nodes": w.max, "requests": traffic.summary(t_kill),
                       "retries": {s["metric"].get("error", "?"): float(s["value"][1])
                                   for s in prom.client.query("ray_k3_serve_handoff_retries_total")}}
    result["serve_moments"] = sampler.moments
    result["placement_after"] = placement()
    result["serve_panels"] = panels_over(prom, ["k3-serving", "k3-cluster"], t_serve)
    result["rules"] = prom.client.rule_names()
    result["alerts"] = [(a["labels"]["alertname"], a["state"]) for a in prom.client.alerts()]
    result["k3_metric_names"] = prom.client.metric_names("ray_k3_")
    event(f"serve done: {result['serve']}")


class SecondCluster:
    """Another Ray with its own Prometheus beside this one, from the end of training until the Serve
    app is up: each Prometheus must see only its own SessionName (all ports of both heads their own,
    the metrics servers included). Its start-up and the wait for its autoscaler's first series
    overlap the scale-down and the deployment; it is gone before the Serve traffic and the node
    removal, which need the two cores."""

    def __init__(self) -> None:
        self.head = LocalRayHead(num_cpus=1, workdir=work / "other")
        self.prom = Prometheus(self.head.session_dir, work / "other-prometheus", scrape_interval_s=1)

    def start(self) -> "SecondCluster":
        self.head.start()
        self.prom.start()
        event(f"second cluster up on {self.head.gcs_address}")
        return self

    def check(self, head: LocalRayHead, prom: Prometheus) -> None:
        result["sessions"] = {"mine": [head.session_dir.resolve().name, self.head.session_dir.resolve().name],
                              "seen": [{k: sorted(v) for k, v in sessions_seen(p.client).items()}
                                       for p in (prom, self.prom)]}
        event(f"second cluster: {result['sessions']}")

    def stop(self) -> None:
        """Stop both; the `finally` of the scenario calls it again (a no-op then)."""
        if self.prom.alive() or self.head.alive():
            self.prom.stop()
            self.head.stop()
            event("second cluster stopped")


def stop_twice() -> None:
    """`k3 monitor down` and `k3 cluster down`, each twice: what the second call says."""
    result["downs"] = []
    for what, state in (("monitor", MONITOR), ("cluster", CLUSTER), ("monitor", MONITOR), ("cluster", CLUSTER)):
        result["downs"].append(k3(what, "down", "--state", str(state)))
        event(f"k3 {what} down: {result['downs'][-1][0]}")


head = prom = other = None
try:
    head, prom = start()
    event(f"head up on {head.gcs_address}, prometheus {prom.url}")
    result["prometheus_health"] = dashboard_get(head.address, "/api/prometheus_health", head.token_path)
    import ray
    import ray._private.ray_constants as ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # keep 127.0.0.1 (see k3.platform.ops.local_ray.init_local_ray)
    ray.init(address=head.gcs_address, _node_ip_address="127.0.0.1", log_to_driver=False)
    result["nodes_at_start"] = alive_nodes()
    train()
    t_end = time.time()
    other = SecondCluster().start()
    wait_for(lambda: alive_nodes() == 1, 180, "worker nodes removed")
    result["scale_down_s"] = time.time() - t_end
    event(f"scaled down to the head {result['scale_down_s']:.0f} s after the job ended")
    serve_phase(before_traffic=lambda: (other.check(head, prom), other.stop()))
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    stop_twice()
except BaseException:
    result["error"] = traceback.format_exc()
    raise
finally:
    import ray

    ray.shutdown()  # before its cluster goes: a driver that loses its GCS for 60 s aborts this process
    for thing in (other, prom, head):  # whatever the downs did not stop
        if thing is not None:
            thing.stop()
    result["left_running"] = {"ray_head": bool(head and head.alive()), "prometheus": bool(prom and prom.alive())}
    event("stopped")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
sys.exit(0)
