"""Pretrain a K3-family model on Ray: DeepSpeed expert-parallel workers, Quantile Balancing.

    # against a running cluster
    ray job submit --working-dir . -- python jobs/pretrain.py --data data/bundled --steps 300
    # or locally (starts a Ray instance on 127.0.0.1)
    python jobs/pretrain.py --data data/bundled --num-workers 2 --ep-size 2

Top to bottom: parse and validate the config (before any worker starts), connect to Ray,
create the named BalanceCoordinator actor, split the token shards with Ray Data, run a
TorchTrainer whose workers host the model shards, print a summary (losses, MaxVio per layer)
and a sample from the final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if not os.environ.get("RAY_ADDRESS"):
    # No cluster given: this job starts a private single-node Ray. Keep every address, torch's
    # distributed rendezvous included, on loopback; Ray reads this before it is imported.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import torch

from k3.platform.balance import BalanceConfig
from k3.platform.train import TrainConfig, load_checkpoint_model, summarize, train_loop_per_worker

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--config", help="JSON file with TrainConfig fields (flags below override it)")
p.add_argument("--preset", help="model preset (default k3-tiny)")
p.add_argument("--data", help="prepared data directory (jobs/prepare_data.py)")
p.add_argument("--num-workers", type=int, help="Ray Train workers")
p.add_argument("--ep-size", type=int, help="expert-parallel size")
p.add_argument("--zero-stage", type=int, choices=[1, 2], help="DeepSpeed ZeRO stage")
p.add_argument("--micro-batch", type=int, help="sequences per worker per step")
p.add_argument("--steps", type=int, help="optimizer steps")
p.add_argument("--lr", type=float, help="peak learning rate")
p.add_argument("--optimizer", choices=["adamw", "muon"])
p.add_argument("--balance", choices=["quantile", "quantile_hist", "loss_free", "aux_loss", "none"],
               help="expert balancing method")
p.add_argument("--activation-checkpointing", action="store_true", default=None)
p.add_argument("--checkpoint-every", type=int)
p.add_argument("--log-every", type=int)
p.add_argument("--storage-path", help="where checkpoints are persisted (default ./runs)")
p.add_argument("--name", help="run name")
p.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
p.add_argument("--max-failures", type=int)
p.add_argument("--seed", type=int)
p.add_argument("--use-gpu", action="store_true", default=None)
p.add_argument("--fail-at-step", type=int, help="testing: one worker exits at this step (fault drill)")
p.add_argument("--sample", type=int, default=64, help="tokens to sample from the final checkpoint (0: none)")
p.add_argument("--summary-json", help="also write the summary here")
args = p.parse_args()

# 1. Config, validated before anything starts.
fields = json.loads(Path(args.config).read_text()) if args.config else {}
for flag, key in [("preset", "preset"), ("data", "data"), ("num_workers", "num_workers"), ("ep_size", "ep_size"),
                  ("zero_stage", "zero_stage"), ("micro_batch", "micro_batch"), ("steps", "steps"), ("lr", "lr"),
                  ("optimizer", "optimizer"), ("activation_checkpointing", "activation_checkpointing"),
                  ("checkpoint_every", "checkpoint_every"), ("log_every", "log_every"),
                  ("storage_path", "storage_path"), ("name", "name"), ("resume", "resume"),
                  ("max_failures", "max_failures"), ("seed", "seed"), ("use_gpu", "use_gpu"),
                  ("fail_at_step", "fail_at_step")]:
    if getattr(args, flag) is not None:
        fields[key] = getattr(args, flag)
if args.balance:
    fields["balance"] = {**fields.get("balance", {}), "method": args.balance}
try:
    cfg = TrainConfig(**fields)
    cfg = cfg.model_copy(update={"storage_path": str(Path(cfg.storage_path).resolve()),
                                 "data": str(Path(cfg.data).resolve())})
    data_info = cfg.check()
except ValueError as e:
    sys.exit(f"pretrain: invalid configuration: {e}")
mcfg = cfg.model_cfg()
print(f"pretrain: {cfg.preset}, {cfg.num_workers} workers, ep_size {cfg.ep_size}, ZeRO-{cfg.zero_stage}, "
      f"balance {cfg.balance.method}, {cfg.steps} steps x {cfg.micro_batch * cfg.num_workers} sequences of "
      f"{data_info['seq_len']} tokens", flush=True)

# 2. Ray: the job's cluster, or a local one on loopback.
import ray  # noqa: E402
import ray.data  # noqa: E402
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

from k3.platform.coordinator import get_or_create_coordinator  # noqa: E402
from k3.platform.data import read_manifest  # noqa: E402

if not ray.is_initialized():
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
os.environ.setdefault("DS_ACCELERATOR", "cuda" if cfg.use_gpu else "cpu")
run_dir = Path(cfg.storage_path) / cfg.name
run_dir.mkdir(parents=True, exist_ok=True)

# 3. The balance coordinator: a named actor that outlives worker restarts.
coordinator = None
n_moe = mcfg.mlp_types.count("moe")
if cfg.balance.method != "none" and n_moe:
    coordinator = get_or_create_coordinator(
        cfg.coordinator_name, num_layers=n_moe, num_experts=mcfg.num_experts, k=mcfg.num_experts_per_token,
        config=cfg.balance, world_size=cfg.num_workers, state_path=str(run_dir / "coordinator.pt"))

# 4. Data: deterministic, equal splits of the shards, one per worker.
ctx = ray.data.DataContext.get_current()
ctx.execution_options.preserve_order = True
manifest = read_manifest(cfg.data)
splits = ray.data.read_parquet(manifest.shard_paths(cfg.data)).split(cfg.num_workers, equal=True)

# 5. Train.
env = {"DS_ACCELERATOR": os.environ["DS_ACCELERATOR"], "TORCH_EXTENSIONS_DIR": os.environ.get(
    "TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "torch_extensions")), "PYTHONUNBUFFERED": "1"}
if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"]
trainer = TorchTrainer(
    train_loop_per_worker,
    train_loop_config={"config": cfg.model_dump(), "splits": splits},
    scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu,
                                 resources_per_worker={"CPU": 1} if not cfg.use_gpu else None),
    run_config=RunConfig(name=cfg.name, storage_path=cfg.storage_path,
                         failure_config=FailureConfig(max_failures=cfg.max_failures),
                         checkpoint_config=CheckpointConfig(num_to_keep=3),
                         worker_runtime_env={"env_vars": env}),
)
try:
    result = trainer.fit()
except Exception as e:  # Ray Train raises after max_failures restarts
    sys.exit(f"pretrain: training failed: {e}")

# 6. Summary and a sample from the final checkpoint, loaded as one single-process model.
with result.checkpoint.as_directory() as d:
    state = torch.load(Path(d) / "k3" / "state.pt", weights_only=False)
    summary = {"config": {"preset": cfg.preset, "num_workers": cfg.num_workers, "ep_size": cfg.ep_size,
                          "balance": cfg.balance.method, "steps": cfg.steps},
               **summarize(state["history"]), "checkpoint": result.checkpoint.path}
    if coordinator is not None:
        summary["coordinator"] = {k: v for k, v in ray.get(coordinator.metrics.remote()).items() if k != "layers"}
    print("summary " + json.dumps(summary))
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    if args.sample:
        from tokenizers import Tokenizer

        from k3.model import SamplingConfig, generate

        model = load_checkpoint_model(d)
        tok = Tokenizer.from_file(str(Path(d) / "k3" / "tokenizer.json"))
        prompt = tok.encode("def ").ids
        new = generate(model, [prompt], SamplingConfig(max_new_tokens=args.sample, temperature=0.8, top_p=0.95,
                                                        seed=cfg.seed))[0]
        print("sample:\n" + tok.decode(prompt + new))
if coordinator is not None:
    ray.kill(coordinator, no_restart=True)
