"""Expert parallelism, applied to a single-device K3 model from outside (torchtitan's way).

`shard_experts(model, ep_rank, ep_size)` swaps every MoE layer's experts for the rank's own
range [rank * E / ep, (rank + 1) * E / ep), so a rank builds only its experts (call it on a model
built on the meta device, then materialise). `apply_expert_parallel(model, group)` installs the
all-to-all dispatcher: each (token, expert) pair travels to the rank owning the expert, is
computed there in one grouped pass, and comes back to be weighted and summed by its token's
rank. Gradients flow back through the same all-to-alls (torch's functional autograd collective), so router
weights and everything before the experts train exactly as on one device.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from k3.model.moe import Experts, LatentMoE


def moe_layers(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def shard_experts(model: nn.Module, ep_rank: int, ep_size: int) -> None:
    for moe in moe_layers(model):
        E = moe.cfg.num_experts
        if E % ep_size:
            raise ValueError(f"ep_size={ep_size} must divide num_experts={E}")
        n = E // ep_size
        old = moe.experts
        dim = old.w_gate.shape[-1]
        with torch.device(old.w_gate.device):
            moe.experts = Experts(moe.cfg, dim, old.layer_idx, first=ep_rank * n, count=n)


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for moe in moe_layers(model) for p in moe.experts.parameters()]


class AllToAllDispatch:
    """Callable installed as `Experts.dispatch`; see the module docstring."""

    def __init__(self, group: dist.ProcessGroup | None, ep_size: int, num_experts: int) -> None:
        self.group, self.ep, self.E = group, ep_size, num_experts
        self.per_rank = num_experts // ep_size
        self.last_a2a_seconds = 0.0

    def __call__(self, experts: Experts, x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        N, k = idx.shape
        flat = idx.reshape(-1)
        dest = flat // self.per_rank
        order = torch.argsort(dest, stable=True)
        token = order // k
        send_counts = torch.bincount(dest, minlength=self.ep)
        recv_counts = torch.empty_like(send_counts)
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        recv_ids = flat.new_empty(sum(recv))
        dist.all_to_all_single(recv_ids, flat[order].contiguous(), recv, send, group=self.group)
        # Differentiable all-to-all (its backward is the reverse exchange); waited on here so the
        # timing below is the exchange's, not whoever touches the tensor first.
        recv_x = wait_tensor(all_to_all_single_autograd(x[token].contiguous(), recv, send, self.group))
        t1 = time.perf_counter()
        y = experts.grouped(recv_x, recv_ids - experts.first)
        t2 = time.perf_counter()
        back = wait_tensor(all_to_all_single_autograd(y.contiguous(), send, recv, self.group))
        self.last_a2a_seconds += (t1 - t0) + (time.perf_counter() - t2)
        back = back * weight.reshape(-1)[order, None].to(back.dtype)
        return x.new_zeros(N, x.shape[-1]).index_add(0, token, back.to(x.dtype))


def apply_expert_parallel(model: nn.Module, group: dist.ProcessGroup | None, ep_size: int) -> list[AllToAllDispatch]:
    """Install the dispatcher on every MoE layer (after shard_experts). Returns the dispatchers."""
    out = []
    for moe in moe_layers(model):
        d = AllToAllDispatch(group, ep_size, moe.cfg.num_experts)
        moe.experts.dispatch = d
        out.append(d)
    return out


def build_model(cfg, ep_rank: int = 0, ep_size: int = 1, seed: int = 0, device: str = "cpu"):
    """A K3ForCausalLM holding only this rank's experts, initialised exactly as the full model
    would be from the same seed (so ep_size changes placement, never values)."""
    from k3.model import K3ForCausalLM

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    if ep_size > 1:
        shard_experts(model, ep_rank, ep_size)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.reset_parameters()
    return model
