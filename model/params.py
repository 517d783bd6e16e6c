"""Parameter counts from the meta device: no memory is allocated, so the 2.8T preset counts in
well under a second.

Active parameters per token: everything a token's forward touches except the input embedding
(a row lookup, not a matmul), counting only k of the E routed experts in each MoE layer.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .config import K3Config
from .model import K3ForCausalLM
from .vision import MoonViT, PatchMergerV2


@dataclass
class ParamCount:
    total: int
    active: int
    embedding: int
    routed_experts: int
    attention: int
    note: str = "active excludes the input embedding and counts top-k of the routed experts per MoE layer"

    def as_dict(self) -> dict:
        return asdict(self)


def count_parameters(cfg: K3Config) -> ParamCount:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    total = embedding = routed = attention = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if name == "model.embed_tokens.weight":
            embedding += n
        elif ".mlp.experts." in name:
            routed += n
        elif ".self_attn." in name:
            attention += n
    active_routed = routed * cfg.num_experts_per_token // cfg.num_experts
    active = total - embedding - routed + active_routed
    return ParamCount(total=total, active=active, embedding=embedding, routed_experts=routed, attention=attention)


@dataclass
class VisionParamCount:
    tower: int  # MoonViT-V2: patch embedding, position table, blocks, final norm
    projector: int  # PatchMergerV2
    total: int

    def as_dict(self) -> dict:
        return asdict(self)


def count_vision_parameters(cfg: K3Config) -> VisionParamCount | None:
    """Tower and projector sizes of a multimodal config (None for a text-only one)."""
    if cfg.vision_config is None:
        return None
    with torch.device("meta"):
        tower, projector = MoonViT(cfg.vision_config), PatchMergerV2(cfg.vision_config)
    t = sum(p.numel() for p in tower.parameters())
    j = sum(p.numel() for p in projector.parameters())
    return VisionParamCount(tower=t, projector=j, total=t + j)
