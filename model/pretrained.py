"""k3's own model directory: `config.json` (K3Config) and `model.safetensors` (k3's parameter
names), the form a trained model is served and shared in. Tokenizer files beside them
(`tokenizer.json`, `tokenizer_config.json`) belong to whoever wrote the directory.

Training checkpoints (DeepSpeed state, expert shards, optimizer) are a different thing, read by
k3.platform; `k3.platform.train.export.export_model` turns one into this directory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint_reader import CheckpointReader
from .config import K3Config
from .directory import MODEL_FILES, Source, check_destination, owned, write_beside
from .loading import check_device, check_dtype, model_class, require_state
from .model import K3ForCausalLM, load_dtype
from .moe import require_all_experts
from .multimodal import K3ForConditionalGeneration

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def save_model_dir(model: K3ForCausalLM | K3ForConditionalGeneration, path: str | Path,
                   overwrite: bool = False) -> Path:
    """Write config.json and model.safetensors (with a vision tower, its config and weights too).

    Written beside and swapped in (model/directory.py): a failure leaves the previous directory as
    it was, and its other files (a tokenizer) stay. Refused before anything is written: a model
    holding only some experts, and the directory the model was loaded from unless `overwrite`."""
    check_destination(model.source, path, overwrite)
    require_all_experts(model)
    with write_beside(path, stale=owned(MODEL_FILES)) as new:
        write_model_files(model, new)
    return Path(path)


def write_model_files(model: K3ForCausalLM | K3ForConditionalGeneration, directory: Path) -> None:
    """config.json and model.safetensors of `model` into `directory` as they are (no checks, no swap:
    the caller's write_beside provides both)."""
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS), metadata={"format": "pt", "k3": "1"})
    model.cfg.to_json(directory / CONFIG)


def load_model_dir(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                   vision: bool | None = None) -> K3ForCausalLM | K3ForConditionalGeneration:
    """A model directory written by save_model_dir; a ValueError names what is missing or off.
    `vision` as in k3.model.load (which calls this for a k3 model directory)."""
    root = Path(path)
    dtype, device = check_dtype(dtype), check_device(device, meta=False)
    for name in (CONFIG, WEIGHTS):
        if not (root / name).is_file():
            raise ValueError(f"{root}: not a k3 model directory (no {name})")
    cfg = K3Config.from_json(root / CONFIG)
    cls = model_class(cfg, vision)
    reader = CheckpointReader(root)  # names the file and tensor of an unreadable or non-finite tensor
    prefix = "language_model." if cfg.vision_config is not None and cls is K3ForCausalLM else ""  # the LM alone
    state = {k[len(prefix):]: reader.get(k).to(device) for k in reader.keys() if k.startswith(prefix)}
    with torch.device("meta"):
        model = cls(cfg)
    require_state(model, state, str(root / WEIGHTS))
    state = {k: v.to(load_dtype(k, v.dtype, dtype)) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.source = Source(root, "k3")
    return model.eval()
