"""Kimi Delta Attention ops.

Public functions (shape-checked, dispatching to the best path for the device):

- `chunk_kda`: prefill and training, chunkwise, packed sequences, initial/final state;
  differentiable (a hand-written chunkwise backward on both paths).
- `kda_step`: one decode step for a batch of sequences whose states live in a slot pool.

CUDA tensors run the Triton kernels (triton.py), CPU tensors the torch path (cpu.py);
`backend="torch"` or `"triton"` forces one (Triton on CPU needs TRITON_INTERPRET=1).
`naive_recurrent_kda` and `naive_kda_step` (reference.py) are the readable ground truth with
the same signatures.
"""
from __future__ import annotations

import math
from typing import NoReturn

import torch

from .._dispatch import fail, use_triton
from .cpu import chunk_kda_torch, kda_step_torch
from .reference import naive_kda_step, naive_recurrent_kda

__all__ = ["chunk_kda", "kda_step", "naive_recurrent_kda", "naive_kda_step", "check_kda_inputs"]

MAX_TRITON_HEAD_DIM = 256  # one [BT, K] block per program; fla has the same limit
# exp(-88) is below fp32's smallest normal number: a gate under -88 decays the state to 0 as
# surely as -inf does, and clamping there keeps the chunk's cumulative sums (and their
# differences) finite and precise (-1e38 lost 27% of the result, -inf gave NaN)
GATE_FLOOR = -88.0


def _fail(name: str, msg: str) -> NoReturn:
    fail("kda", name, msg)


def _pick_backend(x: torch.Tensor, backend: str | None, head_dims: dict[str, int]) -> str:
    """'triton' for CUDA tensors (or when forced), else 'torch'; checks what Triton needs."""
    if not use_triton("kda", x, backend):
        return "torch"
    for name, d in head_dims.items():
        if not 1 <= d <= MAX_TRITON_HEAD_DIM:
            _fail(name, f"head dim {d} is not supported by the Triton kernel (1..{MAX_TRITON_HEAD_DIM})")
    return "triton"


