"""MXFP4 weights in the K3 release's packing (compressed-tensors `mxfp4-pack-quantized`).

A quantised Linear weight W [out, in] is stored as two uint8 tensors:

- `weight_packed` [out, in / 2]: one 4-bit E2M1 code per element, two per byte; element 2j sits
  in the low nibble of byte j, element 2j + 1 in the high nibble. In a code, bit 3 is the sign
  and bits 0-2 index the magnitudes E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6].
- `weight_scale` [out, in / 32]: one E8M0 exponent per group of 32 consecutive elements of a row;
  the group's values are E2M1[code] * 2 ** (scale - 127). Byte 0xFF is NaN in E8M0: refused.

Quantising a group (the OCP MX rule): the shared exponent is floor(log2(max |w|)) - 2 (2 is the
exponent of E2M1's largest value, 6 = 1.5 * 2**2), so max |w| / 2**e lands in [4, 8); each
w / 2**e rounds to the nearest E2M1 magnitude (ties to the even code, above 6 to 6). A code's
sign bit is set only for a non-zero magnitude, and an all-zero group gets scale 0, so
`quantize(dequantize(quantize(w)))` gives back the same bytes (export -> import -> export is
bit-identical).

Worked example: one row of 64 values, two groups.

    group 0: w[0:4] = [1.0, -0.3, 5.5, 0.75], w[4:32] = 0
        max |w| = 5.5, floor(log2 5.5) = 2  ->  e = 0, scale byte 127 (x 2**0)
        1.0  -> 1.0 (code 0b0010 = 0x2)
        -0.3 -> 0.5 with the sign (0b1001 = 0x9; 0.3 is nearer 0.5 than 0)
        5.5  -> 6.0 (0x7; 5.5 is past the 4 | 6 midpoint 5)
        0.75 -> a tie between 0.5 (0x1) and 1.0 (0x2): the even code, 1.0 (0x2)
        bytes: [0x2 | 0x9 << 4, 0x7 | 0x2 << 4, 0, ...] = [0x92, 0x27, 0x00 x 14]
        dequantised: [1.0, -0.5, 6.0, 1.0, 0, ...]
    group 1: w[32] = 40.0, w[33] = -3.0, the rest 0
        floor(log2 40) = 5  ->  e = 3, scale byte 130 (x 8)
        40 / 8 = 5.0 -> a tie between 4 (0x6) and 6 (0x7): the even code, 4 -> 32.0
        -3 / 8 = -0.375 -> 0.5 with the sign (0x9) -> -4.0
        bytes: [0x6 | 0x9 << 4, 0, ...] = [0x96, 0x00 x 15]

So `weight_packed` = [[0x92, 0x27, 0 x 14, 0x96, 0 x 15]] and `weight_scale` = [[127, 130]];
tests/model/test_hf_k3.py checks exactly these bytes.
"""
from __future__ import annotations

import torch

GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a value on a midpoint goes to the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _check(name: str, t: torch.Tensor, dtype: torch.dtype) -> None:
    if t.dtype != dtype or t.dim() != 2:
        raise ValueError(f"{name}: must be a 2-D {dtype} tensor, got {t.dtype} of shape {tuple(t.shape)}")


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     name: str = "W") -> torch.Tensor:
    """weight_packed [out, in / 2] uint8 + weight_scale [out, in / 32] uint8 -> W [out, in] in `dtype`.

    Every MXFP4 value is exactly representable in bf16 and fp32, so either dtype is lossless. A
    scale byte 0xFF (NaN in E8M0) is refused. `name` prefixes the tensors' names in errors."""
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    _check(f"{name}.weight_packed", packed, torch.uint8)
    _check(f"{name}.weight_scale", scale, torch.uint8)
    out, half = packed.shape
    if scale.shape != (out, 2 * half // GROUP) or (2 * half) % GROUP:
        raise ValueError(f"{name}.weight_scale: shape {tuple(scale.shape)} does not fit weight_packed "
                         f"{tuple(packed.shape)} (expected [{out}, {2 * half // GROUP}], groups of {GROUP})")
    if packed.is_meta:
        return torch.empty(out, 2 * half, dtype=dtype, device="meta")
    nan = (scale == 0xFF).nonzero()
    if len(nan):
        raise ValueError(f"{name}.weight_scale: byte 0xFF (NaN in E8M0) at [row, group] {nan[0].tolist()}; "
                         f"k3 loads exact weights only")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(out, 2 * half).long()  # [out, in]
    table = torch.tensor(E2M1 + tuple(-v for v in E2M1), dtype=torch.float32, device=packed.device)
    values = table[codes]
    exps = scale.to(torch.int32) - 127  # [out, groups]
    w = torch.ldexp(values.view(out, -1, GROUP), exps[..., None].to(torch.float32))
    return w.reshape(out, 2 * half).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] (in a multiple of 32) -> (weight_packed [out, in / 2] uint8, weight_scale [out, in / 32] uint8).

    A meta tensor gives meta outputs of the right shapes (parameter counting)."""
    if w.dim() != 2 or w.shape[1] % GROUP:
        raise ValueError(f"MXFP4 needs a 2-D weight whose input width is a multiple of {GROUP}, got {tuple(w.shape)}")
    out, n = w.shape
    if w.is_meta:
        return (torch.empty(out, n // 2, dtype=torch.uint8, device="meta"),
                torch.empty(out, n // GROUP, dtype=torch.uint8, device="meta"))
    g = w.detach().float().reshape(out, n // GROUP, GROUP)
    if not torch.isfinite(g).all():
        raise ValueError("MXFP4: the weight has non-finite values")
    amax = g.abs().amax(-1)  # [out, groups]
    # frexp: amax = m * 2**k with m in [0.5, 1), so floor(log2(amax)) = k - 1 exactly (no log2 rounding).
    _, k = torch.frexp(amax)
    byte = torch.where(amax > 0, (k.to(torch.int32) - 1 - 2 + 127).clamp(0, 254), torch.zeros_like(k, dtype=torch.int32))
    x = torch.ldexp(g.abs(), (127 - byte)[..., None].to(torch.float32))  # |w| / 2**e
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    mag = torch.bucketize(x, mids)  # x == midpoint -> the lower code
    on_mid = (mag < len(_MIDPOINTS)) & (x == mids[mag.clamp_max(len(_MIDPOINTS) - 1)])
    mag = torch.where(on_mid & (mag % 2 == 1), mag + 1, mag)  # ties to the even code
    codes = (mag | torch.where((g < 0) & (mag > 0), 8, 0)).to(torch.uint8).reshape(out, n)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), byte.to(torch.uint8).contiguous()
