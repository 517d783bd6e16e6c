"""A K3 release checkpoint loads exactly or is refused with a ValueError naming the file, the tensor
(or config field) and the reason: non-finite weights, MXFP4 NaN scales, tensors k3 does not map,
wrong shapes, truncated shards, config fields the release always sets but the file lacks, values
k3 cannot honour, impossible expert placements."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from release_reference import release_tensors, tiny_release_config, write_release_checkpoint

import k3.model
from k3.model.hf_k3 import load_k3
from k3.model.hf_k3_config import config_from_release

P = "language_model.model.layers."
SHARED, EXPERTS_LO, EXPERTS_HI = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


def write(path: Path, cfg: dict | None = None, change=None) -> Path:
    """A tiny release at `path`; `change(tensors)` edits its tensors before they are written."""
    cfg = cfg or tiny_release_config()
    tensors = release_tensors(cfg)
    if change is not None:
        change(tensors)
    write_release_checkpoint(path, cfg, tensors)
    return path


def set_value(name: str, index: tuple, value: float):
    def change(tensors):
        tensors[name][index] = value
    return change


def replace(name: str, make):
    def change(tensors):
        tensors[name] = make(tensors[name])
    return change


def without(cfg: dict, *keys: str) -> dict:
    """`cfg` with the field at a dotted path under text_config removed (not set to null)."""
    cfg = copy.deepcopy(cfg)
    *parents, last = keys
    node = cfg["text_config"]
    for k in parents:
        node = node[k]
    del node[last]
    return cfg


# -- tensors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("change,vision,match", [
    (set_value(P + "0.self_attn.q_proj.weight", (3, 5), float("nan")), False,
     f"{SHARED}: {P}0.self_attn.q_proj.weight: non-finite"),
    (set_value(P + "1.self_attn.dt_bias", (7,), float("inf")), False, f"{SHARED}: {P}1.self_attn.dt_bias: non-finite"),
    (set_value("vision_tower.encoder.blocks.1.wqkv.weight", (0, 0), float("-inf")), True,
     f"{SHARED}: vision_tower.encoder.blocks.1.wqkv.weight: non-finite"),
    (set_value(P + "2.block_sparse_moe.experts.6.w2.weight_scale", (1, 0), 255), False,
     f"{EXPERTS_HI}: {P}2.block_sparse_moe.experts.6.w2.weight_scale: .*0xFF"),
    (replace(P + "1.block_sparse_moe.experts.2.w1.weight_scale", lambda t: t[:1].contiguous()), False,
     f"{EXPERTS_LO}: {P}1.block_sparse_moe.experts.2.w1.weight_scale: shape"),
    (replace(P + "0.self_attention_res_proj.weight", lambda t: t.reshape(-1, 1).contiguous()), False,
     f"{SHARED}: {P}0.self_attention_res_proj.weight: shape \\(64, 1\\) != expected \\(1, 64\\)"),
    (replace(P + "0.self_attn.q_proj.weight", lambda t: t[:3].contiguous()), False,
     f"{SHARED}: {P}0.self_attn.q_proj.weight: shape"),
])
def test_a_bad_tensor_is_refused_with_its_file_and_name(tmp_path, change, vision, match):
    path = write(tmp_path / "ckpt", change=change)
    with pytest.raises(ValueError, match=match):
        load_k3(path, vision=vision)


@pytest.mark.parametrize("name", ["model.layers.6.mtp.weight", P + "4.eh_proj.weight", "vision_tower.extra.weight"])
def test_a_tensor_k3_does_not_map_is_refused_whatever_its_prefix(tmp_path, name):
    def add(tensors):
        tensors[name] = torch.zeros(2, 2, dtype=torch.bfloat16)
    path = write(tmp_path / "ckpt", change=add)
    for vision in (False, True):
        with pytest.raises(ValueError, match=f"does not map.*{name}"):
            load_k3(path, vision=vision)


def test_a_truncated_shard_is_named(tmp_path):
    path = write(tmp_path / "ckpt")
    shard = path / EXPERTS_HI
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{EXPERTS_HI}: cannot read"):
        k3.model.load(path)


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("keys", [
    ("activation_situ_beta",), ("activation_situ_linear_beta",), ("hidden_act",), ("rms_norm_eps",),
    ("num_experts_per_token",), ("first_k_dense_replace",), ("routed_scaling_factor",), ("moe_renormalize",),
    ("topk_method",), ("linear_attn_config", "gate_lower_bound"),
])
def test_a_field_the_release_always_sets_is_required(tmp_path, keys):
    path = write(tmp_path / "ckpt")
    (path / "config.json").write_text(json.dumps(without(tiny_release_config(), *keys)))
    with pytest.raises(ValueError, match=f"text_config.{'.'.join(keys)} is missing"):
        load_k3(path, vision=False)
    with pytest.raises(ValueError, match=keys[-1]):
        k3.model.load_config(path)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_act", "gelu", "hidden_act"),
    ("activation_situ_linear_beta", None, "activation_situ_linear_beta"),
    ("moe_router_activation_func", "softmax", "moe_router_activation_func"),
    ("num_expert_group", 8, "num_expert_group"),
    ("topk_method", "greedy", "topk_method"),
    ("mla_use_nope", False, "mla_use_nope"),
    ("num_nextn_predict_layers", 1, "num_nextn_predict_layers"),
    ("latent_moe_use_norm", False, "latent_moe_use_norm"),
    ("num_key_value_heads", 1, "num_key_value_heads"),
    ("moe_layer_freq", 0, "moe_layer_freq"),
    ("quantization_config", {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}, "mxfp4"),
])
def test_config_values_k3_cannot_honour_are_refused(tmp_path, field, value, match):
    path = write(tmp_path / "ckpt")
    (path / "config.json").write_text(json.dumps(tiny_release_config(**{field: value})))
    with pytest.raises(ValueError, match=match):
        load_k3(path, vision=False)


def with_value(cfg: dict, keys: tuple[str, ...], value) -> dict:
    """`cfg` with the field at a dotted path (from the top level) set to `value`."""
    cfg = copy.deepcopy(cfg)
    *parents, last = keys
    node = cfg
    for k in parents:
        node = node[k]
    node[last] = value
    return cfg


T = "text_config"


@pytest.mark.parametrize("keys,value,match", [
    ((T, "scoring_func"), "softmax", "text_config.scoring_func='softmax': k3's router is sigmoid"),
    # JSON booleans only: bool("false") is True
    ((T, "moe_renormalize"), "false", "text_config.moe_renormalize='false': must be true or false"),
    ((T, "moe_renormalize"), 0, "text_config.moe_renormalize=0: must be true or false"),
    ((T, "mla_use_output_gate"), "false", "text_config.mla_use_output_gate='false': must be true or false"),
    ((T, "mla_use_nope"), "false", "text_config.mla_use_nope='false': must be true or false"),
    ((T, "tie_word_embeddings"), "false", "text_config.tie_word_embeddings='false': must be true or false"),
    ((T, "latent_moe_use_norm"), "true", "text_config.latent_moe_use_norm='true': must be true or false"),
    ((T, "linear_attn_config", "use_full_rank_gate"), "false",
     "text_config.linear_attn_config.use_full_rank_gate='false': must be true or false"),
    # wrong types: were TypeError, IndexError, AttributeError or a float() error without the field
    ((T, "eos_token_id"), [], r"text_config.eos_token_id=\[\]: must be a token id"),
    ((T, "num_expert_group"), "8", "text_config.num_expert_group='8': must be an integer"),
    ((T, "first_k_dense_replace"), "1", "text_config.first_k_dense_replace='1': must be an integer"),
    ((T, "routed_scaling_factor"), "abc", "text_config.routed_scaling_factor='abc': must be a number"),
    ((T, "activation_situ_beta"), "4", "text_config.activation_situ_beta='4': must be a number"),
    ((T, "linear_attn_config"), [1], r"text_config.linear_attn_config=\[1\]: must be an object"),
    ((T, "linear_attn_config", "gate_lower_bound"), "-5",
     "text_config.linear_attn_config.gate_lower_bound='-5': must be a number"),
    ((T, "linear_attn_config", "kda_layers"), "1,2",
     "text_config.linear_attn_config.kda_layers='1,2': must be a list of integers"),
    (("vision_config",), "x", "vision_config: must be an object"),
    ((T, "vocab_size"), "256", "K3Config.vocab_size: must be an int"),
])
def test_config_fields_of_the_wrong_type_name_config_json_and_the_field(keys, value, match):
    with pytest.raises(ValueError, match=f"config.json:? {match}"):
        config_from_release(with_value(tiny_release_config(), keys, value))


def test_a_null_gate_lower_bound_is_the_unbounded_gate():
    cfg = tiny_release_config()
    cfg["text_config"]["linear_attn_config"]["gate_lower_bound"] = None
    assert config_from_release(cfg).kda_gate == "unbounded"


# -- expert placement and other mistakes ---------------------------------------------------------------
@pytest.mark.parametrize("first_k_dense", [1, 4])  # some MoE layers, or none
@pytest.mark.parametrize("ep_rank,ep_size,match", [
    (1, 1, "must lie in"), (0, 0, "ep_size >= 1"), (0, -2, "ep_size >= 1"), (2, 2, "must lie in"),
])
def test_impossible_expert_placements_are_refused(tmp_path, first_k_dense, ep_rank, ep_size, match):
    path = write(tmp_path / "ckpt", tiny_release_config(first_k_dense_replace=first_k_dense))
    with pytest.raises(ValueError, match=match):
        load_k3(path, ep_rank=ep_rank, ep_size=ep_size, vision=False)
    with pytest.raises(ValueError, match=match):
        k3.model.load(path, ep_rank=ep_rank, ep_size=ep_size)


def test_other_mistakes_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        load_k3(tmp_path, vision=False)
    text_only = tiny_release_config()
    del text_only["vision_config"]
    path = write(tmp_path / "ckpt", text_only)
    with pytest.raises(ValueError, match="no vision_config"):
        load_k3(path, vision=True)
    with pytest.raises(ValueError, match="ep_size=3"):
        load_k3(path, ep_rank=0, ep_size=3, vision=False)


@pytest.mark.parametrize("content, match", [
    (b'{"model_type": "kimi_k3", "text_config": ', r"config.json: not JSON"),  # cut short
    (b'\xff\xfe{"model_type"', r"config.json: not JSON"),  # not UTF-8
    (b'[1, 2]', r"config.json: not a JSON object"),
    (b'{"model_type": "kimi_k3", "text_config": "llama"}', r"config.json: not a K3 release config .*text_config object"),
])
def test_a_config_json_that_is_not_a_release_config_is_named(tmp_path, content, match):
    """read_config raised a bare JSONDecodeError, UnicodeDecodeError or AttributeError."""
    from k3.model.hf_k3 import read_config

    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ValueError, match=f"{tmp_path}/{match}"):
        read_config(tmp_path)
