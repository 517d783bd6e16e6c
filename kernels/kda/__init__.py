"""Kimi Delta Attention ops.

Public functions (shape-checked, dispatching to the best path for the device):

- `chunk_kda`: prefill and training, chunkwise, packed sequences, initial/final state, the
  state at any asked-for token offset; differentiable (a hand-written chunkwise backward on
  both paths). Returns a `KDAOutput` on every backend.
- `kda_step`: one decode step for a batch of sequences whose states live in a slot pool.

CUDA tensors run the Triton kernels (triton.py over triton_fwd.py and triton_bwd.py;
triton_step.py), CPU tensors the torch path (cpu.py over cpu_blocks.py); `backend="torch"` or
`"triton"` forces one (Triton on CPU needs TRITON_INTERPRET=1). Both cut a batch into chunks
the same way (chunks.py). `naive_recurrent_kda`, `naive_chunk_kda` and `naive_kda_step`
(reference.py) are the readable ground truth with the same signatures.
"""
from __future__ import annotations

import torch

from ..dispatch import check_scale, use_triton
from .contract import (KDAOutput, check_chunk_size, check_gate, check_kda_inputs, check_lower_bound,
                       check_states_at, check_step_inputs, kda_fail)
from .cpu import chunk_kda_torch, kda_step_torch
from .reference import naive_chunk_kda, naive_kda_step, naive_recurrent_kda

__all__ = ["chunk_kda", "kda_step", "KDAOutput", "naive_recurrent_kda", "naive_chunk_kda", "naive_kda_step",
           "check_kda_inputs"]

MAX_TRITON_HEAD_DIM = 256  # one [BT, K] block per program; fla has the same limit
# exp(-88) is below fp32's smallest normal number: a gate under -88 decays the state to 0 as
# surely as -inf does, and clamping there keeps the chunk's cumulative sums (and their
# differences) finite and precise (-1e38 lost 27% of the result, -inf gave NaN)
GATE_FLOOR = -88.0


def _pick_backend(x: torch.Tensor, backend: str | None, head_dims: dict[str, int]) -> str:
    """'triton' for CUDA tensors (or when forced), else 'torch'; checks what Triton needs."""
    if not use_triton("kda", x, backend):
        return "torch"
    for name, d in head_dims.items():
        if not 1 <= d <= MAX_TRITON_HEAD_DIM:
            kda_fail(name, f"head dim {d} is not supported by the Triton kernel (1..{MAX_TRITON_HEAD_DIM})")
    return "triton"


def _gate_for(path: str, g: torch.Tensor, lower_bound: float | None, chunk_size: int):
    """The gate and the bound a path can use: checked, clamped at GATE_FLOOR, the bound dropped
    where it no longer keeps the diagonal sub-chunks in fp32."""
    # The dense diagonal sub-chunks are anchored mid-way, so e^(sub / 2 * |lb|) must stay far
    # inside fp32; the torch path's sub-chunk is min(chunk_size, 16), Triton's always 16.
    sub_chunk = 16 if path == "triton" else min(chunk_size, 16)
    if lower_bound is not None and lower_bound * sub_chunk < -80.0:
        lower_bound = None
    if check_gate(g, lower_bound) < GATE_FLOOR:
        g = g.clamp_min(GATE_FLOOR)
    return g, lower_bound


def chunk_kda(
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
    lower_bound: float | None = None,
    *,
    backend: str | None = None,
    states_at: dict[int, list[int]] | None = None,
) -> KDAOutput:
    """Chunkwise KDA over (packed) sequences, differentiable.

    Args:
        q, k: [B, T, H, K] (q, k already L2-normalised by the caller); v: [B, T, H, V];
        g: [B, T, H, K] log-decay <= 0 (fp32 recommended); beta: [B, T, H] in [0, 1].
        scale: multiplies q, finite and > 0; default K ** -0.5.
        initial_state: [N, H, K, V] (fp32), N = B, or the number of packed sequences.
        output_final_state: also return the final state [N, H, K, V] fp32.
        cu_seqlens: [N + 1] offsets when the batch is packed (B == 1).
        chunk_size: a multiple of 16 up to 256, or at most 16 (Triton: 16, 32 or 64, else 64).
        lower_bound: g >= lower_bound is guaranteed (K3's bounded gate); faster, same result.
        backend: None (Triton on CUDA, torch on CPU), "torch" or "triton".
        states_at: {sequence: [token offsets in (0, its length]]} (inference only): also the
            state after each offset, read in the same pass (the sequence's chunks are cut there).
    Returns:
        KDAOutput(o [B, T, H, V] in v's dtype, final state or None, states
        {(sequence, offset): [H, K, V] fp32}).
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    scale = check_scale("kda", scale, k.shape[-1] ** -0.5)
    check_chunk_size(chunk_size)
    check_lower_bound(lower_bound)
    B, T = k.shape[:2]
    lengths = [T] * B if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    states_at = check_states_at(states_at, lengths, (q, k, v, g, beta, initial_state))
    path = _pick_backend(k, backend, {"k": k.shape[-1], "v": v.shape[-1]})
    g, lower_bound = _gate_for(path, g, lower_bound, chunk_size)
    if B * T == 0:  # no tokens (states_at cannot name an offset): the state passes through
        final = (initial_state.float().clone() if initial_state is not None
                 else torch.zeros(N, k.shape[2], k.shape[3], v.shape[-1], device=k.device))
        return KDAOutput(v.new_zeros(v.shape), final if output_final_state else None, {})
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(k.device)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, lower_bound, states_at)
    if path == "triton":
        from .triton import chunk_kda_triton

        return chunk_kda_triton(*args)
    return chunk_kda_torch(*args)


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_idx: torch.Tensor,
    scale: float | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """One decode step; states read from and written back to `state_pool` in place.

    Args:
        q, k, g: [N, H, K]; v: [N, H, V]; beta: [N, H].
        state_pool: [P, H, K, V] fp32, the engine's slots; rows not in slot_idx are untouched
            (bit for bit).
        slot_idx: [N] int32/int64, distinct slot per sequence, each in [0, P).
        backend: None (Triton on CUDA, torch on CPU), "torch" or "triton".
    Returns:
        o: [N, H, V] in v's dtype.
    """
    check_step_inputs(q, k, v, g, beta, state_pool, slot_idx)
    K = k.shape[-1]
    scale = check_scale("kda", scale, K**-0.5)
    if _pick_backend(k, backend, {"k": K, "v": v.shape[-1]}) == "triton":
        if not state_pool.is_contiguous():
            kda_fail("state_pool", "must be contiguous for the Triton kernel (it is updated in place)")
        from .triton_step import kda_step_triton

        return kda_step_triton(q, k, v, g, beta, state_pool, slot_idx, scale)
    return kda_step_torch(q, k, v, g, beta, state_pool, slot_idx.long(), scale=scale)
