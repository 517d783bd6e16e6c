"""Parameter groups and the learning-rate schedule of the training workers."""
from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms, gates' per-channel vectors, AttnRes queries and biases get none."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "attn_res" not in name else no_decay).append(p)
    return [{"name": "decay", "params": decay, "weight_decay": weight_decay},
            {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]


def cosine_lr(step: int, total_steps: int, warmup_steps: int, peak: float, min_ratio: float = 0.1) -> float:
    """Linear warmup to peak, cosine decay to min_ratio * peak at total_steps."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
