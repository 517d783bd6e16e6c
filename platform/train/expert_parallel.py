"""Expert parallelism, applied to a single-device K3 model from outside (torchtitan's way).

The model arrives holding only this rank's experts (`k3.model.build(cfg, ep_rank, ep_size)` or
`k3.model.load(path, ep_rank=..., ep_size=...)`: placement is the model's, k3.model.moe). Here:

- groups: `ep_groups(rank, world, ep_size)` makes the expert-parallel groups (consecutive ranks)
  and the expert-data-parallel groups (ranks holding the same experts);
- dispatch: `apply_expert_parallel(model, ep_group, edp_group, world)` installs the all-to-all
  dispatcher (each (token, expert) pair travels to the rank owning the expert, is computed there
  in one grouped pass and comes back; gradients flow back through the same all-to-alls, torch's
  functional autograd collective) and returns an `ExpertParallel` handle;
- gradients: `ExpertParallel.reduce_grads()` sums expert gradients over the expert-data-parallel
  group and divides by the world size (the data-parallel mean whatever ep_size is) and returns
  their squared norm over all experts of all ranks, to fold into the one global clip;
- checkpoints: `ExpertParallel.load_weights` takes this rank's rows of full-width expert weights
  (k3.model.training_checkpoint merges the files of any ep_size into those).
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


def ep_groups(rank: int, world: int, ep_size: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(expert-parallel group, expert-data-parallel group) of this rank.

    EP groups are consecutive ranks [0..ep), [ep..2ep), ...; the ranks holding the same experts
    (same rank % ep) form the expert-data-parallel groups. Every rank creates every group, as
    torch.distributed requires. With ep_size 1 there is no EP group and the EDP group is WORLD."""
    if world % ep_size:
        raise ValueError(f"ep_size={ep_size} must divide the world size {world}")
    if ep_size == 1:
        return None, (dist.group.WORLD if world > 1 else None)
    ep_group = edp_group = None
    for start in range(0, world, ep_size):
        g = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            ep_group = g
    for r in range(ep_size):
        g = dist.new_group(list(range(r, world, ep_size)))
        if rank % ep_size == r:
            edp_group = g
    return ep_group, edp_group


class AllToAllDispatch:
    """Callable installed as `Experts.dispatch`; see the module docstring. Counts what it moves:
    the seconds spent exchanging, and the bytes this rank sends to the other ranks of its group
    (expert counts, expert ids and rows in each forward, recompute included; the rows' gradients
    in the backward)."""

    def __init__(self, group: dist.ProcessGroup | None, ep_size: int, num_experts: int) -> None:
        self.group, self.ep, self.E = group, ep_size, num_experts
        self.per_rank = num_experts // ep_size
        self.seconds = 0.0
        self.sent_bytes = 0

    def reset(self) -> None:
        self.seconds, self.sent_bytes = 0.0, 0

    def _count_grad(self, rows: int):
        """A hook that counts the gradient of `rows` off-rank rows, sent back by the reverse
        all-to-all in the backward."""
        def hook(grad: torch.Tensor) -> None:
            self.sent_bytes += rows * grad.shape[-1] * grad.element_size()
        return hook

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
        me = dist.get_rank(self.group)
        out_rows, in_rows = sum(send) - send[me], sum(recv) - recv[me]  # rows that cross to or from other ranks
        recv_ids = flat.new_empty(sum(recv))
        dist.all_to_all_single(recv_ids, flat[order].contiguous(), recv, send, group=self.group)
        # Differentiable all-to-all (its backward is the reverse exchange); waited on here so the
        # timing below is the exchange's, not whoever touches the tensor first.
        recv_x = wait_tensor(all_to_all_single_autograd(x[token].contiguous(), recv, send, self.group))
        t1 = time.perf_counter()
        y = experts.grouped(recv_x, recv_ids - experts.first)
        t2 = time.perf_counter()
        back = wait_tensor(all_to_all_single_autograd(y.contiguous(), send, recv, self.group))
        self.seconds += (t1 - t0) + (time.perf_counter() - t2)
        width = x.shape[-1]
        self.sent_bytes += (self.ep - 1) * send_counts.element_size() + out_rows * flat.element_size() \
            + (out_rows * x.element_size() + in_rows * y.element_size()) * width
        if recv_x.requires_grad:
            recv_x.register_hook(self._count_grad(in_rows))
            back.register_hook(self._count_grad(out_rows))
        back = back * weight.reshape(-1)[order, None].to(back.dtype)
        return x.new_zeros(N, x.shape[-1]).index_add(0, token, back.to(x.dtype))


class ExpertParallel:
    """The experts of one rank and the groups they live in (returned by apply_expert_parallel)."""

    def __init__(self, model: nn.Module, ep_group, edp_group, world: int, ep_size: int,
                 dispatchers: list[AllToAllDispatch]) -> None:
        self.model, self.ep_group, self.edp_group = model, ep_group, edp_group
        self.world, self.ep_size, self.dispatchers = world, ep_size, dispatchers
        self._owner = {id(p): moe.experts for moe in moe_layers(model) for p in moe.experts.parameters()}
        self.params = [p for moe in moe_layers(model) for p in moe.experts.parameters()]
        self.ids = set(self._owner)

    def owner(self, p: nn.Parameter) -> Experts:
        """The Experts module (its range [first, first + count)) a local expert parameter belongs to."""
        return self._owner[id(p)]

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """This rank's rows of full-width expert weights [E, ...] by parameter name."""
        for n, p in self.model.named_parameters():
            if id(p) not in self.ids:
                continue
            if n not in weights:
                raise ValueError(f"{where}: no expert weights for {n}")
            ex = self.owner(p)
            p.copy_(weights[n][ex.first:ex.first + ex.count])

    def reset_counters(self) -> None:
        for d in self.dispatchers:
            d.reset()

    def all_to_all_seconds(self) -> float:
        return sum(d.seconds for d in self.dispatchers)

    def all_to_all_bytes(self) -> int:
        """Bytes this rank sent to other ranks through the all-to-alls since reset_counters."""
        return sum(d.sent_bytes for d in self.dispatchers)

    def reduce_grads(self) -> float:
        """Sum expert gradients over the ranks holding the same experts, divide by the world
        size; returns the squared norm of the reduced gradients over every expert of every rank
        (fp64; the same value on every rank)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        if self.edp_group is not None and dist.get_world_size(self.edp_group) > 1:
            dist.all_reduce(flat, group=self.edp_group)
        flat.div_(self.world)
        sq = flat.double().pow(2).sum().reshape(1)
        if self.world > 1:  # each expert is held once per EP group: sum over one group's worth of ranks
            dist.all_reduce(sq)
            sq /= self.world // self.ep_size
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()
        return float(sq)

    def scale_grads(self, factor: float) -> None:
        if factor != 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(factor)


def apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None, edp_group: dist.ProcessGroup | None,
                          world: int = 1) -> ExpertParallel:
    """Install the all-to-all dispatcher on every MoE layer (when ep_group spans > 1 rank; the
    model must hold only this rank's experts, see k3.model.build) and return the handle that
    reduces expert gradients over edp_group."""
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    dispatchers = []
    if ep_size > 1:
        for moe in moe_layers(model):
            d = AllToAllDispatch(ep_group, ep_size, moe.cfg.num_experts)
            moe.experts.dispatch = d
            dispatchers.append(d)
    return ExpertParallel(model, ep_group, edp_group, world, ep_size, dispatchers)
