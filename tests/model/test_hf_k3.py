"""K3 release checkpoints: a random checkpoint written in the release layout (tests/release_reference.py)
loads into k3 with the logits of an independent fp32 forward; export round trips; MXFP4 packing;
expert-parallel streaming reads only a rank's experts; config fields k3 cannot honour are refused."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from release_reference import (load_release_files, reference_logits, release_tensors, tiny_release_config,
                               write_release_checkpoint)

from k3.model import K3ForCausalLM, SamplingConfig, generate, get_preset
from k3.model.hf_k3 import CheckpointReader, attn_res_pair, load_k3, save_k3
from k3.model.hf_k3_config import config_from_release, config_to_release, mlp_schedule, vision_from_release
from k3.model.multimodal import K3ForConditionalGeneration
from k3.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from k3.model.params import count_parameters, count_release_parameters, count_vision_parameters
import k3.model

REPO = Path(__file__).resolve().parents[2]
PUBLISHED = REPO / "model" / "data" / "k3_release_config.json"
VISION = ("vision_tower.", "mm_projector.")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _write(path: Path, cfg: dict, seed: int = 0) -> Path:
    write_release_checkpoint(path, cfg, release_tensors(cfg, seed))
    return path


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("k3rel") / "ckpt", tiny_release_config())


# -- MXFP4 ---------------------------------------------------------------------------------------
def test_mxfp4_worked_example():
    """The example in k3.model.mxfp4's docstring, byte for byte."""
    w = torch.zeros(1, 64)
    w[0, :4] = torch.tensor([1.0, -0.3, 5.5, 0.75])
    w[0, 32:34] = torch.tensor([40.0, -3.0])
    packed, scale = quantize_mxfp4(w)
    want = [0x92, 0x27] + [0] * 14 + [0x96] + [0] * 15
    assert packed.tolist() == [want] and scale.tolist() == [[127, 130]]
    back = dequantize_mxfp4(packed, scale, torch.float32)
    assert back[0, :4].tolist() == [1.0, -0.5, 6.0, 1.0] and back[0, 32:34].tolist() == [32.0, -4.0]
    assert back[0, 4:32].abs().sum() == 0 and back[0, 34:].abs().sum() == 0


@pytest.mark.parametrize("scale_log2", [-12, 0, 9])
@pytest.mark.parametrize("shape", [(3, 32), (17, 96)])
def test_mxfp4_roundtrip_idempotent_and_within_half_a_step(shape, scale_log2):
    g = torch.Generator().manual_seed(shape[0] + scale_log2)
    w = torch.randn(*shape, generator=g) * 2.0 ** scale_log2
    w[0, :32] = 0  # an all-zero group
    w[1, 5] = -w[1].abs().max() * 1.9  # a group whose largest value clamps to 6
    packed, scale = quantize_mxfp4(w)
    deq = dequantize_mxfp4(packed, scale, torch.float32)
    again = quantize_mxfp4(deq)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)
    assert torch.equal(dequantize_mxfp4(packed, scale, torch.bfloat16).float(), deq)  # exact in bf16 too
    step = 2.0 ** (scale.float() - 127)  # the group's unit; E2M1 spacing is at most 2 units, clamping 2 units
    err = (deq - w).abs().reshape(shape[0], -1, 32)
    assert (err <= 2 * step[..., None]).all()
    assert torch.equal(deq[0, :32], torch.zeros(32)) and scale[0, 0] == 0


@pytest.mark.parametrize("packed,scale,match", [
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8), "w1.weight_scale: shape"),
    (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8), "w1.weight_packed: must be"),
    (torch.zeros(2, 16, dtype=torch.uint8), torch.tensor([[3], [255]], dtype=torch.uint8),
     r"w1.weight_scale: byte 0xFF \(NaN in E8M0\) at \[row, group\] \[1, 0\]"),
])
def test_mxfp4_rejects_bad_tensors(packed, scale, match):
    with pytest.raises(ValueError, match=match):
        dequantize_mxfp4(packed, scale, name="w1")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 48))


