"""Serving memory per sequence and per GPU, and prefill time from FLOPs.

A serving replica spans `replica_gpus` GPUs: the routed experts are split over all of them (EP =
the replica); every other weight is split over a tensor-parallel group of `tp` GPUs inside a node
(heads and MLP widths), and each TP group serves whole sequences. Per sequence the cache is the
model's declaration (`k3.model.cache.cache_bytes`: fixed KDA state per layer, MLA latents per
token per layer): under TP the KDA state splits with the heads, while every rank of the group
needs all of a sequence's MLA latents (they are shared by the heads: MLA's price under TP). A GPU
also needs a prefill working set: one chunk's activations through the widest sub-layer, and the
sliced MLA attention's scores (model/mla.py). The planner takes the smallest TP, then the
smallest replica, that holds the weights and one sequence.

Prefill time: the prompt's forward FLOPs (training.forward_flops_per_token over the prompt) on
the replica's GPUs at a stated share of their bf16 peak.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from k3.model.cache import cache_bytes
from k3.model.config import K3Config

from . import activations as act
from .hardware import GPU
from .training import Counts, forward_flops_per_token

EXPERT_BYTES = {"bf16": 2.0, "mxfp4": 0.5 + 1 / 32}  # MXFP4: a 4-bit value each, one E8M0 scale per 32


@dataclass
class ServePlan:
    tp: int
    replica_gpus: int
    replicas: int
    weights_per_gpu: int
    workspace_per_gpu: int
    kda_state_per_sequence: int
    mla_latents_per_sequence: int
    cache_per_sequence_per_gpu: int  # the KDA state's 1/tp share and all the latents
    sequences_per_tp_group: int
    prefill_flops: float
    prefill_seconds: float

    @property
    def sequences_per_gpu(self) -> float:
        return self.sequences_per_tp_group / self.tp

    def as_dict(self) -> dict:
        return asdict(self) | {"sequences_per_gpu": self.sequences_per_gpu}


def sequence_bytes(cfg: K3Config, tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(fixed KDA state, MLA latents) of one sequence of `tokens`, from the model's declaration."""
    fixed = cache_bytes(cfg, 0, dtype)
    return fixed, cache_bytes(cfg, tokens, dtype) - fixed


def workspace_bytes(cfg: K3Config, chunk: int, dtype_bytes: int) -> int:
    """A prefill chunk's working set: its tokens through the widest sub-layer (what a training
    forward would keep of it bounds what inference holds at once) and the sliced MLA attention's
    fp32 score buffer."""
    from k3.model.mla import SCORE_BUDGET

    widest = max(act.sublayers(cfg, dtype_bytes, "triton"))
    return chunk * widest + SCORE_BUDGET * 4


def replica_shapes(cfg: K3Config, gpus: int, gpu: GPU) -> list[tuple[int, int]]:
    """(tp, replica size): powers of two, TP inside a node, the replica a multiple of TP dividing
    the GPUs and the expert count."""
    out, tp = [], 1
    while tp <= min(gpus, gpu.gpus_per_node):
        size = tp
        while size <= gpus:
            if gpus % size == 0 and cfg.num_experts % size == 0:
                out.append((tp, size))
            size *= 2
        tp *= 2
    return out


def plan_serving(cfg: K3Config, counts: Counts, gpu: GPU, gpus: int, context: int, chunk: int = 8192,
                 expert_format: str = "mxfp4", utilisation: float = 0.4) -> ServePlan:
    """The replica shape holding the most `context`-token sequences per GPU (ties: the smaller
    TP, then the smaller replica); ValueError when none holds its weights and one sequence."""
    if expert_format not in EXPERT_BYTES:
        raise ValueError(f"unknown expert format {expert_format!r}; choose from {sorted(EXPERT_BYTES)}")
    fixed, latents = sequence_bytes(cfg, context)
    flops = context * forward_flops_per_token(cfg, counts.active, context)
    best = None
    for tp, size in replica_shapes(cfg, gpus, gpu):
        per_seq = fixed // tp + latents
        work = workspace_bytes(cfg, min(chunk, context), 2) // tp
        weights = int(counts.dense * 2 / tp + counts.experts / size * EXPERT_BYTES[expert_format])
        free = gpu.usable_bytes - weights - work
        if free < per_seq:
            continue
        plan = ServePlan(tp, size, gpus // size, weights, work, fixed, latents, per_seq, free // per_seq, flops,
                         flops / (size * gpu.bf16_flops * utilisation))
        if best is None or plan.sequences_per_gpu > best.sequences_per_gpu:
            best = plan
    if best is None:
        raise ValueError(f"serving does not fit: no replica of {gpus} x {gpu.name} (TP up to {gpu.gpus_per_node}) "
                         f"holds the weights and one {context}-token sequence ({(fixed + latents) / 2**30:.2f} GiB) "
                         f"within {gpu.usable_bytes / 2**30:.1f} GiB per GPU")
    return best
