"""jobs/bench_vs_transformers.py as a user runs it: the decode comparison of k3's engines against
transformers' `generate` on the same imported weights gives the same tokens and one entry per
engine asked for, and a floor (the run's counted arithmetic and bytes at this machine's rates) below
what k3 measured; bad flags are refused, each named, before any model is built. The speedups are the
benchmark's to show (docs/benchmarks.md), not a test's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = str(REPO / "jobs" / "bench_vs_transformers.py")


def run(*argv: str) -> subprocess.CompletedProcess:
    # as a user runs it: EngineConfig's own default (the session's K3_COMPILE_DECODE=0 left out)
    env = {k: v for k, v in os.environ.items() if k != "K3_COMPILE_DECODE"} | {"OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, SCRIPT, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_every_bad_flag_is_refused_at_once_naming_it():
    # one line each, before any model is built (a model name it lacks was a KeyError's traceback)
    done = run("--engines", "default,fast", "--batches", "1,17", "--new-tokens", "0", "--models", "kimi9",
               "--only", "decode,eval", "--repeats", "0", "--train-seq", "1")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    for line in ("--engines takes default, compiled, eager, got 'default,fast'",
                 "--batches: each must be 1..16", "got [17]", "--new-tokens must be >= 1, got 0",
                 "--models takes kimi8, kimi4, got 'kimi9'", "--only takes decode, train, got 'decode,eval'",
                 "--repeats must be >= 1, got 0", "--train-seq must be >= 2"):
        assert line in done.stderr, (line, done.stderr)
    done = run("--batches", "1,x")
    assert done.returncode == 2 and "--batches takes comma-separated integers, got '1,x'" in done.stderr


def test_decode_gives_transformers_tokens_for_each_engine():
    # the eager engine (the default's graphs take a minute or more to compile; tests/serve/test_graphs.py
    # holds them to the eager tokens); the floor's counted runs are eager whatever the default
    done = run("--only", "decode", "--models", "kimi4", "--batches", "1,2", "--new-tokens", "3", "--repeats", "1",
               "--engines", "eager")
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout)["kimi4"]["decode"]
    assert set(res) == {"1", "2"}
    for batch, r in res.items():
        assert set(r) == {"transformers_s", "transformers_tokens_per_s", "floor", "eager"}
        assert r["eager"]["sequences_identical"] == f"{batch}/{batch}" and r["eager"]["speedup"] > 0
        # the floor is a lower bound: below what k3 measured, with all its parts counted
        f = r["floor"]
        assert 0 < f["floor_s"] < r["eager"]["k3_s"] and 0 < r["eager"]["fraction_of_floor"] < 1
        assert f["max_speedup"] > r["eager"]["speedup"]
        assert f["prefill_gflop"] > 0 and f["decode_mflop_per_step"] > 0 and f["decode_mb_per_step"] > 0


def test_the_floor_counts_a_depthwise_convolution_backward_as_its_work():
    # torch's own rule counts a grouped conv's backward as a dense one's (the short conv's
    # 768 channels: 768x); the bench's counts each gradient at the forward's cost, and agrees
    # with torch's rule where there are no groups
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    from k3.jobs.bench_vs_transformers import step_flops

    x, w = torch.randn(1, 64, 50, requires_grad=True), torch.randn(64, 1, 4, requires_grad=True)
    fwd = step_flops(lambda: F.conv1d(x, w, groups=64))
    assert fwd == 2 * 64 * 47 * 4
    assert step_flops(lambda: F.conv1d(x, w, groups=64).sum().backward()) == 3 * fwd
    x.requires_grad_(False)
    assert step_flops(lambda: F.conv1d(x, w, groups=64).sum().backward()) == 2 * fwd  # the weight's only
    x2, w2 = torch.randn(2, 16, 30, requires_grad=True), torch.randn(32, 16, 3, requires_grad=True)
    with FlopCounterMode(display=False) as fc:
        F.conv1d(x2, w2).sum().backward()
    assert step_flops(lambda: F.conv1d(x2, w2).sum().backward()) == fc.get_total_flops()
