"""The CPU path's building blocks: pair products with pairwise decays, and the unit-lower inverse.

The pairwise decays e^(G_i - G_j) of a chunk are where naive implementations pay: a [C, C, K]
tensor per chunk. Here they are dense matmuls over 16-token sub-chunks (`pair_products`). Between
two sub-chunks the factorisation is anchored at the boundary between them, so both factors are
<= 1 for any gate. On a diagonal sub-chunk the anchor is its middle token: exact and overflow-free
when no token's decay from the anchor exceeds e^40, as a gate with a lower bound guarantees (K3's
g > -5 keeps 8 tokens of decay above -40) and as an unbounded gate (Kimi Linear's) usually gives:
`mid_anchor_safe` checks a tile's decays for that. Where a whole chunk stays within e^40 of its
own middle token (a mild gate), the chunk is one such block: one matmul, no sub-chunks
(`diagonal_span` picks the form per tile). Where even a sub-chunk fails, it is split again into
4-token blocks the same way, and only 4 x 4 diagonal blocks take the exact pairwise product.

The gradient of a pair product P_ij = sum_c a_ic b_jc e^(G_ic - G_jc) is da = dP (b e^-G) e^G,
db = dP^T (a e^G) e^-G, dG = a da - b db, computed with the same anchoring as the forward.
Decays are in base 2 (G2 = G log2 e): torch's exp2 is several times faster than exp on CPU.
"""
from __future__ import annotations

import torch

SUB_CHUNK = 16
# The largest |G_i - G_anchor| (log2) a diagonal sub-chunk may hold for its middle-token anchoring:
# e^40, what 8 tokens of K3's bounded gate (g >= -5) can reach. Factors stay within 2^+-58.
MID_ANCHOR_LOG2 = 40 * 1.4426950408889634
# Unbounded diagonal sub-chunks build [.., 16, 16, K] decays; do that this many elements at a time.
_PAIRWISE_ELEMENTS = 1 << 24


def _sub_size(C: int, target: int) -> int:
    """The largest divisor of C that is <= target."""
    return max(d for d in range(1, min(C, target) + 1) if C % d == 0)


