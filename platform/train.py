"""Distributed pretraining: what each Ray Train worker runs, and the config it runs from.

A worker builds the model holding only its experts (k3.platform.ep), wraps it with DeepSpeed
(ZeRO-1/2; fp32 on CPU, bf16 on GPU), routes tokens to experts by all-to-all, reads its split
of the token shards through Ray Data, balances experts through the BalanceCoordinator (the
bias for step t+1 is requested right after step t's forward and collected before step t+1),
and reports metrics and checkpoints through `ray.train.report`.

Checkpoint layout (one directory per checkpoint; Ray Train merges every worker's files and
registers the checkpoint only once all are persisted, so a half-written one is never "latest"):

    ds/...                      DeepSpeed engine state (ZeRO optimizer partitions per rank)
    k3/config.json              K3Config
    k3/shared.pt                every non-expert parameter and buffer (rank 0)
    k3/experts-ep{r}-of-{n}.pt  routed experts of expert-parallel rank r (one rank per r)
    k3/state.pt                 step, data position, coordinator state, losses so far
    k3/tokenizer.json           the tokenizer the data was made with
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from k3.model import K3Config, K3ForCausalLM, get_preset
from k3.model.config import PRESETS
from k3.model.hf_k3 import load_pretrained, pretrained_config

from .balance import BalanceConfig, Balancer, loss_free_update, switch_aux_loss
from .data import read_manifest
from .optim import cosine_lr


class TrainConfig(BaseModel):
    """Everything a pretraining run needs; validated on the driver before any worker starts."""

    model_config = ConfigDict(extra="forbid")

    preset: str = Field("k3-tiny", description="Model preset (k3, k3-small, k3-tiny, kimi-linear-48b-a3b).")
    init_from: str | None = Field(None, description="Start from a released checkpoint directory (K3 release layout "
                                  "or Kimi Linear); its config.json replaces the preset.")
    model_overrides: dict[str, Any] = Field(default_factory=dict, description="K3Config fields to change.")
    data: str = Field("data/bundled", description="Directory written by jobs/prepare_data.py.")
    num_workers: int = Field(2, ge=1, description="Ray Train workers (one model shard each).")
    ep_size: int = Field(1, ge=1, description="Expert-parallel ranks; must divide num_experts and num_workers.")
    zero_stage: Literal[1, 2] = Field(1, description="DeepSpeed ZeRO stage.")
    micro_batch: int = Field(8, ge=1, description="Sequences per worker per step.")
    steps: int = Field(200, ge=1, description="Optimizer steps.")
    lr: float = Field(1e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a fraction of the peak (cosine).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay on matrices.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="AdamW, or Muon for the dense matrices + AdamW for the rest (DeepSpeed's Muon; its "
        "gradient clipping is off and grad_norm then reports the orthogonalised update's norm; Muon wants a larger "
        "peak lr than AdamW, ~0.02).")
    activation_checkpointing: bool = Field(False, description="Recompute sub-layers in backward.")
    balance: BalanceConfig = Field(default_factory=BalanceConfig, description="Expert balancing method and knobs.")
    checkpoint_every: int = Field(50, ge=1, description="Steps between checkpoints (and at the end).")
    log_every: int = Field(10, ge=1, description="Steps between progress lines and metric reports.")
    storage_path: str = Field("runs", description="Where Ray Train persists checkpoints.")
    name: str = Field("k3-pretrain", description="Run name (a directory under storage_path).")
    resume: bool = Field(False, description="Continue from the run's latest checkpoint.")
    max_failures: int = Field(2, ge=0, description="Worker-group restarts after failures.")
    seed: int = Field(0, description="Seed of the model init, data order and sampling.")
    use_gpu: bool = Field(False, description="One GPU per worker (NCCL, bf16).")
    coordinator_name: str = Field("k3-balance", description="Name of the BalanceCoordinator actor.")
    fail_at_step: int | None = Field(None, description="Testing: rank 1 exits at this step once (fault drill).")

    def model_cfg(self) -> K3Config:
        if self.init_from:
            if self.model_overrides:
                raise ValueError("model_overrides cannot change a model loaded with init_from")
            return pretrained_config(self.init_from)
        return get_preset(self.preset, **self.model_overrides)

    def check(self) -> dict:
        """Everything that can be known before a worker starts; returns the manifest as a dict."""
        if self.preset not in PRESETS:
            raise ValueError(f"preset {self.preset!r} is not one of {sorted(PRESETS)}")
        cfg = self.model_cfg()
        if self.num_workers % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide num_workers={self.num_workers}")
        if "moe" in cfg.mlp_types and cfg.num_experts % self.ep_size:
            raise ValueError(f"ep_size={self.ep_size} must divide num_experts={cfg.num_experts}")
        if not Path(self.data).exists():
            raise ValueError(f"data path {self.data!r} does not exist (run jobs/prepare_data.py)")
        m = read_manifest(self.data)
        if m.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer vocab {m.vocab_size} exceeds the model's vocab_size {cfg.vocab_size}")
        per_step = self.micro_batch * self.num_workers
        if per_step > m.num_sequences:
            raise ValueError(f"micro_batch x num_workers = {per_step} sequences per step, but the data has only "
                             f"{m.num_sequences}")
        if self.balance.method in ("quantile", "quantile_hist") and cfg.num_experts_per_token >= cfg.num_experts:
            raise ValueError("quantile balancing needs num_experts_per_token < num_experts")
        if self.balance.method == "quantile" and self.num_workers > 1:
            raise ValueError("balance.method 'quantile' (exact) needs every token's margins in one process; with "
                             "more than one worker use 'quantile_hist' (the coordinator's histogram solve)")
        return {"num_sequences": m.num_sequences, "seq_len": m.seq_len, "vocab_size": m.vocab_size}


# -- checkpoint files ---------------------------------------------------------------------------
def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def save_model_files(model: K3ForCausalLM, out: Path, rank: int, ep_rank: int, ep_size: int,
                     edp_rank: int, expert_opt: torch.optim.Optimizer | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if rank == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items() if not _is_expert(k)}, out / "shared.pt")
        (out / "config.json").write_text(model.cfg.to_json() + "\n")
    if edp_rank == 0:
        torch.save({"weights": {k: v.detach().cpu() for k, v in state.items() if _is_expert(k)},
                    "optimizer": expert_opt.state_dict() if expert_opt is not None else None},
                   out / f"experts-ep{ep_rank}-of-{ep_size}.pt")


def load_checkpoint_model(path: str | Path, device: str = "cpu") -> K3ForCausalLM:
    """A training checkpoint as one single-process K3ForCausalLM (all experts), for eval/serving."""
    root = Path(path)
    k3dir = root / "k3" if (root / "k3").is_dir() else root
    if not (k3dir / "config.json").exists():
        raise ValueError(f"{path}: not a k3 training checkpoint (no k3/config.json)")
    cfg = K3Config.from_json(k3dir / "config.json")
    state = torch.load(k3dir / "shared.pt", map_location=device)
    parts = sorted(k3dir.glob("experts-ep*-of-*.pt"), key=lambda p: int(p.name.split("-")[1][2:]))
    if parts:
        n = int(parts[0].name.rsplit("-of-", 1)[1][:-3])
        if len(parts) != n:
            raise ValueError(f"{path}: expected {n} expert files, found {len(parts)}")
        shards = [torch.load(p, map_location=device, weights_only=False)["weights"] for p in parts]
        for key in shards[0]:
            state[key] = torch.cat([s[key] for s in shards], dim=0)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


# -- the worker ---------------------------------------------------------------------------------
def _ep_groups(rank: int, world: int, ep: int):
    """(expert-parallel group of this rank, expert-data-parallel group of this rank).

    EP groups are consecutive ranks [0..ep), [ep..2ep), ...; the ranks holding the same experts
    (same rank % ep) form the expert-data-parallel groups. Every rank creates every group, as
    torch.distributed requires."""
    import torch.distributed as dist

    ep_group = edp_group = None
    for start in range(0, world, ep):
        g = dist.new_group(list(range(start, start + ep)))
        if start <= rank < start + ep:
            ep_group = g
    for r in range(ep):
        g = dist.new_group(list(range(r, world, ep)))
        if rank % ep == r:
            edp_group = g
    return ep_group, edp_group


def _reduce_and_clip_experts(experts: list, edp_group, world: int, max_norm: float) -> float:
    """Sum expert gradients over the ranks holding the same experts, divide by the world size,
    clip them by their own global norm (over all experts of all ranks); returns that norm."""
    import torch.distributed as dist

    grads = [p.grad for p in experts if p.grad is not None]
    if not grads:
        return 0.0
    flat = torch.cat([g.reshape(-1) for g in grads])
    if edp_group is not None and dist.get_world_size(edp_group) > 1:
        dist.all_reduce(flat, group=edp_group)
    flat.div_(world)
    sq = flat.double().pow(2).sum().reshape(1)
    if world > 1:  # each expert is held once per EP group: sum over one EP group's worth of ranks
        n_edp = dist.get_world_size(edp_group) if edp_group is not None else 1
        dist.all_reduce(sq)
        sq /= n_edp
    norm = float(sq.sqrt())
    if norm > max_norm:
        flat.mul_(max_norm / (norm + 1e-6))
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
    return norm



def _ds_config(cfg: TrainConfig) -> dict:
    c: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": cfg.zero_stage, "overlap_comm": False, "contiguous_gradients": False},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.use_gpu:
        c["bf16"] = {"enabled": True}
    if cfg.optimizer == "muon":
        # DeepSpeed orthogonalises Muon's matrix gradients (Newton-Schulz) before it measures and
        # clips the gradient norm, so its clip would shrink updates whose size Newton-Schulz has
        # already set (a norm near sqrt(min(rows, cols)) per matrix, ~100 over k3-tiny); leave it off. The
        # experts, outside DeepSpeed, are still clipped at grad_clip.
        c["gradient_clipping"] = 0.0
        c["optimizer"] = {"type": "Muon", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                     "momentum": 0.95, "betas": [0.9, 0.95]}}
    return c


def train_loop_per_worker(loop_config: dict) -> None:  # noqa: C901 - one top-to-bottom loop reads best
    import deepspeed
    import ray
    import ray.data
    import ray.train
    import torch.distributed as dist

    from .coordinator import BalanceClient
    from .ep import apply_expert_parallel, build_model, expert_parameters
    from .metrics import TrainMetrics
    from .optim import param_groups

    cfg = TrainConfig(**loop_config["config"])
    splits = loop_config["splits"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("K3_THREADS_PER_WORKER", "1"))))
    deepspeed.init_distributed(dist_backend="nccl" if cfg.use_gpu else "gloo")
    if rank == 0:
        print(f"rank 0: torch.distributed rendezvous at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
              flush=True)
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if cfg.use_gpu else torch.device("cpu")

    # Model: only this rank's experts, the same values as a single-device model from this seed.
    mcfg = cfg.model_cfg()
    ep = cfg.ep_size
    ep_rank, edp_rank = rank % ep, rank // ep
    if cfg.init_from:  # streamed: this rank reads only its own experts' tensors
        model = load_pretrained(cfg.init_from, dtype=torch.float32, device=str(device), ep_rank=ep_rank, ep_size=ep)
    else:
        model = build_model(mcfg, ep_rank, ep, seed=cfg.seed, device=str(device))
    model.model.gradient_checkpointing = cfg.activation_checkpointing
    # Routed experts stay outside DeepSpeed: its ZeRO optimizer averages every parameter it owns
    # over all data-parallel ranks, which would mix different ranks' different experts. They get
    # their own AdamW; their gradients are summed over the ranks holding the same experts and
    # divided by the world size, which is the data-parallel mean whatever ep_size is.
    experts = expert_parameters(model)
    expert_ids = {id(p) for p in experts}
    ep_dispatch, edp_group = [], None
    if ep > 1:
        ep_group, edp_group = _ep_groups(rank, world, ep)
        ep_dispatch = apply_expert_parallel(model, ep_group, ep)
    elif world > 1:
        edp_group = dist.group.WORLD
    for n, p in model.named_parameters():
        p.use_muon = p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n and cfg.optimizer == "muon"
    groups_ = [{**g, "params": [p for p in g["params"] if id(p) not in expert_ids]}
               for g in param_groups(model, cfg.weight_decay)]
    groups_ = [g for g in groups_ if g["params"]]
    optimizer = torch.optim.AdamW(groups_, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8) if cfg.optimizer == "adamw" else None
    expert_opt = torch.optim.AdamW(experts, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay)
    own_experts = [p.detach().clone() for p in experts]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=_ds_config(cfg),
                                           model_parameters=groups_ if optimizer is None else None)
    with torch.no_grad():  # DeepSpeed broadcast every module parameter from rank 0; experts are per rank
        for p, v in zip(experts, own_experts):
            p.copy_(v)
    del own_experts

    # Resume: DeepSpeed state, data position, losses so far, the coordinator's state.
    start_step, history, coord_state = 0, [], None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            engine.load_checkpoint(d, tag="ds", load_module_strict=False)
            ex = torch.load(Path(d) / "k3" / f"experts-ep{ep_rank}-of-{ep}.pt", weights_only=False)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if id(p) in expert_ids:
                        p.copy_(ex["weights"][n])
            expert_opt.load_state_dict(ex["optimizer"])
            st = torch.load(Path(d) / "k3" / "state.pt", weights_only=False)
            start_step, history, coord_state = st["step"], st["history"], st.get("coordinator")
    gates = [layer.mlp.gate for layer in model.model.layers if layer.is_moe]  # the routers, in layer order
    method = cfg.balance.method if gates else "none"
    coordinator = ray.get_actor(cfg.coordinator_name) if method == "quantile_hist" else None
    local_balancer = None
    if method == "quantile":  # one worker: the exact solve in-process
        local_balancer = Balancer(cfg.balance, len(gates), mcfg.num_experts, mcfg.num_experts_per_token)
    if coordinator is not None and rank == 0 and coord_state is not None:
        ray.get(coordinator.load_state_dict.remote(coord_state))  # back to the checkpoint's step
    dist.barrier()
    client = BalanceClient(coordinator, f"rank-{rank}") if coordinator is not None else None

    # Data: this worker's split, a fixed order per epoch, so a resumed run sees the same batches.
    ray.data.DataContext.get_current().enable_progress_bars = False
    shard = splits[rank]
    rows = shard.count()
    per_epoch = rows // cfg.micro_batch
    if per_epoch == 0:
        raise ValueError(f"worker {rank}: {rows} sequences cannot fill one micro batch of {cfg.micro_batch}")

    def batches(epoch: int, skip: int):
        it = shard.iter_torch_batches(batch_size=cfg.micro_batch, drop_last=True, local_shuffle_buffer_size=4 * cfg.micro_batch,
                                      local_shuffle_seed=cfg.seed * 1000 + epoch, dtypes=torch.long)
        for i, b in enumerate(it):
            if i >= skip:
                yield b["tokens"]

    metrics = TrainMetrics(enabled=rank == 0)
    epoch, pos = divmod(start_step, per_epoch)
    data = batches(epoch, pos)
    t_last, tokens_since, compute_s, wait_s = time.perf_counter(), 0, 0.0, 0.0
    for step in range(start_step, cfg.steps):
        if cfg.fail_at_step is not None and step == cfg.fail_at_step and rank == min(1, world - 1) and ckpt is None:
            os._exit(1)  # fault drill: the restarted group resumes from the last checkpoint
        try:
            batch = next(data)
        except StopIteration:
            epoch += 1
            data = batches(epoch, 0)
            batch = next(data)
        batch = batch.to(device)
        lr = cosine_lr(step, cfg.steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        for g in list(engine.optimizer.param_groups) + list(expert_opt.param_groups):
            g["lr"] = lr
        t0 = time.perf_counter()
        if client is not None:  # the bias solved from the previous step's reports (at the start: the one in hand)
            model.set_router_bias(client.fetch().bias.to(device))
        t1 = time.perf_counter()
        t0_wait = t1 - t0
        wait_s += t0_wait
        for d in ep_dispatch:
            d.last_a2a_seconds = 0.0
        out = engine(batch, labels=batch, collect_router=True)
        loss = out.loss
        if method == "aux_loss":
            loss = loss + sum(switch_aux_loss(r.scores, r.topk_idx, cfg.balance.aux_loss_coef) for r in out.router)
        counts = torch.stack([r.counts for r in out.router]) if out.router else torch.zeros(0)
        if client is not None:
            hist = torch.stack([client.histogram(i, r.margins) for i, r in enumerate(out.router)])
            client.report(step, hist, counts)  # non-blocking; collected before the next step
        engine.backward(loss)
        expert_norm = _reduce_and_clip_experts(experts, edp_group, world, cfg.grad_clip)
        engine.step()
        expert_opt.step()
        expert_opt.zero_grad(set_to_none=True)
        compute_s += time.perf_counter() - t1
        a2a_s = sum(d.last_a2a_seconds for d in ep_dispatch)
        # Step metrics: mean loss over workers, global expert loads.
        # Reduced where the process group can (NCCL takes only CUDA tensors), then read on the host.
        stats = torch.cat([out.loss.detach().reshape(1).float(), counts.float().reshape(-1).to(device)])
        dist.all_reduce(stats)
        stats = stats.cpu()
        mean_loss = float(stats[0]) / world
        loads = stats[1:].reshape(len(gates), -1) if gates else None
        maxvio = (loads.max(1).values / loads.mean(1) - 1).tolist() if loads is not None else []
        # Biases for the next step (never this one): loss-free from the global loads, the same on
        # every rank; exact QB from this process's margins.
        if method == "loss_free":
            with torch.no_grad():
                for gate, l_loads in zip(gates, loads):
                    gate.bias.copy_(loss_free_update(gate.bias, l_loads.to(device), cfg.balance.loss_free_step))
        elif local_balancer is not None:
            for i, r in enumerate(out.router):
                local_balancer.observe(i, r.margins, r.counts)
            local_balancer.step()
            model.set_router_bias(local_balancer.bias().to(device))
        tokens = batch.numel() * world
        # router bias spread (max - min) per MoE layer after this step (`k3 report` plots it over time)
        bias = torch.stack([gate.bias.detach() for gate in gates]) if gates else None
        bias_spread = (bias.max(1).values - bias.min(1).values).tolist() if bias is not None else []
        history.append({"step": step + 1, "loss": mean_loss, "maxvio": maxvio, "tokens": tokens,
                        "step_s": time.perf_counter() - t0, "wait_s": t0_wait, "all_to_all_s": a2a_s,
                        "bias_spread": bias_spread})
        tokens_since += tokens
        last = step + 1 == cfg.steps
        if (step + 1) % cfg.log_every == 0 or last or (step + 1) % cfg.checkpoint_every == 0:
            now = time.perf_counter()
            tps = tokens_since / (now - t_last)
            dense_norm = engine.get_global_grad_norm()
            gnorm = math.sqrt(float(dense_norm or 0.0) ** 2 + expert_norm ** 2)
            report = {"step": step + 1, "loss": mean_loss, "lr": lr, "tokens_per_s": tps,
                      "grad_norm": gnorm,
                      "maxvio_mean": sum(maxvio) / len(maxvio) if maxvio else 0.0, "maxvio": maxvio,
                      "bias_spread": bias_spread, "epoch": epoch, "compute_s": compute_s, "coordinator_wait_s": wait_s,
                      "all_to_all_s": a2a_s}
            metrics.update(report)
            if rank == 0:
                print(f"step {step + 1:5d}/{cfg.steps}  loss {mean_loss:.4f}  lr {lr:.2e}  grad_norm "
                      f"{report['grad_norm']:.3f}  tok/s {tps:,.0f}  maxvio {report['maxvio_mean']:.3f}  "
                      f"coord_wait {wait_s:.2f}s", flush=True)
            t_last, tokens_since, compute_s, wait_s = now, 0, 0.0, 0.0
            checkpoint = None
            tmp = None
            if (step + 1) % cfg.checkpoint_every == 0 or last:
                t_ck = time.perf_counter()
                tmp = Path(tempfile.mkdtemp(prefix=f"k3-ckpt-{rank}-"))
                engine.save_checkpoint(str(tmp), tag="ds")
                save_model_files(model, tmp / "k3", rank, ep_rank, ep, edp_rank, expert_opt)
                if rank == 0:
                    coord = ray.get(coordinator.state_dict.remote()) if coordinator is not None else None
                    torch.save({"step": step + 1, "history": history, "coordinator": coord,
                                "config": cfg.model_dump()}, tmp / "k3" / "state.pt")
                    tok = Path(cfg.data) / "tokenizer.json"
                    if tok.exists():
                        shutil.copy(tok, tmp / "k3" / "tokenizer.json")
                report["checkpoint_s"] = time.perf_counter() - t_ck
                metrics.update({"checkpoint_s": report["checkpoint_s"]})
                checkpoint = ray.train.Checkpoint.from_directory(str(tmp))
            ray.train.report(report, checkpoint=checkpoint)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


def summarize(history: list[dict]) -> dict:
    if not history:
        return {}
    first, last = history[0], history[-1]
    n = len(last["maxvio"])
    tail = history[-max(1, len(history) // 5):]
    return {"steps": last["step"], "first_loss": first["loss"], "final_loss": last["loss"],
            "maxvio_final_per_layer": last["maxvio"],
            "maxvio_tail_mean_per_layer": [sum(h["maxvio"][i] for h in tail) / len(tail) for i in range(n)],
            "loss_is_finite": all(math.isfinite(h["loss"]) for h in history)}


def read_history(checkpoint_dir: str | Path) -> list[dict]:
    return torch.load(Path(checkpoint_dir) / "k3" / "state.pt", weights_only=False)["history"]


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")
