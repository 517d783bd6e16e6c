"""Chunkwise Kimi Delta Attention in plain torch, forward and hand-written backward: the CPU path.

The chunk form (the WY/UT transform) is the one `naive_chunk_kda` in reference.py spells out:
everything but the chunk-to-chunk state hand-off runs in parallel over chunks. Its pairwise decays
are dense matmuls over sub-chunks (cpu_blocks.py), and the chunks are the ChunkTable's (chunks.py),
so a sequence cut at an asked-for offset has a shorter chunk there and nothing else changes.

Work goes one tile of chunks at a time (TILE_CHUNK_HEADS), so every intra-chunk tensor stays in
cache and nothing [T, ...]-sized but the output is made. The backward is a custom
autograd.Function that walks the tiles in reverse: it recomputes a tile's intra-chunk tensors
from the inputs, carries dS across chunks (two matmuls per chunk) and writes the tile's input
gradients; the only thing saved from the forward is the state entering each chunk.

Packed variable-length batches: every chunk sits in a slot of C tokens (a short one padded with
tokens that leave the state unchanged: k = v = q = 0, g = 0, beta = 0). Sequences are sorted by
chunk count, so at chunk position c the sequences still running are a prefix of the sorted order
and the state hand-off is a slice, not a gather.
"""
from __future__ import annotations

import weakref

import torch

from .chunks import ChunkTable
from .contract import KDAOutput
from .cpu_blocks import SUB_CHUNK, diagonal_span, pair_products, pair_products_backward, unit_lower_inverse

# Chunks x heads per tile: 512 KB per [m, H, 64, 64] fp32 tensor, so a tile's working set stays in
# cache (measured best on a 2-core EPYC with 1 MB L2 per core).
TILE_CHUNK_HEADS = 32
# Decays are kept in base 2 (G2 = G log2 e): torch's exp2 is several times faster than exp on CPU.
LOG2E = 1.4426950408889634


