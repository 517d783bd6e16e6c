"""The driver's restart of a run whose Ray Train controller died while it was being created, and
its refusal to resume a run under a layout that would skip or repeat data."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, RayTaskError

from k3.platform.train import launch
from k3.platform.train.config import TrainConfig
from k3.platform.train.data import prepare, read_manifest


def died(class_name: str = "TrainController", never_started: bool = True) -> ActorDiedError:
    """The error Ray raises for an actor whose process exited (here: as the README job's
    controller did, "Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so" on start)."""
    return ActorDiedError(ActorDiedErrorContext(
        class_name=class_name, actor_id=os.urandom(16), pid=4614, node_ip_address="127.0.0.1",
        error_message="Worker unexpectedly exits with a connection error code 2. End of file.",
        never_started=never_started))


def test_only_a_controller_that_never_started_counts():
    assert launch.controller_never_started(died())
    assert not launch.controller_never_started(died(never_started=False))  # it had run: steps may be lost
    assert not launch.controller_never_started(died(class_name="RayTrainWorker"))  # max_failures' business
    init_error = ActorDiedError(RayTaskError("__init__", "Traceback ...", ValueError("bad config")))
    assert init_error.actor_init_failed and not launch.controller_never_started(init_error)
    assert not launch.controller_never_started(RuntimeError("class_name: TrainController never ran"))


class Trainer:
    def __init__(self, errors: list):
        self.errors = errors

    def fit(self):
        if self.errors:
            raise self.errors.pop(0)
        return "result"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("launch")
    prepare("bundled", tmp_path / "data", vocab_size=4096, seq_len=64, rows_per_shard=64, max_bytes=200_000,
            progress=False)
    return TrainConfig(data=str(tmp_path / "data"), storage_path=str(tmp_path / "runs"), name="r", num_workers=2,
                       micro_batch=2, steps=2, balance={"method": "none"})


@pytest.mark.parametrize("errors, outcome", [
    ([died()], "result"),                                 # one crash on start: started again, trained
    ([died(), died()], "result"),                         # CONTROLLER_STARTS = 3
    ([died(), died(), died()], "training failed"),       # then the job fails with Ray's reason
    ([died(never_started=False)], "training failed"),    # a controller that had run is not restarted
])
def test_fit_starts_a_run_again_when_its_controller_died_on_start(cfg, monkeypatch, capsys, errors, outcome):
    starts = []
    monkeypatch.setattr(launch, "check_every_node_sees_the_run", lambda cfg, run: None)
    monkeypatch.setattr(launch, "start_coordinator", lambda cfg, run: None)
    monkeypatch.setattr(launch, "data_splits", lambda cfg: [])
    monkeypatch.setattr(launch, "make_trainer", lambda cfg, splits: starts.append(1) or Trainer(errors))
    monkeypatch.setattr(launch, "run_summary", lambda cfg, run, result: {"result": result})
    n = len(errors)
    if outcome == "result":
        assert launch.fit(cfg) == {"result": "result"} and len(starts) == n + 1
        assert capsys.readouterr().out.count("controller process died before it started") == n
    else:
        with pytest.raises(RuntimeError, match="(?s)training failed: The actor died unexpectedly.*TrainController"):
            launch.fit(cfg)
        assert len(starts) == min(n, launch.CONTROLLER_STARTS)


@pytest.mark.ray
def test_the_data_is_read_in_equal_ordered_splits_without_an_actor_per_read(ray_local, cfg):
    """`data_splits` is the driver's read of every token shard. Ray Data's default Parquet reader
    (Ray 2.60) started 32 footer-reading actors for it, every run: seconds of process start-up on
    2 cores, and on an autoscaling cluster nodes added for a read of a few MB. The settings it
    reads with stay with the read: the caller's DataContext is left as it was."""
    import pyarrow.parquet as pq
    import ray.data
    from ray._private import state

    from k3.platform.train.data import read_manifest

    ctx = ray.data.DataContext.get_current()
    settings = lambda: (ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.use_datasource_v2)  # noqa: E731
    caller = settings()
    before = {a["ActorID"] for a in state.actors().values()}
    splits = launch.data_splits(cfg)
    assert settings() == caller  # the read's settings were its own: a program reading after fit() keeps Ray's
    started = sorted(a["ActorClassName"] for a in state.actors().values() if a["ActorID"] not in before)
    assert not [c for c in started if not c.startswith("_")], f"the read started actors: {started}"
    rows = [r for p in read_manifest(cfg.data).shard_paths(cfg.data) for r in pq.read_table(p).to_pylist()]
    got = [s.take_all() for s in splits]
    n = len(rows) // 2
    assert len(splits) == 2 and [len(g) for g in got] == [n, n]
    assert [list(map(int, r["tokens"])) for r in got[0] + got[1]] == [r["tokens"] for r in rows[:2 * n]]


