"""The K3 release's config.json <-> K3Config.

The release config is multimodal: top-level `architectures` ["KimiK3ForConditionalGeneration"],
`model_type` "kimi_k3", a `text_config` (model_type "kimi_linear", the Kimi Linear field names
plus K3's additions) and a `vision_config` (MoonViT-V2, `vt_*` names). Field meanings follow the
release's own modeling code (mirrored in the public ports, see docs/checkpoints.md):

- `linear_attn_config.kda_layers` / `full_attn_layers`: 1-based KDA and MLA layers;
  `gate_lower_bound` set -> the bounded KDA gate; `use_full_rank_gate` -> the full-rank output gate.
- a layer is MoE when `num_experts` is set, layer >= `first_k_dense_replace` and
  layer % `moe_layer_freq` == 0 (0-based), dense otherwise.
- `hidden_act` "situ" with `activation_situ_beta` / `activation_situ_linear_beta` -> SiTU-GLU
  (b1, b2); "silu" -> SwiGLU. Everything else is refused.
- `routed_expert_hidden_size` -> LatentMoE width; the release norms the latent sum
  (`latent_moe_use_norm` true), which is the only LatentMoE k3 has.
- the MLA q/kv latent norms use eps 1e-6 in the release's modeling code (its RMSNorm default;
  `rms_norm_eps` is not passed to them), which is K3Config.mla_norm_eps's default.

Values k3 cannot honour (grouped routing, softmax routing, rotated MLA, MTP layers, a latent MoE
without its norm, ...) raise a ValueError naming the field.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from .config import K3Config
from .vision_config import K3VisionConfig

ARCHITECTURE = "KimiK3ForConditionalGeneration"
MODEL_TYPE = "kimi_k3"
MLA_NORM_EPS = 1e-6  # the release's MLA latent RMSNorms (their default eps; see the module docstring)
# Keys transformers writes into every sub-config; they say nothing about the tower.
_VISION_BOILERPLATE = {"_attn_implementation", "_name_or_path", "architectures", "dtype", "torch_dtype", "model_type",
                       "id2label", "label2id", "chunk_size_feed_forward", "is_encoder_decoder", "output_attentions",
                       "output_hidden_states", "problem_type", "return_dict", "transformers_version"}


def mlp_schedule(num_layers: int, first_k_dense: int, moe_layer_freq: int) -> list[str]:
    """The release rule: MoE where layer >= first_k_dense and layer % moe_layer_freq == 0 (0-based)."""
    if not isinstance(moe_layer_freq, int) or moe_layer_freq < 1:
        raise ValueError(f"config.json: moe_layer_freq must be a positive int, got {moe_layer_freq!r}")
    return ["moe" if i >= first_k_dense and i % moe_layer_freq == 0 else "dense" for i in range(num_layers)]


def schedule_params(mlp_types: list[str]) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) reproducing mlp_types; ValueError if none does."""
    L = len(mlp_types)
    first = next((i for i, t in enumerate(mlp_types) if t == "moe"), L)
    for freq in range(1, L + 1):
        if mlp_schedule(L, first, freq) == mlp_types:
            return first, freq
    raise ValueError(f"mlp_types {mlp_types} is not expressible as first_k_dense_replace + moe_layer_freq")


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"config.json text_config.{field}={value!r}: {why}")


def vision_from_release(v: dict) -> K3VisionConfig:
    """K3VisionConfig for a release `vision_config` block (k3 keeps the released field names)."""
    if v.get("mlp_type", "mlp2") != "mlp2":
        raise ValueError(f"config.json vision_config.mlp_type={v['mlp_type']!r}: the tower's MLP is 'mlp2' "
                         f"(fc0 -> gelu-tanh -> fc1)")
    fields = {f.name for f in dataclasses.fields(K3VisionConfig)}
    unknown = sorted(set(v) - fields - _VISION_BOILERPLATE - {"mlp_type"})
    if unknown:
        raise ValueError(f"config.json vision_config: field(s) k3 does not know: {unknown}")
    return K3VisionConfig.from_dict({k: val for k, val in v.items() if k in fields})