# -- load: logits, dtypes ------------------------------------------------------------------------------
def test_logits_match_independent_reference(release):
    model = load_k3(release, dtype=torch.float32, vision=False).eval()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids).logits
    ref = reference_logits(release, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_cached_greedy_decode_follows_the_reference(release):
    """The cache path (KDA state slots, MLA pages) the engine runs, on the loaded release weights."""
    model = load_k3(release, dtype=torch.float32, vision=False).eval()
    prompt = [5, 17, 3, 99, 42, 7, 250]
    got = generate(model, [prompt], SamplingConfig(max_tokens=5))[0]
    ref = reference_logits(release, torch.tensor([prompt + got]))[0]
    assert got == ref[len(prompt) - 1:-1].argmax(-1).tolist()


def test_default_dtypes_follow_the_checkpoint(release):
    model = load_k3(release, vision=False)
    params = dict(model.named_parameters())
    assert params["model.layers.1.mlp.experts.w_gate"].dtype == torch.bfloat16
    assert params["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    for n in ("model.layers.0.self_attn.A_log", "model.layers.0.self_attn.conv_weight",
              "model.layers.1.mlp.gate.weight", "model.attn_res.queries"):
        assert params[n].dtype == torch.float32, n
    assert model.model.layers[1].mlp.gate.bias.dtype == torch.float32


# -- save: round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize("vision", [False, True])
def test_export_import_export_is_bit_identical(release, tmp_path, vision):
    save_k3(load_k3(release, vision=vision), tmp_path / "a", max_shard_bytes=96 << 10)
    save_k3(load_k3(tmp_path / "a", vision=vision), tmp_path / "b", max_shard_bytes=96 << 10)
    ia, ib = (json.loads((tmp_path / d / "model.safetensors.index.json").read_text()) for d in "ab")
    assert ia == ib and len(set(ia["weight_map"].values())) > 1
    assert (tmp_path / "a" / "config.json").read_text() == (tmp_path / "b" / "config.json").read_text()
    ta, tb = load_release_files(tmp_path / "a"), load_release_files(tmp_path / "b")
    assert ta.keys() == tb.keys() and any(n.startswith(VISION) for n in ta) == vision
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and _bytes(ta[n]) == _bytes(tb[n]), n


@pytest.mark.parametrize("vision", [False, True])
def test_export_keeps_the_release_tensors(release, tmp_path, vision):
    """Release -> k3 -> release: every tensor comes back bit for bit, except the AttnRes pairs (the
    same products norm * proj, factored anew), A_log's unused padding (zeros) and re-packed experts
    (the same dequantised values); a text-only load writes a text-only checkpoint."""
    save_k3(load_k3(release, vision=vision), tmp_path / "out")
    orig, back = load_release_files(release), load_release_files(tmp_path / "out")
    assert set(back) == {n for n in orig if vision or not n.startswith(VISION)}
    cfg = config_from_release(json.loads((release / "config.json").read_text()))
    for n, t in back.items():
        if n.endswith("_res_proj.weight"):
            norm = n.replace("_proj.weight", "_norm.weight")
            assert torch.equal(t.float() * back[norm].float(), orig[n].float() * orig[norm].float()), n
        elif n.endswith("_res_norm.weight"):
            assert t.shape == orig[n].shape and t.dtype == torch.bfloat16, n
        elif n.endswith(".A_log"):
            H = cfg.kda_num_heads
            assert torch.equal(t[:H], orig[n][:H]) and not t[H:].any(), n
        elif n.endswith(".weight_packed"):
            s = n.replace("weight_packed", "weight_scale")
            assert torch.equal(dequantize_mxfp4(t, back[s], torch.float32),
                               dequantize_mxfp4(orig[n], orig[s], torch.float32)), n
        elif not n.endswith(".weight_scale"):
            assert t.dtype == orig[n].dtype and _bytes(t) == _bytes(orig[n]), n
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_from_release(out_cfg) == (cfg if vision else cfg.replace(vision_config=None))
    assert out_cfg["architectures"] == ["KimiK3ForConditionalGeneration"] and out_cfg["model_type"] == "kimi_k3"


@pytest.mark.parametrize("vision", [False, True])
def test_export_gives_back_the_same_model(release, tmp_path, vision):
    """load(save_k3(load(release))) holds the very values load(release) holds, so the logits are equal."""
    first = load_k3(release, dtype=torch.float32, vision=vision).eval()
    save_k3(first, tmp_path / "out")
    again = load_k3(tmp_path / "out", dtype=torch.float32, vision=vision).eval()
    want = first.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in again.state_dict().items())
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(3))
    text = (lambda m: m.language_model) if vision else (lambda m: m)
    with torch.no_grad():
        assert torch.equal(text(again)(ids).logits, text(first)(ids).logits)


