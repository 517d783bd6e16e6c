"""The `k3` CLI answers help and bad input without importing torch or Ray (each costs seconds)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "ray", "deepspeed")


def run_k3(cwd, *args: str) -> tuple[int, str, str, set[str]]:
    """(exit code, stdout, stderr without the import log, every module the process imported)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "k3.platform.ops.cli", *args],
                       cwd=cwd, capture_output=True, text=True, timeout=300)
    log = [l for l in p.stderr.splitlines() if l.startswith("import time:")]
    imported = {l.rsplit("|", 1)[1].strip() for l in log[1:]}  # the first line is the header
    err = "\n".join(l for l in p.stderr.splitlines() if not l.startswith("import time:"))
    return p.returncode, p.stdout, err, imported


@pytest.mark.parametrize("args, rc, expected", [
    (["--help"], 0, "usage: k3"),
    (["params", "--help"], 0, "--release-layout"),
    (["cluster", "--help"], 0, "rayservice"),
    (["monitor", "--help"], 0, "--scrape-interval"),
    (["report", "--help"], 0, "run_dir"),
    (["plan", "--help"], 0, "--context"),
    (["presets"], 0, "k3-tiny"),
    (["config", "--preset", "k3-tiny"], 0, '"num_layers"'),
])
def test_answers_without_torch(tmp_path, args, rc, expected):
    code, out, err, imported = run_k3(tmp_path, *args)
    assert code == rc, err
    assert expected in out
    assert not imported.intersection(HEAVY), sorted(imported.intersection(HEAVY))


@pytest.mark.parametrize("args, rc, message", [
    ([], 2, "k3: error: the following arguments are required: command"),
    (["params"], 2, "k3 params: error: the following arguments are required: --preset"),
    (["params", "--preset", "nope"], 2, "k3 params: error: argument --preset: invalid choice: 'nope'"),
    (["cluster", "up", "--config", "missing.yaml", "--state", "state.json"], 1,
     "k3: error: missing.yaml: no such cluster YAML"),
    (["cluster", "status", "--state", "state.json"], 1, "k3: error: no k3 cluster recorded in state.json"),
    (["cluster", "env", "--state", "state.json"], 1, "k3: error: no k3 cluster recorded in state.json"),
    (["cluster", "rayservice", "--base", "missing.yaml"], 1, "k3: error: missing.yaml: no such manifest"),
    (["monitor", "up", "--session-dir", "nowhere", "--state", "monitor.json"], 1,
     "k3: error: Ray session directory nowhere does not exist"),
    (["report", "no-run"], 1, "k3: error: no-run: no such run directory"),
    *[(["monitor", "up", "--scrape-interval", v], 2, "k3 monitor: error: argument --scrape-interval: must be a "
       f"number of seconds from 0.001 to 86400, got {v}") for v in ("nan", "inf", "0", "-1", "0.0001")],
    (["plan", "--preset", "k3", "--context", "1048576", "--gpus", "64", "--gpu", "x100"], 1,
     "k3: error: unknown GPU 'x100'; choose from ['a100', 'h100', 'h200']"),
    (["plan", "--preset", "k3", "--context", "1048576", "--gpus", "64"], 2,
     "k3 plan: error: the following arguments are required: --gpu"),
])
def test_bad_input_is_refused_without_torch(tmp_path, args, rc, message):
    code, out, err, imported = run_k3(tmp_path, *args)
    assert code == rc and out == ""
    assert err.splitlines()[-1].startswith(message), err
    if rc == 1:  # the operational commands' errors are one line
        assert len(err.splitlines()) == 1, err
    assert not imported.intersection(HEAVY), sorted(imported.intersection(HEAVY))


@pytest.mark.parametrize("args, message", [
    (["cluster", "rayservice", "--base", "bad.yaml"], "k3: error: bad.yaml: not YAML: "),
    (["cluster", "rayservice", "--serve-config", "bad.yaml", "--base",
      str(Path(__file__).resolve().parents[2] / "cluster" / "kuberay" / "rayservice.yaml")],
     "k3: error: bad.yaml: not YAML: "),
    (["cluster", "env", "--state", "bad.yaml"], "k3: error: bad.yaml: not a k3 cluster state file (JSONDecodeError"),
    (["cluster", "status", "--state", "list.json"], "k3: error: list.json: not a k3 cluster state file (TypeError"),
])
def test_unreadable_files_are_named_in_one_line(tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    (tmp_path / "list.json").write_text("[1]")
    code, out, err, imported = run_k3(tmp_path, *args)
    assert code == 1 and out == "" and len(err.splitlines()) == 1 and err.startswith(message), err


def test_params_imports_torch_where_it_counts(tmp_path):
    # the import log sees torch when a command does load it: the checks above can fail
    code, out, err, imported = run_k3(tmp_path, "params", "--preset", "k3-tiny", "--json")
    assert code == 0, err
    assert json.loads(out)["preset"] == "k3-tiny"
    assert "torch" in imported


@pytest.mark.parametrize("args, message", [
    (["--dp", "1", "--cp", "64", "--ep", "64"], "k3: error: the layout DP 1, CP 64, EP 64 does not fit: "),
    (["--gpus", "0"], "k3: error: --gpus must be in [1, 1,048,576], got 0"),
    (["--gpus", "10000000000"], "k3: error: --gpus must be in [1, 1,048,576], got 10,000,000,000"),
    (["--utilisation", "1e-300"], "k3: error: --utilisation must be in [0.01, 1], got 1e-300"),
])
def test_plan_refuses_what_cannot_be_planned_in_one_line(tmp_path, args, message):
    base = {"--preset": "k3", "--context": "1048576", "--gpus": "64", "--gpu": "h200"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    code, out, err, _ = run_k3(tmp_path, "plan", *[x for kv in base.items() for x in kv])
    assert code == 1 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_plan_prints_training_and_serving_for_k3_at_1m(tmp_path):
    code, out, err, _ = run_k3(tmp_path, "plan", "--preset", "k3", "--context", "1048576", "--gpus", "512",
                               "--gpu", "h200")
    assert code == 0, err
    for line in ("Training: DP", "weights", "activations", "all-to-all", "CP exchange", "QB histograms",
                 "Serving:", "bytes/sequence", "sequences/GPU", "prefill time"):
        assert line in out, line
    code, out, err, _ = run_k3(tmp_path, "plan", "--preset", "k3", "--context", "1048576", "--gpus", "512",
                               "--gpu", "h200", "--json")
    plan = json.loads(out)
    assert plan["serving"]["mla_latents_per_sequence"] == 24 * 576 * 2 * 1048576
    assert plan["training"]["fits"] is False


@pytest.mark.parametrize("flag", [[], ["--haproxy"]])
def test_cluster_up_with_haproxy_starts_the_head_with_direct_ingress(monkeypatch, capsys, tmp_path, flag):
    from k3.platform.ops import cluster
    from k3.platform.ops.cli import main

    seen = {}

    def up(config, state, grafana_url=None, env=None):
        seen["env"] = env
        return {"pid": 1, "gcs_address": "127.0.0.1:1", "address": "http://127.0.0.1:2", "session_dir": "/s",
                "prometheus_port": 3, "token_path": "/t"}

    monkeypatch.setattr(cluster, "up", up)
    assert main(["cluster", "up", "--state", str(tmp_path / "state.json"), *flag]) == 0
    if flag:
        assert seen["env"]["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and "HAProxy's" in capsys.readouterr().out
    else:
        assert seen["env"] is None and "HAProxy" not in capsys.readouterr().out
