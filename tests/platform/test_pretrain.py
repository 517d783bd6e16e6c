"""Distributed pretraining on a local Ray cluster: exact expert parallelism, fault recovery (a
worker killed midway through a checkpoint), resume past a half-written checkpoint, file:// URIs, and configs rejected before any worker starts
(the README's `ray job submit` command runs as printed in tests/test_readme.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from k3.platform.train.data import prepare
from k3.platform.train.config import TrainConfig
from k3.platform.train.export import latest_checkpoint
import k3.model

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    prepare("bundled", out, vocab_size=4096, seq_len=64, rows_per_shard=256, max_bytes=1_500_000, progress=False)
    return out


@pytest.fixture(scope="module")
def ds_env():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def run(ray_local, data_dir, tmp_path, name, **kw):
    from k3.platform.train.launch import fit

    fields = {"num_workers": 2, "micro_batch": 4, "log_every": 1, "seed": 0, **kw}
    cfg = TrainConfig(data=str(data_dir), storage_path=str(tmp_path), name=name, **fields)
    return fit(cfg)


def losses(summary):
    return torch.tensor([h["loss"] for h in summary["history"]])


# One run serves two tests: the ep_size=2 run compared with ep_size=1 is also the uninterrupted
# run the crashed one must reproduce (every Ray Train run costs ~1 min of worker start-up and
# teardown on a 2-core machine, against ~2 s a step). Same steps and checkpoints in all three.
RUN = dict(steps=8, checkpoint_every=4)


@pytest.fixture(scope="module")
def ep2_run(ray_local, data_dir, tmp_path_factory, ds_env):
    return run(ray_local, data_dir, tmp_path_factory.mktemp("ep2"), "ep2", ep_size=2, **RUN)


def test_expert_parallel_equals_replicated_experts(ray_local, data_dir, tmp_path, ds_env, ep2_run):
    a, b = run(ray_local, data_dir, tmp_path, "ep1", ep_size=1, **RUN), ep2_run
    la, lb = losses(a), losses(b)
    assert len(la) == len(lb) == RUN["steps"] and a["restored_at"] == b["restored_at"] == []
    rel = ((la - lb).abs() / la.abs()).max().item()
    assert rel <= 1e-4, f"ep_size 1 vs 2 losses differ by {rel:.2e} relative: {la.tolist()} vs {lb.tolist()}"
    # the checkpoint loads as one single-process model holding every expert
    model = k3.model.load(b["checkpoint"])
    assert model.model.layers[1].mlp.experts.count == model.cfg.num_experts


def test_a_worker_killed_midway_through_a_checkpoint_restarts_from_the_last_complete_one(ray_local, data_dir,
                                                                                        tmp_path, ds_env, ep2_run):
    # rank 1 is SIGKILLed midway through writing the step-8 checkpoint (its DeepSpeed files written,
    # its expert file not): the group restarts from the step-4 checkpoint and redoes steps 5-8
    crashed = run(ray_local, data_dir, tmp_path, "crash", ep_size=2, max_failures=1, fail_at_step=7, fail_in="save",
                  **RUN)
    lc, lx = losses(ep2_run), losses(crashed)
    assert crashed["restored_at"] == [4], "the drill did not restart the group from the step-4 checkpoint"
    assert [h["step"] for h in crashed["history"]] == list(range(1, RUN["steps"] + 1)), "steps lost or repeated"
    rel = ((lc - lx).abs() / lc.abs()).max().item()
    assert rel <= 1e-4, f"resumed losses differ from the uninterrupted run by {rel:.2e}: {lx.tolist()} vs {lc.tolist()}"
    assert lx[-1] < lx[0]
    # every checkpoint the run left is complete and loads: the killed save never reached the run
    run_dir = tmp_path / "crash"
    ckpts = sorted(c for c in run_dir.glob("checkpoint_*") if c.is_dir())
    assert len(ckpts) == 2 and Path(latest_checkpoint(run_dir)) == ckpts[-1] == Path(crashed["checkpoint"])
    for c in ckpts:
        assert (c / "k3" / "state.pt").exists() and (c / "k3" / "shared.pt").exists()
        assert len(list((c / "k3").glob("experts-ep*-of-2.pt"))) == 2
        k3.model.load(c)
    # A checkpoint whose upload a killed worker cut short (rank 1's expert file missing) is never the
    # run's latest, and --resume passes it by: Ray Train registers a checkpoint only once every
    # worker's files are persisted.
    partial = run_dir / "checkpoint_2999-01-01_00-00-00.000000"
    shutil.copytree(ckpts[-1], partial)
    (partial / "k3" / "experts-ep1-of-2.pt").unlink()
    assert Path(latest_checkpoint(run_dir)) == ckpts[-1]
    resumed = run(ray_local, data_dir, tmp_path, "crash", ep_size=2, resume=True, steps=10, checkpoint_every=4)
    assert [h["step"] for h in resumed["history"]] == list(range(1, 11)) and resumed["restored_at"] == [4, 8]
    assert resumed["history"][:8] == crashed["history"]
    assert Path(latest_checkpoint(run_dir)) == Path(resumed["checkpoint"]) != partial


def test_bad_configs_fail_before_any_worker_starts(data_dir, tmp_path):
    cases = [
        (dict(ep_size=3, num_workers=3), "ep_size=3 must divide num_experts"),
        (dict(ep_size=4), "ep_size=4 must divide num_workers"),
        (dict(data=str(tmp_path / "missing")), "does not exist"),
        (dict(micro_batch=100_000), "sequences per step"),
        (dict(preset="k5"), "preset"),
        (dict(balance={"method": "quantile"}), "quantile_hist"),
        (dict(fail_at_step=2, fail_in="save"), "fail_in='save' needs a checkpoint at the end of step 2"),
        # context parallelism: C divides the workers and the sequence, pieces hold a conv window
        (dict(context_parallel=3), r"context_parallel \(--context-parallel\) = 3 must divide num_workers"),
        (dict(context_parallel=3, num_workers=3), r"\(--context-parallel\) = 3 must divide the sequence of 64 tokens \(the data's seq_len"),
        (dict(context_parallel=32, num_workers=32), "pieces shorter than the KDA conv window"),
        (dict(context_parallel=2, preset="k3-tiny-vl"), "text presets only"),
    ]
    for change, match in cases:
        kw = {"data": str(data_dir), **change}
        with pytest.raises(ValueError, match=match):
            TrainConfig(**kw).check()
    # and through the job script, before Ray is even imported
    t = time.time()
    out = subprocess.run([sys.executable, "jobs/pretrain.py", "--data", str(data_dir), "--ep-size", "4"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode != 0 and "must divide num_workers" in out.stderr
    out = subprocess.run([sys.executable, "jobs/pretrain.py", "--data", str(data_dir), "--num-workers", "4",
                          "--context-parallel", "3"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode != 0 and "(--context-parallel) = 3 must divide num_workers" in out.stderr
    assert time.time() - t < 60 and "ray" not in out.stdout.lower()


def test_muon_loss_free_balancing_activation_checkpointing_and_file_uris(ray_local, data_dir, tmp_path, ds_env):
    # Muon's orthogonalised updates have RMS ~ 1/sqrt(width) per unit lr, so it takes a larger
    # peak lr than AdamW (0.02, as in Muon's reference setups); no long warmup in 8 steps.
    # data and checkpoints named by file:// URIs, as an object store would be (s3://, gs://)
    s = run(ray_local, f"file://{data_dir}", f"file://{tmp_path}", "muon", num_workers=1, ep_size=1, steps=8, checkpoint_every=8,
            optimizer="muon", lr=0.02, warmup_steps=1, balance={"method": "loss_free"},
            activation_checkpointing=True)
    lx = losses(s)
    assert s["loss_is_finite"] and s["steps"] == 8
    assert lx[-2:].mean() < lx[:2].mean() - 0.1, f"Muon's loss did not fall: {lx.tolist()}"
    assert s["checkpoint"].startswith(f"file://{tmp_path}/muon/checkpoint_")
    import ray.train

    with ray.train.Checkpoint(s["checkpoint"]).as_directory() as d:
        model = k3.model.load(d)
    biases = torch.stack([layer.mlp.gate.bias for layer in model.model.layers if layer.is_moe])
    assert biases.abs().sum() > 0, "loss-free balancing never moved the bias"