class ChunkLayout:
    """The chunks of a ChunkTable in chunk-major, length-sorted order, and its tiles.

    order: sequences sorted by chunk count (descending); active[c]: sequences with a chunk at
    position c (a prefix of `order`); layout chunk m = ends[c] + r is the c-th chunk of order[r].
    in_idx [M, C]: flat token read by each chunk slot (0 for padding, which `pad` marks);
    out_idx [M, C]: where each slot is written (padding goes to the spare row, the token count).
    of_table [NT]: the layout chunk of each table chunk.
    tiles: ranges of chunk positions holding about TILE_CHUNK_HEADS chunks x heads each.
    rows: {(m0, m1): (start, stride)} for each tile whose chunks are whole and evenly spaced in
    the token stream (chunk m0 + i reads tokens start + i * stride onwards: one sequence's run of
    chunks, or the same chunk of sequences of one length), which loads and stores as a strided
    view instead of by index.
    """

    def __init__(self, table: ChunkTable, n_heads: int, device: torch.device) -> None:
        C = self.C = table.size
        first = table.first.tolist()
        n_chunks = [b - a for a, b in zip(first, first[1:])]
        self.order = sorted(range(len(n_chunks)), key=lambda i: -n_chunks[i])
        max_chunks = n_chunks[self.order[0]] if n_chunks else 0
        self.active = [sum(1 for i in self.order if n_chunks[i] > c) for c in range(max_chunks)]
        self.ends = [0]
        for a in self.active:
            self.ends.append(self.ends[-1] + a)
        self.n_chunks = self.ends[-1]
        pos = torch.cat([torch.arange(a) for a in self.active]) if self.active else torch.zeros(0, dtype=torch.long)
        c_of = torch.repeat_interleave(torch.arange(max_chunks), torch.tensor(self.active, dtype=torch.long))
        j = torch.tensor([first[i] for i in self.order], dtype=torch.long)[pos] + c_of  # table chunk of each
        bounds = table.bounds.cpu()[j]
        tok = bounds[:, :1] + torch.arange(C)  # [M, C]
        valid = tok < bounds[:, 1:]
        spare = int(table.bounds[-1, 1]) if table.num_chunks else 0
        self.in_idx = torch.where(valid, tok, 0).to(device)
        self.out_idx = torch.where(valid, tok, spare).to(device)
        self.pad = (~valid).to(device) if not bool(valid.all()) else None
        self.order_t = torch.tensor(self.order, dtype=torch.long, device=device)
        of_table = torch.empty(table.num_chunks, dtype=torch.long).index_copy_(0, j, torch.arange(j.numel()))
        self.of_table = of_table.tolist()
        self.tiles = self._tiles(max_chunks, max(1, TILE_CHUNK_HEADS // max(n_heads, 1)))
        self.rows = {}
        for c0, c1 in self.tiles:
            m0, m1 = self.ends[c0], self.ends[c1]
            if m1 > m0 and bool(valid[m0:m1].all()):
                start = int(tok[m0, 0])
                stride = int(tok[m0 + 1, 0]) - start if m1 - m0 > 1 else C
                even = start + stride * torch.arange(m1 - m0)[:, None] + torch.arange(C)
                if stride >= C and torch.equal(tok[m0:m1], even):
                    self.rows[m0, m1] = (start, stride)

    def _tiles(self, max_chunks: int, per_tile: int) -> list[tuple[int, int]]:
        tiles, c0 = [], 0
        for c in range(max_chunks):
            if c > c0 and self.ends[c + 1] - self.ends[c0] > per_tile:
                tiles.append((c0, c))
                c0 = c
        if max_chunks:
            tiles.append((c0, max_chunks))
        return tiles

    def pad_of(self, m0: int, m1: int) -> torch.Tensor | None:
        return None if self.pad is None else self.pad[m0:m1]


class _Tile:
    """Everything intra-chunk for a tile of chunks: inputs in the chunk layout (q scaled) and the
    quantities the state pass needs. Recomputed in backward instead of stored.

    bounded, span: how the pair products anchor their diagonal blocks (`diagonal_span`: the whole
    chunk as one block where its decays allow, else the sub-chunks where the gate's lower bound or
    the tile's decays allow, else the exact pairwise blocks; the backward's recompute decides the
    same)."""

    FORWARD = ("u", "w", "Aqk", "qg", "k_end", "decay_last")  # all the forward's state pass needs

    def __init__(self, q, k, v, g, beta, bounded: bool, keep: bool = True) -> None:
        # q, k, g: [m, H, C, K]; v: [m, H, C, V]; beta: [m, H, C]
        self.q, self.k, self.v, self.beta = q, k, v, beta
        self.G = G = g.cumsum_(-2).mul_(LOG2E)  # base-2 cumulative decay (g is a private tile copy)
        span = diagonal_span(G[..., None, :], bounded)
        self.bounded, self.span = span is not None, span or SUB_CHUNK
        self.eG = G.exp2()
        self.kb = k * beta[..., None]
        self.X = torch.stack([q, self.kb], dim=-2)  # [m, H, C, 2, K]: Aqk and A share the k side
        P = pair_products(self.X, k[..., None, :], G[..., None, :], self.bounded, self.span)  # [m, H, C, 2, C]
        self.Aqk = P[..., 0, :].contiguous()
        self.T = unit_lower_inverse(P[..., 1, :])
        self.u = self.T @ (v * beta[..., None])
        self.kg = self.kb * self.eG
        self.w = self.T @ self.kg
        G_last = G[..., -1:, :]
        self.e_end = (G_last - G).exp2_()
        self.k_end = k * self.e_end
        self.decay_last = G_last.transpose(-1, -2).exp2()  # [m, H, K, 1]
        self.qg = q * self.eG
        if not keep:  # forward only: drop the rest now, the tile's peak memory is what it keeps
            self.__dict__ = {name: getattr(self, name) for name in self.FORWARD}


def _spaced(x: torch.Tensor, rows: tuple[int, int], m: int, C: int) -> torch.Tensor:
    """x [BT, H, *] seen as [m, C, H, *]: chunk i the C rows from start + i * stride."""
    start, stride = rows
    return x.as_strided((m, C, *x.shape[1:]), (stride * x.stride(0), *x.stride()), x.storage_offset() + start * x.stride(0))


def _load(flat: torch.Tensor, idx: torch.Tensor, pad: torch.Tensor | None, m: int, C: int,
          rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Rows idx of flat [BT, H, *] -> a private fp32 tile [m, H, C, *] (padding zeroed); evenly
    spaced whole chunks (`rows`, ChunkLayout.rows) are read in place, not gathered first."""
    src = (_spaced(flat, rows, m, C) if rows is not None else flat.index_select(0, idx).view(m, C, *flat.shape[1:]))
    src = src.transpose(1, 2)
    tile = torch.empty(src.shape, dtype=torch.float32, device=flat.device)
    tile.copy_(src)
    if pad is not None:
        tile.masked_fill_(pad.view(m, 1, C, *([1] * (tile.dim() - 3))), 0.0)
    return tile


def _store(out: torch.Tensor, idx: torch.Tensor, tile: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
    """A tile [m, H, C, *] back to rows idx of out [BT + 1, H, *] (padding goes to the last row);
    evenly spaced whole chunks (`rows`) written in place."""
    if rows is not None:
        _spaced(out, rows, tile.shape[0], tile.shape[2]).copy_(tile.transpose(1, 2))
    else:
        out.index_copy_(0, idx, tile.transpose(1, 2).reshape(-1, *out.shape[1:]))



def _forward(q, k, v, g, beta, h0, lay: ChunkLayout, scale: float, bounded: bool, save: bool,
             want: frozenset[int] = frozenset()):
    """The forward pass (see _ChunkKDA). With save, returns the state entering every chunk
    [M, H, K, V] for the backward; without, keeps one tile's worth at a time. `want`: layout
    chunk indices whose entering state is also returned ({m: [H, K, V]}, copies)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    flat = [x.reshape(B * T, H, x.shape[3] if x.dim() == 4 else 1) for x in (q, k, v, g, beta)]
    o = torch.empty(B * T + 1, H, V, dtype=torch.float32, device=k.device)
    S0_all = k.new_empty(lay.n_chunks, H, K, V, dtype=torch.float32) if save else None
    S = h0
    finished = []
    kept: dict[int, torch.Tensor] = {}
    for c0, c1 in lay.tiles:
        m0, m1 = lay.ends[c0], lay.ends[c1]
        # S0 holds the states entering this tile's chunks, indexed from m0.
        S0 = S0_all[m0:m1] if save else k.new_empty(m1 - m0, H, K, V, dtype=torch.float32)
        t = _load_tile(flat, lay, m0, m1, scale, bounded, keep=False)
        delta = torch.empty_like(t.u)
        for c in range(c0, c1):
            a = lay.active[c]
            if a < S.shape[0]:
                finished.append(S[a:])
                S = S[:a]
            e0, e1 = lay.ends[c] - m0, lay.ends[c + 1] - m0
            if S.data_ptr() != S0[e0:e1].data_ptr():
                S0[e0:e1] = S
            d = delta[e0:e1].flatten(0, 1)
            torch.baddbmm(t.u[e0:e1].flatten(0, 1), t.w[e0:e1].flatten(0, 1), S.flatten(0, 1), alpha=-1.0, out=d)
            # Write the next state straight into its S0 slot when the same sequences continue.
            same = c + 1 < c1 and lay.active[c + 1] == a
            nxt = S0[e1:e1 + a] if same else torch.empty_like(S)
            torch.baddbmm(
                (t.decay_last[e0:e1] * S).flatten(0, 1), t.k_end[e0:e1].flatten(0, 1).transpose(1, 2), d,
                out=nxt.flatten(0, 1),
            )
            S = nxt
        kept.update((m, S0[m - m0].clone()) for m in want if m0 <= m < m1)
        o_t = torch.baddbmm((t.Aqk @ delta).flatten(0, 1), t.qg.flatten(0, 1), S0.flatten(0, 1))
        _store(o, lay.out_idx[m0:m1].flatten(), o_t.view(m1 - m0, H, -1, V), lay.rows.get((m0, m1)))
        del t, delta, o_t
    finished.append(S)
    final = torch.cat(finished[::-1])
    return o[: B * T].view(B, T, H, V), final, S0_all, kept


class _ChunkKDA(torch.autograd.Function):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; h0: [N, H, K, V] fp32 sorted like the
    layout. Returns o [B, T, H, V] fp32 and the final states [N, H, K, V] in the sorted order.

    Works one tile of chunks at a time so the intra-chunk tensors stay in cache; saves only the
    state entering each chunk ([M, H, K, V]) for the backward, which recomputes the rest.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, lay, scale, bounded):
        o, final, S0, _ = _forward(q, k, v, g, beta, h0, lay, scale, bounded, save=True)
        ctx.save_for_backward(q, k, v, g, beta, S0)
        ctx.lay, ctx.scale, ctx.bounded = lay, scale, bounded
        return o, final

    @staticmethod
    # the hand-written backward works in place: torch cannot differentiate it again
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, S0 = ctx.saved_tensors
        lay, scale, bounded = ctx.lay, ctx.scale, ctx.bounded
        B, T, H, K = k.shape
        V = v.shape[-1]
        flat = [x.reshape(B * T, H, x.shape[3] if x.dim() == 4 else 1) for x in (q, k, v, g, beta)]
        do_flat = do.reshape(B * T, H, V)
        grads = [torch.empty(B * T + 1, H, x.shape[-1], dtype=torch.float32, device=k.device) for x in flat]
        carry = _Carry(dfinal)
        for c0, c1 in reversed(lay.tiles):
            m0, m1 = lay.ends[c0], lay.ends[c1]
            t = _load_tile(flat, lay, m0, m1, scale, bounded)
            rows = lay.rows.get((m0, m1))
            dO = _load(do_flat, lay.in_idx[m0:m1].flatten(), lay.pad_of(m0, m1), m1 - m0, lay.C, rows)
            S0_t = S0[m0:m1]
            delta = torch.baddbmm(t.u.flatten(0, 1), t.w.flatten(0, 1), S0_t.flatten(0, 1), alpha=-1.0).view_as(dO)
            dS1, ddelta = carry.through_tile(t, dO, lay, c0, c1)
            idx = lay.out_idx[m0:m1].flatten()
            for out, tile in zip(grads, _tile_grads(t, dO, S0_t, delta, dS1, ddelta, scale)):
                _store(out, idx, tile, rows)
        dh0 = carry.entering()
        out = [gr[: B * T].view(x.shape).to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta))]
        return (*out, dh0, None, None, None)


