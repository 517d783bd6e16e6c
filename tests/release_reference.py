"""Test utilities for K3 release checkpoints, written without k3's model code.

`write_release_checkpoint` writes random weights straight in the release layout (names, dtypes,
MXFP4 codes and scales drawn at random, sharded safetensors with an index, text_config /
vision_config). `reference_logits` is a plain fp32 forward of those files following the
release's modeling code (per-token KDA recurrence, naive MLA, per-token MoE loop, AttnRes with
separate norm weight and projection), so k3's loader and model are checked against something
that shares none of their code.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

P = "language_model."
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def tiny_release_config(**text_overrides) -> dict:
    """A small release config.json (the published field names) with every K3 feature on."""
    text = {
        "model_type": "kimi_linear", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
        "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "mla_use_nope": True,
        "mla_use_output_gate": True, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "attn_res_block_size": 2, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "moe_intermediate_size": 32, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 1.0, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0, "tie_word_embeddings": False,
        "linear_attn_config": {"kda_layers": [1, 2], "full_attn_layers": [3, 4], "num_heads": 4, "head_dim": 32,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                                "ignore": ["re:.*shared_experts.*"],
                                "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                                              "weights": {"num_bits": 4, "group_size": 32}}}},
    }
    text.update(text_overrides)
    vision = {  # the released vision_config fields, at CPU size
        "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
        "init_pos_emb_height": 8, "init_pos_emb_time": 4, "init_pos_emb_width": 8, "linear_bias": False,
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 32,
        "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False,
        "patch_size": 14, "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "qkv_hidden_size": 48,
        "text_hidden_size": text["hidden_size"], "vt_hidden_size": 32, "vt_intermediate_size": 64,
        "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2,
    }
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text,
            "vision_config": vision, "media_placeholder_token_id": 200, "pad_token_id": 0}


def release_tensors(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors in the release layout for config `cfg` (the full config.json dict)."""
    g = torch.Generator().manual_seed(seed)
    t = cfg["text_config"]
    D, V, L = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    lin = t["linear_attn_config"]
    H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    out: dict[str, torch.Tensor] = {}

    def w(name, *shape, std=0.08, dtype=torch.bfloat16, mean=0.0):
        out[name] = (torch.randn(*shape, generator=g) * std + mean).to(dtype)

    w(P + "model.embed_tokens.weight", V, D, std=1.0)
    w(P + "lm_head.weight", V, D)
    w(P + "model.norm.weight", D, std=0.1, mean=1.0)
    for base in [P + "model.output_attn_res"] + [f"{P}model.layers.{i}.{s}" for i in range(L)
                                                  for s in ("self_attention_res", "mlp_res")]:
        w(base + "_norm.weight", D, std=0.1, mean=1.0)
        w(base + "_proj.weight", 1, D, std=0.5)
    for i in range(L):
        p = f"{P}model.layers.{i}"
        w(f"{p}.input_layernorm.weight", D, std=0.1, mean=1.0)
        w(f"{p}.post_attention_layernorm.weight", D, std=0.1, mean=1.0)
        a = f"{p}.self_attn"
        if i + 1 in lin["kda_layers"]:
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                w(f"{a}.{n}.weight", H * K, D)
            for x in "qkv":
                w(f"{a}.{x}_conv1d.weight", H * K, 1, W, std=0.4, dtype=torch.float32)
            a_log = torch.rand(max(H, K), generator=g) * 2  # the padding after H is never read
            a_log[:H] = torch.empty(H).uniform_(1, 16, generator=g).log()
            out[f"{a}.A_log"] = a_log
            w(f"{a}.dt_bias", H * K, std=0.5, dtype=torch.float32)
            w(f"{a}.f_a_proj.weight", K, D)
            w(f"{a}.f_b_proj.weight", H * K, K)
            w(f"{a}.b_proj.weight", H, D)
            w(f"{a}.o_norm.weight", K, std=0.1, mean=1.0, dtype=torch.float32)
            w(f"{a}.o_proj.weight", D, H * K)
        else:
            Hm, nope, rope, vd = t["num_attention_heads"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
            w(f"{a}.q_a_proj.weight", t["q_lora_rank"], D)
            w(f"{a}.q_a_layernorm.weight", t["q_lora_rank"], std=0.1, mean=1.0)
            w(f"{a}.q_b_proj.weight", Hm * (nope + rope), t["q_lora_rank"])
            w(f"{a}.kv_a_proj_with_mqa.weight", t["kv_lora_rank"] + rope, D)
            w(f"{a}.kv_a_layernorm.weight", t["kv_lora_rank"], std=0.1, mean=1.0)
            w(f"{a}.kv_b_proj.weight", Hm * (nope + vd), t["kv_lora_rank"])
            w(f"{a}.g_proj.weight", Hm * vd, D)
            w(f"{a}.o_proj.weight", D, Hm * vd)
        if i < t["first_k_dense_replace"] or i % t["moe_layer_freq"]:
            I = t["intermediate_size"]
            for n, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
                w(f"{p}.mlp.{n}.weight", *shape)
            continue
        m = f"{p}.block_sparse_moe"
        E, I, De = t["num_experts"], t["moe_intermediate_size"], t["routed_expert_hidden_size"]
        w(f"{m}.gate.weight", E, D, std=0.3)
        w(f"{m}.gate.e_score_correction_bias", E, std=0.05, dtype=torch.float32)
        Is = I * t["num_shared_experts"]
        for n, shape in (("gate_proj", (Is, D)), ("up_proj", (Is, D)), ("down_proj", (D, Is))):
            w(f"{m}.shared_experts.{n}.weight", *shape)
        w(f"{m}.routed_expert_down_proj.weight", De, D)
        w(f"{m}.routed_expert_norm.weight", De, std=0.1, mean=1.0)
        w(f"{m}.routed_expert_up_proj.weight", D, De)
        for e in range(E):
            for src, (rows, cols) in (("w1", (I, De)), ("w3", (I, De)), ("w2", (De, I))):
                out[f"{m}.experts.{e}.{src}.weight_packed"] = torch.randint(0, 256, (rows, cols // 2), generator=g,
                                                                            dtype=torch.uint8)
                out[f"{m}.experts.{e}.{src}.weight_scale"] = torch.randint(121, 125, (rows, cols // 32), generator=g,
                                                                           dtype=torch.uint8)
    v = cfg.get("vision_config")
    if v:  # the tower and projector, named and shaped as in the release's tensor listing
        Dv, q, p, Iv = v["vt_hidden_size"], v["qkv_hidden_size"], v["patch_size"], v["vt_intermediate_size"]
        w("vision_tower.patch_embed.proj.weight", Dv, 3, p, p)
        w("vision_tower.patch_embed.pos_emb.weight", v["init_pos_emb_height"], v["init_pos_emb_width"], Dv)
        for b in range(v["vt_num_hidden_layers"]):
            blk = f"vision_tower.encoder.blocks.{b}"
            for n, shape in (("norm0", (Dv,)), ("norm1", (Dv,))):
                w(f"{blk}.{n}.weight", *shape, std=0.1, mean=1.0)
            for n, shape in (("wqkv", (3 * q, Dv)), ("wo", (Dv, q)), ("mlp.fc0", (Iv, Dv)), ("mlp.fc1", (Dv, Iv))):
                w(f"{blk}.{n}.weight", *shape)
        w("vision_tower.encoder.final_layernorm.weight", Dv, std=0.1, mean=1.0)
        m = v["mm_hidden_size"] * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
        w("mm_projector.proj.0.weight", m, m)
        w("mm_projector.proj.2.weight", D, m)
        w("mm_projector.post_norm.weight", D, std=0.1, mean=1.0)
    return out


def write_release_checkpoint(path: Path, cfg: dict, tensors: dict[str, torch.Tensor],
                             expert_shards: int = 2) -> None:
    """Shard 1 holds every non-expert tensor; expert e of every layer goes to shard
    2 + e * expert_shards // E, so expert-parallel ranks need disjoint expert shards."""
    path.mkdir(parents=True, exist_ok=True)
    E = cfg["text_config"]["num_experts"]
    n = 1 + expert_shards
    groups: list[dict] = [{} for _ in range(n)]
    for name, t in tensors.items():
        parts = name.split(".experts.")
        s = 1 + int(parts[1].split(".")[0]) * expert_shards // E if len(parts) == 2 else 0
        groups[s][name] = t
    weight_map = {}
    for s, grp in enumerate(groups):
        file = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        save_file(grp, str(path / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in grp})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def load_release_files(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# -- the reference forward (fp32) ------------------------------------------------------------------
def _rms(x, w, eps):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


def _mxfp4(packed, scale):
    codes = torch.stack([packed & 15, packed >> 4], -1).reshape(packed.shape[0], -1).long()
    vals = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return (vals.reshape(packed.shape[0], -1, 32) * 2.0 ** (scale.float() - 127)[..., None]).reshape(vals.shape)


def _situ(g, u, b1, b2):
    return b1 * torch.tanh(g / b1) * torch.sigmoid(g) * (b2 * torch.tanh(u / b2))


def _mlp(x, wt, base, t):
    g, u = x @ wt[base + ".gate_proj.weight"].T, x @ wt[base + ".up_proj.weight"].T
    return _situ(g, u, t["activation_situ_beta"], t["activation_situ_linear_beta"]) @ wt[base + ".down_proj.weight"].T


def _kda(x, wt, a, t):
    lin = t["linear_attn_config"]
    H, K, W = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    B, T, _ = x.shape

    def conv(u, weight):  # causal depthwise conv, weight [C, 1, W], then SiLU
        u = F.pad(u.transpose(1, 2), (W - 1, 0))
        return F.silu(F.conv1d(u, weight, groups=weight.shape[0]).transpose(1, 2))

    q, k, v = (conv(x @ wt[f"{a}.{n}_proj.weight"].T, wt[f"{a}.{n}_conv1d.weight"]).reshape(B, T, H, K) for n in "qkv")
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    f = ((x @ wt[f"{a}.f_a_proj.weight"].T) @ wt[f"{a}.f_b_proj.weight"].T).reshape(B, T, H, K)
    rate = wt[f"{a}.A_log"][:H].exp()[:, None]
    g = lin["gate_lower_bound"] * torch.sigmoid(rate * (f + wt[f"{a}.dt_bias"].reshape(H, K)))
    beta = torch.sigmoid(x @ wt[f"{a}.b_proj.weight"].T)
    S = torch.zeros(B, H, K, K)
    outs = []
    for s in range(T):
        S = S * g[:, s].exp()[..., None]
        u = beta[:, s, :, None] * (v[:, s] - torch.einsum("bhkv,bhk->bhv", S, k[:, s]))
        S = S + k[:, s, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, s]) * K ** -0.5)
    o = torch.stack(outs, 1)
    gate = (x @ wt[f"{a}.g_proj.weight"].T).reshape(B, T, H, K)
    o = _rms(o, wt[f"{a}.o_norm.weight"], t["rms_norm_eps"]) * torch.sigmoid(gate)
    return o.reshape(B, T, H * K) @ wt[f"{a}.o_proj.weight"].T


def _mla(x, wt, a, t):
    B, T, _ = x.shape
    H, nope, rope, vd, r = (t[k] for k in ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim",
                                           "v_head_dim", "kv_lora_rank"))
    q = _rms(x @ wt[f"{a}.q_a_proj.weight"].T, wt[f"{a}.q_a_layernorm.weight"], 1e-6) @ wt[f"{a}.q_b_proj.weight"].T
    q = q.reshape(B, T, H, nope + rope).transpose(1, 2)
    ckv = x @ wt[f"{a}.kv_a_proj_with_mqa.weight"].T
    c, kpe = ckv[..., :r], ckv[..., r:]
    kv = (_rms(c, wt[f"{a}.kv_a_layernorm.weight"], 1e-6) @ wt[f"{a}.kv_b_proj.weight"].T).reshape(B, T, H, nope + vd)
    k = torch.cat([kv[..., :nope], kpe[:, :, None].expand(B, T, H, rope)], -1).transpose(1, 2)
    v = kv[..., nope:].transpose(1, 2)
    scores = q @ k.transpose(-1, -2) * (nope + rope) ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    o = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * vd)
    o = o * torch.sigmoid(x @ wt[f"{a}.g_proj.weight"].T)
    return o @ wt[f"{a}.o_proj.weight"].T


