"""Reading safetensors checkpoints (one model.safetensors, or shards with model.safetensors.index.json)
one tensor at a time, refusing what cannot be loaded exactly.

Every error names the file and the tensor: a shard safetensors cannot open (truncated, not
safetensors), an index naming a tensor its shard lacks, and a floating tensor holding NaN or inf
(checked as each tensor is read: one pass over it, nothing allocated the size of it).
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


class CheckpointReader:
    """Lazy tensor access over sharded safetensors (or one model.safetensors).

    `reads` counts every tensor read by name and `opened` lists the shard files touched, so a
    caller (or a test) can see exactly what a load pulled from disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if (self.path / INDEX).exists():
            try:
                self.weight_map: dict[str, str] = json.loads((self.path / INDEX).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{self.path / INDEX}: not a safetensors index ({e!r})") from e
        elif (self.path / SINGLE).exists():
            self.weight_map = {k: SINGLE for k in self._open(SINGLE).keys()}
        else:
            raise ValueError(f"{self.path}: no {INDEX} or {SINGLE}")
        self._files: dict[str, object] = {}
        self.reads: Counter[str] = Counter()
        self.opened: list[str] = []

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def where(self, name: str) -> str:
        """'FILE: TENSOR', how errors name a tensor."""
        return f"{self.weight_map.get(name, '?')}: {name}"

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ValueError(f"checkpoint lacks tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = self._open(file)
            self.opened.append(file)
        try:
            t = self._files[file].get_tensor(name)
        except Exception as e:  # safetensors' own error type says neither file nor tensor
            raise ValueError(f"{self.where(name)}: cannot read the tensor ({e})") from e
        self.reads[name] += 1
        require_finite(t, self.where(name))
        return t

    def _open(self, file: str):
        try:
            return safe_open(self.path / file, "pt")
        except Exception as e:  # a truncated shard fails here, in safetensors' words only
            raise ValueError(f"{file}: cannot read {self.path / file} as safetensors ({e})") from e


def require_finite(t: torch.Tensor, where: str) -> None:
    """A ValueError naming `where` ('FILE: TENSOR') when a floating tensor holds NaN or inf; every
    k3 loader checks each tensor it reads with this."""
    if t.is_floating_point() and t.numel():
        lo, hi = torch.aminmax(t.reshape(-1))  # NaN propagates into both, inf shows in one
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise ValueError(f"{where}: non-finite values (NaN or inf); k3 loads exact weights only")