def check_kda_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None) -> int:
    """Validate the chunk/recurrent contract; return the number of sequences N."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor):
            _fail(name, f"must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            _fail(name, f"must be floating point, got {x.dtype}")
        if x.device != k.device:
            _fail(name, f"is on {x.device} but k is on {k.device}")
    if k.dim() != 4:
        _fail("k", f"must be [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    if H < 1 or K < 1:
        _fail("k", f"needs at least one head and a head dim >= 1, got H={H}, K={K}")
    if v.dim() == 4 and v.shape[-1] < 1:
        _fail("v", f"needs a value head dim >= 1, got V={v.shape[-1]}")
    if q.shape != k.shape:
        _fail("q", f"shape {tuple(q.shape)} != k shape {tuple(k.shape)}")
    if g.shape != k.shape:
        _fail("g", f"shape {tuple(g.shape)} != k shape {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        _fail("v", f"must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        _fail("beta", f"must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            _fail("cu_seqlens", f"must be a tensor, got {type(cu_seqlens).__name__}")
        if B != 1:
            _fail("q", f"batch must be 1 when cu_seqlens is given (packed), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail("cu_seqlens", f"must be a 1-D integer tensor [N + 1], got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            _fail("cu_seqlens", f"must rise from 0 to T={T}, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
        N = len(cu) - 1
    else:
        N = B
    if initial_state is not None:
        want = (N, H, K, v.shape[-1])
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            _fail("initial_state", "must be a floating-point tensor")
        if tuple(initial_state.shape) != want:
            _fail("initial_state", f"must be [N, H, K, V] = {list(want)}, got {tuple(initial_state.shape)}")
        if initial_state.device != k.device:
            _fail("initial_state", f"is on {initial_state.device} but k is on {k.device}")
    return N


def _check_gate(g: torch.Tensor, lower_bound: float | None) -> float:
    """g is a log-decay: <= 0, and >= lower_bound when one is promised (the fast diagonal blocks
    rely on it; a broken promise would overflow instead of failing). Returns min(g)."""
    if g.numel() == 0:
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(g.detach()))
    if not (hi <= 0.0) or math.isnan(lo):  # also catches NaN
        _fail("g", f"must be a log-decay <= 0 everywhere, got max {hi}")
    if lower_bound is not None and lo < lower_bound:
        _fail("g", f"has values below lower_bound={lower_bound} (min {lo}); pass lower_bound=None for an unbounded gate")
    return lo


def _check_lower_bound(lower_bound) -> None:
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not math.isfinite(lower_bound) or lower_bound >= 0):
        _fail("lower_bound", f"must be None or a finite number < 0, got {lower_bound!r}")


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
):
    """Chunkwise KDA over (packed) sequences, differentiable.

    Args:
        q, k: [B, T, H, K] (q, k already L2-normalised by the caller); v: [B, T, H, V];
        g: [B, T, H, K] log-decay <= 0 (fp32 recommended); beta: [B, T, H] in [0, 1].
        scale: multiplies q, default K ** -0.5.
        initial_state: [N, H, K, V] (fp32), N = B, or the number of packed sequences.
        output_final_state: also return the final state [N, H, K, V] fp32.
        cu_seqlens: [N + 1] offsets when the batch is packed (B == 1).
        chunk_size: a multiple of 16, or at most 16 (Triton: 16, 32 or 64, else 64).
        lower_bound: g >= lower_bound is guaranteed (K3's bounded gate); faster, same result.
        backend: None (Triton on CUDA, torch on CPU), "torch" or "triton".
        states_at: {sequence: [token offsets, multiples of chunk_size]} (torch path, inference):
            the states after those offsets as a third result {(sequence, offset): [H, K, V]}.
    Returns:
        (o [B, T, H, V] in v's dtype, final state or None[, states])
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1 or (
        chunk_size > 16 and chunk_size % 16
    ):
        _fail("chunk_size", f"must be <= 16 or a multiple of 16, got {chunk_size!r}")
    _check_lower_bound(lower_bound)
    path = _pick_backend(k, backend, {"k": k.shape[-1], "v": v.shape[-1]})
    # The dense diagonal sub-chunks are anchored mid-way, so e^(sub / 2 * |lb|) must stay far
    # inside fp32; the torch path's sub-chunk is min(chunk_size, 16), Triton's always 16.
    sub_chunk = 16 if path == "triton" else min(chunk_size, 16)
    if lower_bound is not None and lower_bound * sub_chunk < -80.0:
        lower_bound = None
    if _check_gate(g, lower_bound) < GATE_FLOOR:
        g = g.clamp_min(GATE_FLOOR)
    if states_at is not None and path == "triton":
        _fail("states_at", "is served by the torch path only (the Triton kernel keeps no chunk states)")
    if k.shape[1] == 0 and states_at:
        _fail("states_at", "asks for states of a batch without tokens")
    if k.shape[1] == 0:  # no tokens: nothing to compute, the state passes through
        o = v.new_zeros(v.shape)
        if not output_final_state:
            return o, None
        N = k.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        final = (initial_state.float().clone() if initial_state is not None
                 else torch.zeros(N, k.shape[2], k.shape[3], v.shape[-1], device=k.device))
        return o, final
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(k.device)
    scale = k.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size, lower_bound)
    if path == "triton":
        from .triton import chunk_kda_triton

        return chunk_kda_triton(*args)
    if states_at is not None:
        return chunk_kda_torch(*args, states_at=states_at)
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
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool),
                    ("slot_idx", slot_idx)):
        if not isinstance(x, torch.Tensor):
            _fail(name, f"must be a tensor, got {type(x).__name__}")
    if k.dim() != 3:
        _fail("k", f"must be [N, H, K], got shape {tuple(k.shape)}")
    N, H, K = k.shape
    for name, x in (("q", q), ("g", g)):
        if x.shape != k.shape:
            _fail(name, f"shape {tuple(x.shape)} != k shape {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[:2] != (N, H):
        _fail("v", f"must be [N, H, V] = [{N}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (N, H):
        _fail("beta", f"must be [N, H] = [{N}, {H}], got {tuple(beta.shape)}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not x.is_floating_point():
            _fail(name, f"must be floating point, got {x.dtype}")
    if H < 1 or K < 1 or v.shape[-1] < 1:
        _fail("k" if H < 1 or K < 1 else "v", f"needs H, K, V >= 1, got H={H}, K={K}, V={v.shape[-1]}")
    if g.numel() and not bool((g <= 0).all()):  # also catches NaN
        _fail("g", f"must be a log-decay <= 0 everywhere, got max {float(g.max())}")
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, v.shape[-1]):
        _fail("state_pool", f"must be [P, {H}, {K}, {v.shape[-1]}], got {tuple(state_pool.shape)}")
    if state_pool.dtype != torch.float32:
        _fail("state_pool", f"must be float32 (recurrent state stays fp32), got {state_pool.dtype}")
    if slot_idx.shape != (N,) or slot_idx.dtype not in (torch.int32, torch.int64):
        _fail("slot_idx", f"must be an integer tensor of shape [{N}], got {tuple(slot_idx.shape)} {slot_idx.dtype}")
    for name, x in (("q", q), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool), ("slot_idx", slot_idx)):
        if x.device != k.device:
            _fail(name, f"is on {x.device} but k is on {k.device}")
    if N:
        lo, hi = (int(x) for x in torch.aminmax(slot_idx))
        if lo < 0 or hi >= state_pool.shape[0]:
            _fail("slot_idx", f"out of range [0, {state_pool.shape[0]}): min {lo}, max {hi}")
        if torch.unique(slot_idx).numel() != N:
            _fail("slot_idx", "has duplicate slots; each sequence needs its own")
    scale = K**-0.5 if scale is None else float(scale)
    if _pick_backend(k, backend, {"k": K, "v": v.shape[-1]}) == "triton":
        if not state_pool.is_contiguous():
            _fail("state_pool", "must be contiguous for the Triton kernel (it is updated in place)")
        from .triton import kda_step_triton

        return kda_step_triton(q, k, v, g, beta, state_pool, slot_idx, scale)
    return kda_step_torch(q, k, v, g, beta, state_pool, slot_idx.long(), scale=scale)
