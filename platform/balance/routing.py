"""Router-side quantities every balancing method shares: top-k routing with a selection bias, QB
margins, expert loads, MaxVio, the per-expert load target q = N k / E, and the two baselines'
updates (DeepSeek-V3's loss-free sign step, Switch's auxiliary loss). Plain tensors in and out.
"""
from __future__ import annotations

import torch

from k3.model.moe import select_experts
# expert_ids [N, top_k] (each in [0, E)) -> tokens per expert [E] int64
from k3.model.moe import tokens_per_expert as expert_loads

def _check_scores(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> None:
    if scores.dim() != 2 or not scores.is_floating_point():
        raise ValueError(f"scores must be a floating [N, E] tensor, got {tuple(scores.shape)} {scores.dtype}")
    check_top_k(top_k, scores.shape[1])
    if bias.shape != (scores.shape[1],):
        raise ValueError(f"bias must be [E={scores.shape[1]}], got {tuple(bias.shape)}")


def check_top_k(top_k: int, num_experts: int) -> None:
    """QB needs a (k+1)-th expert per token: 1 <= k < E."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < num_experts:
        raise ValueError(f"top_k (num_experts_per_token) must satisfy 1 <= top_k < experts, got top_k={top_k!r} with {num_experts} experts")


def check_layers(num_layers: int, num_experts: int, top_k: int) -> None:
    """What a balancer over `num_layers` MoE layers needs: at least one layer, 1 <= k < E."""
    check_top_k(top_k, num_experts)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")


def route(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as the model does it, plus QB margins.

    scores [N, E], bias [E] -> (margins [N, E] = s - alpha, expert_ids [N, top_k]).
    """
    _check_scores(scores, bias, top_k)
    idx, margins = select_experts(scores, bias, top_k)
    return margins, idx


def token_margins(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [N, E], bias [E] -> margins [N, E] = s - alpha, alpha = (k+1)-th largest of s + b per token."""
    return route(scores, bias, top_k)[0]


def max_violation(loads: torch.Tensor) -> float:
    """MaxVio = max load / mean load - 1 (0 when perfectly balanced)."""
    loads = loads.double()
    mean = loads.mean()
    if mean <= 0:
        raise ValueError("max_violation: no token was routed")
    return float(loads.max() / mean - 1)


def centred(bias: torch.Tensor) -> torch.Tensor:
    """Subtract the mean; top-k of s + b is unchanged by a shift of every b_e."""
    return bias - bias.mean()


def quantile_target(n_tokens: int, top_k: int, num_experts: int) -> float:
    """q = N k / E, the load every expert should carry; raises if it is outside (0, N)."""
    check_top_k(top_k, num_experts)
    q = n_tokens * top_k / num_experts
    if not 0 < q < n_tokens:
        raise ValueError(f"q = N k / E = {n_tokens} * {top_k} / {num_experts} = {q:g} is outside (0, N={n_tokens})")
    return q


def loss_free_update(bias: torch.Tensor, loads: torch.Tensor, step_size: float = 1e-3) -> torch.Tensor:
    """DeepSeek-V3 auxiliary-loss-free balancing: b_e += step * sign(mean load - load_e)."""
    loads = loads.to(torch.float64)
    return (bias + step_size * torch.sign(loads.mean() - loads).to(bias.dtype)).to(bias.dtype)


def switch_aux_loss(probs: torch.Tensor, expert_ids: torch.Tensor, coef: float = 1.0) -> torch.Tensor:
    """Switch Transformer load-balancing loss, generalised to top-k; a differentiable scalar.

    probs [N, E]: router probabilities (rows sum to 1; normalise sigmoid scores per token);
    expert_ids [N, top_k]: the selection. Loss = coef * E * sum_e f_e P_e with f_e the fraction of the
    N k routed slots that went to e (not differentiable) and P_e the mean probability of e.
    It equals coef under uniform routing; gradients reach the router through P only.
    """
    if probs.dim() != 2 or expert_ids.dim() != 2 or probs.shape[0] != expert_ids.shape[0]:
        raise ValueError(f"switch_aux_loss: need probs [N, E] and expert_ids [N, top_k], got {tuple(probs.shape)} and {tuple(expert_ids.shape)}")
    n, e = probs.shape
    f = expert_loads(expert_ids, e).to(probs.dtype) / expert_ids.numel()
    p = probs.mean(0)
    return coef * e * (f * p).sum()
