"""The training step of one worker, in parts (torchtitan's shape): `Trainer.build`,
`make_batch`, `train_step`, `save` and `load`.

The Trainer assumes torch.distributed is initialised (Ray Train's worker, or a test's spawned
processes) and knows nothing of Ray Data or reporting: the worker loop in k3.platform.train.worker
feeds it batches and reports what `train_step` returns.

Parameters and their optimizers:
- routed experts stay outside DeepSpeed: DeepSpeed applies its expert-parallel gradient handling
  only to modules that are its own MoE classes (tests/platform/test_trainer.py shows the
  attribute route is ignored), and its expert reduction averages over the expert-data-parallel
  group, which is ep_size times the data-parallel mean. The experts get their own AdamW and
  `ExpertParallel.reduce_grads` (k3.platform.train.expert_parallel);
- everything else is DeepSpeed ZeRO-1/2's;
- one global gradient norm over both: the experts' squared norm is folded into the norm
  DeepSpeed's optimizer computes (`_fold_expert_norm`), DeepSpeed clips its parameters by that
  global norm and the experts are scaled by the same factor; `grad_norm` is the global norm.
"""
from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from k3.model.hf_k3 import load_pretrained

from k3.platform.balance.strategies import BalanceStrategy, strategy_class
from k3.platform.train.data import read_manifest
from k3.platform.train.expert_parallel import apply_expert_parallel, build_model, ep_groups, is_expert_param, load_experts, save_experts
from k3.platform.train.optim import cosine_lr, param_groups
from k3.model.tokenizer import load_tokenizer
from k3.platform.train.vision_data import ExampleEncoder, MediaSchedule, collate, read_vision_rows


def ds_config(cfg) -> dict:
    """DeepSpeed config of a TrainConfig."""
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
        # already set (a norm near sqrt(min(rows, cols)) per matrix, ~100 over k3-tiny); leave it
        # off. The experts (AdamW) are still clipped at grad_clip by their own norm.
        c["gradient_clipping"] = 0.0
        c["optimizer"] = {"type": "Muon", "params": {"lr": cfg.lr, "weight_decay": cfg.weight_decay,
                                                     "momentum": 0.95, "betas": [0.9, 0.95]}}
    return c


def clip_factor(norm: float, max_norm: float) -> float:
    """DeepSpeed's clip rule: scale by 1 / max(1, (norm + 1e-6) / max_norm); max_norm 0 = off."""
    if max_norm <= 0:
        return 1.0
    return 1.0 / max(1.0, (norm + 1e-6) / max_norm)


def _fold_expert_norm(ds_optimizer, expert_sq) -> None:
    """Make DeepSpeed's ZeRO optimizer measure (and clip by) sqrt(its norm^2 + expert_sq()).

    `scaled_global_norm` is where ZeRO-1/2 combine their groups' norms before clipping; the
    experts' reduced squared norm (identical on every rank) is added there, so one global norm
    clips every parameter, as in Megatron-Core and torchtitan."""
    if not hasattr(ds_optimizer, "scaled_global_norm"):
        raise RuntimeError(f"{type(ds_optimizer).__name__} has no scaled_global_norm: cannot fold the expert norm "
                           "into DeepSpeed's clip (ZeRO stage 1/2 optimizer expected)")
    inner = ds_optimizer.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        dense = inner(norm_type)
        scale = float(getattr(ds_optimizer, "loss_scale", 1.0))
        return torch.sqrt(dense.double() ** 2 + expert_sq() * scale * scale).to(dense.dtype)

    ds_optimizer.scaled_global_norm = scaled_global_norm


def initial_model(cfg, mcfg, ep_rank: int, ep_size: int, device: torch.device):
    """This rank's model before training: cfg.init_from's weights (streamed: only this rank's
    experts are read; with the vision tower when the checkpoint has one, as mcfg says), or the
    preset initialised from cfg.seed."""
    if cfg.init_from:
        return load_pretrained(cfg.init_from, dtype=torch.float32, device=str(device), ep_rank=ep_rank,
                               ep_size=ep_size, vision=mcfg.vision_config is not None)
    return build_model(mcfg, ep_rank, ep_size, seed=cfg.seed, device=str(device))


