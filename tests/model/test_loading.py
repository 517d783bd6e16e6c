"""k3.model.build and k3.model.load: one way to build, one way to load every layout k3 reads.

Each layout is written from the same built model; loading it back gives the same logits, an
expert-parallel rank gets exactly its rows of the experts, and `vision` picks the class the same
way everywhere.
"""
from __future__ import annotations

import json

import pytest
import torch

import k3.model
from helpers import rel_rms
from k3.model import get_preset
from k3.model import training_checkpoint as ckpt
from k3.model.hf_k3 import save_k3
from k3.model.hf_kimi import save_kimi_linear
from k3.model.multimodal import K3ForConditionalGeneration
from k3.model.pretrained import save_model_dir

IDS = torch.tensor([[5, 9, 17, 33, 2, 8, 100]])


def tiny(**kw):
    return get_preset("k3-tiny", num_layers=4, layer_types=["kda", "kda", "kda", "mla"],
                      mlp_types=["dense", "moe", "moe", "moe"], **kw)


def write_training(model, path):
    d = path / "k3"
    d.mkdir(parents=True)
    ckpt.save_shared(model, d)
    for r in range(2):  # as two expert-parallel ranks would
        part = k3.model.build(model.cfg, r, 2, seed=1)
        ckpt.save_experts(part, d, r, 2)
    return path


def write(layout, model, path):
    if layout == "training":
        return write_training(model, path)
    if layout == "k3-release":  # bf16 experts, not MXFP4: the comparison sees bf16 rounding only
        save_k3(model, path, quantize_experts=False)
    else:
        {"k3": save_model_dir, "kimi-linear": save_kimi_linear}[layout](model, path)
    return path


def experts_of(model):
    return [(l.mlp.experts.first, l.mlp.experts.count, l.mlp.experts.w_up) for l in model.model.layers if l.is_moe]


def test_build_places_experts_without_changing_their_values():
    cfg = tiny()
    full = k3.model.build(cfg, seed=1)
    for r in range(4):
        part = k3.model.build(cfg, r, 4, seed=1)
        for (first, count, w), (_, _, w_full) in zip(experts_of(part), experts_of(full)):
            assert (first, count) == (r * cfg.num_experts // 4, cfg.num_experts // 4)
            assert torch.equal(w, w_full[first:first + count])
        shared = {n: p for n, p in part.named_parameters() if ".experts." not in n}
        assert all(torch.equal(p, dict(full.named_parameters())[n]) for n, p in shared.items())


def test_build_leaves_the_callers_random_stream_alone():
    torch.manual_seed(7)
    a = torch.rand(3)
    torch.manual_seed(7)
    k3.model.build(tiny(), seed=1)
    assert torch.equal(torch.rand(3), a)


@pytest.mark.parametrize("layout", ["training", "k3", "k3-release", "kimi-linear"])
def test_every_layout_loads_back_the_same_model(layout, tmp_path):
    # Kimi Linear has no latent MoE, SiTU-GLU or AttnRes: that layout gets a Kimi-Linear-shaped model
    cfg = tiny(moe_latent_size=None, activation="swiglu", attn_res_block_size=None, q_lora_rank=None,
               mla_output_gate=False, kda_gate="unbounded", kda_output_gate="low_rank") if layout == "kimi-linear" \
        else tiny()
    model = k3.model.build(cfg, seed=1).eval()
    path = write(layout, model, tmp_path / layout)
    assert k3.model.load_config(path) == (k3.model.load(path).cfg)
    back = k3.model.load(path, dtype=torch.float32)
    with torch.no_grad():
        want, got = model(IDS).logits, back(IDS).logits
    if layout == "k3-release":  # the release stores bf16 (3% here on random weights; a wrong mapping is ~100%)
        assert rel_rms(got, want) < 5e-2
    else:
        assert torch.equal(got, want)
    rank = k3.model.load(path, dtype=torch.float32, ep_rank=1, ep_size=2)
    for (first, count, w), (_, _, w_full) in zip(experts_of(rank), experts_of(back)):
        assert (first, count) == (cfg.num_experts // 2, cfg.num_experts // 2)
        assert torch.equal(w, w_full[first:first + count])


@pytest.mark.parametrize("layout", ["training", "k3", "k3-release"])
def test_vision_picks_the_class_the_same_way_for_every_layout(layout, tmp_path):
    model = k3.model.build(get_preset("k3-tiny-vl"), seed=2).eval()
    path = write(layout, model, tmp_path / layout)
    assert isinstance(k3.model.load(path), K3ForConditionalGeneration)  # what the config holds
    text = k3.model.load(path, vision=False)
    assert type(text).__name__ == "K3ForCausalLM"
    assert set(text.state_dict()) == set(model.language_model.state_dict())
    plain = write(layout, k3.model.build(tiny(), seed=1), tmp_path / f"{layout}-text")
    with pytest.raises(ValueError, match="vision=True but"):
        k3.model.load(plain, vision=True)


@pytest.mark.parametrize("make,match", [
    (lambda d: d / "missing", "no such checkpoint directory"),
    (lambda d: d, "no config.json"),
    (lambda d: (d / "config.json").write_text("{not json") and d, "not JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]") and d, "not a JSON object"),
    (lambda d: (d / "config.json").write_bytes(b"\xff\xfe\x00") and d, "config.json: not JSON .*utf-8"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "llama"})) and d, "model_type 'llama'"),
])
def test_a_directory_k3_cannot_read_is_named(tmp_path, make, match):
    with pytest.raises(ValueError, match=match):
        k3.model.load(make(tmp_path))
    with pytest.raises(ValueError, match=match):
        k3.model.load_config(make(tmp_path))


