"""KDA's chunked Triton path: the autograd.Function over the forward (triton_fwd.py) and the
backward (triton_bwd.py) kernels, and `chunk_kda_triton`, the contract of `chunk_kda`.

Every batch runs packed ([1, T_total] with cu_seqlens) over a ChunkTable (chunks.py); the states
asked for by states_at are read where the forward's state kernel crosses them.
"""
from __future__ import annotations

import torch

from .chunks import ChunkTable
from .contract import KDAOutput
from .triton_bwd import chunk_bwd
from .triton_fwd import chunk_fwd


class _ChunkKDATriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, table, scale, bounded, want_final, snap):
        o, ht, saved = chunk_fwd(q, k, v, g, beta, scale, h0, table, bounded, want_final, snap)
        ctx.save_for_backward(q, k, v, g, beta, h0, *saved)
        ctx.table, ctx.scale, ctx.bounded = table, scale, bounded
        return o, ht

    @staticmethod
    # Triton kernels: nothing of the backward is recorded for a second one
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, *saved = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = chunk_bwd(
            q, k, v, g, beta, ctx.scale, h0, ctx.table, ctx.bounded, saved, do.contiguous(),
            None if dht is None else dht.contiguous())
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, None, None


def chunk_kda_triton(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
                     chunk_size: int, lower_bound: float | None, states_at: dict[int, list[int]]) -> KDAOutput:
    """Triton chunked KDA; the contract of `k3.kernels.kda.chunk_kda` (inputs checked, tokens > 0).

    chunk_size: 16, 32 or 64 tokens per chunk (other sizes run with 64; the result is the same).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    BT = chunk_size if chunk_size in (16, 32, 64) else 64
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (B + 1) * T, T, device=k.device)
    table = ChunkTable(cu_seqlens, BT, states_at)
    flat = [x.reshape(B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)]
    h0 = None if initial_state is None else initial_state.float().contiguous()
    inner = [key for key, j in table.state_chunk.items() if j >= 0]  # the rest are final states
    snap = None
    if inner:
        h_idx = torch.full((table.num_chunks,), -1, dtype=torch.int32, device=k.device)
        at = torch.tensor([table.state_chunk[key] for key in inner], device=k.device)
        h_idx[at] = torch.arange(len(inner), dtype=torch.int32, device=k.device)
        snap = (h_idx, torch.empty(len(inner), H, K, V, dtype=torch.float32, device=k.device))
    want_final = output_final_state or len(inner) < len(table.state_chunk)
    o, ht = _ChunkKDATriton.apply(*flat, h0, table, scale, lower_bound is not None, want_final, snap)
    states = {key: snap[1][s] for s, key in enumerate(inner)}
    states.update((key, ht[key[0]].clone()) for key, j in table.state_chunk.items() if j < 0)
    return KDAOutput(o.view(B, T, H, V), ht if output_final_state else None, states)
