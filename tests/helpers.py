"""Shared test utilities (imported as `helpers` via conftest's sys.path entry)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ||a - e|| / ||e|| (fla's measure), safe for an all-zero reference."""
    a, e = actual.detach().double(), expected.detach().double()
    denom = e.pow(2).mean().sqrt().clamp_min(1e-30)
    return float((a - e).pow(2).mean().sqrt() / denom)


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_rms(actual, expected)
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.0e}"


def run_killed_midway(call: str, target: str, after: int, cwd=None):
    """Run the Python source `call` in a fresh interpreter in which `target` ("module:attr" or
    "module:Class.attr", e.g. "pyarrow.parquet:write_table") SIGKILLs the process right after its
    `after`-th call returns: a writer killed midway, at a point the test names. Asserts the process
    died there (a call that never reached the point would make the test prove nothing)."""
    import signal
    import subprocess
    import sys
    import textwrap

    module, attr = target.split(":")
    owner_path, _, name = attr.rpartition(".")
    code = textwrap.dedent(f"""
        import importlib, os, signal
        owner = importlib.import_module({module!r})
        for part in {owner_path!r}.split(".") if {owner_path!r} else []:
            owner = getattr(owner, part)
        original, calls = getattr(owner, {name!r}), [0]
        def killing(*args, **kwargs):
            out = original(*args, **kwargs)
            calls[0] += 1
            if calls[0] == {after}:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        setattr(owner, {name!r}, killing)
    """) + textwrap.dedent(call)
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, f"not killed at {target} call {after}: rc {proc.returncode}\n" \
                                               f"{proc.stderr[-2000:]}"
    return proc


def tree_bytes(root) -> dict:
    """{relative path: bytes} of every file under `root` (what a directory holds, to compare)."""
    from pathlib import Path

    root = Path(root)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.05) -> None:
    """Poll cond() until it holds (what another thread or process does, with no fixed sleep to
    guess its time); an AssertionError naming `what` once timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(every_s)
