"""Kimi Linear checkpoints in Hugging Face layout <-> K3ForCausalLM.

Reads config.json plus safetensors (one file or an index of shards) with the weight names of the
released Kimi-Linear-48B-A3B (`block_sparse_moe.experts.N.w1`, `self_attn.q_conv1d`, ...), and
also the names transformers uses in memory (`mlp.experts.gate_up_proj`, `self_attn.conv1d`,
`self_attn.forget_gate.*`). Tensors are loaded one at a time into a model built on the meta
device, so peak memory is the model itself. Export writes the released layout back.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from .checkpoint_reader import CheckpointReader
from .config import K3Config
from .directory import MODEL_FILES, Source, check_destination, owned, write_beside
from .hf_k3_config import ConfigFields, k3_config, mlp_schedule, refuse_unsupported, schedule_params
from .loading import check_device, check_dtype, read_config_json, require_floating, wants_vision
from .model import K3ForCausalLM, load_dtype
from .moe import require_all_experts


def config_from_hf(hf: dict) -> K3Config:
    """A K3Config for a Kimi Linear config.json (the released form or transformers' saved form)."""
    f = ConfigFields(hf)
    L = f.integer("num_hidden_layers")
    if L is None or L < 1:
        raise ValueError(f"config.json: num_hidden_layers must be a positive int, got {L!r}")
    lin = f.section("linear_attn_config")
    if hf.get("layer_types"):
        types = _kinds(f, "layer_types", {"full_attention": "mla", "linear_attention": "kda"})
    elif "full_attn_layers" in lin:
        full = set(lin.integers("full_attn_layers"))  # 1-based in the released config
        types = ["mla" if i + 1 in full else "kda" for i in range(L)]
    else:
        raise ValueError("config.json: needs layer_types or linear_attn_config.full_attn_layers")
    act = f.get("hidden_act", default="silu")
    if act != "silu":  # the MLPs would silently run SwiGLU on weights trained with another activation
        raise ValueError(f"config.json: hidden_act={act!r} is not supported for Kimi Linear (k3 runs 'silu' "
                         f"gated MLPs, SwiGLU)")
    # The released modeling code puts an MoE where layer >= first_k_dense_replace and
    # layer % moe_layer_freq == 0; transformers' saved form lists mlp_layer_types instead.
    k, freq = f.integer("first_k_dense_replace", default=1), f.integer("moe_layer_freq", default=1)
    rule = mlp_schedule(L, k, freq)
    if hf.get("mlp_layer_types"):
        mlp = _kinds(f, "mlp_layer_types", {"sparse": "moe", "dense": "dense"})
        if freq != 1 and mlp != rule:
            raise ValueError(f"config.json: moe_layer_freq={freq} (with first_k_dense_replace={k}) contradicts "
                             f"mlp_layer_types {hf['mlp_layer_types']}")
    else:
        mlp = rule
    refuse_unsupported(f, types, nope_default=True)
    return k3_config(
        vocab_size=f.get("vocab_size"), hidden_size=f.get("hidden_size"), num_layers=L, layer_types=types,
        mlp_types=mlp, intermediate_size=f.get("intermediate_size"),
        rms_norm_eps=f.number("rms_norm_eps", default=1e-5),
        max_position_embeddings=f.get("model_max_length", "max_position_embeddings", default=1_048_576),
        tie_word_embeddings=f.flag("tie_word_embeddings", default=False), activation="swiglu",
        kda_num_heads=f.get("linear_num_heads", default=lin.get("num_heads", default=32)),
        kda_head_dim=f.get("linear_head_dim", default=lin.get("head_dim", default=128)),
        kda_conv_size=f.get("linear_conv_kernel_dim", default=lin.get("short_conv_kernel_size", default=4)),
        kda_gate="unbounded", kda_output_gate="low_rank",
        num_heads=f.get("num_attention_heads"), q_lora_rank=f.get("q_lora_rank"), kv_lora_rank=f.get("kv_lora_rank"),
        qk_nope_head_dim=f.get("qk_nope_head_dim"), qk_rope_head_dim=f.get("qk_rope_head_dim"),
        v_head_dim=f.get("v_head_dim"), mla_output_gate=False,
        num_experts=f.get("num_experts", "num_local_experts"),
        num_experts_per_token=f.get("num_experts_per_token", "num_experts_per_tok"),
        num_shared_experts=f.get("num_shared_experts", "n_shared_experts", default=1),
        moe_intermediate_size=f.get("moe_intermediate_size"), moe_latent_size=None,
        routed_scaling=float(f.number("routed_scaling_factor", default=1.0)),
        moe_renormalize=f.flag("moe_renormalize", "norm_topk_prob", default=True), attn_res_block_size=None,
        bos_token_id=f.get("bos_token_id"), eos_token_id=f.token_id("eos_token_id"), pad_token_id=f.get("pad_token_id"),
    )


def _kinds(f: ConfigFields, name: str, kinds: dict[str, str]) -> list[str]:
    """A per-layer list of transformers' names (layer_types, mlp_layer_types) in k3's words."""
    v = f.get(name)
    if not isinstance(v, list) or any(t not in kinds for t in v):
        f.refuse(name, v, f"must be a list of {sorted(kinds)}")
    return [kinds[t] for t in v]


def config_to_hf(cfg: K3Config) -> dict:
    """config.json for a Kimi-Linear-expressible K3Config; ValueError naming the field that is not."""
    checks = {
        "attn_res_block_size": cfg.attn_res_block_size is None, "moe_latent_size": cfg.moe_latent_size is None,
        "activation": cfg.activation == "swiglu", "kda_gate": cfg.kda_gate == "unbounded",
        "kda_output_gate": cfg.kda_output_gate == "low_rank", "mla_output_gate": not cfg.mla_output_gate,
        "tie_word_embeddings": not cfg.tie_word_embeddings,
    }
    bad = [k for k, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"config has K3 features Kimi Linear cannot express: {bad}")
    full = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"]
    kda = [i + 1 for i, t in enumerate(cfg.layer_types) if t == "kda"]
    # The released modeling code reads first_k_dense_replace + moe_layer_freq, not mlp_layer_types.
    first_k, freq = schedule_params(cfg.mlp_types) if "moe" in cfg.mlp_types else (cfg.num_layers, 1)
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "mla_use_nope": True,
        "num_experts": cfg.num_experts, "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts, "routed_scaling_factor": cfg.routed_scaling,
        "moe_renormalize": cfg.moe_renormalize, "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1, "topk_group": 1,
        "first_k_dense_replace": first_k, "moe_layer_freq": freq,
        "layer_types": ["full_attention" if t == "mla" else "linear_attention" for t in cfg.layer_types],
        "mlp_layer_types": ["sparse" if t == "moe" else "dense" for t in cfg.mlp_types],
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": kda, "head_dim": cfg.kda_head_dim,
                               "num_heads": cfg.kda_num_heads, "short_conv_kernel_size": cfg.kda_conv_size},
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "model_max_length": cfg.max_position_embeddings,
        "tie_word_embeddings": False, "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }


