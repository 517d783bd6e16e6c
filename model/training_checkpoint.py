"""The model's part of a k3 training checkpoint, and reading one back as a single model.

A training checkpoint (written by k3.platform.train) is a directory whose `k3/` folder holds:

    config.json                 K3Config
    shared.pt                   every non-expert parameter and buffer (written once, by rank 0)
    experts-ep{r}-of-{n}.pt     expert-parallel rank r of n: its routed experts' weights and their
                                optimizer state, both keyed by full parameter name

plus the trainer's own files (state.pt, tokenizer.json, DeepSpeed's ds/). Expert files merge
along the expert axis, so a checkpoint written with one ep_size reads with any other.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint_reader import require_finite
from .config import K3Config
from .directory import Source
from .model import K3ForCausalLM, load_dtype
from .moe import is_expert_param

SHARED, CONFIG = "shared.pt", "config.json"


def model_dir(path: str | Path) -> Path:
    """The `k3/` folder of a checkpoint directory (or the folder itself when given)."""
    root = Path(path)
    return root / "k3" if (root / "k3").is_dir() else root


def read_config(path: str | Path) -> K3Config:
    d = model_dir(path)
    if not (d / CONFIG).is_file():
        raise ValueError(f"{path}: not a k3 training checkpoint (no k3/{CONFIG})")
    return K3Config.from_json(d / CONFIG)


def expert_file(ep_rank: int, ep_size: int) -> str:
    return f"experts-ep{ep_rank}-of-{ep_size}.pt"


def save_shared(model: torch.nn.Module, out: str | Path) -> None:
    """config.json and shared.pt of `model` into the folder `out`."""
    out = Path(out)
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    torch.save({k: v.detach().cpu() for k, v in named.items() if not is_expert_param(k)}, out / SHARED)
    (out / CONFIG).write_text(model.cfg.to_json() + "\n")


def save_experts(model: torch.nn.Module, out: str | Path, ep_rank: int, ep_size: int,
                 optimizer_state: dict[str, dict[str, Any]] | None = None) -> None:
    """This expert-parallel rank's routed experts (and, by parameter name, their optimizer state)."""
    weights = {n: p.detach().cpu() for n, p in model.named_parameters() if is_expert_param(n)}
    torch.save({"weights": weights, "optimizer": optimizer_state or {}}, Path(out) / expert_file(ep_rank, ep_size))


def read_experts(path: str | Path, map_location: str | torch.device = "cpu"
                 ) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Every expert file of a checkpoint merged along the expert axis: (weights, optimizer state)
    by full parameter name, all E experts."""
    d = model_dir(path)
    parts = sorted(d.glob("experts-ep*-of-*.pt"), key=lambda p: int(p.name.split("-")[1][2:]))
    if not parts:
        return {}, {}
    n = int(parts[0].name.rsplit("-of-", 1)[1][:-3])
    if len(parts) != n or any(p.name != expert_file(r, n) for r, p in enumerate(parts)):
        raise ValueError(f"{d}: expected the {n} files {expert_file(0, n)} .. {expert_file(n - 1, n)}, found "
                         f"{[p.name for p in parts]}")
    # tensors and plain values only: unpickling a checkpoint someone hands over must not run its code
    shards = [_read(p, map_location) for p in parts]
    for p, s in zip(parts, shards):
        if not (isinstance(s, dict) and isinstance(s.get("weights"), dict) and isinstance(s.get("optimizer"), dict)):
            raise ValueError(f"{p}: not a k3 expert file (a dict of 'weights' and 'optimizer')")
        if set(s["weights"]) != set(shards[0]["weights"]):
            raise ValueError(f"{p}: holds other expert tensors than {parts[0].name} "
                             f"({sorted(set(s['weights']) ^ set(shards[0]['weights']))[:5]})")
        for key, t in s["weights"].items():
            require_finite(t, f"{p}: {key}")
    try:
        weights = {key: torch.cat([s["weights"][key] for s in shards], dim=0) for key in shards[0]["weights"]}
    except RuntimeError as e:  # shapes that do not merge along the expert axis
        raise ValueError(f"{d}: expert files do not merge along the expert axis ({e})") from e
    opt: dict[str, dict] = {}
    for key, st0 in shards[0]["optimizer"].items():
        opt[key] = {k: (torch.cat([s["optimizer"][key][k] for s in shards], dim=0)
                        if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in st0.items()}
    return weights, opt


def _read(path: Path, map_location) -> Any:
    """torch.load of tensors and plain values, with an unreadable file (truncated, empty, not
    torch's, or pickling other objects) a ValueError naming it."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError... naming no file
        raise ValueError(f"{path}: cannot read it as a torch file ({type(e).__name__}: {e})") from e


def read_state(k3dir: str | Path, map_location=None) -> dict:
    """The trainer's `state.pt` in a checkpoint's k3 directory (step, history, config, the
    balancing state), read as tensors and plain values only: a file someone hands over cannot run
    code, and an unreadable one (or one that is no k3 state) is a ValueError naming it."""
    path = Path(k3dir) / "state.pt"
    state = _read(path, map_location)
    if not isinstance(state, dict) or isinstance(state.get("step"), bool) or not isinstance(state.get("step"), int):
        raise ValueError(f"{path}: not a k3 training state (a dict holding its step)")
    return state


def load_training_checkpoint(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                             vision: bool | None = None):
    """A training checkpoint as one single-process model holding every expert (k3.model.load
    calls this; use that)."""
    from .loading import model_class, require_state

    d = model_dir(path)
    cfg = read_config(path)
    if not (d / SHARED).is_file():
        raise ValueError(f"{d}: no {SHARED} (an incomplete checkpoint?)")
    state = _read(d / SHARED, device)
    if not (isinstance(state, dict) and all(torch.is_tensor(v) for v in state.values())):
        raise ValueError(f"{d / SHARED}: not a k3 {SHARED} (a dict of tensors by parameter name)")
    for key, t in state.items():
        require_finite(t, f"{d / SHARED}: {key}")
    state.update(read_experts(d, map_location=device)[0])
    cls = model_class(cfg, vision)
    if cfg.vision_config is not None and cls is K3ForCausalLM:  # the language model alone
        state = {k[len("language_model."):]: v for k, v in state.items() if k.startswith("language_model.")}
    if dtype is not None:
        state = {k: v.to(load_dtype(k, v.dtype, dtype)) for k, v in state.items()}
    with torch.device("meta"):
        model = cls(cfg)
    require_state(model, state, f"{d} ({SHARED} and the expert files, against {CONFIG})")
    model.load_state_dict(state, strict=True, assign=True)
    model.source = Source(Path(path), "training")
    return model
