"""Writing a directory of user data without ever leaving less than was there, and knowing which
directory a loaded model is read from. Every k3 writer of user data goes through `write_beside`:
the model writers (save_k3, save_kimi_linear, save_model_dir, export_model), prepared data and
its media set, the Grafana dashboards, the alert rules, run reports, and each training worker's
checkpoint stage.

    with write_beside("data/bundled", stale=lambda rel: rel.startswith("shard-")) as stage:
        ...  # write the new version into `stage`
    # only here does data/bundled change: one atomic exchange of two directories

The stage is a sibling of the destination (the same filesystem, so the swap is a rename). Before
the swap, every file of the previous version that the writer did not write again is hard-linked
into the stage, except those `stale` names: a writer replaces what it owns and keeps the rest (a
model directory keeps its tokenizer, the text data its media set, a dashboards folder a user's own
files). Then everything is fsynced and swapped in with Linux's renameat2(RENAME_EXCHANGE);
elsewhere with two renames, and a writer killed between them leaves the previous version beside
the destination, which the next write of that destination puts back. Stages of writers that died
are removed by the next write of the same destination.

A model's `source` (set by every loader) says where its weights are read from: safetensors are
memory-mapped, so a loaded model may still be backed by those files. `check_destination`
refuses to replace that directory, or one holding it, unless the caller passes overwrite=True
(which is safe: the swap unlinks the old files, and a mapped file lives until it is unmapped).
"""
from __future__ import annotations

import ctypes
import errno
import fnmatch
import glob
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# The files of a model directory in every layout k3 writes: config.json and safetensors weights
# (one file, or shards with an index). A model writer owns all of them, so no shard or index of an
# earlier save stays behind to be read with the new config.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors")


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


STAGE, ASIDE = "k3-stage", "k3-old"  # sibling names: .<dest name>.<kind>.<host>.<pid>.<random>
# The host is in the name because a destination on a shared filesystem is written from many
# machines: only a writer on this host can be known dead (by its pid).
_HOST = socket.gethostname().replace(".", "_")


def _sibling(dest: Path, kind: str) -> Path:
    return dest.parent / f".{dest.name}.{kind}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _dead_siblings(dest: Path, kind: str) -> list[Path]:
    """Siblings of `kind` written by a process of this host that is gone."""
    prefix = f".{dest.name}.{kind}.{_HOST}."
    found = []
    for p in dest.parent.glob(glob.escape(prefix) + "*"):
        pid = p.name[len(prefix):].split(".")[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            found.append(p)
    return found


def clean_dead_writers(dest: str | os.PathLike) -> None:
    """Put back a previous version a killed swap left aside, and remove the stages of dead writers."""
    dest = Path(dest)
    for aside in _dead_siblings(dest, ASIDE):
        if dest.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, dest)
    for stage in _dead_siblings(dest, STAGE):
        shutil.rmtree(stage, ignore_errors=True)


def stage_dir(dest: str | os.PathLike) -> Path:
    """A new empty directory beside `dest` (named for this process, so a dead writer's is found)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clean_dead_writers(dest)
    stage = _sibling(dest, STAGE)
    stage.mkdir()
    if dest.is_dir():
        shutil.copymode(dest, stage)
    return stage


def _carry_over(old: Path, stage: Path, stale: Callable[[str], bool]) -> None:
    for p in sorted(old.rglob("*")):
        rel = p.relative_to(old).as_posix()
        target = stage / rel
        if stale(rel) or target.exists() or target.is_symlink():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink():
            os.symlink(os.readlink(p), target)
        elif p.is_dir():
            target.mkdir()
        else:
            try:
                os.link(p, target)  # k3's writers never write a file in place, so sharing it is safe
            except OSError:
                shutil.copy2(p, target)


def _libc_exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def swap_in(stage: Path, dest: Path, exchange: Callable[[Path, Path], None] = _libc_exchange) -> None:
    """Make the complete directory `stage` the directory `dest`; the previous `dest` is deleted.
    `exchange` swaps two directories atomically (tests pass one that refuses, for the fallback)."""
    if not dest.exists():
        os.rename(stage, dest)
        return
    try:
        exchange(stage, dest)
        old = stage
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise
        old = _sibling(dest, ASIDE)
        os.rename(dest, old)
        os.rename(stage, dest)
    shutil.rmtree(old)


@contextmanager
def write_beside(dest: str | os.PathLike, stale: Callable[[str], bool] = lambda rel: False,
                 exchange: Callable[[Path, Path], None] = _libc_exchange) -> Iterator[Path]:
    """Yield a stage to write the new version of the directory `dest` into; swap it in when the
    block ends without an exception (files of the old version the block did not write are carried
    over unless `stale(relative posix path)`), else delete it and leave `dest` as it was."""
    dest = Path(dest).resolve()  # a symlinked directory is rewritten where it lives
    if dest.exists() and not dest.is_dir():
        raise ValueError(f"{dest} is not a directory")
    stage = stage_dir(dest)
    try:
        yield stage
        if dest.is_dir():
            _carry_over(dest, stage, stale)
        _fsync_tree(stage)  # the new version is on disk before it takes the name
        swap_in(stage, dest, exchange)
        _fsync(dest.parent)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def owned(patterns: tuple[str, ...]) -> Callable[[str], bool]:
    """A `stale` for writers that own whole top-level entries by name (glob patterns): those of the
    previous version go, everything else is kept."""
    return lambda rel: any(fnmatch.fnmatchcase(rel.split("/")[0], p) for p in patterns)


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