def _spread(G: torch.Tensor, sub: int) -> torch.Tensor:
    """The largest |G_i - G_anchor| over the blocks of `sub` tokens of G [..., C, 1, K], each
    anchored at its middle token (a 0-d tensor; NaN if G holds one)."""
    C = G.shape[-3]
    s = _sub_size(C, sub)
    Gr = G.unflatten(-3, (C // s, s))
    return (Gr - Gr[..., s // 2:s // 2 + 1, :, :]).abs_().amax()


def mid_anchor_safe(G: torch.Tensor, sub: int = SUB_CHUNK) -> bool:
    """Whether every diagonal sub-chunk of G [..., C, 1, K] (the cumulative log2-decay) stays within
    MID_ANCHOR_LOG2 of its middle token: then `pair_products(..., bounded=True)` and its backward
    are as exact as for a bounded gate. One host sync; False for a NaN."""
    return bool(_spread(G, sub) <= MID_ANCHOR_LOG2)


def diagonal_span(G: torch.Tensor, bounded: bool, sub: int = SUB_CHUNK) -> int | None:
    """How `pair_products` may anchor the chunks of G [..., C, 1, K]: C, each whole chunk one block
    anchored at its middle token (every token within MID_ANCHOR_LOG2 of it: one matmul per chunk,
    no sub-chunks); else `sub`, the diagonal sub-chunks anchored so (`mid_anchor_safe`, or the
    gate's lower bound promises it: `bounded`); else None, the exact pairwise blocks. One host sync."""
    C = G.shape[-3]
    if C <= sub:
        return C if bounded or mid_anchor_safe(G, C) else None
    if bounded:
        return C if mid_anchor_safe(G, C) else sub
    whole, part = (torch.stack([_spread(G, C), _spread(G, sub)]) <= MID_ANCHOR_LOG2).tolist()
    return C if whole else sub if part else None


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
    if bounded and n == 1:  # the whole chunk is one block
        return _mid_anchored(X, Y, G)
    out = X.new_zeros(*X.shape[:-1], C)
    for ib in range(n - 1):
        e = (ib + 1) * s
        anchor = G[..., e - 1:e, :, :]
        y_t = Y[..., e - s:e, 0, :] * (anchor[..., 0, :] - G[..., e - s:e, 0, :]).exp2()  # [..., s, K]
        x_t = X[..., e:, :, :] * (G[..., e:, :, :] - anchor).exp2()  # [..., C - e, P, K]
        out[..., e:, :, e - s:e] = (x_t.flatten(-3, -2) @ y_t.transpose(-1, -2)).unflatten(-2, (C - e, Pn))
    Xr, Yr, Gr = (t.unflatten(-3, (n, s)) for t in (X, Y, G))  # [..., n, s, P|1, K]
    if bounded:
        blk = _mid_anchored(Xr, Yr, Gr)
    elif s > 4:
        blk = pair_products(Xr, Yr, Gr, False, max(1, s // 4))
    else:
        blk = X.new_empty(*Xr.shape[:-1], s)
        for r in _row_slices(Xr.shape[0], Xr[0].numel() * s):
            E = _pairwise_decay(Gr[r][..., 0, :])  # [m, ..., n, s, s, K]
            # P_ij = X_i . (Y_j e_ij): the decayed Y rows first ([.., s, s, K]), then one batched
            # matmul (a three-operand einsum builds the [.., s, P, s, K] product and copies it)
            blk[r] = Xr[r] @ (Yr[r][..., None, :, 0, :] * E).transpose(-1, -2)
    for i in range(n):
        out[..., i * s:(i + 1) * s, :, i * s:(i + 1) * s] = blk[..., i, :, :, :]
    return out


def _mid_anchored(X: torch.Tensor, Y: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """`pair_products` of one block [..., s, P|1, K], both factors anchored at its middle token."""
    s, Pn = X.shape[-3], X.shape[-2]
    mid = G[..., s // 2:s // 2 + 1, :, :]
    blk = (X * (G - mid).exp2()).flatten(-3, -2) @ (Y * (mid - G).exp2())[..., 0, :].transpose(-1, -2)
    # a fill, not a 0/1 multiply: above the diagonal the products may overflow to inf (huge q
    # with the gate at its bound) and inf * 0 would be NaN
    above = torch.ones(s, s, dtype=torch.bool, device=X.device).triu(1)[:, None, :]
    return blk.unflatten(-2, (s, Pn)).masked_fill_(above, 0.0)


def _mid_anchored_backward(dP: torch.Tensor, X: torch.Tensor, Y: torch.Tensor, G: torch.Tensor):
    """The gradients of `_mid_anchored` for a masked dP [..., s, P, s]: (dX, dY [..., s, 1, K])."""
    s, Pn = X.shape[-3], X.shape[-2]
    mid = G[..., s // 2:s // 2 + 1, :, :]
    f_x, f_y = (G - mid).exp2(), (mid - G).exp2()[..., 0, :]  # [..., s, 1, K], [..., s, K]
    dp = dP.flatten(-3, -2)  # [..., s P, s]
    dX = (dp @ (Y[..., 0, :] * f_y)).unflatten(-2, (s, Pn)) * f_x
    dY = ((dp.transpose(-1, -2) @ (X * f_x).flatten(-3, -2)) * f_y)[..., None, :]
    return dX, dY


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
    if bounded and n == 1:
        return _mid_anchored_backward(dP, X, Y, G)
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
        dXd, dYd = _mid_anchored_backward(dPd, Xr, Yr, Gr)
    elif s > 4:
        dXd, dYd = pair_products_backward(dPd, Xr, Yr, Gr, False, max(1, s // 4))
    else:
        dXd = torch.empty_like(Xr)
        dYd = torch.empty_like(Yr.expand(*Xr.shape[:-2], 1, Xr.shape[-1]))
        for r in _row_slices(Xr.shape[0], Xr[0].numel() * s):
            E = _pairwise_decay(Gr[r][..., 0, :])  # [m, ..., n, s, s, K]
            dXd[r] = dPd[r] @ (Yr[r][..., None, :, 0, :] * E)
            dYd[r] = ((dPd[r].transpose(-1, -2) @ Xr[r]) * E).sum(-3)[..., None, :]
    dX += dXd.flatten(-4, -3)
    dY += dYd.flatten(-4, -3)
    return dX, dY


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """(I + tril(A, -1))^-1 for [..., C, C].

    Doubling over diagonal blocks: with the inverses T11, T22 of two neighbouring b x b blocks
    known, the 2b x 2b block's inverse has T21 = -T22 A21 T11. Six levels of batched matmuls
    for C = 64. (LAPACK's batched triangular solve was taken to be far slower on many small
    matrices; on the Intel Xeon host of 2026-12-05, torch 2.13's MKL, `solve_triangular` took
    61-1,921 us against these 225-3,995 us for 8-256 matrices of 64, to 1e-7: about 1 ms of
    kimi8's 45 ms one-sequence prefill. Not switched on one host's timing: unmeasured on the
    AMD EPYC hosts, where MKL's generic paths were the slow ones before, docs/benchmarks.md.)
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