@pytest.mark.parametrize("ep_rank,ep_size,match", [
    (0, 0, "ep_size >= 1"), (2, 2, "must lie in"), (-1, 2, "must lie in"), (0, 3, "must divide num_experts"),
    (0.5, 2, "ep_rank must be an integer"), (1, 1, "must lie in"),
])
def test_bad_expert_placement_is_refused(ep_rank, ep_size, match):
    with pytest.raises(ValueError, match=match):
        k3.model.build(tiny(), ep_rank, ep_size)


@pytest.mark.parametrize("layout", ["training", "k3", "k3-release"])
@pytest.mark.parametrize("ep_rank,ep_size", [(1, 1), (0, 0), (0, -1), (3, 2)])
def test_bad_expert_placement_is_refused_without_experts_too(layout, ep_rank, ep_size, tmp_path):
    """A model without MoE layers has no expert to place, but the placement is still checked."""
    cfg = tiny().replace(mlp_types=["dense"] * 4)
    with pytest.raises(ValueError, match="must lie in"):
        k3.model.build(cfg, ep_rank, ep_size)
    path = write(layout, k3.model.build(cfg, seed=1), tmp_path / layout)
    with pytest.raises(ValueError, match="must lie in"):
        k3.model.load(path, ep_rank=ep_rank, ep_size=ep_size)


def test_incomplete_training_checkpoint_is_named(tmp_path):
    model = k3.model.build(tiny(), seed=1)
    path = write_training(model, tmp_path / "ck")
    (path / "k3" / "experts-ep1-of-2.pt").unlink()
    with pytest.raises(ValueError, match="experts-ep0-of-2.pt .. experts-ep1-of-2.pt"):
        k3.model.load(path)
    (path / "k3" / "shared.pt").unlink()
    with pytest.raises(ValueError, match="no shared.pt"):
        k3.model.load(path)


def truncate(p):
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def put_nan(p):
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file
        st = load_file(str(p))
        st["lm_head.weight"][0, 0] = float("nan")
        save_file(st, str(p))
    else:
        st = torch.load(p)
        weights = st.get("weights", st)  # an expert file keeps them beside its optimizer state
        weights[next(iter(weights))][0, 0] = float("nan")
        torch.save(st, p)


def to_int64(p):
    """The first weight (safetensors: lm_head's) stored as int64: not a weight k3 can load."""
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file, save_file
        st = load_file(str(p))
        st["lm_head.weight"] = st["lm_head.weight"].long()
        save_file(st, str(p))
    else:
        st = torch.load(p)
        st[next(iter(st))] = st[next(iter(st))].long()
        torch.save(st, p)


def drop_first_key(p):
    st = torch.load(p)
    st.pop(next(iter(st)))
    torch.save(st, p)


class Executes:
    """A pickled object whose unpickling would call a function (here, a harmless one)."""

    def __reduce__(self):
        return (print, ("unpickled: this code ran",))


def add_code(p):
    st = torch.load(p)
    st["optimizer"]["payload"] = Executes()
    torch.save(st, p)


