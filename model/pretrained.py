"""k3's own model directory: `config.json` (K3Config) and `model.safetensors` (k3's parameter
names), the form a trained model is served and shared in. Tokenizer files beside them
(`tokenizer.json`, `tokenizer_config.json`) belong to whoever wrote the directory.

Training checkpoints (DeepSpeed state, expert shards, optimizer) are a different thing, read by
k3.platform; `k3 export` turns one into this directory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import K3Config
from .loading import model_class
from .model import K3ForCausalLM, load_dtype
from .multimodal import K3ForConditionalGeneration

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def save_model_dir(model: K3ForCausalLM | K3ForConditionalGeneration, path: str | Path) -> Path:
    """Write config.json and model.safetensors (with a vision tower, its config and weights too)."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (WEIGHTS + ".tmp")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp), metadata={"format": "pt", "k3": "1"})
    tmp.replace(out / WEIGHTS)  # a half-written file never carries the final name
    model.cfg.to_json(out / CONFIG)
    return out


def load_model_dir(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   vision: bool | None = None) -> K3ForCausalLM | K3ForConditionalGeneration:
    """A model directory written by save_model_dir; a ValueError names what is missing or off.
    `vision` as in k3.model.load (which calls this for a k3 model directory)."""
    root = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (root / name).is_file():
            raise ValueError(f"{root}: not a k3 model directory (no {name})")
    cfg = K3Config.from_json(root / CONFIG)
    cls = model_class(cfg, vision)
    state = load_file(str(root / WEIGHTS), device=str(device))
    if cfg.vision_config is not None and cls is K3ForCausalLM:  # the language model alone
        state = {k[len("language_model."):]: v for k, v in state.items() if k.startswith("language_model.")}
    with torch.device("meta"):
        model = cls(cfg)
    want = set(model.state_dict())
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise ValueError(f"{root / WEIGHTS}: missing tensors {missing[:5]}, unexpected tensors {extra[:5]}")
    for k, v in model.state_dict().items():
        if state[k].shape != v.shape:
            raise ValueError(f"{root / WEIGHTS}: {k} has shape {tuple(state[k].shape)}, the config makes "
                             f"{tuple(v.shape)}")
    state = {k: v.to(load_dtype(k, v.dtype, dtype)) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