_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def _hf_to_k3_tensors(reader: CheckpointReader, cfg: K3Config) -> Iterator[tuple[str, torch.Tensor]]:
    used: set[str] = set()
    names = reader.keys()
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        if kind == "kda":
            if f"{a}.q_conv1d.weight" in reader.weight_map:
                convs = [f"{a}.{x}_conv1d.weight" for x in "qkv"]
                conv = torch.cat([reader.get(n).reshape(reader.get(n).shape[0], -1) for n in convs])
                used.update(convs)
            else:
                used.add(f"{a}.conv1d.weight")
                conv = reader.get(f"{a}.conv1d.weight")
                conv = conv.reshape(conv.shape[0], -1)
            yield f"{a}.conv_weight", conv
            for n in ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight"):
                src = f"{a}.{n}" if f"{a}.{n}" in reader.weight_map else f"{a}.forget_gate.{n}"
                used.add(src)
                t = reader.get(src)
                yield f"{a}.{n}", t.reshape(-1) if n == "A_log" else t
            used.add(f"{a}.o_norm.weight")
            yield f"{a}.o_norm_weight", reader.get(f"{a}.o_norm.weight")
        moe = f"{p}.block_sparse_moe" if any(n.startswith(f"{p}.block_sparse_moe.") for n in names) else f"{p}.mlp"
        if cfg.mlp_types[i] == "moe":
            used.update({f"{moe}.gate.weight", f"{moe}.gate.e_score_correction_bias"})
            yield f"{p}.mlp.gate.weight", reader.get(f"{moe}.gate.weight")  # fp32: load_dtype
            if f"{moe}.gate.e_score_correction_bias" in reader.weight_map:
                yield f"{p}.mlp.gate.bias", reader.get(f"{moe}.gate.e_score_correction_bias")
            E = cfg.num_experts
            if f"{moe}.experts.gate_up_proj" in reader.weight_map:
                gu = reader.get(f"{moe}.experts.gate_up_proj")
                used.update({f"{moe}.experts.gate_up_proj", f"{moe}.experts.down_proj"})
                gate, up = gu.chunk(2, dim=1)
                yield f"{p}.mlp.experts.w_gate", gate
                yield f"{p}.mlp.experts.w_up", up
                yield f"{p}.mlp.experts.w_down", reader.get(f"{moe}.experts.down_proj")
            else:
                for src, dst in (("w1", "w_gate"), ("w3", "w_up"), ("w2", "w_down")):
                    keys = [f"{moe}.experts.{e}.{src}.weight" for e in range(E)]
                    missing = [k for k in keys if k not in reader.weight_map]
                    if missing:
                        raise ValueError(f"checkpoint lacks expert weights, e.g. {missing[0]}")
                    used.update(keys)
                    yield f"{p}.mlp.experts.{dst}", torch.stack([reader.get(k) for k in keys])
            for n in names:
                if n.startswith(f"{moe}.shared_experts."):
                    used.add(n)
                    yield f"{p}.mlp." + n[len(f"{moe}."):], reader.get(n)
    for n in names:
        if n in used or _EXPERT.match(n):
            continue
        # transformers writes every MLP (the dense one too) under block_sparse_moe.
        yield n.replace(".block_sparse_moe.", ".mlp."), reader.get(n)


