"""Every model writer (save_k3, save_kimi_linear, save_model_dir, export_model) writes beside the old
directory and swaps the new one in when complete (k3.model.directory): killed midway it leaves the
previous version byte for byte; it refuses, before writing anything, a model holding only some
experts and the directory the model is being read from; files it does not own stay."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from writer_cases import WRITERS, model_state, tiny_config, training_checkpoint, write_case, write_model

import k3.model
from k3.platform.train.export import export_model

REPO = Path(__file__).resolve().parents[2]
MODEL_WRITERS = [w for w in WRITERS if w != "export_model"]

# Writes the seed-2 model over `path` and stops for good once the first safetensors file is
# complete, after telling the parent, which then kills it: the kill lands mid-write, every time.
_KILLED = r"""
import sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
from writer_cases import write_case
writer, path, scratch, marker = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])

def stop_after_first_weights(frame, event, arg):
    code = frame.f_code
    if event == "return" and code.co_name == "save_file" and code.co_filename.endswith("safetensors/torch.py"):
        marker.write_text("one weights file written")
        time.sleep(600)

sys.setprofile(stop_after_first_weights)
write_case(writer, 2, path, scratch)
"""


def files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def siblings(path: Path) -> list[str]:
    """Hidden entries beside `path` that a write to it made (partial or set-aside directories)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def kill_midway(writer: str, path: Path, scratch: Path) -> None:
    marker = scratch / "marker"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _KILLED, writer, str(path), str(scratch), str(marker)],
                             cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not marker.exists():
        if child.poll() is not None:
            pytest.fail(f"the writer finished before it could be killed: {child.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail("the writer never wrote a weights file")
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    child.stderr.close()


@pytest.mark.parametrize("writer", WRITERS)
def test_a_writer_killed_midway_leaves_the_previous_version(writer, tmp_path):
    path = tmp_path / "out"
    write_case(writer, 1, path, tmp_path)
    before, state = files(path), model_state(path)
    kill_midway(writer, path, tmp_path)
    assert len(siblings(path)) == 1  # the kill landed while the new version was being written beside
    assert files(path) == before
    assert all(torch.equal(v, state[k]) for k, v in model_state(path).items())
    write_case(writer, 3, path, tmp_path)  # the next write completes and clears what the killed one left
    assert siblings(path) == [] and files(path) != before


@pytest.mark.parametrize("writer", MODEL_WRITERS)
def test_a_model_holding_some_experts_is_refused_before_anything_is_written(writer, tmp_path):
    path = tmp_path / "out"
    write_case(writer, 1, path, tmp_path)
    before = files(path)
    part = k3.model.build(tiny_config(writer), ep_rank=1, ep_size=2, seed=1)
    with pytest.raises(ValueError, match=r"holds experts \[8, 16\) of 16"):
        write_model(writer, part, path)
    assert files(path) == before and siblings(path) == []


@pytest.mark.parametrize("writer", MODEL_WRITERS)
def test_writing_over_the_directory_a_model_was_loaded_from_needs_overwrite(writer, tmp_path):
    path = tmp_path / "out"
    write_case(writer, 1, path, tmp_path)
    before = files(path)
    model = k3.model.load(path)
    for dest in (path, tmp_path):  # the directory itself, or one that holds it
        with pytest.raises(ValueError, match="loaded from .*overwrite=True"):
            write_model(writer, model, dest)
    assert files(path) == before
    want = model.state_dict()
    write_model(writer, model, path, overwrite=True)  # its weights are read from the files being replaced
    assert all(torch.equal(v, want[k].float()) for k, v in model_state(path).items())


def test_export_refuses_to_write_over_its_checkpoint(tmp_path):
    run = training_checkpoint(k3.model.build(tiny_config("export_model"), seed=1), tmp_path / "run")
    before = files(run)
    with pytest.raises(ValueError, match="loaded from"):
        export_model(run, run)
    assert files(run) == before


@pytest.mark.parametrize("writer", WRITERS)
def test_a_new_save_keeps_other_files_and_leaves_no_stale_weights(writer, tmp_path):
    """Over a sharded release export: the shards and index go (a reader would take the stale index
    over a new model.safetensors); a tokenizer's files, notes and folders the writer does not write stay."""
    path = tmp_path / "out"
    write_case("save_k3", 1, path, tmp_path)
    keep = {"notes.txt": b"mine", "tiktoken.model": b"\x00\x01", "extra/readme.md": b"hello"}
    for name, data in keep.items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(data)
    write_case(writer, 2, path, tmp_path)
    after = files(path)
    assert all(after[name] == data for name, data in keep.items())
    shards = [n for n in after if n.startswith("model-")]
    assert (len(shards) > 1) == (writer == "save_k3") and ("model.safetensors.index.json" in after) == bool(shards)
    want = k3.model.build(tiny_config(writer), seed=2).state_dict()
    got = model_state(path)
    assert got.keys() == want.keys() and siblings(path) == []
