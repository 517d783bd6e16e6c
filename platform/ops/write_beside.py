"""Write beside, swap in: how k3 rewrites a directory of user data (prepared data, the media set,
the Grafana dashboards), so that a writer killed at any point leaves the previous version whole.

    with write_beside("data/bundled", stale=lambda rel: rel.startswith("shard-")) as stage:
        ...  # write the new version into `stage`
    # only here does data/bundled change: one atomic exchange of two directories

The stage is a sibling of the destination (the same filesystem, so the swap is a rename). Before
the swap, every file of the previous version that the writer did not write again is hard-linked
into the stage, except those `stale` names: a writer replaces what it owns and keeps the rest (the
text data keeps its media set, a dashboards folder a user's own files). The swap is Linux's
renameat2(RENAME_EXCHANGE); elsewhere two renames, and a writer killed between them leaves the
previous version beside the destination, which the next write of that destination puts back.
Stages of writers that died are removed by the next write of the same destination.
"""
from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STAGE, ASIDE = "k3-stage", "k3-old"  # sibling names: .<dest name>.<kind>-<pid>-<random>


def _sibling(dest: Path, kind: str) -> Path:
    return dest.parent / f".{dest.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _dead_siblings(dest: Path, kind: str) -> list[Path]:
    """Siblings of `kind` whose writer process is gone."""
    found = []
    for p in dest.parent.glob(f".{dest.name}.{kind}-*-*"):
        pid = p.name[len(f".{dest.name}.{kind}-"):].split("-")[0]
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
        swap_in(stage, dest, exchange)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