def config_from_release(d: dict) -> K3Config:
    """K3Config for a release config.json (the multimodal top level, or a bare text_config)."""
    tc = d.get("text_config", d)
    if not isinstance(tc, dict):
        raise ValueError("config.json: text_config must be an object")

    def get(name: str, default: Any = None) -> Any:
        v = tc.get(name, d.get(name) if tc is not d else None)
        return default if v is None else v

    L = get("num_hidden_layers")
    if not isinstance(L, int) or L < 1:
        raise ValueError(f"config.json: text_config.num_hidden_layers must be a positive int, got {L!r}")
    lin = tc.get("linear_attn_config") or {}
    kda = set(lin.get("kda_layers") or [])
    full = set(lin.get("full_attn_layers") or [])
    if kda & full or (kda | full) - set(range(1, L + 1)):
        raise ValueError("config.json: linear_attn_config.kda_layers / full_attn_layers must split layers 1..L")
    if not kda and not full:
        raise ValueError("config.json: text_config.linear_attn_config needs kda_layers and full_attn_layers")
    layer_types = ["kda" if i + 1 in kda else "mla" for i in range(L)]

    if get("num_experts") is None:
        mlp_types = ["dense"] * L
    else:
        mlp_types = mlp_schedule(L, get("first_k_dense_replace", 0), get("moe_layer_freq", 1))

    act = get("hidden_act", "silu")
    if act == "situ":
        b1, b2 = get("activation_situ_beta", 1.0), tc.get("activation_situ_linear_beta")
        if b2 is None:
            _refuse("activation_situ_linear_beta", b2, "SiTU without the up-projection clamp is not in k3")
        activation = dict(activation="situ_glu", situ_b1=float(b1), situ_b2=float(b2))
    elif act == "silu":
        activation = dict(activation="swiglu")
    else:
        _refuse("hidden_act", act, "k3 runs 'situ' (SiTU-GLU) or 'silu' (SwiGLU) only")
    if get("moe_router_activation_func", "sigmoid") != "sigmoid":
        _refuse("moe_router_activation_func", get("moe_router_activation_func"), "k3's router is sigmoid")
    groups, topk_group = get("num_expert_group", 1), get("topk_group", 1)
    if groups > 1 and groups > topk_group:
        _refuse("num_expert_group", groups, "grouped routing is not supported by k3")
    if not tc.get("mla_use_nope", False) and "mla" in layer_types:
        _refuse("mla_use_nope", tc.get("mla_use_nope"), "k3's MLA is NoPE (no rotary embedding)")
    if get("num_nextn_predict_layers", 0):
        _refuse("num_nextn_predict_layers", get("num_nextn_predict_layers"), "MTP layers are not supported by k3")
    if get("num_key_value_heads", get("num_attention_heads")) != get("num_attention_heads"):
        _refuse("num_key_value_heads", get("num_key_value_heads"), "MLA has one KV latent for all heads")
    latent = get("routed_expert_hidden_size")
    if latent is not None and not tc.get("latent_moe_use_norm", False):
        _refuse("latent_moe_use_norm", tc.get("latent_moe_use_norm"), "k3's LatentMoE always norms the latent sum")
    bound = lin.get("gate_lower_bound")
    eos = get("eos_token_id")
    vision = vision_from_release(d["vision_config"]) if d.get("vision_config") and tc is not d else None
    return K3Config(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=L, layer_types=layer_types,
        mlp_types=mlp_types, intermediate_size=get("intermediate_size"), rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        max_position_embeddings=get("max_position_embeddings", 1_048_576),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)), **activation,
        kda_num_heads=lin.get("num_heads", get("num_attention_heads")), kda_head_dim=lin.get("head_dim", 128),
        kda_conv_size=lin.get("short_conv_kernel_size", 4),
        kda_gate="unbounded" if bound is None else "bounded", kda_gate_lower_bound=-5.0 if bound is None else float(bound),
        kda_output_gate="full" if lin.get("use_full_rank_gate", False) else "low_rank",
        num_heads=get("num_attention_heads"), q_lora_rank=get("q_lora_rank"), kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=get("qk_nope_head_dim"), qk_rope_head_dim=get("qk_rope_head_dim"),
        v_head_dim=get("v_head_dim"), mla_output_gate=bool(get("mla_use_output_gate", False)),
        mla_norm_eps=MLA_NORM_EPS,
        # A config without experts (all dense) still fills the MoE fields validly; they are unused.
        num_experts=get("num_experts", 2), num_experts_per_token=get("num_experts_per_token", 1),
        num_shared_experts=get("num_shared_experts", 0), moe_intermediate_size=get("moe_intermediate_size", 1),
        moe_latent_size=latent,
        routed_scaling=float(get("routed_scaling_factor", 1.0)), moe_renormalize=bool(get("moe_renormalize", True)),
        attn_res_block_size=get("attn_res_block_size"), bos_token_id=get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos, pad_token_id=get("pad_token_id"),
        vision_config=vision, media_placeholder_token_id=d.get("media_placeholder_token_id"),
    )


