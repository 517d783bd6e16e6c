"""Driver side of pretraining: coordinator, data splits, TorchTrainer, summary.

`fit(cfg)` assumes Ray is initialised (the job's cluster, a local one, or a test's) and returns
the run summary; jobs/pretrain.py is the command line around it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from k3.platform.balance.strategies import needs_coordinator

from .config import TrainConfig
from .worker import summarize, train_loop_per_worker


def fit(cfg: TrainConfig) -> dict:
    """Run (or resume) a pretraining run; raises ValueError for a bad config before any worker
    starts and RuntimeError when training fails after its allowed restarts."""
    import ray
    import ray.data
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from k3.platform.balance.coordinator import get_or_create_coordinator
    from .data import read_manifest

    cfg = cfg.model_copy(update={"storage_path": str(Path(cfg.storage_path).resolve()),
                                 "data": str(Path(cfg.data).resolve())})
    cfg.check()
    mcfg = cfg.model_cfg()
    run_dir = Path(cfg.storage_path) / cfg.name
    if not cfg.resume and run_dir.exists() and any(c.is_dir() for c in run_dir.glob("checkpoint_*")):
        raise ValueError(f"run {run_dir} already has checkpoints: pass resume=True (--resume) or a new name")
    run_dir.mkdir(parents=True, exist_ok=True)

    # The balance coordinator: a named actor that outlives worker restarts.
    coordinator = None
    n_moe = mcfg.mlp_types.count("moe")
    if needs_coordinator(cfg.balance) and n_moe:
        coordinator = get_or_create_coordinator(
            cfg.coordinator_name, num_layers=n_moe, num_experts=mcfg.num_experts, k=mcfg.num_experts_per_token,
            config=cfg.balance, world_size=cfg.num_workers, state_path=str(run_dir / "coordinator.pt"))

    # Deterministic, equal splits of the token shards, one per data-parallel group (the ranks of a
    # context-parallel group read the same one).
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    manifest = read_manifest(cfg.data)
    splits = ray.data.read_parquet(manifest.shard_paths(cfg.data)).split(cfg.num_workers // cfg.context_parallel,
                                                                           equal=True)

    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cuda" if cfg.use_gpu else "cpu"),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache" / "torch_extensions")),
           "PYTHONUNBUFFERED": "1",
           # one line per log interval: Ray Train's print patch both tees a worker's print to stdout
           # and logs it to the console, so every line came twice
           "RAY_TRAIN_ENABLE_PRINT_PATCH": os.environ.get("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")}
    if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"config": cfg.model_dump(), "splits": splits},
        scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                     resources_per_worker=None if cfg.use_gpu else {"CPU": 1}),
        run_config=RunConfig(name=cfg.name, storage_path=cfg.storage_path,
                             failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=3),
                             worker_runtime_env={"env_vars": env}),
    )
    try:
        try:
            result = trainer.fit()
        except Exception as e:  # Ray Train raises once max_failures restarts are used up
            raise RuntimeError(f"training failed: {e}") from e
        with result.checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "k3" / "state.pt", weights_only=False)
        summary = {"config": {"preset": cfg.preset, "num_workers": cfg.num_workers, "ep_size": cfg.ep_size,
                              "zero_stage": cfg.zero_stage, "balance": cfg.balance.method, "steps": cfg.steps},
                   **summarize(state["history"]), "history": state["history"], "checkpoint": result.checkpoint.path}
        if coordinator is not None:
            summary["coordinator"] = {k: v for k, v in ray.get(coordinator.metrics.remote()).items() if k != "layers"}
        return summary
    finally:
        if coordinator is not None:
            ray.kill(coordinator, no_restart=True)