@pytest.mark.parametrize("layout,file,damage,match", [
    ("training", "k3/experts-ep0-of-2.pt", add_code, "experts-ep0-of-2.pt: cannot read"),  # never run
    ("k3", "model.safetensors", truncate, "model.safetensors as safetensors"),
    ("k3", "model.safetensors", lambda p: p.write_bytes(b""), "model.safetensors as safetensors"),
    ("k3", "model.safetensors", lambda p: p.write_bytes(b"\0" * 1000), "model.safetensors as safetensors"),
    ("k3", "model.safetensors", put_nan, "model.safetensors: lm_head.weight: non-finite"),
    ("training", "k3/shared.pt", truncate, "shared.pt: cannot read"),
    ("training", "k3/shared.pt", lambda p: p.write_bytes(b""), "shared.pt: cannot read"),
    ("training", "k3/experts-ep1-of-2.pt", truncate, "experts-ep1-of-2.pt: cannot read"),
    ("training", "k3/shared.pt", put_nan, r"shared.pt: model.embed_tokens.weight: non-finite"),
    ("training", "k3/experts-ep0-of-2.pt", put_nan, r"experts-ep0-of-2.pt: model.layers.1.mlp.experts.\w+: non-finite"),
    ("training", "k3/shared.pt", drop_first_key, r"missing tensors \['model.embed_tokens.weight'\]"),
    ("k3", "model.safetensors", to_int64, "model.safetensors: lm_head.weight is stored as torch.int64"),
    ("training", "k3/shared.pt", to_int64, r"shared.pt .*: model.embed_tokens.weight is stored as torch.int64"),
])
def test_damaged_checkpoint_is_a_value_error_naming_the_file(layout, file, damage, match, tmp_path):
    path = write(layout, k3.model.build(tiny(), seed=1), tmp_path / layout)
    damage(path / file)
    with pytest.raises(ValueError, match=match):
        k3.model.load(path)


@pytest.mark.parametrize("layout", ["k3", "training"])
def test_config_that_does_not_match_the_weights_is_named(layout, tmp_path):
    path = write(layout, k3.model.build(tiny(), seed=1), tmp_path / layout)
    cfg = path / ("k3/config.json" if layout == "training" else "config.json")
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"num_experts": 8, "num_experts_per_token": 2}))
    with pytest.raises(ValueError, match=r"mlp.gate.weight has shape \(16, 128\), the config makes \(8, 128\)"):
        k3.model.load(path)


@pytest.mark.parametrize("layout", ["k3", "training"])
def test_config_json_missing_fields_is_refused_naming_the_fields(layout, tmp_path):
    """Missing fields are never the full K3's (situ_glu, eps 1e-5, bounded gate): logits would differ."""
    cfg = tiny(activation="swiglu", kda_gate="unbounded", rms_norm_eps=1e-2)
    path = write(layout, k3.model.build(cfg, seed=1), tmp_path / layout)
    file = path / ("k3/config.json" if layout == "training" else "config.json")
    d = json.loads(file.read_text())
    for f in ("activation", "rms_norm_eps", "kda_gate"):
        del d[f]
    file.write_text(json.dumps(d))
    match = f"{file}: K3Config: missing field\\(s\\) \\['activation', 'kda_gate', 'rms_norm_eps'\\]"
    for read in (k3.model.load, k3.model.load_config):
        with pytest.raises(ValueError, match=match):
            read(path)


def test_build_refuses_a_model_larger_than_memory_before_allocating():
    with pytest.raises(ValueError, match=r"parameters take 1,0\d\d,\d\d\d.\d GiB, more than the .* GiB of cpu"):
        k3.model.build(tiny(vocab_size=1 << 40))  # 1 PiB: it tried to allocate it
    with pytest.raises(ValueError, match="cannot be allocated anywhere: .*overflow"):
        k3.model.build(tiny(vocab_size=1 << 62))
    on_meta = k3.model.build(tiny(vocab_size=1 << 40), device="meta")  # allocates nothing
    assert on_meta.lm_head.weight.is_meta and on_meta.lm_head.weight.shape == (1 << 40, 128)


NO_CUDA_DEVICE = f"cuda:{torch.cuda.device_count()}"  # one past the last, on any machine


@pytest.mark.parametrize("kw,match", [
    (dict(dtype=torch.int64), "dtype=torch.int64: must be a floating torch dtype"),
    (dict(dtype="int64"), "dtype='int64': must be a floating"),
    (dict(dtype="bf16"), "dtype='bf16': must be a floating"),
    (dict(dtype=16), "dtype=16: must be a floating"),
    (dict(device=NO_CUDA_DEVICE), f"device='{NO_CUDA_DEVICE}': this machine has"),
    (dict(device="gpu"), "device='gpu' is not a device"),
    (dict(device="meta"), "device='meta': .* no weights"),
])
def test_bad_load_arguments_are_named(kw, match, tmp_path):
    path = save_model_dir(k3.model.build(tiny(), seed=1), tmp_path / "k3")
    with pytest.raises(ValueError, match=match):
        k3.model.load(path, **kw)


def test_load_takes_a_dtype_by_name_and_build_checks_its_device(tmp_path):
    path = save_model_dir(k3.model.build(tiny(), seed=1), tmp_path / "k3")
    model = k3.model.load(path, dtype="bfloat16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays fp32
    with pytest.raises(ValueError, match=f"device='{NO_CUDA_DEVICE}'"):
        k3.model.build(tiny(), device=NO_CUDA_DEVICE)
