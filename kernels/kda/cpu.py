"""Chunkwise Kimi Delta Attention in plain torch, forward and hand-written backward: the CPU path.

Within a chunk of C tokens, write G_i for the cumulative log-decay up to token i (per key
channel, relative to the chunk start) and delta_j = beta_j (v_j - k_j^T D_j S_{j-1}) for the
"new value" written at token j. Unrolling the recurrence gives

    (I + A) delta = beta v - (beta k e^G) S_0,     A_ij = beta_i sum_c k_ic k_jc e^(G_ic - G_jc), j < i
    o_i   = (q_i e^(G_i)) S_0 + sum_(j <= i) [sum_c q_ic k_jc e^(G_ic - G_jc)] delta_j
    S_C   = diag(e^(G_C)) S_0 + sum_j (k_j e^(G_C - G_j)) delta_j^T

so everything but the chunk-to-chunk state hand-off runs in parallel over chunks (the WY/UT
form: delta = u - w S_0 with [u | w] = (I + A)^-1 [beta v | beta k e^G]).

The pairwise decays e^(G_i - G_j) are where naive implementations pay: a [C, C, K] tensor per
chunk. Here they are dense matmuls over 16-token sub-chunks (`pair_products`). Between two
sub-chunks the factorisation is anchored at the boundary between them, so both factors are <= 1
for any gate. On a diagonal sub-chunk the anchor is its middle token: exact and overflow-free
when the gate has a lower bound (K3's g > -5 keeps 8 tokens of decay above -40). Without a bound
(Kimi Linear's gate) a diagonal sub-chunk is split again into 4-token blocks the same way, and
only 4 x 4 diagonal blocks take the exact pairwise product.

Work goes one tile of chunks at a time (TILE_CHUNK_HEADS), so every intra-chunk tensor stays in
cache and nothing [T, ...]-sized but the output is made. The backward is a custom
autograd.Function that walks the tiles in reverse: it recomputes a tile's intra-chunk tensors
from the inputs, carries dS across chunks (two matmuls per chunk) and writes the tile's input
gradients; the only thing saved from the forward is the state entering each chunk. The gradient
of a pair product P_ij = sum_c a_ic b_jc e^(G_ic - G_jc) is da = dP (b e^-G) e^G,
db = dP^T (a e^G) e^-G, dG = a da - b db, computed with the same anchoring as the forward.

Packed variable-length batches: every sequence is cut into its own chunks (the last one padded
with tokens that leave the state unchanged: k = v = q = 0, g = 0, beta = 0). Sequences are
sorted by chunk count, so at chunk position c the sequences still running are a prefix of the
sorted order and the state hand-off is a slice, not a gather.
"""
from __future__ import annotations

import torch

SUB_CHUNK = 16
# Unbounded diagonal sub-chunks build [.., 16, 16, K] decays; do that this many elements at a time.
_PAIRWISE_ELEMENTS = 1 << 24
# Chunks x heads per tile: 512 KB per [m, H, 64, 64] fp32 tensor, so a tile's working set stays in
# cache (measured best on a 2-core EPYC with 1 MB L2 per core).
TILE_CHUNK_HEADS = 32
# Decays are kept in base 2 (G2 = G log2 e): torch's exp2 is several times faster than exp on CPU.
LOG2E = 1.4426950408889634