def load_kimi_linear(path: str | Path, dtype: torch.dtype | None = None,
                     device: str | torch.device = "cpu", vision: bool | None = None) -> K3ForCausalLM:
    """Build a K3ForCausalLM from a Kimi Linear checkpoint directory (config.json + safetensors).
    (k3.model.load calls this for a Kimi Linear directory; Kimi Linear has no vision tower.)"""
    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path}: no config.json")
    dtype, device = check_dtype(dtype), check_device(device, meta=False)
    cfg = config_from_hf(read_config_json(path))
    wants_vision(cfg, vision, f"{path}/config.json (Kimi Linear)")
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state: dict[str, torch.Tensor] = {}
    for name, t in _hf_to_k3_tensors(CheckpointReader(path), cfg):
        if name not in expected:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        want = expected[name]
        require_floating(name, t, str(path))
        if tuple(t.shape) != tuple(want.shape):
            raise ValueError(f"checkpoint tensor {name}: shape {tuple(t.shape)} != expected {tuple(want.shape)} "
                             f"(check heads x head_dim in config.json)")
        state[name] = t.to(device=device, dtype=load_dtype(name, t.dtype, dtype))
    missing = sorted(set(expected) - set(state) - {n for n in expected if n.endswith(".mlp.gate.bias")})
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    for n in expected:
        if n not in state:  # a checkpoint without a router bias: zeros
            state[n] = torch.zeros(expected[n].shape, dtype=torch.float32, device=device)
    model.load_state_dict(state, strict=True, assign=True)
    model.source = Source(path, "kimi-linear")
    return model


def save_kimi_linear(model: K3ForCausalLM, path: str | Path, overwrite: bool = False) -> None:
    """Write config.json + model.safetensors in the released Kimi Linear layout.

    Written beside `path` and swapped in when complete (model/directory.py): a failure leaves the
    previous checkpoint as it was; files of `path` that are not weights or config.json (a
    tokenizer) stay. Refused before anything is written: a model holding only some experts, K3
    features Kimi Linear cannot express, and the directory the model was loaded from unless
    `overwrite`."""
    if not isinstance(model, K3ForCausalLM):
        raise ValueError(f"Kimi Linear has no vision tower: save a K3ForCausalLM (e.g. model.language_model), "
                         f"got {type(model).__name__}")
    check_destination(model.source, path, overwrite)
    require_all_experts(model)
    cfg = model.cfg
    hf_cfg = config_to_hf(cfg)
    out: dict[str, torch.Tensor] = {}
    for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
        t = t.detach().cpu().contiguous()
        m = re.match(r"^(model\.layers\.\d+)\.(self_attn|mlp)\.(.+)$", name)
        if not m:
            out[name] = t
            continue
        p, part, rest = m.groups()
        if part == "self_attn":
            a = f"{p}.self_attn"
            if rest == "conv_weight":
                for x, chunk in zip("qkv", t.chunk(3, dim=0)):
                    out[f"{a}.{x}_conv1d.weight"] = chunk[:, None, :].contiguous()
            elif rest == "A_log":
                out[f"{a}.A_log"] = t.reshape(1, 1, -1, 1).contiguous()
            elif rest == "o_norm_weight":
                out[f"{a}.o_norm.weight"] = t
            else:
                out[f"{a}.{rest}"] = t
            continue
        layer = int(p.rsplit(".", 1)[1])
        if cfg.mlp_types[layer] == "dense":
            out[name] = t
            continue
        moe = f"{p}.block_sparse_moe"
        if rest == "gate.bias":
            out[f"{moe}.gate.e_score_correction_bias"] = t
        elif rest.startswith("experts."):
            src = {"experts.w_gate": "w1", "experts.w_up": "w3", "experts.w_down": "w2"}[rest]
            for e in range(t.shape[0]):
                out[f"{moe}.experts.{e}.{src}.weight"] = t[e].contiguous()
        else:
            out[f"{moe}.{rest}"] = t
    with write_beside(path, stale=owned(MODEL_FILES)) as new:
        save_file(out, str(new / "model.safetensors"), metadata={"format": "pt"})
        (new / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")


def kimi_linear_torch_only():
    """transformers' Kimi Linear module with its own torch paths.

    transformers decides at import time whether `chunk_kda` and friends come from fla (Triton,
    GPU only) or from its torch fallback; on a CPU-only machine with fla installed that choice
    is wrong. Import the module with fla and causal_conv1d hidden, then unhide them.
    """
    import importlib
    import sys

    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name in sys.modules:
        mod = sys.modules[name]
    else:
        hidden = {k: sys.modules.get(k) for k in ("fla", "causal_conv1d")}
        try:
            for k in hidden:
                sys.modules[k] = None  # makes `import k` raise ImportError
            mod = importlib.import_module(name)
        finally:
            for k, v in hidden.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v
    return mod
