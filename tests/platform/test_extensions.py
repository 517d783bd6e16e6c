"""A C++ extension build killed midway must not make the next job wait forever on its lock; every
process builds with the same ninja."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from torch.utils.file_baton import FileBaton

from k3.platform.ops.extensions import (
    clear_stale_extension_locks,
    lock_holders,
    use_interpreter_ninja,
    wait_for_extension_locks,
)

# What torch.utils.cpp_extension does around a build: take the baton on <dir>/<name>/lock, keep it
# open while compiling (here: sleeping), release it at the end.
BUILD = """
import sys, time
from torch.utils.file_baton import FileBaton
b = FileBaton(sys.argv[1])
assert b.try_acquire()
print("compiling", flush=True)
time.sleep(120)
b.release()
"""


@pytest.fixture
def building(tmp_path):
    lock = tmp_path / "fused_adam" / "lock"
    lock.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", BUILD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "compiling"
    yield tmp_path, lock, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_live_build_is_waited_for_then_named_in_a_timeout(building):
    root, lock, proc = building
    assert lock_holders(lock) == [proc.pid]
    assert clear_stale_extension_locks(root) == [] and lock.exists()  # a live build keeps its lock
    with pytest.raises(TimeoutError, match=f"{lock}.*pid\\(s\\) \\[{proc.pid}\\].*rm {lock}"):
        wait_for_extension_locks(root, timeout_s=0.5, poll_s=0.1)


def test_build_killed_midway_leaves_a_lock_the_next_run_clears(building):
    root, lock, proc = building
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert lock.exists(), "the killed build left no lock: nothing to test"
    # without k3: torch's wait on this lock never returns
    waiter = threading.Thread(target=FileBaton(str(lock), wait_seconds=0.05).wait, daemon=True)
    waiter.start()
    waiter.join(1.0)
    assert waiter.is_alive(), "torch's FileBaton.wait returned on a dead build's lock"
    # with k3: the next run removes the stale lock and its build takes the baton at once
    assert wait_for_extension_locks(root, timeout_s=5) == [lock]
    nxt = FileBaton(str(lock))
    assert nxt.try_acquire()
    nxt.release()


def _exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_interpreters_ninja_goes_first_on_path_once(tmp_path, monkeypatch):
    # Two ninja versions hash a build's command differently and rebuild each other's extension:
    # every k3 process builds with the ninja beside its interpreter, whatever PATH it started with.
    system = _exe(tmp_path / "usr" / "bin" / "ninja")
    venv = _exe(tmp_path / "venv" / "bin" / "ninja").parent
    monkeypatch.setenv("PATH", f"{system.parent}{os.pathsep}/bin")
    assert use_interpreter_ninja(venv) == str(venv / "ninja")
    assert use_interpreter_ninja(venv) == str(venv / "ninja")
    assert os.environ["PATH"] == f"{venv}{os.pathsep}{system.parent}{os.pathsep}/bin"


def test_path_is_left_alone_without_a_ninja_beside_the_interpreter(tmp_path, monkeypatch):
    system = _exe(tmp_path / "usr" / "bin" / "ninja")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    monkeypatch.setenv("PATH", str(system.parent))
    assert use_interpreter_ninja(tmp_path / "venv" / "bin") == str(system)
    assert os.environ["PATH"] == str(system.parent)


def test_an_empty_path_gets_the_interpreters_bin_and_no_empty_entry(tmp_path, monkeypatch):
    venv = _exe(tmp_path / "venv" / "bin" / "ninja").parent
    monkeypatch.setenv("PATH", "")
    assert use_interpreter_ninja(venv) == str(venv / "ninja")
    assert os.environ["PATH"] == str(venv)


@pytest.mark.distributed
def test_init_distributed_leaves_stdout_to_the_caller():
    # DeepSpeed's shared-memory op prints "... built successfully" on stdout when it loads: a job
    # whose stdout is its JSON result (jobs/bench_vs_transformers.py --only train) printed invalid
    # JSON; through k3's init_distributed the line goes to stderr
    code = ("import json, os\n"
            "from k3.platform.ops.local_ray import free_port\n"
            "os.environ['MASTER_PORT'] = str(free_port())\n"
            "from k3.platform.ops.extensions import init_distributed\n"
            "init_distributed('gloo')\n"
            "import torch.distributed as dist\n"
            "print(json.dumps({'world': dist.get_world_size()}))\n")
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == '{"world": 1}\n', done.stdout
    assert "built successfully" in done.stderr
