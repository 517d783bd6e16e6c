"""C++ extension builds (DeepSpeed's ops, through torch.utils.cpp_extension) that never hang.

torch guards each build directory with a `lock` file (`torch.utils.file_baton.FileBaton`): the
builder creates it with O_EXCL, keeps it open while compiling and deletes it at the end; every
other process polls until the file is gone, with no time limit. A build killed midway (a job
timeout, Ctrl-C, a preempted worker) leaves the file behind and every later job that needs that
extension waits forever, silently.

`wait_for_extension_locks()` runs before k3 lets DeepSpeed build or load anything: a lock that
no live process holds open (Linux: /proc/<pid>/fd) is stale and removed, so the next build
starts over; a lock a live process holds is waited for, up to `timeout_s`, then a TimeoutError
names the lock, its holders and how to clear it. Where /proc cannot tell (another OS, or the
extensions directory shared between machines), a lock older than `timeout_s` fails the same way.

`use_interpreter_ninja()` runs there too: torch builds with the first `ninja` on PATH, and a venv
holds its own (the `ninja` package, a DeepSpeed dependency) beside the system's. Two ninja
versions hash a build's command lines differently (1.11 and 1.13 here), so each takes the other's
build of the same command for stale and compiles the extension again (60-100 s on 2 cores, every
other process waiting on its lock) whenever a process started with the venv's bin on PATH (a `k3
cluster up` job) and one started without it (`.venv/bin/python jobs/pretrain.py`) take turns.

`init_distributed(backend)` is DeepSpeed's with both: its shared-memory op announces its build on
stdout, which would corrupt a job whose stdout is its JSON result; the line goes to stderr.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path


def use_interpreter_ninja(bin_dir: str | Path | None = None) -> str | None:
    """Put bin_dir (default: this interpreter's, the venv's bin) first on PATH when it holds a
    `ninja` and PATH finds another one first; returns the ninja PATH finds now (None: none)."""
    bin_dir = Path(os.path.dirname(sys.executable) if bin_dir is None else bin_dir)
    own = shutil.which("ninja", path=str(bin_dir))
    found = shutil.which("ninja")
    if own is not None and (found is None or Path(found).parent != Path(own).parent):
        rest = os.environ.get("PATH", "")  # an empty entry would put the current directory on PATH
        os.environ["PATH"] = f"{bin_dir}{os.pathsep}{rest}" if rest else str(bin_dir)
        found = shutil.which("ninja")
    return found


def init_distributed(backend: str) -> None:
    """`deepspeed.init_distributed(dist_backend=backend)` with this interpreter's ninja, after any
    stale build lock is cleared, and with whatever it prints sent to stderr."""
    import deepspeed

    use_interpreter_ninja()
    wait_for_extension_locks()
    with contextlib.redirect_stdout(sys.stderr):
        deepspeed.init_distributed(dist_backend=backend)


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, or torch's default root."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def extension_locks(root: Path | None = None) -> list[Path]:
    """Every build lock under root (root/<name>/lock and root/<tag>/<name>/lock)."""
    root = extensions_root() if root is None else Path(root)
    if not root.is_dir():
        return []
    return sorted(set(root.glob("*/lock")) | set(root.glob("*/*/lock")))


def lock_holders(lock: Path) -> list[int] | None:
    """PIDs that hold `lock` open, or None when this machine cannot tell (no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "fd").is_dir():
        return None
    target = os.path.realpath(lock)
    holders = []
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for fd in (pid_dir / "fd").iterdir():
                try:
                    if os.readlink(fd) == target:
                        holders.append(int(pid_dir.name))
                        break
                except OSError:
                    continue
        except OSError:  # the process ended, or is not ours to read
            continue
    return holders


def clear_stale_extension_locks(root: Path | None = None) -> list[Path]:
    """Remove every build lock that no live process holds open; returns the removed paths."""
    removed = []
    for lock in extension_locks(root):
        if lock_holders(lock) == []:
            try:
                lock.unlink()
                removed.append(lock)
            except FileNotFoundError:  # its build just finished
                pass
    return removed


def wait_for_extension_locks(root: Path | None = None, timeout_s: float = 900.0, poll_s: float = 0.5) -> list[Path]:
    """Clear stale build locks and wait (at most timeout_s) for live builds; returns the locks
    removed as stale. Raises TimeoutError naming a lock still held after timeout_s."""
    removed = clear_stale_extension_locks(root)
    deadline = time.monotonic() + timeout_s
    while True:
        pending = []
        for lock in extension_locks(root):
            holders = lock_holders(lock)
            if holders == []:
                try:
                    lock.unlink()
                    removed.append(lock)
                except FileNotFoundError:
                    pass
                continue
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                continue
            if holders is None and age < timeout_s:
                continue  # cannot see its owner: only an old lock is suspect
            pending.append((lock, holders))
        if not pending:
            return removed
        if time.monotonic() >= deadline:
            lock, holders = pending[0]
            who = f"held open by pid(s) {holders}" if holders else "whose owner cannot be seen from here"
            raise TimeoutError(
                f"extension build lock {lock} ({who}) did not clear in {timeout_s:.0f}s; if no build of "
                f"{lock.parent.name} is running, delete it (rm {lock}) and retry")
        time.sleep(poll_s)
