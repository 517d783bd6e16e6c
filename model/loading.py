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
import os
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


def check_device(device: str | torch.device, meta: bool = True) -> torch.device:
    """`device` as a torch.device this machine has ('cpu', 'cuda[:i]' where CUDA is, 'meta' when
    `meta`); a ValueError naming the argument for anything else."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device ({e})") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            raise ValueError(f"device={device!r}: this machine has {count} CUDA device(s)")
    elif dev.type != "cpu" and not (meta and dev.type == "meta"):
        allowed = "'cpu', 'cuda' or 'meta'" if meta else "'cpu' or 'cuda' (a model loaded on 'meta' has no weights)"
        raise ValueError(f"device={device!r}: k3 models run on {allowed}")
    return dev


def check_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The floating torch dtype `dtype` names (a torch.dtype, or its name: 'bfloat16'); None stays
    None (the stored dtypes). A ValueError naming the argument for anything else."""
    named = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if dtype is None or isinstance(named, torch.dtype) and named.is_floating_point:
        return named
    raise ValueError(f"dtype={dtype!r}: must be a floating torch dtype or its name (torch.bfloat16 or 'bfloat16'), "
                     f"or None to keep the stored dtypes")


def memory_bytes(device: torch.device, free: bool = False) -> int | None:
    """The memory of `device` (the machine's RAM for 'cpu'), or with `free` what can be allocated
    on it now (RAM: the kernel's MemAvailable, which counts the page cache it would give back);
    None for 'meta', which holds nothing."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] if free else \
            torch.cuda.get_device_properties(device.index or 0).total_memory
    if device.type != "cpu":
        return None
    if free:
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def build(cfg: K3Config, ep_rank: int = 0, ep_size: int = 1, seed: int = 0, device: str | torch.device = "cpu",
          vision: bool | None = None) -> Model:
    """A freshly initialised model. Built on the meta device, reduced to this rank's experts, then
    materialised and initialised from `seed`: each expert's values depend on (seed, layer, expert)
    only, so ep_size changes where experts live, never their values. A model larger than the
    memory of `device` is refused before anything is allocated; `device="meta"` allocates nothing."""
    dev = check_device(device)
    try:
        with torch.device("meta"):
            model = model_class(cfg, vision)(cfg)
    except RuntimeError as e:  # a tensor whose byte count overflows int64, even on meta
        if "overflow" not in str(e):
            raise
        raise ValueError(f"the model of this config cannot be allocated anywhere: {e}") from None
    if ep_size != 1 or ep_rank != 0:
        shard_experts(model, ep_rank, ep_size)
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # tied ones once
    memory = memory_bytes(dev)
    if memory is not None and size > memory:
        raise ValueError(f"the model's parameters take {size / 2**30:,.1f} GiB, more than the {memory / 2**30:,.1f} "
                         f"GiB of {dev} (k3.model.params.count_parameters counts them without allocating)")
    model.to_empty(device=dev)
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
        require_floating(k, state[k], where)


def require_floating(name: str, t: torch.Tensor, where: str) -> None:
    """A ValueError naming `where` and the tensor unless it is stored in a floating dtype (every
    parameter and buffer of a k3 model is)."""
    if not t.is_floating_point():
        raise ValueError(f"{where}: {name} is stored as {t.dtype}; k3 weights are floating point")


def read_config_json(path: str | Path) -> dict:
    """config.json of checkpoint directory `path` as a JSON object; a ValueError naming the file."""
    p = Path(path) / "config.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{p}: not a JSON object")
    return d


def checkpoint_format(path: str | Path) -> str:
    """'training', 'k3', 'k3-release' or 'kimi-linear'; a ValueError for anything else."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"{root}: no such checkpoint directory")
    if (root / "k3" / "config.json").is_file() or (root / "shared.pt").is_file():
        return "training"
    if not (root / "config.json").is_file():
        raise ValueError(f"{root}: not a checkpoint k3 reads (no config.json, no k3/config.json)")
    d = read_config_json(root)
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

    return config_from_hf(read_config_json(path))


def load(path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
         ep_rank: int = 0, ep_size: int = 1, vision: bool | None = None) -> Model:
    """The model in a checkpoint directory, in eval mode. dtype (a torch.dtype or its name) None
    keeps the stored dtypes (routing and KDA-gate tensors stay fp32 whatever is asked); device is
    'cpu' or 'cuda[:i]'. With ep_size > 1 the model holds
    only rank ep_rank's experts; the K3 release streams just those tensors from disk, the other
    layouts read whole and keep the rank's rows. `model.source` records the directory and its
    layout (k3.model.directory.Source): the writers refuse to write over it unless overwrite=True."""
    dtype, device = check_dtype(dtype), check_device(device, meta=False)
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