class _Carry:
    """The backward's dS, the gradient of the state entering the next chunk position, over the
    sequences still running; a sequence's final-state gradient joins at its last chunk."""

    def __init__(self, dfinal: torch.Tensor) -> None:
        self.dfinal, self.dS, self.joined = dfinal, dfinal[:0], 0

    def through_tile(self, t: "_Tile", dO: torch.Tensor, lay: ChunkLayout, c0: int, c1: int):
        """The tile's chunk positions in reverse: the gradient of the state leaving each chunk
        (dS1 [m, H, K, V]) and of each chunk's delta (ddelta [m, H, C, V])."""
        m0 = lay.ends[c0]
        H, K, V = self.dfinal.shape[1:]
        dd0 = t.Aqk.transpose(-1, -2) @ dO  # [m, H, C, V]
        qg_do = t.qg.transpose(-1, -2) @ dO  # [m, H, K, V]
        dS1 = dO.new_empty(dO.shape[0], H, K, V)
        ddelta = torch.empty_like(dd0)
        dS = self.dS
        for c in range(c1 - 1, c0 - 1, -1):
            a = lay.active[c]
            if a > self.joined:  # sequences whose last chunk is c
                dS = torch.cat([dS, self.dfinal[self.joined:a]])
                self.joined = a
            sl = slice(lay.ends[c] - m0, lay.ends[c + 1] - m0)
            dS1[sl] = dS
            dd = torch.baddbmm(dd0[sl].flatten(0, 1), t.k_end[sl].flatten(0, 1), dS.flatten(0, 1))
            ddelta[sl] = dd.view(a, H, -1, V)
            dS = torch.baddbmm(
                (t.decay_last[sl] * dS + qg_do[sl]).flatten(0, 1), t.w[sl].flatten(0, 1).transpose(1, 2), dd,
                alpha=-1.0,
            ).view(a, H, K, V)
        self.dS = dS
        return dS1, ddelta

    def entering(self) -> torch.Tensor:
        """dh0 in the sorted order, once every tile is through (sequences without chunks included)."""
        return torch.cat([self.dS, self.dfinal[self.joined:]])


