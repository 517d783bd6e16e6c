"""Readable Kimi Delta Attention: the per-token recurrence, in fp32. The ground truth for tests.

Per head, with a state S of shape [K, V]:

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (q_t * scale)

which is computed as: decay S, read the memory at k_t, write beta_t times the error back.
"""
from __future__ import annotations

import torch


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token KDA.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H].
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, H, K, V], N = B, or the number of sequences when packed.
        cu_seqlens: [N + 1] int offsets of packed sequences (then B must be 1).
    Returns:
        o: [B, T, H, V] in v's dtype; the final state [N, H, K, V] in fp32 (or None).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        bounds = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    # Per-token views from one unbind per tensor: indexing x[b, t] inside the loop would give each
    # token a backward that writes a whole [B, T, ...] gradient, O(T^2) for the sequence.
    qs, ks, vs, gs, betas = ([xb.unbind(0) for xb in x.unbind(0)] for x in (q, k, v, g, beta))
    outs, finals = [], []  # bounds run through every token in order, so the outputs stack into o
    for n, (b, start, end) in enumerate(bounds):
        if initial_state is None:
            S = q.new_zeros(H, K, V)
        else:
            S = initial_state[n].float()
        for t in range(start, end):
            k_t = ks[b][t]
            S = S * gs[b][t].exp()[..., None]
            memory = torch.einsum("hk,hkv->hv", k_t, S)
            delta = betas[b][t][:, None] * (vs[b][t] - memory)
            S = S + k_t[..., None] * delta[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", qs[b][t] * scale, S))
        finals.append(S)
    o = torch.stack(outs).view(B, T, H, V) if outs else v.new_zeros(B, T, H, V, dtype=torch.float32)
    final = torch.stack(finals) if output_final_state else None
    return o.to(dtype), final


def naive_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_idx: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step for a batch of sequences whose states live in a pool of slots.

    q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H]; state_pool: [P, H, K, V] fp32, updated in
    place at rows slot_idx [N]. Returns o: [N, H, V] in v's dtype.
    """
    N, H, K = k.shape
    scale = K**-0.5 if scale is None else scale
    outs = []
    for n in range(N):
        slot = int(slot_idx[n])
        o, S = naive_recurrent_kda(
            q[n][None, None], k[n][None, None], v[n][None, None], g[n][None, None], beta[n][None, None],
            scale=scale, initial_state=state_pool[slot][None], output_final_state=True,
        )
        state_pool[slot] = S[0]
        outs.append(o[0, 0])
    return torch.stack(outs)
