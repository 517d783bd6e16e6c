"""The K3 release's config.json <-> K3Config.

The release config is multimodal: top-level `architectures` ["KimiK3ForConditionalGeneration"],
`model_type` "kimi_k3", a `text_config` (model_type "kimi_linear", the Kimi Linear field names
plus K3's additions) and a `vision_config` (MoonViT-V2, `vt_*` names). Field meanings follow the
release's own modeling code (mirrored in the public ports, see docs/checkpoints.md):

- `linear_attn_config.kda_layers` / `full_attn_layers`: 1-based KDA and MLA layers;
  `gate_lower_bound` a number -> the bounded KDA gate, null -> Kimi Linear's unbounded one;
  `use_full_rank_gate` -> the full-rank output gate.
- a layer is MoE when `num_experts` is set, layer >= `first_k_dense_replace` and
  layer % `moe_layer_freq` == 0 (0-based), dense otherwise.
- `hidden_act` "situ" with `activation_situ_beta` / `activation_situ_linear_beta` -> SiTU-GLU
  (b1, b2); "silu" -> SwiGLU. Everything else is refused.
- `routed_expert_hidden_size` -> LatentMoE width; the release norms the latent sum
  (`latent_moe_use_norm` true), which is the only LatentMoE k3 has.
- the MLA q/kv latent norms use eps 1e-6 in the release's modeling code (its RMSNorm default;
  `rms_norm_eps` is not passed to them), which is K3Config.mla_norm_eps's default.

Values k3 cannot honour (grouped routing, softmax routing, a `topk_method` other than
"noaux_tc", rotated MLA, MTP layers, a latent MoE without its norm, ...) raise a ValueError naming
the field (`refuse_unsupported`, shared with the Kimi Linear reader), as does a field of the wrong
JSON type (`"false"` for a boolean, `"8"` for an integer: `ConfigFields`). So does a missing
field that the release always sets and that the weights cannot confirm: `hidden_act`,
`activation_situ_beta` / `activation_situ_linear_beta`, `rms_norm_eps`,
`linear_attn_config.gate_lower_bound` and, with experts, `num_experts_per_token`,
`first_k_dense_replace`, `routed_scaling_factor`, `moe_renormalize`, `topk_method`; k3 never
guesses them. Defaults remain only where they equal the release's modeling code and the release
(`moe_layer_freq` 1, sigmoid routing, one expert group, no MTP layers) or where a wrong guess
cannot load (head counts and sizes, which the weights' shapes check, and features whose tensors
would be missing or left over).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NoReturn

from .config import K3Config, get_preset
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


def vision_from_release(v: dict) -> K3VisionConfig:
    """K3VisionConfig for a release `vision_config` block (k3 keeps the released field names)."""
    if not isinstance(v, dict):
        raise ValueError(f"config.json vision_config: must be an object, got {v!r}")
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
    f = ConfigFields(d, tc)
    L = f.integer("num_hidden_layers")
    if L is None or L < 1:
        raise ValueError(f"config.json: text_config.num_hidden_layers must be a positive int, got {L!r}")
    lin = f.section("linear_attn_config")
    layer_types = _layer_types(L, lin)
    moe = f.get("num_experts") is not None
    mlp_types = mlp_schedule(L, f.integer("first_k_dense_replace", required=True),
                             f.integer("moe_layer_freq", default=1)) if moe else ["dense"] * L
    refuse_unsupported(f, layer_types, nope_default=False)
    # the release says one KV head per query head (MLA has one KV latent for all heads). Kimi Linear's
    # configs are not checked for it: transformers' default is 32 whatever the heads, and its MLA
    # runs alike with any value.
    heads = f.get("num_attention_heads")
    if f.get("num_key_value_heads", default=heads) != heads:
        f.refuse("num_key_value_heads", f.get("num_key_value_heads"), "MLA has one KV latent for all heads")
    if "gate_lower_bound" not in lin:
        raise ValueError("config.json text_config.linear_attn_config.gate_lower_bound is missing: the K3 release "
                         "always sets it (-5.0); null selects Kimi Linear's unbounded gate")
    bound = lin.number("gate_lower_bound")
    has_vision = d.get("vision_config") not in (None, {}) and tc is not d
    vision = vision_from_release(d["vision_config"]) if has_vision else None
    return k3_config(
        vocab_size=f.get("vocab_size"), hidden_size=f.get("hidden_size"), num_layers=L, layer_types=layer_types,
        mlp_types=mlp_types, intermediate_size=f.get("intermediate_size"),
        rms_norm_eps=float(f.number("rms_norm_eps", required=True)),
        max_position_embeddings=f.get("max_position_embeddings", default=1 << 20),
        tie_word_embeddings=f.flag("tie_word_embeddings", default=False), **_activation(f),
        kda_num_heads=lin.get("num_heads", default=f.get("num_attention_heads")),
        kda_head_dim=lin.get("head_dim", default=128), kda_conv_size=lin.get("short_conv_kernel_size", default=4),
        kda_gate="unbounded" if bound is None else "bounded", kda_gate_lower_bound=-5.0 if bound is None else float(bound),
        kda_output_gate="full" if lin.flag("use_full_rank_gate", default=False) else "low_rank",
        num_heads=f.get("num_attention_heads"), q_lora_rank=f.get("q_lora_rank"), kv_lora_rank=f.get("kv_lora_rank"),
        qk_nope_head_dim=f.get("qk_nope_head_dim"), qk_rope_head_dim=f.get("qk_rope_head_dim"),
        v_head_dim=f.get("v_head_dim"), mla_output_gate=f.flag("mla_use_output_gate", default=False),
        mla_norm_eps=MLA_NORM_EPS, **(_moe(f) if moe else _NO_MOE), attn_res_block_size=f.get("attn_res_block_size"),
        bos_token_id=f.get("bos_token_id"), eos_token_id=f.token_id("eos_token_id"),
        pad_token_id=f.get("pad_token_id"), vision_config=vision,
        media_placeholder_token_id=d.get("media_placeholder_token_id"),
    )


def k3_config(**fields: Any) -> K3Config:
    """K3Config(**fields) read from a config.json: its ValueError names the file too."""
    try:
        return K3Config(**fields)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None


# A config without experts (all dense) still fills the MoE fields validly; they are unused.
_NO_MOE = dict(num_experts=2, num_experts_per_token=1, num_shared_experts=0, moe_intermediate_size=1,
               moe_latent_size=None, routed_scaling=1.0, moe_renormalize=True)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_ints(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) for t in v)


class ConfigFields:
    """The fields of a Hugging Face config.json, each read with its JSON type checked: a wrong one
    is a ValueError naming config.json and the field (never `bool("false")`, never a TypeError
    later). `tc` holds the model's fields (the release's text_config, or all of Kimi Linear's
    file); a field missing there is read from the top level `d`, where the release repeats the
    token ids. A null field counts as missing."""

    def __init__(self, d: dict, tc: dict | None = None, prefix: str | None = None) -> None:
        self.d, self.tc = d, d if tc is None else tc
        self.prefix = ("" if self.tc is self.d else "text_config.") if prefix is None else prefix

    def __contains__(self, name: str) -> bool:
        return name in self.tc

    def refuse(self, name: str, value: Any, why: str) -> NoReturn:
        raise ValueError(f"config.json {self.prefix}{name}={value!r}: {why}")

    def _find(self, names: tuple[str, ...]) -> tuple[str, Any]:
        """(the first of `names` that is set, its value), or (names[0], None)."""
        for n in names:
            v = self.tc.get(n, self.d.get(n) if self.tc is not self.d else None)
            if v is not None:
                return n, v
        return names[0], None

    def _read(self, names: tuple[str, ...], default: Any, required: bool, ok, what: str) -> Any:
        name, v = self._find(names)
        if v is None:
            if required:  # a field the K3 release always sets and the weights cannot confirm: never guessed
                raise ValueError(f"config.json {self.prefix}{name} is missing: the K3 release always sets it and "
                                 f"k3 does not guess it")
            return default
        if not ok(v):
            self.refuse(name, v, f"must be {what}")
        return v

    def get(self, *names: str, default: Any = None) -> Any:
        """The first of `names` that is set, as it is (K3Config checks the type), else `default`."""
        return self._read(names, default, False, lambda v: True, "")

    def required(self, name: str) -> Any:
        return self._read((name,), None, True, lambda v: True, "")

    def flag(self, *names: str, default: bool | None = None, required: bool = False) -> bool | None:
        return self._read(names, default, required, lambda v: isinstance(v, bool), "true or false (a JSON boolean)")

    def integer(self, *names: str, default: int | None = None, required: bool = False) -> int | None:
        return self._read(names, default, required, _is_int, "an integer")

    def number(self, *names: str, default: float | None = None, required: bool = False) -> float | None:
        return self._read(names, default, required, lambda v: _is_int(v) or isinstance(v, float), "a number")

    def integers(self, name: str) -> list[int]:
        """A list of integers ([] when missing)."""
        return self._read((name,), [], False, _is_ints, "a list of integers")

    def token_id(self, name: str) -> int | None:
        """A token id, or the first of a list of them (transformers allows several end tokens)."""
        v = self._read((name,), None, False, lambda v: _is_int(v) or _is_ints(v) and len(v) > 0,
                       "a token id or a non-empty list of them")
        return v[0] if isinstance(v, list) else v

    def section(self, name: str) -> "ConfigFields":
        """The fields of the object `name` (none when it is missing)."""
        v = self._read((name,), {}, False, lambda v: isinstance(v, dict), "an object")
        return ConfigFields(v, prefix=f"{self.prefix}{name}.")


def refuse_unsupported(f: ConfigFields, layer_types: list[str], nope_default: bool) -> None:
    """Refuse what the K3 release and Kimi Linear configs can say but k3 cannot run, naming the
    field. `nope_default`: what a missing mla_use_nope means (Kimi Linear's MLA is always NoPE; the
    release always sets it)."""
    for name in ("moe_router_activation_func", "scoring_func"):  # scoring_func: DeepSeek's name for it
        if f.get(name, default="sigmoid") != "sigmoid":
            f.refuse(name, f.get(name), "k3's router is sigmoid")
    if f.get("topk_method", default="noaux_tc") != "noaux_tc":
        f.refuse("topk_method", f.get("topk_method"), "k3 selects by score + e_score_correction_bias ('noaux_tc')")
    groups, topk_group = f.integer("num_expert_group", "n_group", default=1), f.integer("topk_group", default=1)
    if groups > 1 and groups > topk_group:
        f.refuse("num_expert_group", groups, "grouped routing is not supported by k3")
    if not f.flag("mla_use_nope", default=nope_default) and "mla" in layer_types:
        f.refuse("mla_use_nope", f.get("mla_use_nope"), "k3's MLA is NoPE (no rotary embedding)")
    if f.integer("num_nextn_predict_layers", default=0):
        f.refuse("num_nextn_predict_layers", f.get("num_nextn_predict_layers"), "MTP layers are not supported by k3")


def _layer_types(L: int, lin: ConfigFields) -> list[str]:
    kda, full = set(lin.integers("kda_layers")), set(lin.integers("full_attn_layers"))
    if kda & full or (kda | full) - set(range(1, L + 1)):
        raise ValueError("config.json: linear_attn_config.kda_layers / full_attn_layers must split layers 1..L")
    if not kda and not full:
        raise ValueError("config.json: text_config.linear_attn_config needs kda_layers and full_attn_layers")
    return ["kda" if i + 1 in kda else "mla" for i in range(L)]


def _activation(f: ConfigFields) -> dict:
    act = f.required("hidden_act")
    if act == "silu":
        return dict(activation="swiglu")
    if act != "situ":
        f.refuse("hidden_act", act, "k3 runs 'situ' (SiTU-GLU) or 'silu' (SwiGLU) only")
    return dict(activation="situ_glu", situ_b1=float(f.number("activation_situ_beta", required=True)),
                situ_b2=float(f.number("activation_situ_linear_beta", required=True)))


def _moe(f: ConfigFields) -> dict:
    f.required("topk_method")  # its value: refuse_unsupported
    latent = f.get("routed_expert_hidden_size")
    if latent is not None and not f.flag("latent_moe_use_norm", default=False):
        f.refuse("latent_moe_use_norm", f.get("latent_moe_use_norm"), "k3's LatentMoE always norms the latent sum")
    return dict(num_experts=f.get("num_experts"),
                num_experts_per_token=f.integer("num_experts_per_token", required=True),
                num_shared_experts=f.get("num_shared_experts", default=0),
                moe_intermediate_size=f.get("moe_intermediate_size"), moe_latent_size=latent,
                routed_scaling=float(f.number("routed_scaling_factor", required=True)),
                moe_renormalize=f.flag("moe_renormalize", required=True))


def config_to_release(cfg: K3Config, with_vision: bool = False, quantized_experts: bool = True,
                      base: dict | None = None) -> dict:
    """The release config.json for a K3Config; with_vision adds its vision_config (the tower's weights
    are in the checkpoint). k3's own vision fields (e.g. vt_rms_norm_eps) are written too, so the
    config reads back unchanged.

    `base`: the config.json the model was loaded from. Its fields k3 does not write stay as they
    were (at every level), so other loaders read the export as they read the original; a field k3
    writes takes k3's value, or is dropped where k3 writes none (quantization_config of unquantised
    experts, vision_config of a text-only model). The original quantization_config is kept when the
    experts are quantised again: k3 reads only its format and group size."""
    if cfg.mla_norm_eps != MLA_NORM_EPS and "mla" in cfg.layer_types:
        raise ValueError(f"mla_norm_eps={cfg.mla_norm_eps}: the release layout fixes the MLA latent norm eps at "
                         f"{MLA_NORM_EPS}")
    text = _text_config(cfg)
    if "moe" in cfg.mlp_types:
        text.update(_moe_config(cfg))
        if quantized_experts:
            text["quantization_config"] = _QUANTIZATION
    out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "text_config": text,
           "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id,
           "tie_word_embeddings": cfg.tie_word_embeddings}
    if cfg.media_placeholder_token_id is not None:
        out["media_placeholder_token_id"] = cfg.media_placeholder_token_id
    if with_vision:
        if cfg.vision_config is None:
            raise ValueError("config has no vision_config to write")
        out["vision_config"] = {**cfg.vision_config.to_dict(), "mlp_type": "mlp2"}
    if base is None:
        return out
    merged = _merge(base, out, _written_fields())
    original_q = (base.get("text_config") or {}).get("quantization_config")
    if "quantization_config" in text and original_q:
        merged["text_config"]["quantization_config"] = original_q
    return merged


def _text_config(cfg: K3Config) -> dict:
    lin = {
        "kda_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"],
        "full_attn_layers": [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"],
        "num_heads": cfg.kda_num_heads, "head_dim": cfg.kda_head_dim, "short_conv_kernel_size": cfg.kda_conv_size,
        "use_full_rank_gate": cfg.kda_output_gate == "full",
        "gate_lower_bound": cfg.kda_gate_lower_bound if cfg.kda_gate == "bounded" else None,
    }
    if cfg.activation == "swiglu":
        act: dict[str, Any] = {"hidden_act": "silu"}
    else:
        act = {"hidden_act": "situ", "activation_situ_beta": cfg.situ_b1, "activation_situ_linear_beta": cfg.situ_b2}
    return {
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


def _moe_config(cfg: K3Config) -> dict:
    first, freq = schedule_params(cfg.mlp_types)
    return {
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
        "first_k_dense_replace": first, "moe_layer_freq": freq, "routed_expert_hidden_size": cfg.moe_latent_size,
        "latent_moe_use_norm": cfg.moe_latent_size is not None, "routed_scaling_factor": cfg.routed_scaling,
        "moe_renormalize": cfg.moe_renormalize, "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    }


# Only the routed experts are quantised; the ignore list names the other Linear families, but
# loaders detect quantisation by `weight_packed`, as the release needs.
_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"], "input_activations": None,
                                  "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                                              "symmetric": True}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
               "re:.*routed_expert_(down|up)_proj.*", "re:vision_tower.*", "re:mm_projector.*"],
}


@functools.cache
def _written_fields() -> dict:
    """Every field config_to_release can write, nested as written: its output for the K3 preset,
    which has every feature on."""
    return config_to_release(get_preset("k3"), with_vision=True)


def _merge(base: dict, ours: dict, written: dict) -> dict:
    """`ours` over `base` in base's order: a field k3 writes (a key of `written`) takes our value or
    is left out; base's other fields stay; objects both sides write merge the same way, level by level."""
    out = {}
    for k, v in base.items():
        if k in ours:
            nested = isinstance(v, dict) and isinstance(ours[k], dict) and isinstance(written.get(k), dict)
            out[k] = _merge(v, ours[k], written[k]) if nested else ours[k]
        elif k not in written:
            out[k] = v
    out.update({k: v for k, v in ours.items() if k not in base})
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
