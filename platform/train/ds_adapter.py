"""DeepSpeed behind one adapter: the Trainer trains, this module knows DeepSpeed's quirks.

What DeepSpeed is given, and what it is not:
- routed experts stay outside DeepSpeed: DeepSpeed applies its expert-parallel gradient handling
  only to modules that are its own MoE classes (tests/platform/test_trainer.py shows the
  attribute route is ignored), and its expert reduction averages over the expert-data-parallel
  group, which is ep_size times the data-parallel mean. The experts get their own AdamW here and
  their gradients are reduced by `ExpertParallel.reduce_grads` (k3.platform.train.expert_parallel);
- `deepspeed.initialize` broadcasts every module parameter from rank 0, experts included, which
  are per rank: each rank's experts are put back right after;
- one global gradient norm: the experts' squared norm is folded into the norm DeepSpeed's ZeRO
  optimizer computes (`fold_expert_norm`), DeepSpeed clips its parameters by that global norm
  and the experts are scaled by the same factor, as in Megatron-Core and torchtitan;
- with Muon, DeepSpeed orthogonalises the matrix gradients before it measures a norm, so its clip
  is off and the experts are clipped by their own norm (`ds_config`).
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .expert_parallel import ExpertParallel
from .optim import param_groups

ADAMW_BETAS = (0.9, 0.95)


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


def fold_expert_norm(ds_optimizer, expert_sq: Callable[[], float]) -> None:
    """Make DeepSpeed's ZeRO optimizer measure (and clip by) sqrt(its norm^2 + expert_sq()).

    `scaled_global_norm` is where ZeRO-1/2 combine their groups' norms before clipping; the
    experts' reduced squared norm (identical on every rank) is added there."""
    if not hasattr(ds_optimizer, "scaled_global_norm"):
        raise RuntimeError(f"{type(ds_optimizer).__name__} has no scaled_global_norm: cannot fold the expert norm "
                           "into DeepSpeed's clip (ZeRO stage 1/2 optimizer expected)")
    inner = ds_optimizer.scaled_global_norm

    def scaled_global_norm(norm_type=2):
        dense = inner(norm_type)
        scale = float(getattr(ds_optimizer, "loss_scale", 1.0))
        return torch.sqrt(dense.double() ** 2 + expert_sq() * scale * scale).to(dense.dtype)

    ds_optimizer.scaled_global_norm = scaled_global_norm


class DeepSpeedAdapter:
    """One rank's DeepSpeed engine for the dense parameters plus the experts' own AdamW."""

    def __init__(self, cfg, model: nn.Module, ep: ExpertParallel) -> None:
        import deepspeed

        self.cfg, self.ep = cfg, ep
        self._expert_sq = 0.0
        for n, p in model.named_parameters():
            p.use_muon = cfg.optimizer == "muon" and p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n
        dense = [{**g, "params": [p for p in g["params"] if id(p) not in ep.ids]}
                 for g in param_groups(model, cfg.weight_decay)]
        dense = [g for g in dense if g["params"]]
        opt = torch.optim.AdamW(dense, lr=cfg.lr, betas=ADAMW_BETAS, eps=1e-8) if cfg.optimizer == "adamw" else None
        self.expert_opt = torch.optim.AdamW(ep.params, lr=cfg.lr, betas=ADAMW_BETAS, eps=1e-8,
                                            weight_decay=cfg.weight_decay)
        own = [p.detach().clone() for p in ep.params]
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(cfg),
                                                    model_parameters=dense if opt is None else None)
        with torch.no_grad():  # initialize broadcast every parameter from rank 0; experts are per rank
            for p, v in zip(ep.params, own):
                p.copy_(v)
        if cfg.optimizer == "adamw":
            fold_expert_norm(self.engine.optimizer, lambda: self._expert_sq)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def zero_grad(self) -> None:
        self.engine.zero_grad()
        self.expert_opt.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for g in list(self.engine.optimizer.param_groups) + list(self.expert_opt.param_groups):
            g["lr"] = lr

    def backward_and_step(self, loss: torch.Tensor) -> float:
        """Backward, the experts' gradient reduction, one global clip and one optimizer step on
        every parameter; returns the global gradient norm before clipping."""
        # DeepSpeed's Muon torch.compiles its Newton-Schulz update (in the backward's reduction and
        # the step), once per matrix shape: on a CPU k3-tiny's first step took 7.9 s against 0.6
        # eager with inductor's cache warm (one process), and a cold cache (a fresh machine, CI) took
        # the suite's 8-step Muon run to 250 s against ~57 s for an AdamW run; no step is faster for
        # it (17 vs 20 ms eager vs compiled for five k3-tiny shapes, one thread), so eager there
        eager = self.cfg.optimizer == "muon" and not self.cfg.use_gpu
        with torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext():
            self.engine.backward(loss)
            self._expert_sq = self.ep.reduce_grads()
            if self.cfg.optimizer == "muon":  # DeepSpeed's clip is off (see ds_config); experts by their own norm
                self.ep.scale_grads(clip_factor(math.sqrt(self._expert_sq), self.cfg.grad_clip))
                self.engine.step()
                grad_norm = math.sqrt(float(self.engine.get_global_grad_norm() or 0.0) ** 2 + self._expert_sq)
            else:
                self.engine.step()  # measures the global norm (experts folded in) and clips by it
                grad_norm = float(self.engine.get_global_grad_norm())
                self.ep.scale_grads(clip_factor(grad_norm, self.cfg.grad_clip))
        self.expert_opt.step()
        self.expert_opt.zero_grad(set_to_none=True)
        return grad_norm

    # -- checkpoints
    def expert_optimizer_state(self, model: nn.Module) -> dict[str, dict[str, Any]]:
        """The experts' AdamW state by full parameter name (what a checkpoint's expert file holds)."""
        out = {}
        for n, p in model.named_parameters():
            st = self.expert_opt.state.get(p) if id(p) in self.ep.ids else None
            if st:
                out[n] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
        return out

    def load_expert_optimizer_state(self, model: nn.Module, state: dict[str, dict[str, Any]]) -> None:
        """Each local expert's slice of a full-width (all E experts) AdamW state by name."""
        for n, p in model.named_parameters():
            if id(p) not in self.ep.ids or n not in state:
                continue
            ex = self.ep.owner(p)
            rows = slice(ex.first, ex.first + ex.count)
            self.expert_opt.state[p] = {k: (v[rows].clone().to(p.device) if torch.is_tensor(v) and v.dim() > 0
                                            else (v.clone() if torch.is_tensor(v) else v)) for k, v in state[n].items()}

    def save(self, out: Path) -> None:
        self.engine.save_checkpoint(str(out), tag="ds")

    def load(self, d: Path, is_expert_param: Callable[[str], bool]) -> None:
        def dense_only(src, dst):  # experts come from the k3 files, resharded to this ep_size
            dst.load_state_dict({k: v for k, v in src.items() if not is_expert_param(k)}, strict=False)

        self.engine.load_checkpoint(str(d), tag="ds", load_module_strict=False, custom_load_fn=dense_only)
