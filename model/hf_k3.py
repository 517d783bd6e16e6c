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

A checkpoint loads exactly or not at all: a tensor k3 does not map, a shape the config does not
make, a NaN or inf weight, an MXFP4 scale byte 0xFF (NaN in E8M0) or an unreadable shard is a
ValueError naming the file and the tensor (model/checkpoint_reader.py reads them).

Block AttnRes: the release mixes with softmax(proj . (norm_w * rms(v))) = softmax((proj * norm_w)
. rms(v)), so k3 holds the product as one pseudo-query per mix (BlockAttnRes.queries). Loading
folds the pair (exact in fp32: a bf16 x bf16 product fits fp32's mantissa); saving factors each
query back into a bf16 pair whose product is the query exactly when it is such a product (every
query of a loaded release), so release -> k3 -> release keeps every product and the logits, and
export -> import -> export is bit-identical (`attn_res_pair`).

A_log: the release stores [max(H, K)] fp32 for H KDA heads, one rate per head in the first H
entries (as SGLang's K3 port and the GGUF converter read it); k3 reads those and writes zeros
after them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from .checkpoint_reader import INDEX, CheckpointReader
from .config import K3Config
from .directory import MODEL_FILES, Source, check_destination, owned, write_beside
from .hf_k3_config import check_quantization, config_from_release, config_to_release
from .loading import read_config_json, wants_vision
from .model import K3ForCausalLM, load_dtype
from .moe import Experts, check_expert_parallel, require_all_experts, shard_experts
from .multimodal import K3ForConditionalGeneration
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .vision import MoonViT, PatchMergerV2

__all__ = ["CheckpointReader", "attn_res_pair", "load_k3", "read_config", "release_tensors", "save_k3"]

PREFIX = "language_model."
# Release tensors stored in fp32; every other floating tensor is bf16.
_RELEASE_FP32 = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")
_EXPERT_SRC = {"w_gate": "w1", "w_up": "w3", "w_down": "w2"}


def read_config(path: str | Path) -> tuple[dict, K3Config]:
    """(the release config.json as a dict, its K3Config)."""
    p = Path(path) / "config.json"
    if not p.exists():
        raise ValueError(f"{path}: no config.json")
    d = read_config_json(path)
    if d.get("model_type") not in (None, "kimi_k3") or not isinstance(d.get("text_config"), dict):
        raise ValueError(f"{p}: not a K3 release config (model_type {d.get('model_type')!r}, needs a text_config "
                         f"object)")
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


def _expert_name(i: int, e: int, src: str, quantized: bool) -> list[str]:
    base = f"{PREFIX}model.layers.{i}.block_sparse_moe.experts.{e}.{src}"
    return [f"{base}.weight_packed", f"{base}.weight_scale"] if quantized else [f"{base}.weight"]


def _conv_names(i: int) -> list[str]:
    return [f"{PREFIX}model.layers.{i}.self_attn.{x}_conv1d.weight" for x in "qkv"]


def _a_log_len(cfg: K3Config) -> int:
    return max(cfg.kda_num_heads, cfg.kda_head_dim)


# -- Block AttnRes pairs ---------------------------------------------------------------------------
_MANTISSAS = 1 + torch.arange(128, dtype=torch.float32) / 128  # every bf16 value in [1, 2)


def attn_res_pair(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm [D], proj [1, D]) in bf16 whose fp32 product is the nearest such product to `query` [D].

    Scaling by a power of two moves a factor between norm and proj, so trying each of the 128
    bf16 mantissas as the norm and rounding query / norm to bf16 finds the nearest product. A
    query that is a bf16 x bf16 product (every query folded from a release) comes back exactly;
    another (trained in fp32) within 2**-11.7 of its size, 2**-14.5 on average (bf16 alone:
    2**-8 and 2**-9.5; measured over 200k normal values). The nearest product is factored with
    the smallest mantissa that divides it exactly, so a product always gets the same pair."""
    if query.is_meta:
        return (torch.empty(query.shape[-1], dtype=torch.bfloat16, device="meta"),
                torch.empty(1, query.shape[-1], dtype=torch.bfloat16, device="meta"))
    q = query.detach().float().reshape(-1, 1).cpu()  # [D, 1]
    prod = (q / _MANTISSAS).bfloat16().float() * _MANTISSAS  # [D, 128], exact: 8 x 8 mantissa bits
    nearest = prod.gather(1, (prod - q).abs().argmin(1, keepdim=True))  # [D, 1]
    proj = (nearest / _MANTISSAS).bfloat16()
    first = (proj.float() * _MANTISSAS == nearest).int().argmax(1, keepdim=True)  # the smallest exact mantissa
    return _MANTISSAS[first[:, 0]].bfloat16(), proj.gather(1, first).reshape(1, -1)


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
    tensor. Tensors k3 does not map are refused before any is read. The model's `source` records
    `path` and the config.json, which save_k3 writes back. (k3.model.load calls this for a release.)
    """
    raw, cfg = read_config(path)
    check_expert_parallel(ep_rank, ep_size)
    r = reader or CheckpointReader(path)
    with_tower = wants_vision(cfg, vision, f"{path}/config.json")
    moe = [i for i, t in enumerate(cfg.mlp_types) if t == "moe"]
    quantized = bool(moe) and _expert_name(moe[0], 0, "w1", True)[0] in r
    _refuse_unknown(r, cfg, quantized)
    model = _load_text(r, cfg, quantized, dtype, device, ep_rank, ep_size)
    if with_tower:
        model = _add_tower(r, model, dtype, device)
    model.source = Source(Path(path), "k3-release", raw)
    return model


def _refuse_unknown(r: CheckpointReader, cfg: K3Config, quantized: bool) -> None:
    """A tensor the mapping does not know (an MTP layer, a misnamed one) would be dropped silently: refuse."""
    with torch.device("meta"):
        full = K3ForConditionalGeneration(cfg) if cfg.vision_config is not None else K3ForCausalLM(cfg)
    unknown = sorted(set(r.keys()) - {name for name, _ in release_tensors(full, quantized)})
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} tensors k3 does not map: "
                         f"{', '.join(r.where(n) for n in unknown[:3])}")


