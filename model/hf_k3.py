"""K3 release checkpoints <-> K3ForCausalLM: load (streamed, per expert-parallel rank) and save.

The release layout (names from the release's modeling code and the public ports; the evidence is
in docs/checkpoints.md): config.json with `text_config` / `vision_config` (model/hf_k3_config.py),
sharded safetensors with `model.safetensors.index.json`. Text tensors carry the prefix
`language_model.`; per decoder layer:

    input_layernorm, post_attention_layernorm                       [D]
    self_attention_res_norm [D], self_attention_res_proj [1, D]     Block AttnRes, attention side
    mlp_res_norm [D], mlp_res_proj [1, D]                           Block AttnRes, MLP side
    self_attn.{q,k,v}_proj, {q,k,v}_conv1d [HK, 1, W] fp32, A_log fp32, dt_bias fp32, f_a_proj,
      f_b_proj, b_proj, g_proj (or g_a_proj/g_b_proj), o_norm fp32, o_proj                       KDA
    self_attn.q_a_proj, q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm,
      kv_b_proj, g_proj, o_proj                                                                   MLA
    mlp.{gate,up,down}_proj                                                             dense layer
    block_sparse_moe.gate.weight, gate.e_score_correction_bias fp32, shared_experts.*,
      routed_expert_down_proj, routed_expert_norm, routed_expert_up_proj,
      experts.N.{w1 (gate), w3 (up), w2 (down)}.{weight_packed, weight_scale}  (MXFP4, model/mxfp4.py)

plus model.embed_tokens, model.norm, model.output_attn_res_{norm,proj} and lm_head. The vision
tower and projector (`vision_tower.*`, `mm_projector.*`, bf16) carry k3's own module names
(model/vision.py follows the release), so they map one to one.

Block AttnRes: the release mixes with softmax(proj . (norm_w * rms(v))) = softmax((proj * norm_w)
. rms(v)), so k3 holds the product as one pseudo-query per mix (BlockAttnRes.queries). Loading
folds it (exact in fp32: a bf16 x bf16 product fits fp32's mantissa); saving writes the query as
the projection and ones as the norm weight, so export -> import -> export is bit-identical.

A_log: the release stores [max(H, K)] fp32 for H KDA heads, one rate per head in the first H
entries (as SGLang's K3 port and the GGUF converter read it); k3 reads those and writes zeros
after them.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import K3Config
from .hf_k3_config import check_quantization, config_from_release, config_to_release
from .loading import wants_vision
from .model import K3ForCausalLM, load_dtype
from .moe import Experts, shard_experts
from .multimodal import K3ForConditionalGeneration
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .vision import MoonViT, PatchMergerV2

PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")  # named as k3's modules, no language_model. prefix
INDEX = "model.safetensors.index.json"
# Release tensors stored in fp32; every other floating tensor is bf16.
_RELEASE_FP32 = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")
_EXPERT_SRC = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}


class CheckpointReader:
    """Lazy tensor access over sharded safetensors (or one model.safetensors).

    `reads` counts every tensor read by name and `opened` lists the shard files touched, so a
    caller (or a test) can see exactly what a load pulled from disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").exists():
            with safe_open(self.path / "model.safetensors", "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"{self.path}: no {INDEX} or model.safetensors")
        self._files: dict[str, object] = {}
        self.reads: Counter[str] = Counter()
        self.opened: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = safe_open(self.path / file, "pt")
            self.opened.append(file)
        self.reads[name] += 1
        return self._files[file].get_tensor(name)


def read_config(path: str | Path) -> tuple[dict, K3Config]:
    """(the release config.json as a dict, its K3Config)."""
    p = Path(path) / "config.json"
    if not p.exists():
        raise ValueError(f"{path}: no config.json")
    d = json.loads(p.read_text())
    if d.get("model_type") not in (None, "kimi_k3") or "text_config" not in d:
        raise ValueError(f"{p}: not a K3 release config (model_type {d.get('model_type')!r}, needs text_config)")
    check_quantization(d["text_config"])
    return d, config_from_release(d)


# -- name mapping --------------------------------------------------------------------------------
def _renames(cfg: K3Config, i: int) -> list[tuple[str, str]]:
    """(k3 name, release name) of layer i's tensors that map one to one."""
    k, r = f"model.layers.{i}", f"{PREFIX}model.layers.{i}"
    pairs = [("input_layernorm.weight",) * 2, ("post_attention_layernorm.weight",) * 2]
    if cfg.layer_types[i] == "kda":
        attn = ["q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj"]
        attn += ["g_proj"] if cfg.kda_output_gate == "full" else ["g_a_proj", "g_b_proj"]
        pairs += [(f"self_attn.{n}.weight",) * 2 for n in attn]
        pairs += [("self_attn.dt_bias",) * 2, ("self_attn.o_norm_weight", "self_attn.o_norm.weight")]
    else:
        attn = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
        attn += ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"] + (["g_proj"] if cfg.mla_output_gate
                                                                                   else [])
        pairs += [(f"self_attn.{n}.weight",) * 2 for n in attn]
    if cfg.mlp_types[i] == "dense":
        pairs += [(f"mlp.{n}.weight",) * 2 for n in ("gate_proj", "up_proj", "down_proj")]
    else:
        moe = "block_sparse_moe"
        pairs += [("mlp.gate.weight", f"{moe}.gate.weight"), ("mlp.gate.bias", f"{moe}.gate.e_score_correction_bias")]
        if cfg.num_shared_experts:
            pairs += [(f"mlp.shared_experts.{n}.weight", f"{moe}.shared_experts.{n}.weight")
                      for n in ("gate_proj", "up_proj", "down_proj")]
        if cfg.moe_latent_size is not None:
            pairs += [("mlp.latent_down.weight", f"{moe}.routed_expert_down_proj.weight"),
                      ("mlp.latent_norm.weight", f"{moe}.routed_expert_norm.weight"),
                      ("mlp.latent_up.weight", f"{moe}.routed_expert_up_proj.weight")]
    return [(f"{k}.{a}", f"{r}.{b}") for a, b in pairs]


