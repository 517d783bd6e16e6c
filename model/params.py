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


@dataclass
class ReleaseCount:
    """Weights in the K3 release layout against k3's own count of the same model.

    The release stores each Block AttnRes mix as an RMSNorm weight [D] and a projection [1, D];
    k3 folds the pair into one pseudo-query [D] (the mix only sees their product), so the release
    has (2L + 1) x D more numbers. KDA's A_log is stored [max(H, K)] with one rate per head in the
    first H entries: (max(H, K) - H) more per KDA layer. The router's correction bias
    (`e_score_correction_bias`, E per MoE layer) is a stored tensor in the release and a buffer in
    k3 (set by balancing, never trained), so k3's parameter count leaves it out. MXFP4 experts
    count one weight per element (a packed byte holds two); their E8M0 scales are listed apart.
    `tensors` is the number of stored text tensors (packed weight and scale counted apart)."""

    total: int
    k3_total: int
    attn_res_norms: int
    a_log_padding: int
    router_bias: int
    mxfp4_scales: int
    tensors: int

    @property
    def explained(self) -> int:
        """The part of total - k3_total the three layout differences account for."""
        return self.attn_res_norms + self.a_log_padding + self.router_bias

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


def count_release_parameters(cfg: K3Config) -> ReleaseCount:
    """Count the release layout of `cfg` tensor by tensor, over a meta-device model (no memory)."""
    from .hf_k3 import release_tensors

    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    total = scales = tensors = 0
    for name, t in release_tensors(model):
        tensors += 1
        if name.endswith(".weight_scale"):
            scales += t.numel()
        else:
            total += t.numel() * (2 if name.endswith(".weight_packed") else 1)
    kda = cfg.layer_types.count("kda")
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size if cfg.attn_res_block_size is not None else 0
    pad = kda * (max(cfg.kda_num_heads, cfg.kda_head_dim) - cfg.kda_num_heads)
    bias = cfg.mlp_types.count("moe") * cfg.num_experts
    k3_total = sum(p.numel() for p in model.parameters())
    return ReleaseCount(total=total, k3_total=k3_total, attn_res_norms=norms, a_log_padding=pad, router_bias=bias,
                        mxfp4_scales=scales, tensors=tensors)