def _moe(x, wt, m, t):
    B, T, D = x.shape
    xs = x.reshape(-1, D)
    scores = torch.sigmoid(xs @ wt[f"{m}.gate.weight"].float().T)
    idx = (scores + wt[f"{m}.gate.e_score_correction_bias"]).topk(t["num_experts_per_token"], -1).indices
    wts = scores.gather(1, idx)
    wts = wts / (wts.sum(-1, keepdim=True) + 1e-20) * t["routed_scaling_factor"]
    lat = xs @ wt[f"{m}.routed_expert_down_proj.weight"].T
    y = torch.zeros_like(lat)
    for n in range(xs.shape[0]):
        for j in range(idx.shape[1]):
            e = f"{m}.experts.{int(idx[n, j])}"
            w1, w3, w2 = (_mxfp4(wt[f"{e}.{s}.weight_packed"], wt[f"{e}.{s}.weight_scale"]) for s in ("w1", "w3", "w2"))
            h = _situ(lat[n] @ w1.T, lat[n] @ w3.T, t["activation_situ_beta"], t["activation_situ_linear_beta"])
            y[n] += wts[n, j] * (h @ w2.T)
    y = _rms(y, wt[f"{m}.routed_expert_norm.weight"], t["rms_norm_eps"]) @ wt[f"{m}.routed_expert_up_proj.weight"].T
    return (y + _mlp(xs, wt, f"{m}.shared_experts", t)).reshape(B, T, D)


