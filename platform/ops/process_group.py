"""Processes k3 starts as the leaders of their own process groups (a Ray head, Prometheus): alive
while any process of the group is, stopped by signalling the group, never by name."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def group_alive(pid: int | None, proc: subprocess.Popen | None = None) -> bool:
    """Whether any process of the group `pid` leads still runs. An exited leader that is this
    process's child is reaped first: as a zombie it would keep the group existing, so a group
    whose every process has exited would read as alive (and a stop would wait out its grace)."""
    if pid is None:
        return False
    if proc is not None:
        proc.poll()
    else:  # a handle rebuilt from a state file: the leader may still be our child
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # not our child (another process started it): its parent reaps it
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pid: int | None, proc: subprocess.Popen | None = None, grace_s: float = 30.0) -> None:
    """SIGTERM to the group, SIGKILL to what is left of it after `grace_s` (then up to 10 s more
    for it to go); a no-op when nothing of it runs."""
    deadline = time.time() + grace_s
    for sig, until in ((signal.SIGTERM, deadline), (signal.SIGKILL, deadline + 10)):
        if not group_alive(pid, proc):
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # went between the check and the signal
            return
        while group_alive(pid, proc) and time.time() < until:
            time.sleep(0.2)