def _tile_grads(t: "_Tile", dO, S0_t, delta, dS1, ddelta, scale: float):
    """One tile's input gradients (dq, dk, dv, dg, dbeta as [m, H, C, *] tiles), given the state
    entering each chunk (S0_t), its delta, and the gradients of the leaving state and of delta."""
    m, H, C = delta.shape[:3]
    S0T = S0_t.transpose(-1, -2)
    dqg = dO @ S0T  # [m, H, C, K]
    dAqk = (dO @ delta.transpose(-1, -2)).tril_()
    dw = -(ddelta @ S0T)
    dk_end = delta @ dS1.transpose(-1, -2)
    dG_last = t.decay_last.squeeze(-1) * (S0_t * dS1).sum(-1)  # [m, H, K]
    TT = t.T.transpose(-1, -2)
    dbv, dkg = TT @ ddelta, TT @ dw
    dA = torch.baddbmm(
        (dbv @ t.u.transpose(-1, -2)).flatten(0, 1), dkg.flatten(0, 1), t.w.flatten(0, 1).transpose(1, 2)
    ).view(m, H, C, C).tril_(-1).neg_()
    dX, dY = pair_products_backward(
        torch.stack([dAqk, dA], dim=-2), t.X, t.k[..., None, :], t.G[..., None, :], t.bounded, t.span
    )
    dY = dY[..., 0, :]
    dkb = dX[..., 1, :] + dkg * t.eG
    dk_end_k = dk_end * t.k_end
    dG = dqg * t.qg + dkg * t.kg + (t.X * dX).sum(-2) - t.k * dY - dk_end_k
    dG[..., -1, :] += dk_end_k.sum(-2) + dG_last
    return ((dqg * t.eG + dX[..., 0, :]).mul_(scale), dk_end * t.e_end + dY + dkb * t.beta[..., None],
            dbv * t.beta[..., None], dG.flip(-2).cumsum(-2).flip(-2),
            ((dkb * t.k).sum(-1) + (dbv * t.v).sum(-1))[..., None])