def config_to_release(cfg: K3Config, with_vision: bool = False, quantized_experts: bool = True) -> dict:
    """The release config.json for a K3Config; with_vision adds its vision_config (the tower's weights
    are in the checkpoint). k3's own vision fields (e.g. vt_rms_norm_eps) are written too, so the
    config reads back unchanged."""
    if cfg.mla_norm_eps != MLA_NORM_EPS and "mla" in cfg.layer_types:
        raise ValueError(f"mla_norm_eps={cfg.mla_norm_eps}: the release layout fixes the MLA latent norm eps at "
                         f"{MLA_NORM_EPS}")
    if cfg.activation == "swiglu":
        act: dict[str, Any] = {"hidden_act": "silu"}
    else:
        act = {"hidden_act": "situ", "activation_situ_beta": cfg.situ_b1, "activation_situ_linear_beta": cfg.situ_b2}
    has_moe = "moe" in cfg.mlp_types
    first, freq = schedule_params(cfg.mlp_types) if has_moe else (cfg.num_layers, 1)
    lin = {
        "kda_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"],
        "full_attn_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"],
        "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim, "short_conv_kernel_size": cfg.kda_conv_size,
        "use_full_rank_gate": cfg.kda_output_gate == "full",
    }
    if cfg.kda_gate == "bounded":
        lin["gate_lower_bound"] = cfg.kda_gate_lower_bound
    text = {
        "model_type": "kimi_linear", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads, "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_output_gate, "linear_attn_config": lin, **act,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attn_res_block_size": cfg.attn_res_block_size,
        "num_nextn_predict_layers": 0, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    if has_moe:
        text.update({
            "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
            "num_shared_experts": cfg.num_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
            "first_k_dense_replace": first, "moe_layer_freq": freq, "routed_expert_hidden_size": cfg.moe_latent_size,
            "latent_moe_use_norm": cfg.moe_latent_size is not None, "routed_scaling_factor": cfg.routed_scaling,
            "moe_renormalize": cfg.moe_renormalize, "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
        })
        if quantized_experts:
            # Only the routed experts are quantised; the ignore list names the other Linear
            # families, but loaders detect quantisation by `weight_packed`, as the release needs.
            text["quantization_config"] = {
                "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                              "input_activations": None,
                                              "weights": {"num_bits": 4, "type": "float", "group_size": 32,
                                                          "strategy": "group", "symmetric": True}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
                           "re:.*routed_expert_(down|up)_proj.*", "re:vision_tower.*", "re:mm_projector.*"],
            }
    out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text,
           "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.media_placeholder_token_id is not None:
        out["media_placeholder_token_id"] = cfg.media_placeholder_token_id
    if with_vision:
        if cfg.vision_config is None:
            raise ValueError("config has no vision_config to write")
        out["vision_config"] = {**cfg.vision_config.to_dict(), "mlp_type": "mlp2"}
    return out


def check_quantization(text_config: dict) -> None:
    """Refuse a quantization_config k3 cannot read (anything but MXFP4, groups of 32)."""
    q = text_config.get("quantization_config")
    if not q:
        return
    fmt = q.get("format")
    if q.get("quant_method") != "compressed-tensors" or fmt != "mxfp4-pack-quantized":
        raise ValueError(f"config.json text_config.quantization_config: k3 reads compressed-tensors "
                         f"'mxfp4-pack-quantized' only, got quant_method={q.get('quant_method')!r} format={fmt!r}")
    for name, group in (q.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        if w.get("num_bits", 4) != 4 or w.get("group_size", 32) != 32:
            raise ValueError(f"config.json quantization_config.config_groups.{name}.weights: MXFP4 needs num_bits 4 "
                             f"and group_size 32, got {w.get('num_bits')} / {w.get('group_size')}")
