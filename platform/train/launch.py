"""Driver side of pretraining: locations, coordinator, data splits, TorchTrainer, summary.

`fit(cfg)` assumes Ray is initialised (the job's cluster, a local one, or a test's) and returns
the run summary; jobs/pretrain.py is the command line around it.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

import torch

from k3.model.training_checkpoint import read_state
from k3.platform.balance.strategies import needs_coordinator

from . import storage
from .config import TrainConfig
from .data import MANIFEST, read_manifest
from .export import registered_checkpoints
from .worker import summarize, train_loop_per_worker


# Ray Train restarts failed workers (max_failures), never its controller: a controller whose
# process dies while it is being created has run nothing, so the run starts again that often.
CONTROLLER_STARTS = 3


def controller_never_started(e: BaseException) -> bool:
    """Whether `e` says Ray Train's TrainController actor died before its creation finished
    (its process crashed on start: no worker, step or checkpoint of the run exists yet)."""
    import ray.exceptions

    text = str(e)
    return (isinstance(e, ray.exceptions.ActorDiedError) and not e.actor_init_failed
            and "class_name: TrainController" in text and "never ran" in text)


def fit(cfg: TrainConfig) -> dict:
    """Run (or resume) a pretraining run; raises ValueError for a bad config before any worker
    starts and RuntimeError when training fails after its allowed restarts."""
    import ray

    cfg = cfg.located()
    cfg.check()
    run = storage.join(cfg.storage_path, cfg.name)
    found = registered_checkpoints(run)
    if not cfg.resume and found:
        raise ValueError(f"run {run} already has checkpoints: pass resume=True (--resume) or a new name")
    if found:  # Ray Train resumes from the latest: it must continue the data where the run stopped
        check_resume(cfg, found[-1])
    check_every_node_sees_the_run(cfg, run)
    coordinator = start_coordinator(cfg, run)
    try:
        for attempt in range(1, CONTROLLER_STARTS + 1):
            try:
                result = make_trainer(cfg, data_splits(cfg)).fit()
                break
            except Exception as e:  # Ray Train raises once max_failures restarts are used up
                if attempt < CONTROLLER_STARTS and controller_never_started(e):
                    print(f"pretrain: Ray Train's controller process died before it started (attempt {attempt} of "
                          f"{CONTROLLER_STARTS}; nothing had run): starting the run again", flush=True)
                    continue
                raise RuntimeError(f"training failed: {e}") from e
        summary = run_summary(cfg, run, result)
        if coordinator is not None:
            summary["coordinator"] = {k: v for k, v in ray.get(coordinator.metrics.remote()).items() if k != "layers"}
        return summary
    finally:
        if coordinator is not None:
            ray.kill(coordinator, no_restart=True)


# What a resumed run must keep, with its flag. The data position in a checkpoint is its step count:
# each data-parallel group (num_workers / context_parallel ranks) reads one split of the rows
# (data_splits) in batches of micro_batch shuffled from seed (worker.StepData), so with another
# count of groups, micro batch or seed a resumed run would skip some rows and repeat others.
# num_workers is kept whole as well: DeepSpeed's ZeRO optimizer state is cut in one part per
# worker, and it refuses another count on load (inside every worker, after the start-up).
RESUME_FIELDS = {"num_workers": "--num-workers", "context_parallel": "--context-parallel",
                 "micro_batch": "--micro-batch", "seed": "--seed"}
# multimodal presets: which steps are media steps, and each worker's draw of examples (MediaSchedule)
MEDIA_RESUME_FIELDS = {"media_micro_batch": "--media-micro-batch", "text_every": "--text-every"}


def check_resume(cfg: TrainConfig, checkpoint: str) -> None:
    """Refuse to resume from `checkpoint` (the run's latest registered one) with a config that
    would train other rows than the run would have, or whose workers could not load it: one
    ValueError naming each changed flag with the checkpoint's value. A field the checkpoint's
    config lacks was added to TrainConfig after it was written, when the run behaved as its default
    does; a checkpoint without a rows hash (written before it was kept) is compared by its data
    path instead."""
    state = read_checkpoint_state(checkpoint)
    saved = state.get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"--resume: {checkpoint} holds no training config in k3/state.pt, so what data layout it "
                         f"was trained with is unknown; start a new run from its weights with --init-from {checkpoint}")
    fields = dict(RESUME_FIELDS)
    if cfg.model_cfg().vision_config is not None:
        fields |= MEDIA_RESUME_FIELDS
    changed = []
    for field, flag in fields.items():
        was = saved.get(field, TrainConfig.model_fields[field].default)
        if getattr(cfg, field) != was:
            changed.append(f"{flag} {getattr(cfg, field)} (the checkpoint's: {was})")
    if state.get("data_hash") is not None:
        now = read_manifest(cfg.data).rows_hash()
        if now != state["data_hash"]:
            changed.append(f"--data {cfg.data} holds other rows (rows hash {now}, the checkpoint's: "
                           f"{state['data_hash']}; prepared from other input or settings)")
    elif saved.get("data") is not None and saved["data"] != cfg.data:
        changed.append(f"--data {cfg.data} (the checkpoint's: {saved['data']}; it predates the rows hash, so its "
                       f"path is compared)")
    if changed:
        raise ValueError(f"--resume from {checkpoint} (step {state['step']}) would skip or repeat data: "
                         f"{'; '.join(changed)}. Resume with the checkpoint's values, or start a new run from its "
                         f"weights with --init-from {checkpoint} --name <new run>")


def read_checkpoint_state(checkpoint: str) -> dict:
    """k3/state.pt of a checkpoint (a path or URI), read as read_state reads it; ValueError naming
    it when it is missing or unreadable."""
    k3dir = storage.join(checkpoint, "k3")
    if storage.node_path(k3dir) is not None:
        return read_state(storage.node_path(k3dir))
    with tempfile.TemporaryDirectory() as d:  # an object store: the one small file, not the checkpoint
        try:
            Path(d, "state.pt").write_bytes(storage.read_bytes(storage.join(k3dir, "state.pt")))
        except OSError as e:
            raise ValueError(f"{storage.join(k3dir, 'state.pt')}: cannot read it ({e})") from e
        return read_state(d)


def check_every_node_sees_the_run(cfg: TrainConfig, run: str) -> None:
    """On a multi-node cluster, the data and the run's storage must be the same on every node. A
    file this driver leaves in the run shows whether a node sees the storage (writing it also
    creates the run's directory, where the coordinator keeps its state)."""
    files = {f"--data {cfg.data!r}": storage.join(cfg.data, MANIFEST)}
    probe = None
    if storage.node_path(run) is not None:
        probe = storage.join(run, f".k3-visible-{secrets.token_hex(8)}")
        storage.write_bytes(probe, secrets.token_bytes(16))
        files[f"--storage-path {cfg.storage_path!r}"] = probe
    try:
        storage.check_every_node_sees(files)
    finally:
        if probe is not None:
            storage.delete_file(probe)


def start_coordinator(cfg: TrainConfig, run: str):
    """The balance coordinator, a named actor that outlives worker restarts (None when the method
    needs none). It keeps its state in the run when the run is on the nodes' filesystem."""
    from k3.platform.balance.coordinator import get_or_create_coordinator

    mcfg = cfg.model_cfg()
    n_moe = mcfg.mlp_types.count("moe")
    if not (needs_coordinator(cfg.balance) and n_moe):
        return None
    state = storage.node_path(storage.join(run, "coordinator.pt"))
    return get_or_create_coordinator(
        cfg.coordinator_name, num_layers=n_moe, num_experts=mcfg.num_experts, top_k=mcfg.num_experts_per_token,
        config=cfg.balance, world_size=cfg.num_workers, state_path=state)


def data_splits(cfg: TrainConfig) -> list:
    """Deterministic, equal splits of the token shards, one per data-parallel group (the ranks of
    a context-parallel group read the same one). Ray Data's settings for this read are set for it
    alone: the datasets keep their own copy, and the caller's DataContext is as it was."""
    import ray.data

    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.use_datasource_v2
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    # Ray Data's newer Parquet reader (Ray 2.60's default) lists the files through 32 new
    # actors that read their footers, started and killed on every read: ~4 s for the 24 files of
    # a small run on 2 cores, the processes' start-up taking the cores from training after it,
    # and on an autoscaling cluster their 1-CPU placement requests add nodes for a read of a few
    # MB. The reader before it reads the footers in the read tasks (0.4-1.8 s here).
    ctx.use_datasource_v2 = False
    try:
        paths = read_manifest(cfg.data).shard_paths(cfg.data)
        # one block per shard, whatever the cluster's size: the workers' shuffle buffers fill from
        # the blocks in order, so the batches (and a resumed run's) do not depend on how many CPUs
        # read them
        return ray.data.read_parquet(paths, override_num_blocks=len(paths)).split(
            cfg.num_workers // cfg.context_parallel, equal=True)
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars, ctx.use_datasource_v2 = saved


def worker_env(cfg: TrainConfig) -> dict[str, str]:
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if cfg.use_gpu else "cpu"),
           "PYTHONUNBUFFERED": "1",
           # one line per log interval: Ray Train's print patch both tees a worker's print to stdout
           # and logs it to the console, so every line came twice
           "RAY_TRAIN_ENABLE_PRINT_PATCH": os.environ.get("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")}
    # DeepSpeed's ops build where the driver's would: TORCH_EXTENSIONS_DIR when set, else torch's
    # default (a directory of k3's own here made a README job rebuild what `make demo` had built)
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
    return env


def make_trainer(cfg: TrainConfig, splits: list):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.model_dump(), "splits": splits},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=None if cfg.use_gpu else {"CPU": 1}),
        run_config=RunConfig(name=cfg.name, storage_path=cfg.storage_path,
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=3),
                             worker_runtime_env={"env_vars": worker_env(cfg)}),
    )


def run_summary(cfg: TrainConfig, run: str, result) -> dict:
    """Losses, MaxVio per layer and the history from the final checkpoint, and where it is (a
    path, or a URI under a URI storage_path)."""
    with result.checkpoint.as_directory() as d:
        state = read_state(Path(d) / "k3")
    return {"config": {"preset": cfg.preset, "num_workers": cfg.num_workers, "ep_size": cfg.ep_size,
                       "zero_stage": cfg.zero_stage, "balance": cfg.balance.method, "steps": cfg.steps},
            **summarize(state["history"]), "history": state["history"], "restored_at": state.get("restored_at", []),
            "checkpoint": storage.join(run, Path(result.checkpoint.path).name)}