class ChunkLayout:
    """Chunk-major, length-sorted token layout of a (packed) batch, and its tiles.

    order: sequences sorted by chunk count (descending); active[c]: sequences with a chunk at
    position c (a prefix of `order`); chunk m = ends[c] + r is the c-th chunk of order[r].
    in_idx [M, C]: flat token read by each chunk slot (0 for padding, which `pad` marks);
    out_idx [M, C]: where each slot is written (padding goes to the spare row BT).
    tiles: ranges of chunk positions holding about TILE_CHUNK_HEADS chunks x heads each.
    """

    def __init__(self, lengths: list[int], chunk_size: int, n_heads: int, device: torch.device) -> None:
        C = self.C = chunk_size
        n_chunks = [(L + C - 1) // C for L in lengths]
        self.order = sorted(range(len(lengths)), key=lambda i: -n_chunks[i])
        starts = [0]
        for L in lengths:
            starts.append(starts[-1] + L)
        max_chunks = n_chunks[self.order[0]] if lengths else 0
        self.active = [sum(1 for i in self.order if n_chunks[i] > c) for c in range(max_chunks)]
        self.ends = [0]
        for a in self.active:
            self.ends.append(self.ends[-1] + a)
        self.n_chunks = self.ends[-1]
        first = torch.tensor([starts[i] for i in self.order], dtype=torch.long)
        length = torch.tensor([lengths[i] for i in self.order], dtype=torch.long)
        pos = torch.cat([torch.arange(a) for a in self.active]) if self.active else torch.zeros(0, dtype=torch.long)
        c_of = torch.repeat_interleave(torch.arange(max_chunks), torch.tensor(self.active, dtype=torch.long))
        tok = c_of[:, None] * C + torch.arange(C)  # [M, C] position inside the sequence
        valid = tok < length[pos][:, None]
        flat_tok = first[pos][:, None] + tok
        self.in_idx = torch.where(valid, flat_tok, 0).to(device)
        self.out_idx = torch.where(valid, flat_tok, starts[-1]).to(device)
        self.pad = (~valid).to(device) if not bool(valid.all()) else None
        self.order_t = torch.tensor(self.order, dtype=torch.long, device=device)
        per_tile = max(1, TILE_CHUNK_HEADS // max(n_heads, 1))
        self.tiles = []
        c0 = 0
        for c in range(max_chunks):
            if c > c0 and self.ends[c + 1] - self.ends[c0] > per_tile:
                self.tiles.append((c0, c))
                c0 = c
        if max_chunks:
            self.tiles.append((c0, max_chunks))

    def pad_of(self, m0: int, m1: int) -> torch.Tensor | None:
        return None if self.pad is None else self.pad[m0:m1]


def _sub_size(C: int, target: int) -> int:
    """The largest divisor of C that is <= target."""
    return max(d for d in range(1, min(C, target) + 1) if C % d == 0)


def _pairwise_decay(G: torch.Tensor) -> torch.Tensor:
    """[..., s, K] -> 2^(G_i - G_j) for j <= i, else 0: [..., s, s, K]."""
    diff = G[..., :, None, :] - G[..., None, :, :]
    s = G.shape[-2]
    keep = torch.ones(s, s, dtype=torch.bool, device=G.device).tril()
    return diff.masked_fill_(~keep[..., None], float("-inf")).exp2_()


def _row_slices(n_rows: int, per_row: int):
    step = max(1, _PAIRWISE_ELEMENTS // max(per_row, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def pair_products(X: torch.Tensor, Y: torch.Tensor, G: torch.Tensor, bounded: bool, sub: int = SUB_CHUNK) -> torch.Tensor:
    """P_ij = sum_c X_ic Y_jc 2^(G_ic - G_jc) for j <= i (0 above the diagonal).

    X: [..., C, P, K], P products (q and beta k) interleaved by token so each one matmul;
    Y, G: [..., C, 1, K]; G is the cumulative log2-decay, non-increasing in C. Returns [..., C, P, C].
    Diagonal blocks of an unbounded gate recurse with 4x smaller blocks down to 4 x 4 pairwise.
    """
    C, Pn = X.shape[-3], X.shape[-2]
    s = _sub_size(C, sub)
    n = C // s
    out = X.new_zeros(*X.shape[:-1], C)
    for ib in range(n - 1):
        e = (ib + 1) * s
        anchor = G[..., e - 1:e, :, :]
        y_t = Y[..., e - s:e, 0, :] * (anchor[..., 0, :] - G[..., e - s:e, 0, :]).exp2()  # [..., s, K]
        x_t = X[..., e:, :, :] * (G[..., e:, :, :] - anchor).exp2()  # [..., C - e, P, K]
        out[..., e:, :, e - s:e] = (x_t.flatten(-3, -2) @ y_t.transpose(-1, -2)).unflatten(-2, (C - e, Pn))
    Xr, Yr, Gr = (t.unflatten(-3, (n, s)) for t in (X, Y, G))  # [..., n, s, P|1, K]
    if bounded:
        mid = Gr[..., s // 2:s // 2 + 1, :, :]
        blk = (Xr * (Gr - mid).exp2()).flatten(-3, -2) @ (Yr * (mid - Gr).exp2())[..., 0, :].transpose(-1, -2)
        # where, not a 0/1 multiply: above the diagonal the products may overflow to inf (huge
        # q with the gate at its bound) and inf * 0 would be NaN
        keep = torch.ones(s, s, dtype=torch.bool, device=X.device).tril()[:, None, :]
        blk = torch.where(keep, blk.unflatten(-2, (s, Pn)), 0.0)
    elif s > 4:
        blk = pair_products(Xr, Yr, Gr, False, max(1, s // 4))
    else:
        blk = X.new_empty(*Xr.shape[:-1], s)
        for r in _row_slices(Xr.shape[0], Xr[0].numel() * s):
            E = _pairwise_decay(Gr[r][..., 0, :])  # [m, ..., n, s, s, K]
            blk[r] = torch.einsum("...ipk,...jk,...ijk->...ipj", Xr[r], Yr[r][..., 0, :], E)
    for i in range(n):
        out[..., i * s:(i + 1) * s, :, i * s:(i + 1) * s] = blk[..., i, :, :, :]
    return out


def pair_products_backward(
    dP: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, G: torch.Tensor, bounded: bool, sub: int = SUB_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of `pair_products` for a masked dP [..., C, P, C]: (dX [..., C, P, K], dY [..., C, 1, K]).

    With P_ij = sum_c X_ic Y_jc e_ijc: dX_i = sum_j dP_ij Y_j e_ij, dY_j = sum_i dP_ij X_i e_ij, and
    dG = sum_P X dX - Y dY (done by the caller); the same anchoring as the forward keeps it finite.
    """
    C, Pn = X.shape[-3], X.shape[-2]
    s = _sub_size(C, sub)
    n = C // s
    dX = torch.zeros_like(X)
    dY = torch.zeros_like(Y.expand(*X.shape[:-2], 1, X.shape[-1]))
    for ib in range(n - 1):
        e = (ib + 1) * s
        anchor = G[..., e - 1:e, :, :]
        f_y = (anchor[..., 0, :] - G[..., e - s:e, 0, :]).exp2()  # [..., s, K]
        f_x = (G[..., e:, :, :] - anchor).exp2()  # [..., C - e, 1, K]
        dp = dP[..., e:, :, e - s:e].flatten(-3, -2)  # [..., (C - e) P, s]
        dX[..., e:, :, :] += (dp @ (Y[..., e - s:e, 0, :] * f_y)).unflatten(-2, (C - e, Pn)) * f_x
        dY[..., e - s:e, 0, :] += (dp.transpose(-1, -2) @ (X[..., e:, :, :] * f_x).flatten(-3, -2)) * f_y
    Xr, Yr, Gr = (t.unflatten(-3, (n, s)) for t in (X, Y, G))
    dPd = torch.stack([dP[..., i * s:(i + 1) * s, :, i * s:(i + 1) * s] for i in range(n)], dim=-4)
    if bounded:
        mid = Gr[..., s // 2:s // 2 + 1, :, :]
        f_x, f_y = (Gr - mid).exp2(), (mid - Gr).exp2()[..., 0, :]  # [..., n, s, 1, K], [..., n, s, K]
        dpd = dPd.flatten(-3, -2)  # [..., n, s P, s]
        dXd = (dpd @ (Yr[..., 0, :] * f_y)).unflatten(-2, (s, Pn)) * f_x
        dYd = ((dpd.transpose(-1, -2) @ (Xr * f_x).flatten(-3, -2)) * f_y)[..., None, :]
    elif s > 4:
        dXd, dYd = pair_products_backward(dPd, Xr, Yr, Gr, False, max(1, s // 4))
    else:
        dXd = torch.empty_like(Xr)
        dYd = torch.empty_like(Yr.expand(*Xr.shape[:-2], 1, Xr.shape[-1]))
        for r in _row_slices(Xr.shape[0], Xr[0].numel() * s):
            E = _pairwise_decay(Gr[r][..., 0, :])  # [m, ..., n, s, s, K]
            dXd[r] = torch.einsum("...ipj,...jk,...ijk->...ipk", dPd[r], Yr[r][..., 0, :], E)
            dYd[r] = torch.einsum("...ipj,...ipk,...ijk->...jk", dPd[r], Xr[r], E)[..., None, :]
    dX += dXd.flatten(-4, -3)
    dY += dYd.flatten(-4, -3)
    return dX, dY


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + tril(A, -1))^-1 for [..., C, C].

    Doubling over diagonal blocks: with the inverses T11, T22 of two neighbouring b x b blocks
    known, the 2b x 2b block's inverse has T21 = -T22 A21 T11. Six levels of batched matmuls
    for C = 64; LAPACK's batched triangular solve is ~50x slower on many small matrices.
    """
    C = A.shape[-1]
    P = 1 << max(C - 1, 0).bit_length()
    if P != C:  # zero-pad to a power of two: the leading block of the inverse is the answer
        return unit_lower_inverse(torch.nn.functional.pad(A, (0, P - C, 0, P - C)))[..., :C, :C]
    A = A.contiguous()
    T = torch.zeros_like(A)
    T.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    lead = A.shape[:-2]
    b = 1
    while b < C:
        size = (*lead, C // (2 * b), 2 * b, 2 * b)
        stride = (*A.stride()[:-2], 2 * b * (C + 1), C, 1)  # the diagonal 2b x 2b blocks
        Tv, Av = T.as_strided(size, stride), A.as_strided(size, stride)
        Tv[..., b:, :b] = -(Tv[..., b:, b:] @ (Av[..., b:, :b] @ Tv[..., :b, :b]))
        b *= 2
    return T


class _Tile:
    """Everything intra-chunk for a tile of chunks: inputs in the chunk layout (q scaled) and the
    quantities the state pass needs. Recomputed in backward instead of stored."""

    FORWARD = ("u", "w", "Aqk", "qg", "k_end", "decay_last")  # all the forward's state pass needs

    def __init__(self, q, k, v, g, beta, bounded: bool, keep: bool = True) -> None:
        # q, k, g: [m, H, C, K]; v: [m, H, C, V]; beta: [m, H, C]
        self.q, self.k, self.v, self.beta = q, k, v, beta
        self.G = G = g.cumsum_(-2).mul_(LOG2E)  # base-2 cumulative decay (g is a private tile copy)
        self.eG = G.exp2()
        self.kb = k * beta[..., None]
        self.X = torch.stack([q, self.kb], dim=-2)  # [m, H, C, 2, K]: Aqk and A share the k side
        P = pair_products(self.X, k[..., None, :], G[..., None, :], bounded)  # [m, H, C, 2, C]
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


def _load(flat: torch.Tensor, idx: torch.Tensor, pad: torch.Tensor | None, m: int, C: int) -> torch.Tensor:
    """Rows idx of flat [BT, H, *] -> a private fp32 tile [m, H, C, *] (padding zeroed)."""
    rows = flat.index_select(0, idx).view(m, C, *flat.shape[1:]).transpose(1, 2)
    tile = torch.empty(rows.shape, dtype=torch.float32, device=flat.device)
    tile.copy_(rows)
    if pad is not None:
        tile.masked_fill_(pad.view(m, 1, C, *([1] * (tile.dim() - 3))), 0.0)
    return tile


def _store(out: torch.Tensor, idx: torch.Tensor, tile: torch.Tensor) -> None:
    """A tile [m, H, C, *] back to rows idx of out [BT + 1, H, *] (padding goes to the last row)."""
    out.index_copy_(0, idx, tile.transpose(1, 2).reshape(-1, *out.shape[1:]))


def _forward(q, k, v, g, beta, h0, lay: "ChunkLayout", scale: float, bounded: bool, save: bool,
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
        _store(o, lay.out_idx[m0:m1].flatten(), o_t.view(m1 - m0, H, -1, V))
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
    def backward(ctx, do, dfinal):
        q, k, v, g, beta, S0 = ctx.saved_tensors
        lay, scale, bounded = ctx.lay, ctx.scale, ctx.bounded
        B, T, H, K = k.shape
        V = v.shape[-1]
        flat = [x.reshape(B * T, H, x.shape[3] if x.dim() == 4 else 1) for x in (q, k, v, g, beta)]
        do_flat = do.reshape(B * T, H, V)
        grads = [torch.empty(B * T + 1, H, x.shape[-1], dtype=torch.float32, device=k.device) for x in flat]
        dq, dk, dv, dg, dbeta = grads
        dS = dfinal[:0]
        prev = 0
        for c0, c1 in reversed(lay.tiles):
            m0, m1 = lay.ends[c0], lay.ends[c1]
            m = m1 - m0
            t = _load_tile(flat, lay, m0, m1, scale, bounded)
            dO = _load(do_flat, lay.in_idx[m0:m1].flatten(), lay.pad_of(m0, m1), m, lay.C)
            S0_t = S0[m0:m1]
            S0T = S0_t.transpose(-1, -2)
            delta = torch.baddbmm(t.u.flatten(0, 1), t.w.flatten(0, 1), S0_t.flatten(0, 1), alpha=-1.0).view_as(dO)
            dd0 = t.Aqk.transpose(-1, -2) @ dO  # [m, H, C, V]
            qg_do = t.qg.transpose(-1, -2) @ dO  # [m, H, K, V]
            dS1 = torch.empty_like(S0_t)  # gradient of the state leaving each chunk
            ddelta = torch.empty_like(dd0)
            for c in range(c1 - 1, c0 - 1, -1):
                a = lay.active[c]
                if a > prev:  # sequences whose last chunk is c
                    dS = torch.cat([dS, dfinal[prev:a]])
                    prev = a
                sl = slice(lay.ends[c] - m0, lay.ends[c + 1] - m0)
                dS1[sl] = dS
                dd = torch.baddbmm(dd0[sl].flatten(0, 1), t.k_end[sl].flatten(0, 1), dS.flatten(0, 1))
                ddelta[sl] = dd.view(a, H, -1, V)
                dS = torch.baddbmm(
                    (t.decay_last[sl] * dS + qg_do[sl]).flatten(0, 1), t.w[sl].flatten(0, 1).transpose(1, 2), dd,
                    alpha=-1.0,
                ).view(a, H, K, V)

            dqg = dO @ S0T  # [m, H, C, K]
            dAqk = (dO @ delta.transpose(-1, -2)).tril_()
            dw = -(ddelta @ S0T)
            dk_end = delta @ dS1.transpose(-1, -2)
            dG_last = t.decay_last.squeeze(-1) * (S0_t * dS1).sum(-1)  # [m, H, K]
            TT = t.T.transpose(-1, -2)
            dbv, dkg = TT @ ddelta, TT @ dw
            dA = torch.baddbmm(
                (dbv @ t.u.transpose(-1, -2)).flatten(0, 1), dkg.flatten(0, 1), t.w.flatten(0, 1).transpose(1, 2)
            ).view(m, H, lay.C, lay.C).tril_(-1).neg_()
            dX, dY = pair_products_backward(
                torch.stack([dAqk, dA], dim=-2), t.X, t.k[..., None, :], t.G[..., None, :], bounded
            )
            dY = dY[..., 0, :]
            dkb = dX[..., 1, :] + dkg * t.eG
            dk_end_k = dk_end * t.k_end
            dG = dqg * t.qg + dkg * t.kg + (t.X * dX).sum(-2) - t.k * dY - dk_end_k
            dG[..., -1, :] += dk_end_k.sum(-2) + dG_last
            idx = lay.out_idx[m0:m1].flatten()
            _store(dq, idx, (dqg * t.eG + dX[..., 0, :]).mul_(scale))
            _store(dk, idx, dk_end * t.e_end + dY + dkb * t.beta[..., None])
            _store(dv, idx, dbv * t.beta[..., None])
            _store(dg, idx, dG.flip(-2).cumsum(-2).flip(-2))
            _store(dbeta, idx, ((dkb * t.k).sum(-1) + (dbv * t.v).sum(-1))[..., None])
        dh0 = torch.cat([dS, dfinal[prev:]])
        out = [gr[: B * T].view(x.shape).to(x.dtype) for gr, x in zip(grads, (q, k, v, g, beta))]
        return (*out, dh0, None, None, None)


def _load_tile(flat, lay: ChunkLayout, m0: int, m1: int, scale: float, bounded: bool, keep: bool = True) -> _Tile:
    idx, pad = lay.in_idx[m0:m1].flatten(), lay.pad_of(m0, m1)
    q, k, v, g, beta = (_load(x, idx, pad, m1 - m0, lay.C) for x in flat)
    return _Tile(q.mul_(scale), k, v, g, beta[..., 0], bounded, keep)


def chunk_kda_torch(
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
    states_at: dict[int, list[int]] | None = None,
):
    """Chunkwise KDA, differentiable; same contract as `naive_recurrent_kda`, plus:

    chunk_size: tokens per chunk (a multiple of 16, or <= 16).
    lower_bound: a promise that g >= lower_bound everywhere (K3's bounded gate, -5); enables the
        dense diagonal sub-chunks. None is always correct.
    states_at: {sequence: [token offsets]} (inference only; offsets multiples of chunk_size in
        (0, length]): also return the state after each offset, {(sequence, offset): [H, K, V]
        fp32}, read at the chunk boundaries the pass crosses anyway (a prefix cache's snapshots
        cost no extra pass).
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    lengths = [T] * B if cu_seqlens is None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    N = len(lengths)
    lay = ChunkLayout(lengths, chunk_size, H, k.device)
    if initial_state is None:
        h0 = k.new_zeros(N, H, K, V, dtype=torch.float32)
    else:
        h0 = initial_state.float()
    h0 = h0[lay.order_t] if N else h0
    bounded = lower_bound is not None
    want = _state_chunks(states_at or {}, lengths, lay)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        if states_at:
            raise ValueError("states_at is for inference: call under torch.no_grad() or with inputs that need no grad")
        o, final_sorted = _ChunkKDA.apply(q, k, v, g, beta, h0, lay, scale, bounded)
    else:  # inference: no per-chunk states kept for a backward
        o, final_sorted, _, kept = _forward(q, k, v, g, beta, h0, lay, scale, bounded, save=False,
                                            want=frozenset(want.values()))
    final = None
    if output_final_state or states_at:
        final = torch.empty_like(final_sorted)
        final[lay.order_t] = final_sorted
    if states_at is None:
        return o.to(v.dtype), final
    states = {key: kept[m] if m >= 0 else final[key[0]].clone() for key, m in want.items()}
    return o.to(v.dtype), final if output_final_state else None, states


def _state_chunks(states_at: dict[int, list[int]], lengths: list[int], lay: ChunkLayout) -> dict[tuple[int, int], int]:
    """{(sequence, offset): the layout chunk whose entering state is the state after offset, or -1
    for the sequence's final state}; ValueError for an offset the pass does not cross."""
    rank = {i: r for r, i in enumerate(lay.order)}
    out = {}
    for i, offsets in states_at.items():
        if not 0 <= i < len(lengths):
            raise ValueError(f"states_at: sequence {i} out of range [0, {len(lengths)})")
        for off in offsets:
            if off % lay.C or not 0 < off <= lengths[i]:
                raise ValueError(f"states_at: offset {off} of sequence {i} must be a multiple of chunk_size "
                                 f"{lay.C} in (0, {lengths[i]}]")
            out[(i, off)] = -1 if off == lengths[i] else lay.ends[off // lay.C] + rank[i]
    return out


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