def _top_renames() -> list[tuple[str, str]]:
    return [("model.embed_tokens.weight", f"{PREFIX}model.embed_tokens.weight"),
            ("model.norm.weight", f"{PREFIX}model.norm.weight"), ("lm_head.weight", f"{PREFIX}lm_head.weight")]


def _res_names(cfg: K3Config, l: int) -> tuple[str, str]:
    """(norm, proj) release names of AttnRes mix l (2i: attention side of layer i, 2i+1: MLP side, 2L: output)."""
    if l == 2 * cfg.num_layers:
        base = f"{PREFIX}model.output_attn_res"
    else:
        base = f"{PREFIX}model.layers.{l // 2}." + ("self_attention_res" if l % 2 == 0 else "mlp_res")
    return f"{base}_norm.weight", f"{base}_proj.weight"


def _expert_name(cfg: K3Config, i: int, e: int, src: str, quantized: bool) -> list[str]:
    base = f"{PREFIX}model.layers.{i}.block_sparse_moe.experts.{e}.{src}"
    return [f"{base}.weight_packed", f"{base}.weight_scale"] if quantized else [f"{base}.weight"]


def _conv_names(i: int) -> list[str]:
    return [f"{PREFIX}model.layers.{i}.self_attn.{x}_conv1d.weight" for x in "qkv"]


def _a_log_len(cfg: K3Config) -> int:
    return max(cfg.kda_num_heads, cfg.kda_head_dim)


# -- load ----------------------------------------------------------------------------------------
def load_k3(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
            ep_rank: int = 0, ep_size: int = 1, reader: CheckpointReader | None = None,
            vision: bool | None = None) -> K3ForCausalLM | K3ForConditionalGeneration:
    """A K3ForCausalLM from a K3 release checkpoint directory, streamed tensor by tensor.

    The model is built on the meta device and each parameter is filled from the checkpoint as it
    is read, so peak memory is the loaded model plus one tensor. With ep_size > 1 the model holds
    only rank ep_rank's routed experts and no other expert's tensors are read (nor their shards
    opened). dtype: None keeps the checkpoint's dtypes (bf16; dequantised experts in bf16, which
    is exact); routing and KDA-gate tensors stay fp32 either way. `vision` as in k3.model.load:
    with the tower (the default when config.json has a vision_config) the result is a
    K3ForConditionalGeneration, tower and projector on every rank; vision=False reads no vision
    tensor. (k3.model.load calls this for a release directory.)
    """
    _, cfg = read_config(path)
    r = reader or CheckpointReader(path)
    with_tower = wants_vision(cfg, vision, f"{path}/config.json")
    text = _load_text(r, cfg, dtype, device, ep_rank, ep_size)
    if not with_tower:
        return text
    with torch.device("meta"):
        model = K3ForConditionalGeneration(cfg)
    model.language_model = text
    # Built for real (not on meta), then every weight replaced below; the throwaway init draws from
    # a forked RNG so loading leaves the caller's random stream alone.
    with torch.device(device), torch.random.fork_rng(devices=[]):
        model.vision_tower, model.mm_projector = MoonViT(cfg.vision_config), PatchMergerV2(cfg.vision_config)
    for prefix, module in (("vision_tower.", model.vision_tower), ("mm_projector.", model.mm_projector)):
        state = {}
        for name, p in module.named_parameters():
            t = r.get(prefix + name)
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"checkpoint tensor {prefix + name}: shape {tuple(t.shape)} != expected "
                                 f"{tuple(p.shape)} (check vision_config)")
            state[name] = t.to(device=device, dtype=dtype or t.dtype)
        module.load_state_dict(state, strict=True, assign=True)
    unknown = sorted(n for n in r.keys() if n.startswith(VISION_PREFIXES) and n not in r.reads)
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} vision tensors k3 does not map, e.g. {unknown[:3]}")
    return model