@dataclass
class StepResult:
    """What one optimizer step measured (the same on every rank unless noted)."""

    loss: float  # mean training loss over workers
    grad_norm: float  # global norm before clipping, over every parameter of every rank
    lr: float
    maxvio: list[float]  # per MoE layer: max load / mean load - 1 over all workers' tokens
    tokens: int  # tokens of this step over all workers
    step_s: float
    wait_s: float  # waiting for the balance coordinator
    all_to_all_s: float  # expert all-to-all, this rank
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer:
    """One worker's model shard, optimizers and balancing. See the module docstring."""

    def __init__(self, cfg, rank: int, world: int, device: torch.device | str = "cpu") -> None:
        self.cfg, self.rank, self.world = cfg, rank, world
        self.device = torch.device(device)
        self.ep_size = cfg.ep_size
        self.ep_rank, self.edp_rank = rank % self.ep_size, rank // self.ep_size
        self.model = self.engine = self.expert_opt = self.ep = self.balance = None
        self._expert_sq = 0.0
        self.pad_id = 0  # padding of media batches (masked out of the loss); media_schedule sets it

    # -- build ----------------------------------------------------------------------------------
    def build(self) -> "Trainer":
        import deepspeed

        from k3.platform.ops.extensions import wait_for_extension_locks

        cfg = self.cfg
        mcfg = cfg.model_cfg()
        wait_for_extension_locks()  # DeepSpeed may build an op below: never on a dead build's lock
        model = initial_model(cfg, mcfg, self.ep_rank, self.ep_size, self.device)
        model.model.gradient_checkpointing = cfg.activation_checkpointing
        ep_group, edp_group = ep_groups(self.rank, self.world, self.ep_size)
        self.ep = apply_expert_parallel(model, ep_group, edp_group, self.world)
        for n, p in model.named_parameters():
            p.use_muon = cfg.optimizer == "muon" and p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n
        dense = [{**g, "params": [p for p in g["params"] if id(p) not in self.ep.ids]}
                 for g in param_groups(model, cfg.weight_decay)]
        dense = [g for g in dense if g["params"]]
        opt = (torch.optim.AdamW(dense, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8) if cfg.optimizer == "adamw" else None)
        self.expert_opt = torch.optim.AdamW(self.ep.params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                                            weight_decay=cfg.weight_decay)
        own = [p.detach().clone() for p in self.ep.params]
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg),
                                                    model_parameters=dense if opt is None else None)
        with torch.no_grad():  # DeepSpeed broadcast every module parameter from rank 0; experts are per rank
            for p, v in zip(self.ep.params, own):
                p.copy_(v)
        if cfg.optimizer == "adamw":
            _fold_expert_norm(self.engine.optimizer, lambda: self._expert_sq)
        self.model = model
        gates = [layer.mlp.gate for layer in model.model.layers if layer.is_moe]
        method = cfg.balance.method if gates else "none"
        self.balance: BalanceStrategy = strategy_class(method)(
            cfg.balance, len(gates), mcfg.num_experts, mcfg.num_experts_per_token, self.device,
            rank=self.rank, coordinator_name=cfg.coordinator_name)
        return self

    def start(self) -> None:
        """After build (and load): every rank ready, balancing connected."""
        dist.barrier()
        self.balance.start()

    # -- data -----------------------------------------------------------------------------------
    @property
    def multimodal(self) -> bool:
        return self.cfg.model_cfg().vision_config is not None

    def media_schedule(self) -> MediaSchedule:
        """This rank's image/video examples and the text/media step pattern (multimodal presets)."""
        cfg = self.cfg
        manifest = read_manifest(cfg.data)
        tok = load_tokenizer(Path(cfg.data) / manifest.tokenizer)
        ids = manifest.special_ids
        self.pad_id = ids["pad"]
        encoder = ExampleEncoder(lambda s: tok.encode(s).ids, tok.token_to_id, bos=ids["bos"], eos=ids["eos"])
        return MediaSchedule(read_vision_rows(cfg.data, "train"), encoder, cfg.media_micro_batch, cfg.text_every,
                             cfg.seed, self.rank, self.world)

    def make_batch(self, raw: dict) -> dict[str, torch.Tensor]:
        """A data-loader batch -> the model's inputs on the device.

        Text: {"tokens": [B, T+1] int64} -> {"input_ids": [B, T'], "labels": [B, T']}
        (labels[t + 1] is the target of position t). Media: {"examples": [Example, ...]} ->
        right-padded input_ids/labels (-100 on padding) plus pixel_values [N, 3, p, p] and
        grid_thws [M, 3] for the tower."""
        if "examples" in raw:
            b = collate(raw["examples"], pad_id=self.pad_id)
            out = {"input_ids": b["input_ids"], "labels": b["labels"]}
            if b["pixel_values"] is not None:
                out |= {"pixel_values": b["pixel_values"], "grid_thws": b["grid_thws"]}
            return {k: v.to(self.device) for k, v in out.items()}
        tokens = raw["tokens"].to(self.device, torch.long)
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq], got {tuple(tokens.shape)}")
        return {"input_ids": tokens, "labels": tokens}

    def forward(self, batch: dict[str, torch.Tensor]):
        """The model on one batch -> CausalLMOutput with router outputs. A multimodal model runs
        its tower on text batches too (zero-weighted), so every rank's gradients match."""
        media = {k: batch[k] for k in ("pixel_values", "grid_thws") if k in batch}
        return self.engine(batch["input_ids"], labels=batch["labels"], collect_router=True, **media)

    @torch.no_grad()
    def router_pass(self, batch: dict[str, torch.Tensor]):
        """A function that runs the batch's router outputs under the current weights and biases,
        without the LM head or loss (what balancing solves from after the optimizer step; each
        solve round calls it again). A media batch's placeholders get the tower's rows, as in the
        training forward, encoded once here: the routers see what they will route."""
        embeds = None
        if "pixel_values" in batch:
            rows = torch.cat(self.model.encode_media(batch["pixel_values"], batch["grid_thws"]))
            embeds = self.model.splice(batch["input_ids"], rows)

        @torch.no_grad()
        def run() -> list:
            return self.model.model(batch["input_ids"], collect_router=True, inputs_embeds=embeds)[1]

        return run

    # -- one step -------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        for g in list(self.engine.optimizer.param_groups) + list(self.expert_opt.param_groups):
            g["lr"] = lr

    def train_step(self, batch: dict[str, torch.Tensor], step: int) -> StepResult:
        """Forward, backward, one global clip and one optimizer step on every parameter; the
        balancing bias for the next step. `step` counts from 0."""
        cfg = self.cfg
        lr = cosine_lr(step, cfg.steps, cfg.warmup_steps, cfg.lr, cfg.min_lr_ratio)
        self.set_lr(lr)
        t0 = time.perf_counter()
        wait_s = self.balance.begin_step(self.model)
        self.ep.reset_timers()
        out = self.forward(batch)
        routers = out.router or []
        loss = out.loss
        extra = self.balance.extra_loss(routers)
        if extra is not None:
            loss = loss + extra
        if not self.balance.refreshed_margins:
            self.balance.observe(self.model, step, routers)
        self.engine.backward(loss)
        self._expert_sq = self.ep.reduce_grads()
        if cfg.optimizer == "muon":  # DeepSpeed's clip is off (see ds_config); experts by their own norm
            self.ep.scale_grads(clip_factor(math.sqrt(self._expert_sq), cfg.grad_clip))
            self.engine.step()
            grad_norm = math.sqrt(float(self.engine.get_global_grad_norm() or 0.0) ** 2 + self._expert_sq)
        else:
            self.engine.step()  # measures the global norm (experts folded in) and clips by it
            grad_norm = float(self.engine.get_global_grad_norm())
            self.ep.scale_grads(clip_factor(grad_norm, cfg.grad_clip))
        self.expert_opt.step()
        self.expert_opt.zero_grad(set_to_none=True)
        if self.balance.refreshed_margins:  # the batch's margins under the weights that will route next
            rerun = self.router_pass(batch)
            self.balance.observe(self.model, step, rerun(), rerun)
        # Step statistics over all workers, reduced where the process group can (NCCL takes only
        # CUDA tensors), then read on the host.
        counts = (torch.stack([r.counts for r in routers]).float() if routers
                  else torch.zeros(0, device=self.device))
        stats = torch.cat([out.loss.detach().reshape(1).float(), counts.reshape(-1).to(self.device)])
        if self.world > 1:
            dist.all_reduce(stats)
        stats = stats.cpu()
        loads = stats[1:].reshape(len(routers), -1) if routers else torch.zeros(0, 0)
        maxvio = (loads.max(1).values / loads.mean(1) - 1).tolist() if routers else []
        self.balance.after_step(self.model, step, loads)
        return StepResult(loss=float(stats[0]) / self.world, grad_norm=grad_norm, lr=lr, maxvio=maxvio,
                          tokens=batch["input_ids"].numel() * self.world, step_s=time.perf_counter() - t0,
                          wait_s=wait_s, all_to_all_s=self.ep.all_to_all_seconds(),
                          extra=self.balance.metrics(self.model))

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, out: Path, state: dict[str, Any], tokenizer: Path | None = None) -> None:
        """Every rank writes its part of a checkpoint under `out` (layout: k3.platform.train.worker).
        `state` (rank 0): step, history, ... ; the balancing state is added here."""
        out = Path(out)
        self.engine.save_checkpoint(str(out), tag="ds")
        k3dir = out / "k3"
        k3dir.mkdir(parents=True, exist_ok=True)
        balance_state = self.balance.state_dict()
        if self.rank == 0:
            named = {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}
            torch.save({k: v.detach().cpu() for k, v in named.items() if not is_expert_param(k)}, k3dir / "shared.pt")
            (k3dir / "config.json").write_text(self.model.cfg.to_json() + "\n")
            torch.save({**state, "balance": balance_state, "config": self.cfg.model_dump()}, k3dir / "state.pt")
            if tokenizer is not None and Path(tokenizer).exists():
                shutil.copy(tokenizer, k3dir / "tokenizer.json")
        if self.edp_rank == 0:
            save_experts(self.model, self.expert_opt, k3dir, self.ep_rank, self.ep_size)

    def load(self, d: Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save` with the same world size and any ep_size that
        divides the experts; returns the saved state (step, history, ...)."""
        d = Path(d)

        def dense_only(src, dst):  # experts come from the k3 files, resharded to this ep_size
            dst.load_state_dict({k: v for k, v in src.items() if not is_expert_param(k)}, strict=False)

        self.engine.load_checkpoint(str(d), tag="ds", load_module_strict=False, custom_load_fn=dense_only)
        load_experts(self.model, self.expert_opt, d / "k3")
        state = torch.load(d / "k3" / "state.pt", weights_only=False)
        self.balance.load_state_dict(state.get("balance", state.get("coordinator")))
        return state
