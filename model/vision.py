"""MoonViT-V2, the K3 vision encoder, and its PatchMergerV2 projector.

Input is pre-patchified: `pixel_values` [N, 3, p, p] holds every patch of every item, items
one after another, each item's patches in (frame, row, column) order; `grid_thws` [M, 3] gives
each item's (frames, rows, columns) in patches. Images have t = 1; a video chunk has up to
`init_pos_emb_time` frames. Items are packed in one sequence without padding and attention stays
inside each item, so a packed batch equals each item encoded alone.

Parameter names follow the release checkpoint (`vision_tower.patch_embed.proj`,
`vision_tower.patch_embed.pos_emb.weight`, `vision_tower.encoder.blocks.{i}.{norm0, wqkv, wo,
norm1, mlp.fc0, mlp.fc1}`, `vision_tower.encoder.final_layernorm`, `mm_projector.proj.{0, 2}`,
`mm_projector.post_norm`), so release weights load by name.
"""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from .norm import RMSNorm
from .vision_config import K3VisionConfig


def grid_list(grid_thws: torch.Tensor | list) -> list[tuple[int, int, int]]:
    """grid_thws [M, 3] (tensor or nested list) as a list of (t, h, w); ValueError on bad rows."""
    rows = grid_thws.tolist() if isinstance(grid_thws, torch.Tensor) else list(grid_thws)
    out = []
    for i, g in enumerate(rows):
        if len(g) != 3 or any(int(v) <= 0 for v in g):
            raise ValueError(f"grid_thws[{i}] must be three positive ints (t, h, w), got {g}")
        out.append((int(g[0]), int(g[1]), int(g[2])))
    return out


def item_lengths(grids: list[tuple[int, int, int]]) -> list[int]:
    return [t * h * w for t, h, w in grids]


def sincos_time_table(num_frames: int, dim: int) -> torch.Tensor:
    """[num_frames, dim] fixed table: [sin(m w_k), cos(m w_k)], w_k = 10000^(-k / (dim / 2))."""
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    phase = torch.arange(num_frames, dtype=torch.float64)[:, None] * omega[None]
    return torch.cat([phase.sin(), phase.cos()], dim=1).float()


