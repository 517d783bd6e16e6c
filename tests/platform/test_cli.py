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


# -- state files: `k3 cluster` / `k3 monitor` find what `up` started, and only that -----------------
def head_state(pid, **extra) -> str:
    """A `k3 cluster up` state naming `pid`, its other fields placeholders."""
    return json.dumps({"pid": pid, "workdir": "w", "ports": {"port": 1, "dashboard-port": 2}, "num_cpus": 1,
                       "temp_dir": "t", **extra})


@pytest.fixture
def unrelated():
    """A process nothing of k3 started, leading its own process group."""
    p = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


@pytest.mark.parametrize("what", ["cluster", "monitor"])
@pytest.mark.parametrize("started, said", [
    (None, "was not running as far as k3 can tell"),  # a state of an older k3: no start time
    (1, "was stale (pid"),  # the pid was reused by another process
])
def test_down_never_signals_a_process_the_state_does_not_name(tmp_path, unrelated, what, started, said):
    extra = {} if started is None else {"started": started}
    extra |= {"session_dir": "s", "port": 3} if what == "monitor" else {}
    (tmp_path / "state.json").write_text(head_state(unrelated.pid, **extra))
    code, out, err, _ = run_k3(tmp_path, what, "down", "--state", "state.json")
    assert code == 0 and said in out and "signalled nothing" in out, (out, err)
    assert unrelated.poll() is None, "k3 down killed a process it did not start"
    assert not (tmp_path / "state.json").exists()  # the stale state is gone: `up` is free again


def test_status_of_a_stale_state_says_it_is_not_running(tmp_path, unrelated):
    (tmp_path / "state.json").write_text(head_state(unrelated.pid, started=1))
    code, out, err, _ = run_k3(tmp_path, "cluster", "status", "--state", "state.json")
    assert code == 1 and "k3: error: the k3 cluster recorded in state.json" in err and "is not running" in err, err


@pytest.mark.parametrize("content, why", [
    ("{}", "(KeyError: 'pid')"),
    ("[1]", "(TypeError: a JSON list, not an object)"),
    ("garbage", "(JSONDecodeError: Expecting value"),
    (head_state(0), "(TypeError: pid must be a positive integer, got 0)"),  # killpg(0) is our own group
])
@pytest.mark.parametrize("args", [["cluster", "up"], ["cluster", "status"], ["cluster", "down"],
                                  ["monitor", "up", "--session-dir", "."], ["monitor", "down"]])
def test_a_bad_state_file_is_named_in_one_line_and_down_force_removes_it(tmp_path, content, why, args):
    (tmp_path / "bad.json").write_text(content)
    code, out, err, imported = run_k3(tmp_path, *args, "--state", "bad.json")
    assert code == 1 and len(err.splitlines()) == 1 and "bad.json: not a k3 " in err and why in err, err
    assert f"`k3 {args[0]} down --state" in err and "--force` removes it" in err, err
    assert not imported.intersection(HEAVY)
    if args[1] == "down":
        code, out, err, _ = run_k3(tmp_path, *args, "--state", "bad.json", "--force")
        assert code == 0 and "removed bad.json" in out and not (tmp_path / "bad.json").exists(), err


@pytest.mark.parametrize("state, message", [
    ("adir", "adir: is a directory, not a k3 cluster state file"),
    ("afile/state.json", "afile/state.json: cannot hold a state file:"),
])
@pytest.mark.parametrize("action", ["up", "status", "down"])
def test_a_state_path_that_cannot_hold_a_state_file_is_one_line(tmp_path, state, message, action):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    code, out, err, _ = run_k3(tmp_path, "cluster", action, "--state", state)
    if action != "up" and state.startswith("afile"):  # nothing can be recorded there: nothing runs
        assert (code, out) == (0 if action == "down" else 1, "k3 cluster down: was not running\n"
                               if action == "down" else ""), err
        return
    assert code == 1 and len(err.splitlines()) == 1 and message in err, err
    assert not list(tmp_path.glob("**/head-*"))  # refused before a head started


def test_the_default_state_is_the_checkout_s_from_any_of_its_folders(tmp_path, monkeypatch):
    from k3.platform.ops.state import STATE_DIR_ENV, default_cluster_state, default_monitor_state

    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "k3"\n')
    (tmp_path / "jobs" / "deep").mkdir(parents=True)
    for cwd in (tmp_path, tmp_path / "jobs", tmp_path / "jobs" / "deep"):
        monkeypatch.chdir(cwd)
        assert default_cluster_state() == tmp_path.resolve() / ".cache" / "k3-cluster" / "state.json"
        assert default_monitor_state() == tmp_path.resolve() / ".cache" / "k3-monitor" / "state.json"
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "mine"))
    assert default_cluster_state() == tmp_path.resolve() / "mine" / "k3-cluster" / "state.json"
    monkeypatch.delenv(STATE_DIR_ENV)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cluster_state() == tmp_path.resolve() / "xdg" / "k3" / "k3-cluster" / "state.json"


def test_down_from_a_subfolder_finds_the_cluster_up_recorded_at_the_root(tmp_path, unrelated, monkeypatch):
    from k3.platform.ops.state import STATE_DIR_ENV

    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "k3"\n')
    (tmp_path / "jobs").mkdir()
    state = tmp_path / ".cache" / "k3-cluster" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(head_state(unrelated.pid, started=1))
    code, out, err, _ = run_k3(tmp_path / "jobs", "cluster", "down")
    assert code == 0 and "was stale" in out and not state.exists(), (out, err)
    assert unrelated.poll() is None