def _leaves(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def test_export_keeps_the_config_fields_k3_does_not_use(tmp_path):
    """Every field of the loaded config.json comes back with its value (k3 adds only fields it writes
    itself), so other loaders read the export as they read the release."""
    published = json.loads(PUBLISHED.read_text())
    cfg = tiny_release_config(auto_map=published["text_config"]["auto_map"], initializer_range=0.02, top_k=50)
    for key in ("image_placeholder", "ignore_index", "dtype"):
        cfg[key] = published[key]
    cfg["text_config"]["linear_attn_config"]["chunk_size"] = 64
    cfg["text_config"]["quantization_config"]["quantization_status"] = "compressed"
    path = _write(tmp_path / "rel", cfg)
    save_k3(load_k3(path), tmp_path / "out")
    orig, out = _leaves(cfg), _leaves(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert {k: out.get(k, "<dropped>") for k in orig} == orig
    assert set(out) - set(orig) <= set(_leaves(config_to_release(config_from_release(cfg), with_vision=True)))
    save_k3(load_k3(path, vision=False), tmp_path / "text", quantize_experts=False)
    text_only = json.loads((tmp_path / "text" / "config.json").read_text())
    assert "vision_config" not in text_only and "quantization_config" not in text_only["text_config"]
    assert text_only["text_config"]["initializer_range"] == 0.02 and text_only["image_placeholder"]
    back = _leaves(config_to_release(config_from_release(published), with_vision=True, base=published))
    assert {k: back.get(k, "<dropped>") for k in _leaves(published)} == _leaves(published)


def test_saving_a_rank_over_its_own_checkpoint_is_refused_and_leaves_it(release, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(release, ck)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    m = load_k3(ck, ep_rank=1, ep_size=2)
    with pytest.raises(ValueError, match="loaded from"):
        save_k3(m, ck)
    with pytest.raises(ValueError, match=r"holds experts \[4, 8\) of 8"):
        save_k3(m, ck, overwrite=True)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


@pytest.mark.parametrize("scale_log2", [-20, 0, 7])
def test_attn_res_pairs_keep_the_query(scale_log2):
    """A query that is a product of two bf16 numbers (every loaded release query) is factored exactly
    and the same way again; any other fp32 query to within 2**-11 of its size, 2**-14 on average
    (bf16 alone: 2**-8, 2**-9.5)."""
    g = torch.Generator().manual_seed(scale_log2 + 30)
    norm, proj = (torch.randn(4096, generator=g) * 2.0 ** scale_log2).bfloat16(), torch.randn(4096, generator=g).bfloat16()
    exact = norm.float() * proj.float()
    exact[:7] = 0
    n, p = attn_res_pair(exact)
    assert n.dtype == p.dtype == torch.bfloat16 and p.shape == (1, 4096)
    assert torch.equal(n.float() * p.float().reshape(-1), exact)
    assert all(torch.equal(a, b) for a, b in zip(attn_res_pair(n.float() * p.float().reshape(-1)), (n, p)))
    trained = torch.randn(4096, generator=g) * 2.0 ** scale_log2
    n, p = attn_res_pair(trained)
    rel = (n.float() * p.float().reshape(-1) - trained).abs() / trained.abs()
    assert rel.max() <= 2.0 ** -11 and rel.mean() <= 2.0 ** -13.5


def test_k3_model_round_trip_keeps_logits(tmp_path):
    """A k3-built model (fp32, random) exported (bf16 weights, MXFP4 experts) and imported gives
    back the exported values and nearly the same logits."""
    torch.manual_seed(0)
    cfg = get_preset("k3-tiny", vocab_size=512, num_layers=2, layer_types=["kda", "mla"], mlp_types=["dense", "moe"],
                     num_experts=8, attn_res_block_size=1)
    model = K3ForCausalLM(cfg).eval()
    save_k3(model, tmp_path / "t")
    again = load_k3(tmp_path / "t", dtype=torch.float32, vision=False).eval()
    w, back = model.model.layers[1].mlp.experts.w_up, again.model.layers[1].mlp.experts.w_up
    assert torch.equal(back[3], dequantize_mxfp4(*quantize_mxfp4(w[3]), torch.float32))
    assert torch.equal(again.lm_head.weight, model.lm_head.weight.to(torch.bfloat16).float())
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert (again(ids).logits - model(ids).logits).abs().max() < 0.5  # bf16 + MXFP4 rounding, not garbage


# -- expert-parallel streaming -------------------------------------------------------------------------
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_ep_rank_reads_only_its_experts(release, ep_rank):
    reader = CheckpointReader(release)
    part = load_k3(release, ep_rank=ep_rank, ep_size=2, reader=reader, vision=False)
    full = load_k3(release, vision=False)
    n = 4  # 8 experts over 2 ranks
    mine = range(ep_rank * n, (ep_rank + 1) * n)
    expert_reads = [k for k in reader.reads if ".experts." in k]
    assert expert_reads and all(int(k.split(".experts.")[1].split(".")[0]) in mine for k in expert_reads)
    assert len(expert_reads) == 3 * 3 * n * 2  # 3 MoE layers x (w1, w3, w2) x own experts x (packed, scale)
    assert all(c == 1 for c in reader.reads.values())
    assert not any(k.startswith(VISION) for k in reader.reads)  # a text load never reads the tower
    assert sorted(reader.opened) == ["model-00001-of-00003.safetensors", f"model-{ep_rank + 2:05d}-of-00003.safetensors"]
    fp, pp = dict(full.named_parameters()), dict(part.named_parameters())
    assert fp.keys() == pp.keys()
    for k, v in pp.items():
        want = fp[k][mine.start:mine.stop] if ".experts." in k else fp[k]
        assert torch.equal(v, want), k
    assert part.model.layers[1].mlp.experts.first == mine.start


_PEAK = r"""
import json, sys, torch
torch.set_num_threads(1)
from k3.model.hf_k3 import load_k3
from k3.model.params import count_parameters
from k3.model.hf_k3 import read_config
path, warm = sys.argv[1], sys.argv[2]
load_k3(warm, vision=False)  # torch's lazy imports (dynamo, ~100 MB) and allocator warm-up, outside the measurement
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM to the current resident size
base = status("VmRSS:")
m = load_k3(path, dtype=torch.float32, ep_rank=0, ep_size=2, vision=False)
peak = status("VmHWM:") - base
rank = sum(p.numel() * p.element_size() for p in m.parameters())
full = count_parameters(read_config(path)[1]).total * 4
print(json.dumps({"peak_growth": peak, "rank_model_bytes": rank, "full_model_bytes": full}))
"""


def test_ep_load_peak_memory_below_full_model(release, tmp_path):
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak resident size")
    cfg = tiny_release_config(hidden_size=128, num_hidden_layers=3, num_experts=32, moe_intermediate_size=256,
                              routed_expert_hidden_size=256, linear_attn_config={
                                  "kda_layers": [1, 2], "full_attn_layers": [3], "num_heads": 2, "head_dim": 32,
                                  "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True})
    cfg.pop("vision_config")
    path = _write(tmp_path / "big", cfg)
    out = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(release)], capture_output=True, text=True,
                         check=True, cwd=REPO)
    r = json.loads(out.stdout)
    assert r["rank_model_bytes"] < 0.6 * r["full_model_bytes"]
    assert r["peak_growth"] < r["full_model_bytes"], r


# -- config ---------------------------------------------------------------------------------------
def test_published_config_is_the_k3_preset():
    cfg = config_from_release(json.loads(PUBLISHED.read_text()))
    assert cfg == get_preset("k3", bos_token_id=163584, eos_token_id=163586, pad_token_id=163839)
    assert config_from_release(config_to_release(cfg, with_vision=True)) == cfg


def test_release_layout_count_agrees_with_k3():
    cfg = config_from_release(json.loads(PUBLISHED.read_text()))
    r = count_release_parameters(cfg)
    assert r.k3_total == count_parameters(get_preset("k3")).total
    assert r.total - r.k3_total == r.explained == 187 * 7168 + 69 * (128 - 96) + 92 * 896
    assert abs(r.total / 2.779e12 - 1) < 0.005 and r.mxfp4_scales * 32 == count_parameters(cfg).routed_experts
    # A public per-tensor listing of the release counts 497,220 tensors: text plus tower and projector.
    vision = count_vision_parameters(cfg)
    with torch.device("meta"):
        vl = K3ForConditionalGeneration(cfg)
    n_vision = sum(1 for n, _ in vl.named_parameters() if not n.startswith("language_model."))
    assert r.tensors + n_vision == 497_220 and vision.tower + vision.projector == vision.total


def test_vision_tower_loads_as_released(release):
    model = load_k3(release, dtype=torch.float32, vision=True).eval()
    files = load_release_files(release)
    assert isinstance(model, K3ForConditionalGeneration)
    names = [n for n, _ in model.named_parameters() if n.startswith(VISION)]
    assert sorted(names) == sorted(n for n in files if n.startswith(VISION))
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], files[n].float()) for n in names)
    text = load_k3(release, dtype=torch.float32, vision=False)
    assert all(torch.equal(a, b) for a, b in zip(model.language_model.state_dict().values(),
                                                 text.state_dict().values()))
    grid = [(1, 4, 4)]  # one image of 4 x 4 patches -> 2 x 2 merged tokens
    pixels = torch.randn(16, 3, 14, 14, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 2] + [200] * 4 + [3]])
    with torch.no_grad():
        rows = model.encode_media(pixels, grid)[0]
        logits = model.language_model(ids, inputs_embeds=model.splice(ids, rows)).logits
    assert rows.shape == (4, 64) and torch.isfinite(logits).all()
    assert not torch.allclose(logits, text(ids).logits)  # the image rows replaced the placeholders


