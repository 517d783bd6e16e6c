"""Write beside, swap in (k3.model.directory): the previous version stays whole until the
new one is complete, files the writer does not own are carried over, and what a killed writer
left beside the destination is cleaned up (or put back) by the next write. The writers' own kill
tests: test_data.py, test_vision_data.py, test_monitoring.py."""
from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import tree_bytes
from k3.model.directory import owned, write_beside
from k3.model.directory import _HOST as HOST  # the host part of a sibling's name


def refuse(a: Path, b: Path) -> None:
    raise OSError(errno.ENOSYS, "no atomic exchange here")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def old_version(dest: Path) -> None:
    (dest / "sub").mkdir(parents=True)
    (dest / "owned.txt").write_text("old")
    (dest / "stale-1.bin").write_text("old")
    (dest / "sub" / "users.txt").write_text("mine")


@pytest.mark.parametrize("exchange", [None, refuse], ids=["renameat2", "two-renames"])
def test_the_new_version_replaces_what_the_writer_owns_and_keeps_the_rest(tmp_path, exchange):
    dest = tmp_path / "out"
    old_version(dest)
    kw = {"exchange": exchange} if exchange else {}
    with write_beside(dest, stale=lambda rel: rel.startswith("stale-"), **kw) as stage:
        (stage / "owned.txt").write_text("new")
        (stage / "stale-2.bin").write_text("new")
        assert tree_bytes(dest)["owned.txt"] == b"old"  # nothing changes before the block ends
    assert tree_bytes(dest) == {"owned.txt": b"new", "stale-2.bin": b"new", "sub/users.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_failed_writer_leaves_the_previous_version_and_no_stage(tmp_path):
    dest = tmp_path / "out"
    old_version(dest)
    before = tree_bytes(dest)
    with pytest.raises(RuntimeError, match="midway"):
        with write_beside(dest) as stage:
            (stage / "owned.txt").write_text("half")
            raise RuntimeError("midway")
    assert tree_bytes(dest) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_what_a_killed_writer_left_is_removed_or_put_back(tmp_path):
    dest = tmp_path / "out"
    pid = dead_pid()
    old_version(tmp_path / f".out.k3-old.{HOST}.{pid}.0000")  # killed between the two renames: out is missing
    (tmp_path / f".out.k3-stage.{HOST}.{pid}.0001").mkdir()  # killed while writing
    (tmp_path / f".out.k3-stage.another-host.{pid}.0002").mkdir()  # a writer on another machine: not ours to judge
    with write_beside(dest) as stage:
        (stage / "owned.txt").write_text("new")
    assert tree_bytes(dest) == {"owned.txt": b"new", "stale-1.bin": b"old", "sub/users.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".out.k3-stage.another-host.{pid}.0002", "out"]


def test_owned_top_level_names_go_and_the_rest_is_kept(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    for name in ("config.json", "model-00001-of-00002.safetensors", "tokenizer.json"):
        (dest / name).write_text("old")
    (dest / "notes").mkdir()
    (dest / "notes" / "a.txt").write_text("mine")
    with write_beside(dest, stale=owned(("config.json", "model-*-of-*.safetensors"))) as stage:
        (stage / "config.json").write_text("new")
    assert tree_bytes(dest) == {"config.json": b"new", "notes/a.txt": b"mine", "tokenizer.json": b"old"}


def test_a_symlinked_directory_is_rewritten_where_it_lives(tmp_path):
    real, link = tmp_path / "disk" / "data", tmp_path / "data"
    old_version(real)
    link.symlink_to(real)
    with write_beside(link) as stage:
        (stage / "owned.txt").write_text("new")
    assert link.is_symlink() and (real / "owned.txt").read_text() == "new"


def test_a_destination_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "out").write_text("a file")
    with pytest.raises(ValueError, match="is not a directory"):
        with write_beside(tmp_path / "out"):
            pass
