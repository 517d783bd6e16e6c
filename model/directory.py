"""Writing a directory of user data without ever leaving less than was there, and knowing which
directory a loaded model is read from.

`replace_directory(path, owns)` is how k3 writes a model directory (save_k3, save_kimi_linear,
save_model_dir, k3.platform.train.export.export_model; k3.platform may use it for its own
writers): the writer fills a new sibling directory `.NAME.partial.HOST.PID.TOKEN`; when it is
done, the entries of the old directory that the writer does not own (a tokenizer, notes, a
folder) are hard-linked in, every file and folder is fsynced, the old directory is renamed aside
(`.NAME.old.PID.TOKEN`), the new one renamed to NAME, and the old one deleted. So:

- an exception in the writer removes the partial directory and leaves NAME as it was;
- a kill (or power loss) before the first rename leaves NAME as it was and a partial directory
  beside it, which the next write to NAME from this host removes once its process is gone;
- a kill between the two renames (microseconds) leaves the old version complete under
  `.NAME.old.*`, which nothing removes.

A model's `source` (set by every loader) says where its weights are read from: safetensors are
memory-mapped, so a loaded model may still be backed by those files. `check_destination`
refuses to replace that directory, or one holding it, unless the caller passes overwrite=True
(which is safe: the swap unlinks the old files, and a mapped file lives until it is unmapped).
"""
from __future__ import annotations

import fnmatch
import glob
import os
import shutil
import socket
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

# The files of a model directory in every layout k3 writes: config.json and safetensors weights
# (one file, or shards with an index). A model writer owns all of them, so no shard or index of an
# earlier save stays behind to be read with the new config.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors")
_HOST = socket.gethostname()


@dataclass(frozen=True)
class Source:
    """Where a loaded model came from: its directory, its layout (the names of
    k3.model.loading.checkpoint_format) and, for the K3 release, config.json as read (save_k3
    writes back the fields k3 does not use)."""

    path: Path
    layout: str
    config: dict | None = field(default=None, compare=False, repr=False)


def check_destination(source: Source | None, path: str | Path, overwrite: bool) -> None:
    """Refuse to write over the directory a model is read from (or a folder holding it) unless `overwrite`."""
    if source is None or overwrite:
        return
    dest, src = Path(path).resolve(), source.path.resolve()
    if dest == src or dest in src.parents:
        raise ValueError(f"{path}: the model was loaded from {source.path}; writing there would replace the "
                         f"checkpoint it is read from (pass overwrite=True to do it anyway)")


@contextmanager
def replace_directory(path: str | Path, owns: tuple[str, ...]) -> Iterator[Path]:
    """Yield an empty directory beside `path` to write into; when the body returns it replaces
    `path` (see the module docstring). `owns`: glob patterns of the entry names the writer is
    responsible for; the old directory's other entries are kept."""
    dest = Path(path).resolve()
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest}: exists and is not a directory")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(dest)
    token = uuid.uuid4().hex[:8]
    new = dest.parent / f".{dest.name}.partial.{_HOST}.{os.getpid()}.{token}"
    new.mkdir()
    try:
        yield new
        _keep_others(dest, new, owns)
        _fsync_tree(new)
        _swap(new, dest, dest.parent / f".{dest.name}.old.{os.getpid()}.{token}")
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def _remove_dead_partials(dest: Path) -> None:
    prefix = f".{dest.name}.partial.{_HOST}."
    for p in dest.parent.glob(glob.escape(prefix) + "*"):
        pid = p.name[len(prefix):].split(".")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _keep_others(old: Path, new: Path, owns: tuple[str, ...]) -> None:
    """Link the old directory's entries the writer does not own (and did not write) into the new one."""
    if not old.is_dir():
        return
    for entry in old.iterdir():
        target = new / entry.name
        if os.path.lexists(target) or any(fnmatch.fnmatchcase(entry.name, p) for p in owns):
            continue
        if entry.is_symlink():
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            shutil.copytree(entry, target, symlinks=True, copy_function=_link)
        else:
            _link(entry, target)


def _link(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(src, dst)


def _fsync_tree(root: Path) -> None:
    for folder, _, names in os.walk(root):
        for name in names:
            if not os.path.islink(os.path.join(folder, name)):
                _fsync(os.path.join(folder, name))
        _fsync(folder)


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _swap(new: Path, dest: Path, aside: Path) -> None:
    if not dest.exists():
        os.rename(new, dest)
        _fsync(dest.parent)
        return
    os.rename(dest, aside)
    try:
        os.rename(new, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    _fsync(dest.parent)
    shutil.rmtree(aside)
