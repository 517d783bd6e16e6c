"""The `k3` CLI answers help and bad input without importing torch or Ray (each costs seconds)."""
from __future__ import annotations

import json
import subprocess
import sys

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
])
def test_bad_input_is_refused_without_torch(tmp_path, args, rc, message):
    code, out, err, imported = run_k3(tmp_path, *args)
    assert code == rc and out == ""
    assert err.splitlines()[-1].startswith(message), err
    if rc == 1:  # the operational commands' errors are one line
        assert len(err.splitlines()) == 1, err
    assert not imported.intersection(HEAVY), sorted(imported.intersection(HEAVY))


def test_params_imports_torch_where_it_counts(tmp_path):
    # the import log sees torch when a command does load it: the checks above can fail
    code, out, err, imported = run_k3(tmp_path, "params", "--preset", "k3-tiny", "--json")
    assert code == 0, err
    assert json.loads(out)["preset"] == "k3-tiny"
    assert "torch" in imported
