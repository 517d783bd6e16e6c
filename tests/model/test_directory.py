"""k3.model.directory.replace_directory on its own: an exception inside the write leaves the old
directory and no partial one; a file where the directory should be is refused. (Every model
writer's use of it, killed midway included: tests/model/test_model_writers.py.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from k3.model.directory import replace_directory


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def test_a_failure_inside_the_write_leaves_the_old_directory_and_no_partial(tmp_path):
    path = tmp_path / "d"
    path.mkdir()
    (path / "config.json").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"):
        with replace_directory(path, owns=("config.json",)) as new:
            (new / "config.json").write_text("new")
            raise RuntimeError("disk full")
    assert files(path) == {"config.json": b"old"} and siblings(path) == []
    with replace_directory(path, owns=("config.json",)) as new:
        (new / "config.json").write_text("new")
    assert files(path) == {"config.json": b"new"} and siblings(path) == []


def test_a_file_where_the_directory_should_be_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        with replace_directory(tmp_path / "f", owns=()):
            pass
    assert (tmp_path / "f").read_text() == "x"


def test_a_link_to_a_directory_replaces_what_it_points_to(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    (real / "config.json").write_text("old")
    link.symlink_to(real)
    with replace_directory(link, owns=("config.json",)) as new:
        (new / "config.json").write_text("new")
    assert link.is_symlink() and files(real) == {"config.json": b"new"} and siblings(real) == []


def test_a_new_directory_gets_its_parents(tmp_path):
    with replace_directory(tmp_path / "a" / "b", owns=()) as new:
        (new / "x").write_text("1")
    assert files(tmp_path / "a" / "b") == {"x": b"1"}
