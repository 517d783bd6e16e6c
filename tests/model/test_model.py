"""K3ForCausalLM end to end on k3-tiny: cache, packing, training, validation."""
from __future__ import annotations

import json
import re

import pytest
import torch

from k3.model import K3Config, K3ForCausalLM, SamplingConfig, generate, get_preset


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset("k3-tiny")).eval()
    with torch.no_grad():  # non-trivial depth mixing, so AttnRes is exercised
        m.model.attn_res.queries.normal_(0, 0.05)
    return m


def test_every_k3_feature_is_on_in_tiny():
    c = get_preset("k3-tiny")
    assert c.layer_types[-1] == "mla" and c.layer_types.count("kda") == 3 * c.layer_types.count("mla")
    assert c.kda_gate == "bounded" and c.mla_output_gate and c.attn_res_block_size
    assert c.moe_latent_size and c.num_shared_experts >= 1 and c.activation == "situ_glu"
    assert c.mlp_types[0] == "dense" and set(c.mlp_types[1:]) == {"moe"}


def test_cached_generation_equals_uncached_forward(model):
    prompts = [[5, 17, 99, 3, 250, 7, 8, 1000, 42, 11], list(range(100, 123))]
    toks, logits = generate(model, prompts, SamplingConfig(max_tokens=10), return_logits=True)
    for p, t, lg in zip(prompts, toks, logits):
        with torch.no_grad():
            ref = model(torch.tensor([p + t])).logits[0, len(p) - 1:-1]
        err = (ref - lg).abs().max().item()
        assert err <= 1e-4, f"cached vs uncached logits differ by {err}"
        assert t == ref.argmax(-1).tolist()


def test_packed_batch_equals_one_by_one(model):
    seqs = [torch.randint(0, 4096, (n,)) for n in (5, 70, 1, 33)]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu).logits[0]
        for i, s in enumerate(seqs):
            alone = model(s[None]).logits[0]
            err = (packed[cu[i]:cu[i + 1]] - alone).abs().max().item()
            assert err <= 1e-4, f"sequence {i}: packed vs alone differ by {err}"


def test_packed_loss_never_crosses_a_boundary(model):
    a, b = torch.randint(0, 4096, (1, 9)), torch.randint(0, 4096, (1, 12))
    with torch.no_grad():
        la = model(a, labels=a).loss * 8
        lb = model(b, labels=b).loss * 11
        packed = torch.cat([a, b], 1)
        lp = model(packed, cu_seqlens=torch.tensor([0, 9, 21]), labels=packed).loss * 19
    assert abs(float(lp) - float(la + lb)) < 1e-3


def test_sampling_is_reproducible_with_a_seed(model):
    sc = SamplingConfig(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=123)
    a = generate(model, [[1, 2, 3]], sc)
    b = generate(model, [[1, 2, 3]], sc)
    assert a == b
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], SamplingConfig(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[1]], SamplingConfig(temperature=-1))
    with pytest.raises(ValueError, match="max_tokens"):
        generate(model, [[1]], SamplingConfig(max_tokens=0))
    with pytest.raises(ValueError, match="prompts"):
        generate(model, [[]])


@pytest.mark.slow  # ~20 s of training steps, the full tier
def test_overfits_a_small_batch():
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny")
    m = K3ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 64))
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for step in range(200):
        loss = m(ids, labels=ids).loss
        first = first if first is not None else loss.item()
        if loss.item() <= 0.1 * first:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() <= 0.1 * first, f"loss {first:.3f} -> {loss.item():.3f} after {step + 1} steps"


def test_bad_inputs_get_value_errors(model):
    with pytest.raises(ValueError, match="out of range"):
        model(torch.tensor([[1, 4096]]))
    with pytest.raises(ValueError, match="out of range"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="integer"):
        model(torch.ones(1, 3))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(torch.tensor([[1, 2, 3]]), cu_seqlens=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="labels"):
        model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="biases"):
        model.set_router_bias(torch.zeros(3, 3))


