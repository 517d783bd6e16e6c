"""Kimi Linear checkpoints: a tiny random model built and saved by transformers, imported by k3."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3.model import SamplingConfig, generate, get_preset, K3ForCausalLM
from k3.model.hf_kimi import config_from_hf, kimi_linear_torch_only
from k3.model.hf_kimi import load_kimi_linear, save_kimi_linear
import k3.model

transformers = pytest.importorskip("transformers")
kimi_linear_torch_only()  # transformers' torch path, never fla's GPU kernels

TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=16,
    linear_num_heads=4, routed_scaling_factor=2.446,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention", "full_attention"],
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**TINY)).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):  # a non-zero correction bias, as in the released weights
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
            if hasattr(layer.self_attn, "o_norm"):
                layer.self_attn.o_norm.weight.normal_(1, 0.1)
    path = tmp_path_factory.mktemp("kimi") / "ckpt"
    hf.save_pretrained(path)
    return path, transformers.KimiLinearForCausalLM.from_pretrained(path).eval()


def test_logits_match_transformers(checkpoint):
    path, hf = checkpoint
    ours = load_kimi_linear(path).eval()
    ids = torch.randint(3, 512, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids).logits).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff {diff}"


def test_greedy_continuation_with_cache_matches_transformers(checkpoint):
    path, hf = checkpoint
    ours = load_kimi_linear(path).eval()
    prompt = torch.randint(3, 512, (1, 19), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12,
                           eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    got, logits = generate(ours, [prompt[0].tolist()], SamplingConfig(max_tokens=12), return_logits=True)
    assert got[0] == want
    with torch.no_grad():  # and the cached step logits equal transformers' full forward
        full = hf(torch.tensor([prompt[0].tolist() + want])).logits[0, prompt.shape[1] - 1:-1]
    assert (full - logits[0]).abs().max().item() <= 1e-4


def test_export_roundtrip_loads_in_transformers(checkpoint, tmp_path):
    path, hf = checkpoint
    ours = load_kimi_linear(path).eval()
    save_kimi_linear(ours, tmp_path / "out")
    back = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path / "out").eval()
    again = load_kimi_linear(tmp_path / "out").eval()
    ids = torch.randint(3, 512, (1, 23))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits)
        assert torch.equal(again(ids).logits, ours(ids).logits)


def test_bad_checkpoints_get_clear_errors(checkpoint, tmp_path):
    path, _ = checkpoint
    with pytest.raises(ValueError, match="config.json"):
        load_kimi_linear(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["linear_num_heads"] = 8  # heads x head_dim no longer matches the weights
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match="shape"):
        load_kimi_linear(bad)
    with pytest.raises(ValueError, match="attn_res_block_size"):
        save_kimi_linear(K3ForCausalLM(get_preset("k3-tiny")), tmp_path / "k3")


@pytest.mark.parametrize("act", ["gelu", "situ", "relu"])
def test_hidden_act_other_than_silu_is_refused(checkpoint, tmp_path, act):
    path, _ = checkpoint
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = act
    bad = tmp_path / "act"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=f"hidden_act='{act}'"):
        load_kimi_linear(bad)


def test_moe_layer_freq_is_honoured(tmp_path):
    """The released config form (first_k_dense_replace + moe_layer_freq, no mlp_layer_types)
    loads the schedule the released modeling code builds: MoE where i >= k and i % freq == 0."""
    torch.manual_seed(3)
    kinds = ["dense", "dense", "sparse", "dense", "sparse"]  # k = 1, freq = 2 over 5 layers
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**TINY, mlp_layer_types=kinds)).eval()
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.pop("mlp_layer_types")
    cfg.update(first_k_dense_replace=1, moe_layer_freq=2)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    ours = load_kimi_linear(tmp_path / "hf").eval()
    assert ours.cfg.mlp_types == ["dense", "dense", "moe", "dense", "moe"]
    ids = torch.randint(3, 512, (1, 17))
    with torch.no_grad():
        assert (ours(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4
    save_kimi_linear(ours, tmp_path / "out")
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["moe_layer_freq"] == 2 and "mlp_layer_types" in out_cfg  # both forms, for both readers
    assert load_kimi_linear(tmp_path / "out").cfg.mlp_types == ours.cfg.mlp_types
    cfg.update(mlp_layer_types=["dense"] + ["sparse"] * 4)  # says every layer after the first is MoE
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        load_kimi_linear(tmp_path / "hf")


def test_k3_model_load_reads_kimi_linear(checkpoint):
    path, _ = checkpoint
    full = load_kimi_linear(path).eval()
    assert k3.model.load_config(path) == full.cfg
    ids = torch.randint(3, 512, (1, 7))
    with torch.no_grad():
        assert torch.equal(k3.model.load(path)(ids).logits, full(ids).logits)
    rank = k3.model.load(path, ep_rank=1, ep_size=2)  # one expert-parallel rank: its rows of the experts
    E = full.cfg.num_experts
    for layer, want in zip(rank.model.layers, full.model.layers):
        if layer.is_moe:
            assert (layer.mlp.experts.first, layer.mlp.experts.count) == (E // 2, E // 2)
            assert torch.equal(layer.mlp.experts.w_down, want.mlp.experts.w_down[E // 2:])
    with pytest.raises(ValueError, match="vision=True"):
        k3.model.load(path, vision=True)
    with pytest.raises(ValueError, match="ep_rank=2 must lie in"):
        k3.model.load(path, ep_rank=2, ep_size=2)


RELEASED = Path(k3.model.__file__).parent / "data" / "kimi_linear_48b_a3b_config.json"


@pytest.mark.parametrize("field,value,match", [
    # features k3 cannot run: each would load and silently run something else
    ("mla_use_nope", False, "mla_use_nope=False: k3's MLA is NoPE"),
    ("moe_router_activation_func", "softmax", "moe_router_activation_func='softmax': k3's router is sigmoid"),
    ("scoring_func", "softmax", "scoring_func='softmax': k3's router is sigmoid"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    # JSON booleans only: bool("false") is True
    ("moe_renormalize", "false", "moe_renormalize='false': must be true or false"),
    ("tie_word_embeddings", "false", "tie_word_embeddings='false': must be true or false"),
    ("mla_use_nope", "false", "mla_use_nope='false': must be true or false"),
    # wrong types: were TypeError, IndexError, AttributeError or a ValueError without the field
    ("eos_token_id", [], r"eos_token_id=\[\]: must be a token id"),
    ("num_expert_group", "8", "num_expert_group='8': must be an integer"),
    ("first_k_dense_replace", "1", "first_k_dense_replace='1': must be an integer"),
    ("routed_scaling_factor", "abc", "routed_scaling_factor='abc': must be a number"),
    ("linear_attn_config", [1], r"linear_attn_config=\[1\]: must be an object"),
    ("layer_types", ["linear_attention", "sliding_attention"], "layer_types=.*must be a list of"),
    ("vocab_size", "4096", "K3Config.vocab_size: must be an int"),
])
def test_config_fields_k3_cannot_honour_are_refused_naming_the_field(field, value, match):
    hf = json.loads(RELEASED.read_text()) | {field: value}
    with pytest.raises(ValueError, match=f"config.json:? {match}"):
        config_from_hf(hf)


def test_num_key_value_heads_is_not_read():
    """transformers' KimiLinearConfig keeps its default 32 KV heads whatever num_attention_heads is
    (a config built with 4 heads and no num_key_value_heads runs in transformers): k3 reads the
    model as transformers runs it, not refused."""
    hf = json.loads(RELEASED.read_text())
    assert config_from_hf(hf | {"num_key_value_heads": 1}) == config_from_hf(hf)


def test_several_end_tokens_stop_at_the_first():
    hf = json.loads(RELEASED.read_text()) | {"eos_token_id": [163586, 163585]}
    assert config_from_hf(hf).eos_token_id == 163586


def test_a_weight_that_is_not_floating_point_is_named(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint
    bad = tmp_path / "int"
    bad.mkdir()
    (bad / "config.json").write_text((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].long()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{bad}: model.embed_tokens.weight is stored as torch.int64"):
        load_kimi_linear(bad)