class _TextState:
    """The language model's state, filled from release tensors with each shape checked."""

    def __init__(self, r: CheckpointReader, model: K3ForCausalLM, dtype: torch.dtype | None, device) -> None:
        self.r, self.dtype, self.device = r, dtype, device
        self.expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.state: dict[str, torch.Tensor] = {}

    def read(self, rel: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = self.r.get(rel)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{self.r.where(rel)}: shape {tuple(t.shape)} != expected {tuple(shape)} (check "
                             f"config.json against the weights)")
        return t

    def put(self, name: str, t: torch.Tensor) -> None:
        self.state[name] = t.to(device=self.device, dtype=load_dtype(name, t.dtype, self.dtype))

    def copy(self, name: str, rel: str) -> None:
        self.put(name, self.read(rel, self.expected[name].shape))


def _load_text(r: CheckpointReader, cfg: K3Config, quantized: bool, dtype: torch.dtype | None, device,
               ep_rank: int, ep_size: int) -> K3ForCausalLM:
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    if ep_size != 1 or ep_rank != 0:
        shard_experts(model, ep_rank, ep_size)
    s = _TextState(r, model, dtype, device)
    for k3_name, rel in _top_renames():
        if not (k3_name == "lm_head.weight" and cfg.tie_word_embeddings):
            s.copy(k3_name, rel)
    HK, W = cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_conv_size
    for i in range(cfg.num_layers):
        for k3_name, rel in _renames(cfg, i):
            s.copy(k3_name, rel)
        a = f"model.layers.{i}.self_attn"
        if cfg.layer_types[i] == "kda":
            s.put(f"{a}.conv_weight", torch.cat([s.read(n, (HK, 1, W)).reshape(HK, W) for n in _conv_names(i)]))
            s.put(f"{a}.A_log", s.read(f"{PREFIX}{a}.A_log", (_a_log_len(cfg),))[: cfg.kda_num_heads])
        if cfg.mlp_types[i] == "moe":
            _load_experts(model.model.layers[i].mlp.experts, s, i, quantized)
    if cfg.attn_res_block_size is not None:
        D, mixes = cfg.hidden_size, range(2 * cfg.num_layers + 1)
        pairs = [(s.read(n, (D,)), s.read(p, (1, D))) for n, p in (_res_names(cfg, l) for l in mixes)]
        s.put("model.attn_res.queries", torch.stack([p.float().reshape(-1) * n.float() for n, p in pairs]))
    missing = sorted(set(s.expected) - set(s.state) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    if missing:
        raise ValueError(f"k3 tensors with no source in the checkpoint: {missing[:3]}")
    model.load_state_dict(s.state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _load_experts(experts: Experts, s: _TextState, i: int, quantized: bool) -> None:
    """Fill one MoE layer's local experts [first, first + count) one expert at a time."""
    for dst, src in _EXPERT_SRC.items():
        shape = tuple(s.expected[f"model.layers.{i}.mlp.experts.{dst}"].shape)
        out = None
        for local in range(experts.count):
            names = _expert_name(i, experts.first + local, src, quantized)
            if quantized:
                where = s.r.where(names[0]).removesuffix(".weight_packed")  # "FILE: ...experts.e.w1"
                w = dequantize_mxfp4(s.r.get(names[0]), s.r.get(names[1]), name=where)
            else:
                w = s.r.get(names[0])
            if tuple(w.shape) != shape[1:]:
                raise ValueError(f"{s.r.where(names[0])}: weight shape {tuple(w.shape)} != expected {shape[1:]}")
            if out is None:
                out = torch.empty(shape, dtype=s.dtype or w.dtype, device=s.device)
            out[local].copy_(w)
        s.state[f"model.layers.{i}.mlp.experts.{dst}"] = out


def _add_tower(r: CheckpointReader, text: K3ForCausalLM, dtype: torch.dtype | None, device
               ) -> K3ForConditionalGeneration:
    """`text` with the vision tower and projector read from the checkpoint."""
    cfg = text.cfg
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
                raise ValueError(f"{r.where(prefix + name)}: shape {tuple(t.shape)} != expected {tuple(p.shape)} "
                                 f"(check vision_config)")
            state[name] = t.to(device=device, dtype=dtype or t.dtype)
        module.load_state_dict(state, strict=True, assign=True)
    return model


# -- save ----------------------------------------------------------------------------------------
def _cast(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` as the release stores tensor `name`: bf16, or fp32 for the few fp32 families."""
    dtype = torch.float32 if name.endswith(_RELEASE_FP32) else torch.bfloat16
    return t.detach().to(device="meta" if t.is_meta else "cpu", dtype=dtype).contiguous()


def release_tensors(model: K3ForCausalLM | K3ForConditionalGeneration,
                    quantize_experts: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(release name, tensor) for every tensor, layer by layer (routed experts one at a time), then
    the vision tower's and projector's (bf16) for a K3ForConditionalGeneration. The model must
    hold every expert.

    Works on a meta-device model too (shapes only), which is how the release layout is counted
    and how a load knows the names it maps."""
    if isinstance(model, K3ForConditionalGeneration):
        yield from release_tensors(model.language_model, quantize_experts)
        for prefix, module in (("vision_tower.", model.vision_tower), ("mm_projector.", model.mm_projector)):
            for name, p in module.named_parameters():
                yield prefix + name, _cast(prefix + name, p)
        return
    require_all_experts(model)
    cfg = model.cfg
    params = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for k3_name, rel in _top_renames():
        tied = k3_name == "lm_head.weight" and cfg.tie_word_embeddings
        yield rel, _cast(rel, params["model.embed_tokens.weight" if tied else k3_name])
    for i in range(cfg.num_layers):
        yield from _layer_tensors(model, params, i, quantize_experts)
    if cfg.attn_res_block_size is not None:
        yield from _res_tensors(cfg, 2 * cfg.num_layers, params["model.attn_res.queries"][-1])


def _layer_tensors(model: K3ForCausalLM, params: dict[str, torch.Tensor], i: int,
                   quantize_experts: bool) -> Iterator[tuple[str, torch.Tensor]]:
    cfg = model.cfg
    for k3_name, rel in _renames(cfg, i):
        yield rel, _cast(rel, params[k3_name])
    a = f"model.layers.{i}.self_attn"
    if cfg.layer_types[i] == "kda":
        for name, chunk in zip(_conv_names(i), params[f"{a}.conv_weight"].chunk(3, dim=0)):
            yield name, _cast(name, chunk[:, None, :])
        a_log = params[f"{a}.A_log"].detach()
        padded = torch.zeros(_a_log_len(cfg), dtype=torch.float32, device=a_log.device)
        if not a_log.is_meta:
            padded[: cfg.kda_num_heads] = a_log.float()
        yield f"{PREFIX}{a}.A_log", _cast(".A_log", padded)
    if cfg.attn_res_block_size is not None:
        for l in (2 * i, 2 * i + 1):
            yield from _res_tensors(cfg, l, params["model.attn_res.queries"][l])
    if cfg.mlp_types[i] == "moe":
        yield from _expert_tensors(model.model.layers[i].mlp.experts, i, quantize_experts)


def _expert_tensors(experts: Experts, i: int, quantize: bool) -> Iterator[tuple[str, torch.Tensor]]:
    # On the meta device (counting, naming) every expert has the same shapes: build them once.
    meta = None
    if experts.w_gate.is_meta:
        meta = {dst: quantize_mxfp4(w[0]) if quantize else (_cast(".weight", w[0]),)
                for dst, w in ((dst, getattr(experts, dst)) for dst in _EXPERT_SRC)}
    for e in range(experts.count):
        for dst, src in _EXPERT_SRC.items():
            names = _expert_name(i, e, src, quantize)
            if meta is not None:
                yield from zip(names, meta[dst])
            elif quantize:
                yield from zip(names, quantize_mxfp4(getattr(experts, dst)[e].detach().cpu()))
            else:
                yield names[0], _cast(names[0], getattr(experts, dst)[e])


def _res_tensors(cfg: K3Config, l: int, query: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    yield from zip(_res_names(cfg, l), attn_res_pair(query))


def save_k3(model: K3ForCausalLM | K3ForConditionalGeneration, path: str | Path, max_shard_bytes: int = 4 << 30,
            quantize_experts: bool = True, overwrite: bool = False) -> None:
    """Write config.json + sharded safetensors + model.safetensors.index.json in the release layout.

    Tensors are produced layer by layer and a shard is written as soon as it is full, so memory
    stays at the model plus one shard. A K3ForConditionalGeneration also writes its vision tower,
    projector and vision_config; a K3ForCausalLM writes a text-only checkpoint. A model loaded
    from a release writes back the release config's fields k3 does not use.

    Written beside `path` and swapped in when complete (model/directory.py): a failure leaves the
    previous checkpoint as it was; files of `path` that are not weights or config.json (a
    tokenizer) stay. Refused before anything is written: a model holding only some experts, a
    config the layout cannot express, and the directory the model was loaded from (its weights are
    memory-mapped from there) unless `overwrite`."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    check_destination(model.source, path, overwrite)
    require_all_experts(model)
    base = model.source.config if model.source is not None and model.source.layout == "k3-release" else None
    cfg = config_to_release(model.cfg, with_vision=isinstance(model, K3ForConditionalGeneration),
                            quantized_experts=quantize_experts, base=base)
    with write_beside(path, stale=owned(MODEL_FILES)) as new:
        _write_shards(release_tensors(model, quantize_experts), new, max_shard_bytes)
        (new / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int) -> None:
    """Shards of at most max_shard_bytes (or one tensor) and their index, into `out`."""
    shards: list[list[str]] = []
    buf: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal buf, size
        if buf:  # the shard count is known only at the end: numbered now, named model-i-of-n then
            save_file(buf, str(out / f"part-{len(shards) + 1:05d}.safetensors"), metadata={"format": "pt"})
            shards.append(list(buf))
            buf, size = {}, 0

    for name, t in tensors:
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
        (out / f"part-{s + 1:05d}.safetensors").rename(out / final)
        weight_map.update({n: final for n in names})
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
