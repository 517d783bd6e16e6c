"""One way to build a K3 model and one way to load one.

    build(cfg, ep_rank=0, ep_size=1, seed=0)  a fresh model, initialised from `seed`; under expert
                                              parallelism only rank ep_rank's experts, with the
                                              values the full model would give them
    load(path, ep_rank=0, ep_size=1)          a model from any checkpoint directory k3 reads
    load_config(path)                         its K3Config, without reading weights

Checkpoint layouts, told apart by their files:

    training checkpoint   k3/config.json, k3/shared.pt, k3/experts-ep*-of-*.pt     model/training_checkpoint.py
    k3 model directory    config.json (a K3Config) + model.safetensors             model/pretrained.py
    K3 release            config.json with text_config (model_type kimi_k3)        model/hf_k3.py
    Kimi Linear           config.json of transformers' Kimi Linear                 model/hf_kimi.py

`vision` picks the class everywhere: None gives what the config holds (K3ForConditionalGeneration
when it has a vision_config, else K3ForCausalLM), False the language model alone, True insists
on the tower.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import K3Config
from .model import K3ForCausalLM
from .moe import shard_experts
from .multimodal import K3ForConditionalGeneration

Model = K3ForCausalLM | K3ForConditionalGeneration


def wants_vision(cfg: K3Config, vision: bool | None, where: str = "the config") -> bool:
    """Whether the model for `cfg` carries the vision tower (see the module docstring)."""
    if vision is None:
        return cfg.vision_config is not None
    if vision and cfg.vision_config is None:
        raise ValueError(f"vision=True but {where} has no vision_config")
    return bool(vision)


def model_class(cfg: K3Config, vision: bool | None = None) -> type[Model]:
    return K3ForConditionalGeneration if wants_vision(cfg, vision) else K3ForCausalLM


def build(cfg: K3Config, ep_rank: int = 0, ep_size: int = 1, seed: int = 0, device: str | torch.device = "cpu",
          vision: bool | None = None) -> Model:
    """A freshly initialised model. Built on the meta device, reduced to this rank's experts, then
    materialised and initialised from `seed`: each expert's values depend on (seed, layer, expert)
    only, so ep_size changes where experts live, never their values."""
    with torch.device("meta"):
        model = model_class(cfg, vision)(cfg)
    if ep_size != 1 or ep_rank != 0:
        shard_experts(model, ep_rank, ep_size)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):  # the caller's random stream stays where it was
        torch.manual_seed(seed)
        model.reset_parameters()
    return model


def require_state(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """A ValueError naming `where` unless `state` holds exactly the tensors of `model`, each with its
    shape (before load_state_dict, whose RuntimeError names neither file nor config)."""
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
    for k, v in want.items():
        if not torch.is_tensor(state[k]):
            raise ValueError(f"{where}: {k} is a {type(state[k]).__name__}, not a tensor")
        if state[k].shape != v.shape:
            raise ValueError(f"{where}: {k} has shape {tuple(state[k].shape)}, the config makes {tuple(v.shape)}")


def checkpoint_format(path: str | Path) -> str:
    """'training', 'k3', 'k3-release' or 'kimi-linear'; a ValueError for anything else."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: no such checkpoint directory")
    if (root / "k3" / "config.json").is_file() or (root / "shared.pt").is_file():
        return "training"
    if not (root / "config.json").is_file():
        raise ValueError(f"{root}: not a checkpoint k3 reads (no config.json, no k3/config.json)")
    try:
        d = json.loads((root / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{root / 'config.json'}: not JSON ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"{root / 'config.json'}: not a JSON object")
    if d.get("model_type") == "kimi_k3" or "text_config" in d:
        return "k3-release"
    if "model_type" not in d and "layer_types" in d and "mlp_types" in d:
        return "k3"
    if d.get("model_type") == "kimi_linear" or "linear_attn_config" in d:
        return "kimi-linear"
    raise ValueError(f"{root / 'config.json'}: model_type {d.get('model_type')!r} is none of the layouts k3 reads "
                     "(a k3 model directory, the K3 release, Kimi Linear, a k3 training checkpoint)")


def load_config(path: str | Path) -> K3Config:
    """The K3Config of any checkpoint directory `load` reads."""
    fmt = checkpoint_format(path)
    if fmt == "training":
        from .training_checkpoint import read_config as read_training_config

        return read_training_config(path)
    if fmt == "k3":
        return K3Config.from_json(Path(path) / "config.json")
    if fmt == "k3-release":
        from .hf_k3 import read_config

        return read_config(path)[1]
    from .hf_kimi import config_from_hf

    return config_from_hf(json.loads((Path(path) / "config.json").read_text()))


def load(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
         ep_rank: int = 0, ep_size: int = 1, vision: bool | None = None) -> Model:
    """The model in a checkpoint directory, in eval mode. dtype None keeps the stored dtypes
    (routing and KDA-gate tensors stay fp32 whatever is asked). With ep_size > 1 the model holds
    only rank ep_rank's experts; the K3 release streams just those tensors from disk, the other
    layouts read whole and keep the rank's rows. `model.source` records the directory and its
    layout (k3.model.directory.Source): the writers refuse to write over it unless overwrite=True."""
    fmt = checkpoint_format(path)
    if fmt == "k3-release":
        from .hf_k3 import load_k3

        return load_k3(path, dtype=dtype, device=device, ep_rank=ep_rank, ep_size=ep_size, vision=vision).eval()
    if fmt == "training":
        from .training_checkpoint import load_training_checkpoint as read
    elif fmt == "k3":
        from .pretrained import load_model_dir as read
    else:
        from .hf_kimi import load_kimi_linear as read
    model = read(path, dtype=dtype, device=device, vision=vision)
    if ep_size != 1 or ep_rank != 0:
        shard_experts(model, ep_rank, ep_size)
    return model.eval()