def test_vision_reads_with_expert_parallelism(release):
    reader = CheckpointReader(release)
    part = load_k3(release, ep_rank=1, ep_size=2, reader=reader, vision=True)
    assert part.language_model.model.layers[1].mlp.experts.first == 4
    assert sum(k.startswith(VISION) for k in reader.reads) == sum(k.startswith(VISION) for k in reader.keys())
    assert all(int(k.split(".experts.")[1].split(".")[0]) >= 4 for k in reader.reads if ".experts." in k)


@pytest.mark.parametrize("change,match", [({"mlp_type": "swiglu"}, "mlp_type"), ({"vt_dropout": 0.1}, "vt_dropout")])
def test_vision_config_k3_cannot_honour_is_refused(change, match):
    with pytest.raises(ValueError, match=match):
        vision_from_release({**tiny_release_config()["vision_config"], **change})


def test_moe_layer_freq_is_honoured():
    cfg = config_from_release(tiny_release_config(num_hidden_layers=6, moe_layer_freq=2, linear_attn_config={
        "kda_layers": [1, 2, 3, 5], "full_attn_layers": [4, 6], "num_heads": 4, "head_dim": 32,
        "short_conv_kernel_size": 4, "gate_lower_bound": None}))  # null: Kimi Linear's unbounded gate
    assert cfg.mlp_types == ["dense", "dense", "moe", "dense", "moe", "dense"] == mlp_schedule(6, 1, 2)
    assert cfg.kda_gate == "unbounded" and cfg.kda_output_gate == "low_rank"
    assert config_to_release(cfg)["text_config"]["moe_layer_freq"] == 2
    with pytest.raises(ValueError, match="mlp_types"):
        config_to_release(cfg.replace(mlp_types=["dense", "moe", "dense", "dense", "moe", "moe"]))


def test_load_pretrained_reads_the_release(release):
    a = k3.model.load(release, dtype=torch.float32, ep_rank=1, ep_size=2)
    b = load_k3(release, dtype=torch.float32, ep_rank=1, ep_size=2, vision=False)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