class DividedFixedPosEmb(nn.Module):
    """"divided_fixed" positions: a learnable [H0, W0, D] table resampled to each item's (h, w)
    (used as is when it already matches), plus a fixed sin-cos time row per frame, added only
    when the item has more than one frame (images and one-frame chunks get no time term)."""

    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.init_pos_emb_height, cfg.init_pos_emb_width, cfg.vt_hidden_size))
        self.mode = cfg.pos_emb_interpolation_mode
        self.max_frames = cfg.init_pos_emb_time

    def time_table(self) -> torch.Tensor:
        """[init_pos_emb_time, D] fixed sin-cos rows. Computed, not a buffer: nothing to load or
        save, and a model built on the meta device needs no re-initialisation of it."""
        return sincos_time_table(self.max_frames, self.weight.shape[-1]).to(self.weight.device)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)

    def spatial(self, h: int, w: int) -> torch.Tensor:
        """[h * w, D] table for an h x w grid (row-major)."""
        if (h, w) == tuple(self.weight.shape[:2]):
            return self.weight.flatten(0, 1)
        grid = self.weight.permute(2, 0, 1).unsqueeze(0)  # [1, D, H0, W0]
        out = F.interpolate(grid.float(), size=(h, w), mode=self.mode, align_corners=False).to(self.weight.dtype)
        return out[0].permute(1, 2, 0).flatten(0, 1)

    def forward(self, x_ND: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        parts = []
        for t, h, w in grids:
            if t > self.max_frames:
                raise ValueError(f"grid has {t} frames; a chunk holds at most init_pos_emb_time={self.max_frames}")
            pos = self.spatial(h, w)
            if t > 1:
                pos = pos.unsqueeze(0) + self.time_table()[:t, None, :].to(pos.dtype)  # [t, h*w, D]
            parts.append(pos.reshape(-1, pos.shape[-1]))
        return x_ND + torch.cat(parts).to(x_ND.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.vt_hidden_size, kernel_size=p, stride=p, bias=cfg.patch_embed_proj_bias)
        self.pos_emb = DividedFixedPosEmb(cfg)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.proj(pixel_values.to(self.proj.weight.dtype)).flatten(1)  # [N, D]
        return self.pos_emb(x, grids)


class Rope2D:
    """2D rotary positions per head over (row, column). Channel pair j of a head rotates by
    col * f_{j//2} when j is even and row * f_{j//2} when j is odd, f_i = 10000^(-4i / head_dim);
    a pair is two adjacent channels. The angle depends only on the patch's own (row, column)
    and repeats over the frames of a chunk."""

    def __init__(self, head_dim: int, max_grid: int) -> None:
        self.head_dim, self.max_grid = head_dim, max_grid

    def angles(self, grids: list[tuple[int, int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
        """[N, head_dim / 2] rotation angles for the packed patches (fp32)."""
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, self.head_dim, 4, device=device).float() / self.head_dim)
        parts = []
        for t, h, w in grids:
            if h > self.max_grid or w > self.max_grid:
                raise ValueError(f"grid {h}x{w} exceeds the rotary table's {self.max_grid} patches per side")
            rows = torch.arange(h, device=device).repeat_interleave(w).float()
            cols = torch.arange(w, device=device).repeat(h).float()
            ang = torch.stack([cols[:, None] * inv_freq, rows[:, None] * inv_freq], dim=-1)
            parts.append(ang.flatten(1).repeat(t, 1))  # [t*h*w, head_dim / 2], (col, row) interleaved
        return torch.cat(parts)

    @staticmethod
    def rotate(x_NHK: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Rotate adjacent channel pairs of x [N, H, K] by angles [N, K / 2] (fp32 math)."""
        xf = x_NHK.float().unflatten(-1, (-1, 2))
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        a, b = xf[..., 0], xf[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).to(x_NHK.dtype)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Bidirectional attention inside each item of a packed sequence; q, k, v [N, H, K].

    Items of equal length run as one batched SDPA call (a batch of many same-size images is one
    call); nothing is padded, so no item sees another's patches.
    """
    out = torch.empty_like(v)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, n in enumerate(lengths):
        by_len[n].append(starts[i])
    for n, begins in by_len.items():
        idx = (torch.tensor(begins, device=q.device)[:, None] + torch.arange(n, device=q.device)).reshape(-1)
        qb, kb, vb = (x.index_select(0, idx).unflatten(0, (len(begins), n)).transpose(1, 2) for x in (q, k, v))
        ob = F.scaled_dot_product_attention(qb, kb, vb)  # [B, H, n, K]
        out = out.index_copy(0, idx, ob.transpose(1, 2).reshape(-1, *v.shape[1:]))
    return out


class VisionMLP(nn.Module):
    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        self.fc0 = nn.Linear(cfg.vt_hidden_size, cfg.vt_intermediate_size, bias=cfg.linear_bias)
        self.fc1 = nn.Linear(cfg.vt_intermediate_size, cfg.vt_hidden_size, bias=cfg.linear_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """Pre-norm block: x + wo(attn(rope(wqkv(norm0 x)))), then x + mlp(norm1 x)."""

    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = cfg.vt_num_attention_heads, cfg.head_dim
        self.norm0 = RMSNorm(cfg.vt_hidden_size, cfg.vt_rms_norm_eps)
        self.wqkv = nn.Linear(cfg.vt_hidden_size, 3 * cfg.qkv_hidden_size, bias=cfg.attn_bias)
        self.wo = nn.Linear(cfg.qkv_hidden_size, cfg.vt_hidden_size, bias=cfg.attn_bias)
        self.norm1 = RMSNorm(cfg.vt_hidden_size, cfg.vt_rms_norm_eps)
        self.mlp = VisionMLP(cfg)

    def forward(self, x_ND: torch.Tensor, angles: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        qkv = self.wqkv(self.norm0(x_ND)).view(x_ND.shape[0], 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # [N, H, K] each
        q, k = Rope2D.rotate(q, angles), Rope2D.rotate(k, angles)
        x_ND = x_ND + self.wo(packed_attention(q, k, v, lengths).flatten(1))
        return x_ND + self.mlp(self.norm1(x_ND))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        self.rope_2d = Rope2D(cfg.head_dim, cfg.rope_max_grid)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vt_num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.vt_hidden_size, cfg.vt_rms_norm_eps)

    def forward(self, x_ND: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        angles, lengths = self.rope_2d.angles(grids, x_ND.device), item_lengths(grids)
        for block in self.blocks:
            x_ND = block(x_ND, angles, lengths)
        return self.final_layernorm(x_ND)


def sd2_tpool(x_ND: torch.Tensor, grids: list[tuple[int, int, int]], kernel: list[int]) -> torch.Tensor:
    """Mean over an item's frames, then group each kh x kw block of patches into one token.

    x [sum t*h*w, D] -> [sum (h/kh)*(w/kw), kh*kw*D]; tokens row-major over the merged grid,
    the kh*kw patches of a token row-major inside it.
    """
    kh, kw = kernel
    out, off = [], 0
    for t, h, w in grids:
        if h % kh or w % kw:
            raise ValueError(f"grid {h}x{w} is not divisible by merge_kernel_size {kernel}")
        x = x_ND[off:off + t * h * w].view(t, h // kh, kh, w // kw, kw, -1).mean(0)
        out.append(x.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), -1))
        off += t * h * w
    return torch.cat(out)


class MoonViT(nn.Module):
    """The tower: patch embedding + positions, encoder blocks, final norm, sd2_tpool merge."""

    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thws: torch.Tensor | list) -> torch.Tensor:
        """pixel_values [N, 3, p, p], grid_thws [M, 3] -> merged tokens [sum h*w / 4, 4 * D]."""
        grids = grid_list(grid_thws)
        p = self.cfg.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (3, p, p):
            raise ValueError(f"pixel_values must be [N, 3, {p}, {p}], got {tuple(pixel_values.shape)}")
        n = sum(item_lengths(grids))
        if pixel_values.shape[0] != n:
            raise ValueError(f"pixel_values holds {pixel_values.shape[0]} patches but grid_thws cover {n}")
        x = self.encoder(self.patch_embed(pixel_values, grids), grids)
        return sd2_tpool(x, grids, self.cfg.merge_kernel_size)


class PatchMergerV2(nn.Module):
    """Projector: Linear(4D, 4D) -> GELU -> Linear(4D, text width) -> RMSNorm."""

    def __init__(self, cfg: K3VisionConfig) -> None:
        super().__init__()
        width = cfg.mm_hidden_size * cfg.merge_area
        self.proj = nn.Sequential(nn.Linear(width, width, bias=False), nn.GELU(),
                                  nn.Linear(width, cfg.text_hidden_size, bias=False))
        self.post_norm = RMSNorm(cfg.text_hidden_size, cfg.projector_ln_eps)

    def forward(self, merged: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.proj(merged))


def tokens_per_item(grids: list[tuple[int, int, int]], kernel: list[int]) -> list[int]:
    """Placeholder tokens each item fills (frames pool away, so a chunk counts one frame)."""
    return [(h // kernel[0]) * (w // kernel[1]) for _, h, w in grids]


def init_vision_(module: nn.Module, std: float) -> None:
    """Normal(0, std) linears and conv, ones for norms, the position table at std 0.02."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (RMSNorm, DividedFixedPosEmb)):
            m.reset_parameters()

