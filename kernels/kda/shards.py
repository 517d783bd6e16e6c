"""KDA over a sequence cut into contiguous shards (context parallelism): each shard runs on its own
from a zero state, and what the shards before it did reaches it through one small fold.

The delta rule is linear in the state: the state leaving a shard is `M h_in + h_ext`, with h_in the
state entering it, h_ext the state it leaves from a zero start, and the transition
`M = prod_t (I - beta_t k_t k_t^T) diag(exp g_t)` ([K, K] per head, later tokens on the left).
The output is linear in h_in the same way: `o_t = o_t(0) + R_t h_in`, with the read-out
`R_t = scale q_t^T M_(<=t)`. One chunkwise pass gives all four: run the shard with values
`[v | 0]` ([V + K] wide) from the entering state `[0 | I]` — the state after t tokens is then
`[S_t(0) | M_(<=t)]` and the output `[o_t(0) | R_t]`. The pass is `chunk_kda` itself (the torch
path on CPU, Triton on CUDA while V + K <= 256), so its hand-written backward differentiates it,
and gradients of h_in from the shards after this one flow back into k, g, beta through M and R.

The anchor is fla's KCP (`fla/ops/cp/KCP.md`), which gets (h_ext, M) from a pre-pass over the
chunks' WY factors and then reruns the shard from the folded state; here the identity columns
carry M and R through the one pass, so nothing is rerun.

Packed documents: only a shard's first document can continue from before it (when the shard does
not start on a document boundary) and only its last can run on into the next shard; a boundary
inside the shard makes its transition zero. Contract of each function below; the readable
reference for M is `naive_kda_transition`.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .contract import kda_fail


class KDAShard(NamedTuple):
    """What one shard's pass gives (see the module docstring).

    o: [1, T, H, V] fp32, the output from a zero entering state.
    readout: [1, T, H, K] fp32, R: `o + readout @ h_in` is the output from h_in (zero on tokens
        outside the shard's first document, and everywhere when the shard does not continue one).
    state: [H, K, V] fp32, the state leaving the last document from a zero entering state (h_ext).
    transition: [H, K, K] fp32, M: the last document leaves `transition @ h_in + state`.
    """

    o: torch.Tensor
    readout: torch.Tensor
    state: torch.Tensor
    transition: torch.Tensor


def chunk_kda_shard(q, k, v, g, beta, scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
                    continues: bool = True, chunk_size: int = 64, lower_bound: float | None = None,
                    *, backend: str | None = None) -> KDAShard:
    """One shard of a longer sequence, differentiable: `chunk_kda`'s inputs for [1, T] tokens.

    Args:
        q, k, g: [1, T, H, K]; v: [1, T, H, V]; beta: [1, T, H]; scale, chunk_size, lower_bound,
            backend: as `chunk_kda`.
        cu_seqlens: [N + 1] document offsets inside the shard (None: one document).
        continues: the shard's first document began before the shard (its state comes in).
    Returns:
        KDAShard(o, readout, state, transition).
    """
    from . import chunk_kda

    if k.dim() != 4 or k.shape[0] != 1:
        kda_fail("k", f"a shard is one packed row [1, T, H, K], got shape {tuple(k.shape)}")
    T, H, K = k.shape[1:]
    V = v.shape[-1]
    N = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    # Values [v | 0] from the state [0 | I]: the identity columns carry M and R (fp32: they are
    # the recurrent-state arithmetic, whatever dtype v comes in).
    v_aug = torch.cat([v.float(), v.new_zeros(*v.shape[:-1], K, dtype=torch.float32)], dim=-1)
    h0 = torch.zeros(N, H, K, V + K, device=k.device)
    if continues:
        h0[0, :, :, V:] = torch.eye(K, device=k.device)
    o, final, _ = chunk_kda(q, k, v_aug, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                            cu_seqlens=cu_seqlens, chunk_size=chunk_size, lower_bound=lower_bound, backend=backend)
    first = T if cu_seqlens is None else int(cu_seqlens[1])
    # R beyond the first document is zero already (its entering state had no identity); slicing
    # to the first document's rows keeps that exact instead of trusting the zeros.
    readout = o[..., V:] if first == T else torch.cat([o[:, :first, :, V:], o.new_zeros(1, T - first, H, K)], 1)
    return KDAShard(o[..., :V], readout, final[-1, :, :, :V], final[-1, :, :, V:])


def fold_shard_states(states: torch.Tensor, transitions: torch.Tensor, upto: int) -> torch.Tensor:
    """The state entering shard `upto`: fold the shards before it, oldest first, in fp32.

    states: [C, H, K, V] (each shard's `state`); transitions: [C, H, K, K]. Returns [H, K, V]:
    h = 0, then h = M_j h + h_ext_j for j = 0 .. upto - 1. Differentiable (the backward hands
    each earlier shard its dh_ext and dM)."""
    if states.dim() != 4 or transitions.shape != (*states.shape[:3], states.shape[2]):
        kda_fail("transitions", f"must be [C, H, K, K] beside states [C, H, K, V], got {tuple(transitions.shape)} "
                                f"and {tuple(states.shape)}")
    if not 0 <= upto <= states.shape[0]:
        kda_fail("upto", f"must lie in [0, {states.shape[0]}], got {upto}")
    # A zero computed from `states`, not a new tensor: the result depends on what was gathered
    # even for the first shard, so a caller whose gather is a collective runs its backward on
    # every process (autograd skips a node whose output reaches nothing).
    h = torch.where(torch.zeros((), dtype=torch.bool, device=states.device), states[0].float(), 0.0)
    for j in range(upto):
        h = transitions[j].float() @ h + states[j].float()
    return h


def shard_output(shard: KDAShard, h_in: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The shard's output from the entering state h_in [H, K, V]: o + R h_in, [1, T, H, V] in dtype."""
    return (shard.o + torch.einsum("bthk,hkv->bthv", shard.readout, h_in.float())).to(dtype)


def naive_kda_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Readable reference: M = prod_t (I - beta_t k_t k_t^T) diag(exp g_t) for one sequence,
    token by token in fp32. k, g: [T, H, K]; beta: [T, H]. Returns [H, K, K]."""
    T, H, K = k.shape
    M = torch.eye(K).expand(H, K, K).to(k.device)
    for t in range(T):
        kt, bt = k[t].float(), beta[t].float()
        step = torch.eye(K, device=k.device) - bt[:, None, None] * kt[:, :, None] * kt[:, None, :]
        M = step @ (g[t].float().exp()[:, :, None] * M)
    return M