def test_solving_router_bias_routes_each_layer_with_its_solve_before_the_next(model):
    """Inside solving_router_bias, MoE layer i's solve sees its routing under the biases solved for
    the layers below it and its own bias in hand, and the tokens it routes with the returned bias
    reach the layers above: a forward with every layer solved so equals a plain forward under the
    solved biases. The hooks are gone afterwards, also after a solve that raises."""
    gates = [layer.mlp.gate for layer in model.model.layers if layer.is_moe]
    n, e = len(gates), model.cfg.num_experts
    new = torch.randn(n, e, generator=torch.Generator().manual_seed(1)) * 0.3
    ids = torch.randint(0, model.cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    seen = {}

    def solve(i, out):
        seen[i] = (out.margins.clone(), out.counts.clone())
        return new[i]

    try:
        with torch.no_grad():
            with model.model.solving_router_bias(solve):
                h, routers = model.model(ids, collect_router=True)
            assert sorted(seen) == list(range(n)) and all(g.rebias is None for g in gates)
            assert torch.equal(torch.stack([g.bias for g in gates]), new)
            ref_h, ref = model.model(ids, collect_router=True)
            assert torch.equal(h, ref_h) and all(torch.equal(a.expert_ids, b.expert_ids) for a, b in zip(routers, ref))
            for i in range(n):  # what layer i's solve saw: layers below solved, its own bias not yet
                model.set_router_bias(torch.cat([new[:i], torch.zeros(n - i, e)]))
                r = model.model(ids, collect_router=True)[1][i]
                assert torch.equal(seen[i][0], r.margins) and torch.equal(seen[i][1], r.counts), f"MoE layer {i}"
            assert not torch.equal(seen[n - 1][1], ref[n - 1].counts)  # the solved bias did change the routing

            def fails(i, out):
                raise RuntimeError("solve failed")
            with pytest.raises(RuntimeError, match="solve failed"), model.model.solving_router_bias(fails):
                model.model(ids, collect_router=True)
            assert all(g.rebias is None for g in gates)
    finally:
        model.set_router_bias(torch.zeros(n, e))


@pytest.mark.parametrize("change,field", [
    (dict(num_experts_per_token=16), "num_experts_per_token"),
    (dict(layer_types=["kda"] * 7), "layer_types"),
    (dict(mlp_types=["moe"] * 9), "mlp_types"),
    (dict(attn_res_block_size=0), "attn_res_block_size"),
    (dict(kda_num_heads=0), "kda_num_heads"),
    (dict(layer_types=["kda"] * 7 + ["attention"]), "layer_types"),
    (dict(kda_chunk_size=40), "kda_chunk_size"),
    (dict(kda_chunk_size=272), "kda_chunk_size"),
    (dict(kda_chunk_size=1 << 20), "kda_chunk_size"),  # its forward asked for 35 TB
    (dict(activation="gelu"), "activation"),
    (dict(eos_token_id=5000), "eos_token_id"),
])
def test_inconsistent_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        get_preset("k3-tiny", **change)


@pytest.mark.parametrize("field,value", [
    ("mla_output_gate", "false"), ("tie_word_embeddings", "no"), ("moe_renormalize", 0),
    ("hidden_size", True), ("hidden_size", 128.0), ("num_shared_experts", 1.5), ("num_shared_experts", "2"),
    ("num_shared_experts", None), ("eos_token_id", 2.5), ("eos_token_id", "2"), ("layer_types", None),
    ("layer_types", "kda"), ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1.0), ("rms_norm_eps", "1e-5"),
    ("mla_norm_eps", 0), ("routed_scaling", float("nan")), ("routed_scaling", float("-inf")),
    ("initializer_range", float("nan")), ("situ_b1", "4"), ("situ_b2", float("inf")),
    ("kda_gate_lower_bound", "-5"), ("activation", None),
    # finite, but NaN logits or meaningless: inf in fp32, or far past any model's value
    ("situ_b1", 1e39), ("situ_b2", 3.5e38), ("situ_b2", 1e5), ("routed_scaling", 1e300), ("routed_scaling", 1e4),
    ("kda_gate_lower_bound", -1e300), ("kda_gate_lower_bound", -89.0), ("rms_norm_eps", 1e300),
    ("mla_norm_eps", 2.0), ("initializer_range", 1e30),
])
def test_config_fields_of_the_wrong_type_or_range_name_the_field(field, value):
    d = get_preset("k3-tiny").to_dict() | {field: value}
    with pytest.raises(ValueError, match=f"K3Config.{field}: must be"):
        K3Config.from_dict(d)


