"""Acceptance on the local autoscaling cluster, with a real Prometheus scraping it.

One scenario, in its own process (autoscaling_scenario.py; it starts and stops its own Ray head
and Prometheus and touches no other Ray process): a pretraining job needing more CPUs than the head
has makes the autoscaler add worker nodes, finishes with a falling loss, and the nodes go after
the idle timeout; a Serve deployment whose autoscaling asks for more replicas than the head holds
gets a worker node; every panel query of both shipped dashboards returns data through
Prometheus's HTTP API while that happens.

The serving dashboard is checked with the k3_serve_* metrics emitted by real ray.util.metrics
objects built from k3.platform.ops.metrics.SERVE_METRICS inside a small Serve deployment of the
scenario's own (the k3 Serve app is not on this branch): switch it to the real app once it is.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3.platform.train.data import prepare

# 5 min on a 2-core machine at load 15, 15 min at load 60-118; the scenario is bounded at 1500 s
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1700)]
SCRIPT = Path(__file__).with_name("autoscaling_scenario.py")


@pytest.fixture(scope="module")
def scenario(tmp_path_factory) -> dict:
    data = tmp_path_factory.mktemp("data")
    prepare("bundled", data, vocab_size=4096, seq_len=64, rows_per_shard=256, max_bytes=1_500_000, progress=False)
    work = tmp_path_factory.mktemp("autoscale")
    out = work / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(work / "head" / "ray_token"),
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--data", str(data), "--work", str(work), "--out", str(out)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=1500)
    except BaseException:  # a timeout here or pytest's: SIGTERM lets the scenario stop its head and Prometheus
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    assert out.exists(), f"scenario wrote no result (rc {proc.returncode}):\n{stdout[-3000:]}\n{stderr[-3000:]}"
    result = json.loads(out.read_text())
    result["rc"], result["stderr_tail"] = proc.returncode, stderr[-3000:]
    return result


def test_nothing_is_left_running(scenario):
    assert scenario["left_running"] == {"ray_head": False, "prometheus": False}
    assert scenario["rc"] == 0, f"{scenario['events']}\n{scenario['stderr_tail']}"


def test_training_scales_up_finishes_with_falling_loss_and_scales_down(scenario):
    train = scenario["train"]
    assert scenario["nodes_at_start"] == 1
    assert train["rc"] == 0, train["log_tail"]
    assert train["max_nodes"] >= 2, f"the autoscaler added no node for 2 one-CPU workers on a one-CPU head: {train}"
    losses = train["losses"]
    assert len(losses) >= 2 and losses[-1] < losses[0], f"loss did not fall: {losses}"
    # idle timeout 0.2 min (12 s) + the autoscaler's pass; generous for a loaded 2-core machine
    assert scenario["scale_down_s"] < 120


def test_serve_autoscaling_gets_a_worker_node(scenario):
    assert scenario["serve"]["max_nodes"] >= 2


@pytest.mark.parametrize("dashboard", ["train_panels", "serve_panels"])
def test_every_panel_query_returns_data(scenario, dashboard):
    panels = scenario[dashboard]
    assert panels, f"{dashboard}: no queries evaluated"
    empty = [q for q, n in panels.items() if n == 0]
    assert not empty, f"panel queries with no data: {empty}; metrics seen: {scenario.get('k3_metric_names')}"


def test_report_of_the_run(scenario):
    page = Path(scenario["report"])
    assert page.exists() and page.read_text().count("<img ") == 4