def _load_tile(flat, lay: ChunkLayout, m0: int, m1: int, scale: float, bounded: bool, keep: bool = True) -> _Tile:
    idx, pad = lay.in_idx[m0:m1].flatten(), lay.pad_of(m0, m1)
    rows = lay.rows.get((m0, m1))
    q, k, v, g, beta = (_load(x, idx, pad, m1 - m0, lay.C, rows) for x in flat)
    return _Tile(q.mul_(scale), k, v, g, beta[..., 0], bounded, keep)


# The last call's chunking (key, table, layout): a model's KDA layers all chunk the same batch.
_last_chunking: tuple | None = None


def _chunking(cu_seqlens, B: int, T: int, H: int, chunk_size: int, states_at, device) -> tuple[ChunkTable, ChunkLayout]:
    """The ChunkTable and ChunkLayout of a call, shared with the previous call when it chunked the
    same batch: the same cu_seqlens tensor, unchanged since (a weak reference and its version
    counter), or the same [B, T] without one; the same chunk size, offsets, heads and device."""
    global _last_chunking
    cuts = tuple((i, tuple(offs)) for i, offs in sorted(states_at.items())) if states_at else ()
    batch = (B, T) if cu_seqlens is None else (cu_seqlens._version,)
    key = (*batch, H, chunk_size, cuts, device)
    last = _last_chunking
    if last is not None and last[1] == key and (cu_seqlens is None or last[0]() is cu_seqlens):
        return last[2], last[3]
    cu = torch.arange(0, (B + 1) * T, T, device=device) if cu_seqlens is None else cu_seqlens
    table = ChunkTable(cu, chunk_size, states_at)
    lay = ChunkLayout(table, H, device)
    _last_chunking = ((lambda: None) if cu_seqlens is None else weakref.ref(cu_seqlens), key, table, lay)
    return table, lay


def chunk_kda_torch(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
                    chunk_size: int, lower_bound: float | None, states_at: dict[int, list[int]]) -> KDAOutput:
    """Chunkwise KDA, differentiable; the contract of `k3.kernels.kda.chunk_kda` (inputs checked).

    chunk_size: tokens per chunk (a multiple of 16, or <= 16).
    lower_bound: a promise that g >= lower_bound everywhere (K3's bounded gate, -5); enables the
        dense diagonal sub-chunks. None is always correct.
    states_at: checked {sequence: [offsets]} (inference only): the states there are read where the
        pass crosses them, the sequences cut at those offsets (a prefix cache's snapshots cost no
        extra pass).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    table, lay = _chunking(cu_seqlens, B, T, H, chunk_size, states_at, k.device)
    N = table.num_seqs
    h0 = k.new_zeros(N, H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float()
    h0 = h0[lay.order_t] if N else h0
    bounded = lower_bound is not None
    kept: dict[int, torch.Tensor] = {}
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        o, final_sorted = _ChunkKDA.apply(q, k, v, g, beta, h0, lay, scale, bounded)
    else:  # inference: no per-chunk states kept for a backward
        want = frozenset(lay.of_table[j] for j in table.state_chunk.values() if j >= 0)
        o, final_sorted, _, kept = _forward(q, k, v, g, beta, h0, lay, scale, bounded, save=False, want=want)
    final = None
    if output_final_state or table.state_chunk:
        final = torch.empty_like(final_sorted)
        final[lay.order_t] = final_sorted
    states = {key: kept[lay.of_table[j]] if j >= 0 else final[key[0]].clone() for key, j in table.state_chunk.items()}
    return KDAOutput(o.to(v.dtype), final if output_final_state else None, states)


def kda_step_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_idx: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Batched decode step over pool slots (see `naive_kda_step`); one gather, one scatter."""
    K = k.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = state_pool.index_select(0, slot_idx)  # [N, H, K, V] fp32
    S = S * g.float().exp()[..., None]
    kf = k.float()
    memory = torch.einsum("nhk,nhkv->nhv", kf, S)
    delta = beta.float()[..., None] * (v.float() - memory)
    S = S + kf[..., None] * delta[..., None, :]
    o = torch.einsum("nhk,nhkv->nhv", q.float() * scale, S)
    state_pool.index_copy_(0, slot_idx, S)
    return o.to(v.dtype)
