"""Expert parallelism, applied to a single-device K3 model from outside (torchtitan's way).

One home for everything that depends on where experts live:

- placement: `build_model(cfg, ep_rank, ep_size)` builds only rank `ep_rank`'s experts
  [r E / ep, (r + 1) E / ep) (meta-device build, then materialise), initialised exactly as the
  full model would be from the same seed, so ep_size changes placement and never values;
- groups: `ep_groups(rank, world, ep_size)` makes the expert-parallel groups (consecutive ranks)
  and the expert-data-parallel groups (ranks holding the same experts);
- dispatch: `apply_expert_parallel(model, ep_group, edp_group, world)` installs the all-to-all
  dispatcher (each (token, expert) pair travels to the rank owning the expert, is computed there
  in one grouped pass and comes back; gradients flow back through the same all-to-alls, torch's
  functional autograd collective) and returns an `ExpertParallel` handle;
- gradients: `ExpertParallel.reduce_grads()` sums expert gradients over the expert-data-parallel
  group and divides by the world size (the data-parallel mean whatever ep_size is) and returns
  their squared norm over all experts of all ranks, to fold into the one global clip;
- checkpoints: `save_experts` / `load_experts` write one file per expert-parallel rank with the
  weights and AdamW state by full parameter name; loading concatenates every file along the
  expert axis and slices the loading rank's range, so a checkpoint saved with one ep_size loads
  with any other that divides the experts.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from k3.model.moe import Experts, LatentMoE


def moe_layers(model: nn.Module) -> list[LatentMoE]:
    return [m for m in model.modules() if isinstance(m, LatentMoE)]


def is_expert_param(name: str) -> bool:
    """Routed-expert parameters by name (stacked per layer along dim 0 = the expert axis)."""
    return ".mlp.experts." in name


def shard_experts(model: nn.Module, ep_rank: int, ep_size: int) -> None:
    """Swap every MoE layer's experts for rank `ep_rank`'s range of E / ep_size experts."""
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


def build_model(cfg, ep_rank: int = 0, ep_size: int = 1, seed: int = 0, device: str = "cpu"):
    """A K3ForCausalLM (K3ForConditionalGeneration when cfg has a vision_config) holding only
    this rank's experts, initialised exactly as the full model would be from the same seed (so
    ep_size changes placement, never values)."""
    from k3.model import K3ForCausalLM, K3ForConditionalGeneration

    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg) if cfg.vision_config is not None else K3ForCausalLM(cfg)
    if ep_size > 1:
        shard_experts(model, ep_rank, ep_size)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    model.reset_parameters()
    return model


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


class ExpertParallel:
    """The experts of one rank and the groups they live in (returned by apply_expert_parallel)."""

    def __init__(self, model: nn.Module, ep_group, edp_group, world: int, ep_size: int,
                 dispatchers: list[AllToAllDispatch]) -> None:
        self.model, self.ep_group, self.edp_group = model, ep_group, edp_group
        self.world, self.ep_size, self.dispatchers = world, ep_size, dispatchers
        self.params = expert_parameters(model)
        self.ids = {id(p) for p in self.params}

    def reset_timers(self) -> None:
        for d in self.dispatchers:
            d.last_a2a_seconds = 0.0

    def all_to_all_seconds(self) -> float:
        return sum(d.last_a2a_seconds for d in self.dispatchers)

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
    model must hold only this rank's experts, see build_model) and return the handle that
    reduces expert gradients over edp_group."""
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    dispatchers = []
    if ep_size > 1:
        for moe in moe_layers(model):
            d = AllToAllDispatch(ep_group, ep_size, moe.cfg.num_experts)
            moe.experts.dispatch = d
            dispatchers.append(d)
    return ExpertParallel(model, ep_group, edp_group, world, ep_size, dispatchers)


# -- checkpoint layout --------------------------------------------------------------------------
def expert_file(ep_rank: int, ep_size: int) -> str:
    return f"experts-ep{ep_rank}-of-{ep_size}.pt"


def save_experts(model: nn.Module, optimizer: torch.optim.Optimizer | None, out: Path, ep_rank: int,
                 ep_size: int) -> None:
    """Write this rank's expert weights and optimizer state, both keyed by full parameter name
    (call on one rank per expert-parallel rank: expert-data-parallel rank 0)."""
    named = {n: p for n, p in model.named_parameters() if is_expert_param(n)}
    opt_state = {}
    if optimizer is not None:
        for n, p in named.items():
            st = optimizer.state.get(p)
            if st:
                opt_state[n] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in st.items()}
    torch.save({"weights": {n: p.detach().cpu() for n, p in named.items()}, "optimizer": opt_state},
               Path(out) / expert_file(ep_rank, ep_size))


def read_all_experts(k3dir: Path, map_location: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """Every expert file of a checkpoint merged along the expert axis: (weights, optimizer state)
    by full parameter name, all E experts."""
    parts = sorted(Path(k3dir).glob("experts-ep*-of-*.pt"), key=lambda p: int(p.name.split("-")[1][2:]))
    if not parts:
        return {}, {}
    n = int(parts[0].name.rsplit("-of-", 1)[1][:-3])
    if len(parts) != n:
        raise ValueError(f"{k3dir}: expected {n} expert files, found {len(parts)}")
    shards = [torch.load(p, map_location=map_location, weights_only=False) for p in parts]
    weights = {key: torch.cat([s["weights"][key] for s in shards], dim=0) for key in shards[0]["weights"]}
    opt: dict[str, dict] = {}
    for key in shards[0]["optimizer"]:
        st0 = shards[0]["optimizer"][key]
        opt[key] = {k: (torch.cat([s["optimizer"][key][k] for s in shards], dim=0)
                        if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in st0.items()}
    return weights, opt


def load_experts(model: nn.Module, optimizer: torch.optim.Optimizer | None, k3dir: Path) -> None:
    """Load this rank's slice [first, first + count) of every layer's experts (and their AdamW
    state) from a checkpoint written with any ep_size."""
    weights, opt = read_all_experts(k3dir)
    owner = {}
    for moe in moe_layers(model):
        for p in moe.experts.parameters():
            owner[id(p)] = moe.experts
    with torch.no_grad():
        for n, p in model.named_parameters():
            if not is_expert_param(n):
                continue
            if n not in weights:
                raise ValueError(f"{k3dir}: no expert weights for {n}")
            ex = owner[id(p)]
            sl = slice(ex.first, ex.first + ex.count)
            p.copy_(weights[n][sl])
            if optimizer is not None and n in opt:
                optimizer.state[p] = {k: (v[sl].clone().to(p.device) if torch.is_tensor(v) and v.dim() > 0
                                          else (v.clone() if torch.is_tensor(v) else v)) for k, v in opt[n].items()}