@pytest.mark.parametrize("what,match", [
    ("null", "must be a JSON object"), ("3", "must be a JSON object"), ("[1]", "must be a JSON object"),
    ("", "cannot read"), ("DIR", "cannot read"), ("BINARY", "cannot read"), ("MISSING", "no such file"),
    ("BROKEN", "not valid JSON"),
])
def test_config_json_that_is_not_a_config_names_the_file(tmp_path, what, match):
    files = {"DIR": tmp_path, "BINARY": tmp_path / "bin.json", "MISSING": tmp_path / "none.json",
             "BROKEN": tmp_path / "broken.json"}
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "broken.json").write_text("{")
    arg = str(files.get(what, what))
    with pytest.raises(ValueError, match=match) as e:
        K3Config.from_json(arg)
    if what in files:
        assert str(files[what]) in str(e.value)


def test_config_json_roundtrip(tmp_path):
    for name in ("k3", "k3-tiny", "kimi-linear-48b-a3b", "k3-small"):
        c = get_preset(name)
        p = tmp_path / f"{name}.json"
        c.to_json(p)
        assert K3Config.from_json(p) == c
    d = json.loads(get_preset("k3-tiny").to_json())
    d["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        K3Config.from_dict(d)
    with pytest.raises(ValueError, match="preset"):
        get_preset("k4")


def test_the_gate_floor_is_the_kernels():
    from k3.kernels.kda import GATE_FLOOR
    from k3.model.config import KDA_GATE_FLOOR

    assert KDA_GATE_FLOOR == GATE_FLOOR


def test_the_configs_chunk_sizes_are_the_ones_the_kernels_take():
    from k3.kernels.kda.contract import check_chunk_size
    from k3.model.config import kda_chunk_size_ok

    def kernel_takes(n: int) -> bool:
        try:
            check_chunk_size(n)
        except ValueError:
            return False
        return True

    assert [n for n in range(0, 600) if kda_chunk_size_ok(n) != kernel_takes(n)] == []


def test_an_unknown_override_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['foo'\]"):
        get_preset("k3-tiny", foo=1)
    with pytest.raises(ValueError, match="bar"):
        get_preset("k3-tiny").replace(bar=2)


@pytest.mark.parametrize("preset", ["k3-tiny", "k3-tiny-vl"])
def test_a_config_json_missing_fields_is_refused_naming_file_and_fields(tmp_path, preset):
    """A missing field would take the full K3's value (situ_glu, 1e-5, bounded): never filled in."""
    d = get_preset(preset).to_dict()
    for f in ("activation", "rms_norm_eps", "kda_gate"):
        del d[f]
    if preset == "k3-tiny-vl":
        del d["vision_config"]["vt_rms_norm_eps"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    missing = ["activation", "kda_gate", "rms_norm_eps"] + (["vision_config.vt_rms_norm_eps"] if "vl" in preset else [])
    with pytest.raises(ValueError, match=re.escape(f"{p}: K3Config: missing field(s) {missing}")):
        K3Config.from_json(p)


def test_a_text_only_config_json_may_leave_out_the_vision_fields(tmp_path):
    c = get_preset("k3-tiny")
    d = c.to_dict()
    del d["vision_config"], d["media_placeholder_token_id"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert K3Config.from_json(tmp_path / "config.json") == c
