"""What every KDA path promises and refuses: the result type and the checks of the public functions.

Each check raises the ops' one ValueError form, "kda: <argument> <what is wrong>".
"""
from __future__ import annotations

import math
from numbers import Integral
from typing import NamedTuple, NoReturn

import torch

from ..dispatch import eager, fail


class KDAOutput(NamedTuple):
    """What `chunk_kda` (every backend) and the references return.

    o: [B, T, H, V] in v's dtype.
    final_state: [N, H, K, V] fp32 when output_final_state was asked for, else None.
    states: {(sequence, offset): [H, K, V] fp32}, the state after `offset` tokens of each
        sequence named in states_at (empty without it).
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    states: dict[tuple[int, int], torch.Tensor]


def kda_fail(name: str, msg: str) -> NoReturn:
    fail("kda", name, msg)


def _check_tensors(named: tuple[tuple[str, object], ...], device: torch.device) -> None:
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            kda_fail(name, f"must be a tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            kda_fail(name, f"must be floating point, got {x.dtype}")
        if x.device != device:
            kda_fail(name, f"is on {x.device} but k is on {device}")


def check_kda_inputs(q, k, v, g, beta, initial_state=None, cu_seqlens=None) -> int:
    """Validate the chunk/recurrent contract; return the number of sequences N."""
    if not isinstance(k, torch.Tensor):
        kda_fail("k", f"must be a tensor, got {type(k).__name__}")
    _check_tensors((("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)), k.device)
    if k.dim() != 4:
        kda_fail("k", f"must be [B, T, H, K], got shape {tuple(k.shape)}")
    B, T, H, K = k.shape
    if H < 1 or K < 1:
        kda_fail("k", f"needs at least one head and a head dim >= 1, got H={H}, K={K}")
    if v.dim() == 4 and v.shape[-1] < 1:
        kda_fail("v", f"needs a value head dim >= 1, got V={v.shape[-1]}")
    if q.shape != k.shape:
        kda_fail("q", f"shape {tuple(q.shape)} != k shape {tuple(k.shape)}")
    if g.shape != k.shape:
        kda_fail("g", f"shape {tuple(g.shape)} != k shape {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        kda_fail("v", f"must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        kda_fail("beta", f"must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    N = B if cu_seqlens is None else _check_cu_seqlens(cu_seqlens, B, T)
    if initial_state is not None:
        want = (N, H, K, v.shape[-1])
        if not isinstance(initial_state, torch.Tensor) or not initial_state.is_floating_point():
            kda_fail("initial_state", "must be a floating-point tensor")
        if tuple(initial_state.shape) != want:
            kda_fail("initial_state", f"must be [N, H, K, V] = {list(want)}, got {tuple(initial_state.shape)}")
        if initial_state.device != k.device:
            kda_fail("initial_state", f"is on {initial_state.device} but k is on {k.device}")
    return N


def _check_cu_seqlens(cu_seqlens, B: int, T: int) -> int:
    if not isinstance(cu_seqlens, torch.Tensor):
        kda_fail("cu_seqlens", f"must be a tensor, got {type(cu_seqlens).__name__}")
    if B != 1:
        kda_fail("q", f"batch must be 1 when cu_seqlens is given (packed), got B={B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        kda_fail("cu_seqlens",
                 f"must be a 1-D integer tensor [N + 1], got {tuple(cu_seqlens.shape)} {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        kda_fail("cu_seqlens", f"must rise from 0 to T={T}, got {cu[:8]}{'...' if len(cu) > 8 else ''}")
    return len(cu) - 1


# The largest chunk a path is asked to cut. The Triton kernels run 16, 32 or 64 (64 for any
# larger size); the torch path pads every chunk to chunk_size tokens and builds [H, C, C] tiles of
# it, so a size far past the sequence only costs (2**20 for 5 tokens asked for 17 TB).
MAX_CHUNK_SIZE = 256


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or not 1 <= chunk_size <= MAX_CHUNK_SIZE or (
        chunk_size > 16 and chunk_size % 16
    ):
        kda_fail("chunk_size", f"must be <= 16 or a multiple of 16, at most {MAX_CHUNK_SIZE}, got {chunk_size!r}")


def check_lower_bound(lower_bound) -> None:
    if lower_bound is not None and (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                                    or not math.isfinite(lower_bound) or lower_bound >= 0):
        kda_fail("lower_bound", f"must be None or a finite number < 0, got {lower_bound!r}")


def check_gate(g: torch.Tensor, lower_bound: float | None) -> float:
    """g is a log-decay: <= 0, and >= lower_bound when one is promised (the fast diagonal blocks
    rely on it; a broken promise would overflow instead of failing). Returns min(g)."""
    if g.numel() == 0:
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(g.detach()))
    if not (hi <= 0.0) or math.isnan(lo):  # also catches NaN
        kda_fail("g", f"must be a log-decay <= 0 everywhere, got max {hi}")
    if lower_bound is not None and lo < lower_bound:
        kda_fail("g", f"has values below lower_bound={lower_bound} (min {lo}); "
                      "pass lower_bound=None for an unbounded gate")
    return lo


def check_states_at(states_at, lengths: list[int], tensors: tuple) -> dict[int, list[int]]:
    """{sequence: sorted distinct offsets}, each sequence in [0, N) and each offset in (0, its
    length]; inference only (the states carry no gradient)."""
    if states_at is None:
        return {}
    if not isinstance(states_at, dict):
        kda_fail("states_at", f"must be a dict {{sequence: [token offsets]}}, got {type(states_at).__name__}")
    out = {}
    for i, offsets in states_at.items():
        if not _is_int(i) or not 0 <= i < len(lengths):
            kda_fail("states_at", f"sequence {i!r} out of range [0, {len(lengths)})")
        if not isinstance(offsets, (list, tuple)):
            kda_fail("states_at", f"offsets of sequence {i} must be a list, got {type(offsets).__name__}")
        for off in offsets:
            if not _is_int(off) or not 0 < off <= lengths[i]:
                kda_fail("states_at", f"offset {off!r} of sequence {i} must be an integer in (0, {lengths[i]}]")
        if offsets:
            out[int(i)] = sorted({int(off) for off in offsets})
    if out and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors):
        kda_fail("states_at", "is for inference: call under torch.no_grad() or with inputs that need no grad")
    return out


def _is_int(x) -> bool:
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_step_inputs(q, k, v, g, beta, state_pool, slot_idx) -> None:
    """The contract of `kda_step` (shapes, dtypes, devices, slots)."""
    named = (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool), ("slot_idx", slot_idx))
    for name, x in named:
        if not isinstance(x, torch.Tensor):
            kda_fail(name, f"must be a tensor, got {type(x).__name__}")
    if k.dim() != 3:
        kda_fail("k", f"must be [N, H, K], got shape {tuple(k.shape)}")
    N, H, K = k.shape
    for name, x in (("q", q), ("g", g)):
        if x.shape != k.shape:
            kda_fail(name, f"shape {tuple(x.shape)} != k shape {tuple(k.shape)}")
    if v.dim() != 3 or v.shape[:2] != (N, H):
        kda_fail("v", f"must be [N, H, V] = [{N}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (N, H):
        kda_fail("beta", f"must be [N, H] = [{N}, {H}], got {tuple(beta.shape)}")
    _check_tensors(named[:5], k.device)
    if H < 1 or K < 1 or v.shape[-1] < 1:
        kda_fail("k" if H < 1 or K < 1 else "v", f"needs H, K, V >= 1, got H={H}, K={K}, V={v.shape[-1]}")
    if eager() and g.numel() and not bool((g <= 0).all()):  # also catches NaN
        kda_fail("g", f"must be a log-decay <= 0 everywhere, got max {float(g.max())}")
    _check_pool(state_pool, slot_idx, N, (H, K, v.shape[-1]), k.device)


def _check_pool(state_pool, slot_idx, N: int, hkv: tuple[int, int, int], device) -> None:
    if state_pool.dim() != 4 or state_pool.shape[1:] != hkv:
        kda_fail("state_pool", f"must be [P, {hkv[0]}, {hkv[1]}, {hkv[2]}], got {tuple(state_pool.shape)}")
    if state_pool.dtype != torch.float32:
        kda_fail("state_pool", f"must be float32 (recurrent state stays fp32), got {state_pool.dtype}")
    if slot_idx.shape != (N,) or slot_idx.dtype not in (torch.int32, torch.int64):
        kda_fail("slot_idx", f"must be an integer tensor of shape [{N}], got {tuple(slot_idx.shape)} {slot_idx.dtype}")
    for name, x in (("state_pool", state_pool), ("slot_idx", slot_idx)):
        if x.device != device:
            kda_fail(name, f"is on {x.device} but k is on {device}")
    if N and eager():
        lo, hi = (int(x) for x in torch.aminmax(slot_idx))
        if lo < 0 or hi >= state_pool.shape[0]:
            kda_fail("slot_idx", f"out of range [0, {state_pool.shape[0]}): min {lo}, max {hi}")
        if torch.unique(slot_idx).numel() != N:
            kda_fail("slot_idx", "has duplicate slots; each sequence needs its own")
