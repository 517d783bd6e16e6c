"""The bundled corpus: the Python standard library's own source, which every machine has.

Nothing is downloaded. Files are picked deterministically (sorted paths, test suites and
vendored packages left out) up to a byte budget, so the same Python version gives the same
corpus; the manifest records which version it came from.
"""
from __future__ import annotations

import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__",
              "ensurepip", "turtledemo", "tkinter", "pydoc_data", "config-3"}


@dataclass
class Corpus:
    files: list[Path]
    bytes: int
    source: str

    def texts(self):
        for f in self.files:
            yield f.read_text(encoding="utf-8", errors="replace")


def stdlib_corpus(max_bytes: int = 8_000_000) -> Corpus:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if any(p in _SKIP_DIRS or p.startswith("config-") for p in rel[:-1]):
            continue
        size = f.stat().st_size
        if size == 0 or size > 400_000:
            continue
        if total + size > max_bytes:
            break
        files.append(f)
        total += size
    if not files:
        raise ValueError(f"no Python sources found under {root}")
    return Corpus(files, total, f"python{sys.version_info.major}.{sys.version_info.minor} stdlib at {root}")
