"""MoonViT-V2 configuration with the field names of the released K3 `vision_config`.

The released names are kept verbatim (`vt_*` for the tower's own sizes, `mm_*` for the
projector) so a release `config.json`'s `vision_config` block loads with `from_dict` unchanged.
The two fields the release does not carry are marked below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .fields import check_field_types


@dataclass
class K3VisionConfig:
    """MoonViT-V2 tower + PatchMergerV2 projector. Defaults are the K3 release."""

    patch_size: int = 14  # conv patch embedding, kernel = stride = patch_size, no bias
    init_pos_emb_height: int = 64  # learnable position table rows (interpolated to each grid)
    init_pos_emb_width: int = 64  # learnable position table columns
    init_pos_emb_time: int = 4  # frames per video chunk with a fixed sin-cos time embedding
    pos_emb_type: str = "divided_fixed"  # learnable 2D table + fixed sin-cos time table
    pos_emb_interpolation_mode: str = "bilinear"  # resampling of the 2D table to a grid
    vt_num_hidden_layers: int = 27
    vt_hidden_size: int = 1024
    vt_num_attention_heads: int = 12
    qkv_hidden_size: int = 1536  # width of each of q, k, v (head dim = qkv_hidden_size / heads)
    vt_intermediate_size: int = 4096  # gelu-tanh MLP width
    merge_kernel_size: list[int] = field(default_factory=lambda: [2, 2])  # spatial merge (rows, cols)
    merge_type: str = "sd2_tpool"  # mean over frames, then merge_kernel_size spatial grouping
    video_attn_type: str = "spatial_temporal"  # all patches of a chunk attend to each other
    mm_projector_type: str = "patchmergerv2"  # Linear(4D, 4D) -> GELU -> Linear(4D, text) -> RMSNorm
    mm_hidden_size: int = 1024  # tower width the projector reads (= vt_hidden_size)
    text_hidden_size: int = 7168  # language-model width the projector writes
    projector_hidden_act: str = "gelu"  # exact (erf) GELU between the projector's linears
    projector_ln_eps: float = 1e-5  # eps of the projector's post RMSNorm
    activation_func: str = "gelu_pytorch_tanh"  # tower MLP activation
    norm_type: str = "rmsnorm"
    patch_embed_proj_bias: bool = False
    attn_bias: bool = False
    linear_bias: bool = False
    # Not in the release: the tower's RMSNorm eps (the reference leaves torch.nn.RMSNorm's
    # dtype-dependent default; a fixed value makes fp32 and bf16 runs comparable).
    vt_rms_norm_eps: float = 1e-6
    # Not in the release: the largest grid side the 2D rotary table covers, in patches.
    rope_max_grid: int = 512

    def __post_init__(self) -> None:
        if isinstance(self.merge_kernel_size, tuple):
            self.merge_kernel_size = list(self.merge_kernel_size)
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, fld: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"K3VisionConfig.{fld}: {msg}")

        check_field_types(self)
        for fld in ("patch_size", "init_pos_emb_height", "init_pos_emb_width", "init_pos_emb_time",
                    "vt_num_hidden_layers", "vt_hidden_size", "vt_num_attention_heads", "qkv_hidden_size",
                    "vt_intermediate_size", "mm_hidden_size", "text_hidden_size", "rope_max_grid"):
            v = getattr(self, fld)
            need(isinstance(v, int) and v > 0, fld, f"must be a positive int, got {v!r}")
        need(self.qkv_hidden_size % self.vt_num_attention_heads == 0, "qkv_hidden_size",
             f"{self.qkv_hidden_size} is not divisible by vt_num_attention_heads={self.vt_num_attention_heads}")
        need(self.head_dim % 4 == 0, "qkv_hidden_size",
             f"head dim {self.head_dim} must be divisible by 4 (2D rotary: a (row, column) pair per 4 channels)")
        need(self.vt_hidden_size % 2 == 0, "vt_hidden_size",
             f"must be even (sin-cos time table), got {self.vt_hidden_size}")
        need(len(self.merge_kernel_size) == 2 and all(isinstance(k, int) and k > 0 for k in self.merge_kernel_size),
             "merge_kernel_size", f"must be two positive ints, got {self.merge_kernel_size!r}")
        need(self.mm_hidden_size == self.vt_hidden_size, "mm_hidden_size",
             f"{self.mm_hidden_size} must equal vt_hidden_size {self.vt_hidden_size} (the projector reads the tower)")
        for fld, allowed in (("pos_emb_type", ("divided_fixed",)),
                             ("pos_emb_interpolation_mode", ("bilinear", "bicubic")),
                             ("merge_type", ("sd2_tpool",)), ("video_attn_type", ("spatial_temporal",)),
                             ("mm_projector_type", ("patchmergerv2",)), ("projector_hidden_act", ("gelu",)),
                             ("activation_func", ("gelu_pytorch_tanh",)), ("norm_type", ("rmsnorm",))):
            need(getattr(self, fld) in allowed, fld, f"must be one of {allowed}, got {getattr(self, fld)!r}")
        for fld in ("projector_ln_eps", "vt_rms_norm_eps"):
            need(getattr(self, fld) > 0, fld, f"must be positive, got {getattr(self, fld)!r}")

    @property
    def head_dim(self) -> int:
        return self.qkv_hidden_size // self.vt_num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "K3VisionConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"K3VisionConfig: unknown field(s) {unknown}")
        return cls(**d)


def k3_vision() -> K3VisionConfig:
    return K3VisionConfig()  # the defaults are the release


def tiny_vision(text_hidden_size: int) -> K3VisionConfig:
    """Every vision feature on at CPU size: qkv width differs from the tower width, an 8x8
    position table (most grids interpolate, an 8x8 grid does not), 4-frame chunks, 2x2 merge."""
    return K3VisionConfig(
        init_pos_emb_height=8, init_pos_emb_width=8, vt_num_hidden_layers=2, vt_hidden_size=64,
        vt_num_attention_heads=3, qkv_hidden_size=96, vt_intermediate_size=128, mm_hidden_size=64,
        text_hidden_size=text_hidden_size, rope_max_grid=64,
    )