def _load_text(r: CheckpointReader, cfg: K3Config, dtype: torch.dtype | None, device, ep_rank: int,
               ep_size: int) -> K3ForCausalLM:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    if ep_size != 1 or ep_rank != 0:
        shard_experts(model, ep_rank, ep_size)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    state: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        want = expected[name]
        if tuple(t.shape) != tuple(want.shape):
            raise ValueError(f"checkpoint tensor for {name}: shape {tuple(t.shape)} != expected {tuple(want.shape)} "
                             f"(check config.json against the weights)")
        state[name] = t.to(device=device, dtype=load_dtype(name, t.dtype, dtype))

    for k3_name, rel in _top_renames():
        if k3_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        put(k3_name, r.get(rel))
    quantized = False
    for i in range(cfg.num_layers):
        for k3_name, rel in _renames(cfg, i):
            put(k3_name, r.get(rel))
        a = f"model.layers.{i}.self_attn"
        if cfg.layer_types[i] == "kda":
            convs = [r.get(n) for n in _conv_names(i)]
            put(f"{a}.conv_weight", torch.cat([c.reshape(c.shape[0], -1) for c in convs]))
            a_log = r.get(f"{PREFIX}{a}.A_log").reshape(-1)
            if a_log.numel() < cfg.kda_num_heads:
                raise ValueError(f"{PREFIX}{a}.A_log has {a_log.numel()} values for {cfg.kda_num_heads} heads")
            put(f"{a}.A_log", a_log[: cfg.kda_num_heads])
        if cfg.mlp_types[i] == "moe":
            quantized = _expert_name(cfg, i, 0, "w1", True)[0] in r
            _load_experts(model.model.layers[i].mlp.experts, r, cfg, i, quantized, dtype, device, state)
    if cfg.attn_res_block_size is not None:
        rows = []
        for l in range(2 * cfg.num_layers + 1):
            norm, proj = (r.get(n) for n in _res_names(cfg, l))
            rows.append(proj.float().reshape(-1) * norm.float())  # exact: bf16 x bf16 fits in fp32
        put("model.attn_res.queries", torch.stack(rows))
    missing = sorted(set(expected) - set(state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"k3 tensors with no source in the checkpoint: {missing[:3]}")
    _refuse_unknown(r, cfg, quantized)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _load_experts(experts: Experts, r: CheckpointReader, cfg: K3Config, i: int, quantized: bool,
                  dtype: torch.dtype | None, device, state: dict) -> None:
    """Fill one MoE layer's local experts [first, first + count) one expert at a time."""
    for dst, src in _EXPERT_SRC.items():
        meta = getattr(experts, dst)
        out = None
        for local in range(experts.count):
            names = _expert_name(cfg, i, experts.first + local, src, quantized)
            w = dequantize_mxfp4(r.get(names[0]), r.get(names[1])) if quantized else r.get(names[0])
            if tuple(w.shape) != tuple(meta.shape[1:]):
                raise ValueError(f"{names[0]}: weight shape {tuple(w.shape)} != expected {tuple(meta.shape[1:])}")
            if out is None:
                out = torch.empty(meta.shape, dtype=dtype or w.dtype, device=device)
            out[local].copy_(w)
        state[f"model.layers.{i}.mlp.experts.{dst}"] = out


def _refuse_unknown(r: CheckpointReader, cfg: K3Config, quantized: bool) -> None:
    """Text tensors the mapping does not know (e.g. MTP layers) would be silently dropped: refuse."""
    known = set(r.reads)
    for i in range(cfg.num_layers):
        if cfg.mlp_types[i] == "moe":
            for e in range(cfg.num_experts):
                for src in _EXPERT_SRC.values():
                    known.update(_expert_name(cfg, i, e, src, quantized))
    unknown = sorted(n for n in r.keys() if n.startswith(PREFIX) and n not in known)
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} text tensors k3 does not map, e.g. {unknown[:3]}")


# -- save ----------------------------------------------------------------------------------------
def _release_dtype(name: str) -> torch.dtype:
    return torch.float32 if name.endswith(_RELEASE_FP32) else torch.bfloat16