def _mix(blocks, partial, norm_w, proj_w, eps):
    v = torch.stack(blocks + [partial])  # [n, B, T, D]
    logits = (_rms(v, None, eps) * (norm_w.float() * proj_w.float().reshape(-1))).sum(-1)
    return (logits.softmax(0)[..., None] * v).sum(0)


def reference_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, T, V] of the release checkpoint at `path` for token ids [B, T]."""
    cfg = json.loads((path / "config.json").read_text())
    t = cfg["text_config"]
    wt = {k: (v.float() if v.is_floating_point() else v) for k, v in load_release_files(path).items()}
    eps, bs = t["rms_norm_eps"], t["attn_res_block_size"]

    def res(base):
        return wt[base + "_norm.weight"], wt[base + "_proj.weight"]

    h = wt[P + "model.embed_tokens.weight"][ids]
    blocks: list[torch.Tensor] = []
    for i in range(t["num_hidden_layers"]):
        p = f"{P}model.layers.{i}"
        partial = h
        x = _mix(blocks, partial, *res(p + ".self_attention_res"), eps) if blocks else partial
        if i % bs == 0:  # a block starts: the running sum becomes a completed block
            blocks.append(partial)
            partial = None
        xin = _rms(x, wt[p + ".input_layernorm.weight"], eps)
        kda = i + 1 in t["linear_attn_config"]["kda_layers"]
        out = _kda(xin, wt, p + ".self_attn", t) if kda else _mla(xin, wt, p + ".self_attn", t)
        partial = out if partial is None else partial + out
        x = _mix(blocks, partial, *res(p + ".mlp_res"), eps)
        xin = _rms(x, wt[p + ".post_attention_layernorm.weight"], eps)
        moe = i >= t["first_k_dense_replace"] and i % t["moe_layer_freq"] == 0
        partial = partial + (_moe(xin, wt, p + ".block_sparse_moe", t) if moe else _mlp(xin, wt, p + ".mlp", t))
        h = partial
    h = _mix(blocks, h, *res(P + "model.output_attn_res"), eps)
    return _rms(h, wt[P + "model.norm.weight"], eps) @ wt[P + "lm_head.weight"].T
