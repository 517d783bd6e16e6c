"""Readable Kimi Delta Attention in fp32: the ground truth for tests, two ways.

Per head, with a state S of shape [K, V]:

    S_t = (I - beta_t k_t k_t^T) diag(exp g_t) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (q_t * scale)

`naive_recurrent_kda` runs that token by token: decay S, read the memory at k_t, write beta_t
times the error back. `naive_chunk_kda` computes the same thing a chunk of C tokens at a time,
the form the fast paths use (cpu.py, triton_*.py), without their tiling, sub-chunk anchoring or
layout. Within a chunk, with G_i the cumulative log-decay up to token i and delta_j the "new
value" written at token j, unrolling the recurrence gives

    (I + A) delta = beta v - (beta k e^G) S_0,     A_ij = beta_i sum_c k_ic k_jc e^(G_ic - G_jc), j < i
    o_i   = (q_i e^(G_i)) S_0 + sum_(j <= i) [sum_c q_ic k_jc e^(G_ic - G_jc)] delta_j
    S_C   = diag(e^(G_C)) S_0 + sum_j (k_j e^(G_C - G_j)) delta_j^T

so delta = u - w S_0 with [u | w] = (I + A)^-1 [beta v | beta k e^G] (the WY/UT form): only the
hand-off of S from chunk to chunk is sequential.

Both take `chunk_kda`'s arguments (the chunk form its chunk_size; neither needs a lower_bound)
and return its `KDAOutput`, states_at included.
"""
from __future__ import annotations

import torch

from .contract import KDAOutput


def _sequences(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, first token, end) of each sequence, in token order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = cu_seqlens.tolist()
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


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
    *,
    states_at: dict[int, list[int]] | None = None,
) -> KDAOutput:
    """Token-by-token KDA.

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K] log-decay (<= 0); beta: [B, T, H].
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, H, K, V], N = B, or the number of sequences when packed.
        cu_seqlens: [N + 1] int offsets of packed sequences (then B must be 1).
        states_at: {sequence: [token offsets]}: also the state after each.
    Returns:
        KDAOutput(o [B, T, H, V] in v's dtype, final state [N, H, K, V] fp32 or None, states).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    # Per-token views from one unbind per tensor: indexing x[b, t] inside the loop would give each
    # token a backward that writes a whole [B, T, ...] gradient, O(T^2) for the sequence.
    qs, ks, vs, gs, betas = ([xb.unbind(0) for xb in x.unbind(0)] for x in (q, k, v, g, beta))
    outs, finals, states = [], [], {}  # the sequences run through every token in order
    for n, (b, start, end) in enumerate(_sequences(B, T, cu_seqlens)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].float()
        want = set((states_at or {}).get(n, []))
        for t in range(start, end):
            k_t = ks[b][t]
            S = S * gs[b][t].exp()[..., None]
            memory = torch.einsum("hk,hkv->hv", k_t, S)
            delta = betas[b][t][:, None] * (vs[b][t] - memory)
            S = S + k_t[..., None] * delta[:, None, :]
            outs.append(torch.einsum("hk,hkv->hv", qs[b][t] * scale, S))
            if t + 1 - start in want:
                states[(n, t + 1 - start)] = S
        finals.append(S)
    o = torch.stack(outs).view(B, T, H, V) if outs else v.new_zeros(B, T, H, V)
    return KDAOutput(o.to(dtype), torch.stack(finals) if output_final_state else None, states)


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    states_at: dict[int, list[int]] | None = None,
) -> KDAOutput:
    """Chunkwise KDA in the WY/UT form, one chunk at a time; `naive_recurrent_kda`'s contract.

    chunk_size: tokens per chunk (any size >= 1). A sequence is also cut at its states_at
    offsets, so each asked-for state is a chunk's leaving state. Gates must be finite.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    outs, finals, states = [], [], {}  # chunks in token order
    for n, (b, start, end) in enumerate(_sequences(B, T, cu_seqlens)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].float()
        want = set((states_at or {}).get(n, []))
        cuts = sorted(set(range(0, end - start, chunk_size)) | {c for c in want if c < end - start})
        for c0, c1 in zip(cuts, cuts[1:] + [end - start]):
            sl = slice(start + c0, start + c1)
            o_c, S = _one_chunk(q[b, sl] * scale, k[b, sl], v[b, sl], g[b, sl], beta[b, sl], S)
            outs.append(o_c)
            if c1 in want:
                states[(n, c1)] = S
        finals.append(S)
    o = torch.cat(outs).view(B, T, H, V) if outs else v.new_zeros(B, T, H, V)
    return KDAOutput(o.to(dtype), torch.stack(finals) if output_final_state else None, states)


def _one_chunk(q, k, v, g, beta, S):
    """q (scaled), k, g: [C, H, K]; v: [C, H, V]; beta: [C, H]; S: [H, K, V], the state entering.
    Returns o [C, H, V] and the state leaving the chunk."""
    C = k.shape[0]
    G = g.cumsum(0)  # [C, H, K], decay from the chunk's start through token i
    on_or_below = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()[..., None, None]
    # e^(G_i - G_j) for j <= i, 0 above the diagonal (masked before exp: there it would overflow)
    decay = (G[:, None] - G[None, :]).masked_fill(~on_or_below, float("-inf")).exp()  # [i, j, H, K]
    kb = k * beta[..., None]
    A = torch.einsum("ihc,jhc,ijhc->hij", kb, k, decay).tril(-1)  # [H, C, C], strictly below
    Aqk = torch.einsum("ihc,jhc,ijhc->hij", q, k, decay)  # on and below the diagonal
    unit_lower = torch.eye(C, device=k.device) + A
    # [u | w] = (I + A)^-1 [beta v | beta k e^G], by forward substitution
    u = torch.linalg.solve_triangular(unit_lower, (v * beta[..., None]).transpose(0, 1), upper=False)
    w = torch.linalg.solve_triangular(unit_lower, (kb * G.exp()).transpose(0, 1), upper=False)
    delta = u - w @ S  # [H, C, V]
    o = (q * G.exp()).transpose(0, 1) @ S + Aqk @ delta
    k_end = (k * (G[-1] - G).exp()).transpose(0, 1)  # [H, C, K]: decay from token j to the chunk's end
    S = S * G[-1].exp()[..., None] + k_end.transpose(1, 2) @ delta
    return o.transpose(0, 1), S


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
        o, S, _ = naive_recurrent_kda(
            q[n][None, None], k[n][None, None], v[n][None, None], g[n][None, None], beta[n][None, None],
            scale=scale, initial_state=state_pool[slot][None], output_final_state=True,
        )
        state_pool[slot] = S[0]
        outs.append(o[0, 0])
    return torch.stack(outs)