def release_tensors(model: K3ForCausalLM | K3ForConditionalGeneration,
                    quantize_experts: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(release name, tensor) for every tensor, layer by layer (routed experts one at a time), then
    the vision tower's and projector's (bf16) for a K3ForConditionalGeneration.

    Works on a meta-device model too (shapes only), which is how the release layout is counted."""
    if isinstance(model, K3ForConditionalGeneration):
        yield from release_tensors(model.language_model, quantize_experts)
        for prefix, module in (("vision_tower.", model.vision_tower), ("mm_projector.", model.mm_projector)):
            for name, p in module.named_parameters():
                yield prefix + name, p.detach().to(device="meta" if p.is_meta else "cpu",
                                                   dtype=torch.bfloat16).contiguous()
        return
    cfg = model.cfg
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def cast(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device="cpu" if not t.is_meta else "meta", dtype=_release_dtype(name)).contiguous()

    for k3_name, rel in _top_renames():
        yield rel, cast(rel, params["model.embed_tokens.weight" if k3_name == "lm_head.weight"
                                    and cfg.tie_word_embeddings else k3_name])
    queries = params.get("model.attn_res.queries")
    for i in range(cfg.num_layers):
        for k3_name, rel in _renames(cfg, i):
            yield rel, cast(rel, params[k3_name])
        a = f"model.layers.{i}.self_attn"
        if cfg.layer_types[i] == "kda":
            for name, chunk in zip(_conv_names(i), params[f"{a}.conv_weight"].chunk(3, dim=0)):
                yield name, cast(name, chunk[:, None, :])
            a_log = params[f"{a}.A_log"].detach()
            padded = torch.zeros(_a_log_len(cfg), dtype=torch.float32, device=a_log.device)
            if not a_log.is_meta:
                padded[: cfg.kda_num_heads] = a_log.float()
            yield f"{PREFIX}{a}.A_log", cast(".A_log", padded)
        if queries is not None:
            for l in (2 * i, 2 * i + 1):
                yield from _res_tensors(cfg, l, queries[l])
        if cfg.mlp_types[i] == "moe":
            experts = model.model.layers[i].mlp.experts
            if experts.count != cfg.num_experts:
                raise ValueError(f"layer {i} holds experts [{experts.first}, {experts.first + experts.count}) of "
                                 f"{cfg.num_experts}: save a model with every expert")
            # On the meta device (counting) every expert has the same shapes: build them once.
            shapes = {dst: quantize_mxfp4(getattr(experts, dst)[0]) if quantize_experts else
                      (cast(".weight", getattr(experts, dst)[0]),) for dst in _EXPERT_SRC} if experts.w_gate.is_meta \
                else None
            for e in range(cfg.num_experts):
                for dst, src in _EXPERT_SRC.items():
                    names = _expert_name(cfg, i, e, src, quantize_experts)
                    if shapes is not None:
                        yield from zip(names, shapes[dst])
                        continue
                    w = getattr(experts, dst)[e].detach()
                    if quantize_experts:
                        packed, scale = quantize_mxfp4(w.cpu())
                        yield names[0], packed
                        yield names[1], scale
                    else:
                        yield names[0], cast(names[0], w)
    if queries is not None:
        yield from _res_tensors(cfg, 2 * cfg.num_layers, queries[-1])


def _res_tensors(cfg: K3Config, l: int, query: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    norm, proj = _res_names(cfg, l)
    dev = "meta" if query.is_meta else "cpu"
    yield norm, torch.ones(query.shape[-1], dtype=torch.bfloat16, device=dev)
    yield proj, query.detach().to(device=dev, dtype=torch.bfloat16).reshape(1, -1).contiguous()


def save_k3(model: K3ForCausalLM | K3ForConditionalGeneration, path: str | Path, max_shard_bytes: int = 4 << 30,
            quantize_experts: bool = True) -> None:
    """Write config.json + sharded safetensors + model.safetensors.index.json in the release layout.

    Tensors are produced layer by layer and a shard is written as soon as it is full, so memory
    stays at the model plus one shard. A K3ForConditionalGeneration also writes its vision tower,
    projector and vision_config; a K3ForCausalLM writes a text-only checkpoint."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("model-*.safetensors"):
        old.unlink()
    shards: list[list[str]] = []
    buf: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal buf, size
        if buf:
            save_file(buf, str(path / f"model-{len(shards) + 1:05d}.tmp.safetensors"), metadata={"format": "pt"})
            shards.append(list(buf))
            buf, size = {}, 0

    for name, t in release_tensors(model, quantize_experts):
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        buf[name] = t
        size += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for s, names in enumerate(shards):
        final = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        (path / f"model-{s + 1:05d}.tmp.safetensors").rename(path / final)
        weight_map.update({n: final for n in names})
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
                              + "\n")
    cfg = config_to_release(model.cfg, with_vision=isinstance(model, K3ForConditionalGeneration),
                            quantized_experts=quantize_experts)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