def test_workers_build_deepspeed_ops_where_the_driver_and_make_do(monkeypatch):
    """One extensions directory for every way k3 starts DeepSpeed: a README job from a new
    terminal (no TORCH_EXTENSIONS_DIR) builds into torch's default, as `make demo` and the tests
    do; a directory of k3's own made that job rebuild each op (~1-1.5 min each on 2 cores)."""
    from pathlib import Path

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert "TORCH_EXTENSIONS_DIR" not in launch.worker_env(TrainConfig())
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/ops")
    assert launch.worker_env(TrainConfig())["TORCH_EXTENSIONS_DIR"] == "/somewhere/ops"
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert not [line for line in makefile.splitlines() if "TORCH_EXTENSIONS_DIR" in line and not line.startswith("#")]


# -- resume: the data a checkpoint continues ------------------------------------------------------
def write_checkpoint(root, cfg: TrainConfig, step: int = 4, data_hash: str | None = "of the data", **config) -> str:
    """A checkpoint's k3/state.pt as the workers write it (StepLog.write_checkpoint's state, the
    balancing state and the run's config added by Trainer.save). data_hash "of the data": the hash of
    cfg.data's rows; None: a checkpoint from before it was kept. config: changes to the saved config
    (a value of None drops the field, as in a checkpoint written before TrainConfig had it)."""
    ckpt = root / f"checkpoint_{step}"
    (ckpt / "k3").mkdir(parents=True)
    saved = {k: v for k, v in {**cfg.model_dump(), **config}.items() if v is not None}
    state = {"step": step, "history": [], "restored_at": [], "balance": None, "config": saved}
    if data_hash is not None:
        state["data_hash"] = read_manifest(cfg.data).rows_hash() if data_hash == "of the data" else data_hash
    torch.save(state, ckpt / "k3" / "state.pt")
    return str(ckpt)


@pytest.mark.parametrize("saved, resumed, flags", [
    # 2 workers C = 2 (one data-parallel group) resumed with C = 1 (two): the second group's rows would never train
    (dict(context_parallel=2), dict(), ["--context-parallel 1 (the checkpoint's: 2)"]),
    # the same data-parallel groups on fewer workers: DeepSpeed's optimizer partitions are per worker
    (dict(num_workers=4, context_parallel=2), dict(),
     ["--num-workers 2 (the checkpoint's: 4)", "--context-parallel 1 (the checkpoint's: 2)"]),
    (dict(), dict(micro_batch=4), ["--micro-batch 4 (the checkpoint's: 2)"]),
    (dict(), dict(seed=1), ["--seed 1 (the checkpoint's: 0)"]),
])
def test_resume_refuses_a_changed_data_layout_naming_each_flag(cfg, tmp_path, saved, resumed, flags):
    cfg = cfg.located()
    ckpt = write_checkpoint(tmp_path, cfg, **saved)
    with pytest.raises(ValueError) as e:
        launch.check_resume(cfg.model_copy(update=resumed), ckpt)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--resume from {ckpt} (step 4) would skip or repeat data: ")
    assert msg.count("(the checkpoint's: ") == len(flags) and all(f in msg for f in flags), msg
    assert f"Resume with the checkpoint's values, or start a new run from its weights with --init-from {ckpt}" in msg


def test_resume_compares_the_rows_of_the_data_not_where_they_are(cfg, tmp_path):
    cfg = cfg.located()
    ckpt = write_checkpoint(tmp_path, cfg)
    launch.check_resume(cfg, ckpt)  # the same layout and data
    moved = shutil.copytree(cfg.data, tmp_path / "moved")  # copied to a shared mount: the same rows
    launch.check_resume(cfg.model_copy(update={"data": str(moved)}), ckpt)
    other = tmp_path / "other"  # prepared again with another --seq-len: other rows
    prepare("bundled", other, vocab_size=4096, seq_len=32, rows_per_shard=64, max_bytes=200_000, progress=False)
    with pytest.raises(ValueError, match=f"--data {other} holds other rows"):
        launch.check_resume(cfg.model_copy(update={"data": str(other)}), ckpt)


def test_resume_reads_a_checkpoint_from_before_the_rows_hash_and_context_parallelism(cfg, tmp_path):
    # no rows hash: the data path is compared; no context_parallel in its config: it ran with C = 1
    cfg = cfg.located()
    ckpt = write_checkpoint(tmp_path, cfg, data_hash=None, context_parallel=None)
    launch.check_resume(cfg, ckpt)
    with pytest.raises(ValueError, match=r"--context-parallel 2 \(the checkpoint's: 1\)"):
        launch.check_resume(cfg.model_copy(update={"context_parallel": 2, "num_workers": 2}), ckpt)
    with pytest.raises(ValueError, match="it predates the rows hash, so its path is compared"):
        launch.check_resume(cfg.model_copy(update={"data": str(tmp_path)}), ckpt)


def test_fit_refuses_a_changed_layout_before_anything_starts(cfg, tmp_path, monkeypatch):
    ckpt = write_checkpoint(tmp_path, cfg.located(), context_parallel=2)
    monkeypatch.setattr(launch, "registered_checkpoints", lambda run: [ckpt])
    monkeypatch.setattr(launch, "check_every_node_sees_the_run", lambda cfg, run: pytest.fail("started"))
    with pytest.raises(ValueError, match=r"--context-parallel 1 \(the checkpoint's: 2\)"):
        launch.fit(cfg.model_copy(update={"resume": True}))
