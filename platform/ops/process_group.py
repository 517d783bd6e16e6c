"""Processes k3 starts as the leaders of their own process groups (a Ray head, Prometheus): alive
while any process of the group is, stopped by signalling the group, never by name.

Another process reaches such a group through a state file (`k3 cluster down`, `k3 monitor down`):
the leader's PID and its start time. The PID alone is not the process: once the group has gone,
the kernel hands the number to whatever starts next, and signalling that group would end an
unrelated program. `recorded_group_alive` checks both before anything is signalled.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


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


def start_time(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None
    when there is no such process."""
    try:
        # the command name (field 2) may hold spaces and parentheses: count fields after its ")"
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def valid_pid(pid) -> bool:
    """Whether `pid` (as read from a state file) can name a group k3 started: 0 and -1 would
    signal this process's own group and every process there is."""
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0


def recorded_group_alive(pid: int | None, started: int | None) -> bool:
    """Whether the group a state file records (its leader's `pid` and `start_time`) still runs.

    False when `started` is None (a state written before k3 recorded it: the PID cannot be told
    from a reused one) or when `pid` now names a process that started at another time. A leader
    that exited while the rest of its group runs still counts: Linux does not hand out a PID that
    a live process group is still known by."""
    if not valid_pid(pid) or started is None:
        return False
    now = start_time(pid)
    return (now is None or now == started) and group_alive(pid)


def _leader_alive(pid: int, proc: subprocess.Popen | None) -> bool:
    if proc is not None:
        return proc.poll() is None
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our child, exited now
            return False
    except ChildProcessError:
        pass  # not our child: its parent (or init) reaps it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie nobody has reaped yet has exited
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def stop_group(pid: int | None, proc: subprocess.Popen | None = None, grace_s: float = 30.0,
               rest_grace_s: float = 5.0) -> None:
    """Stop the group `pid` leads: SIGTERM to the leader first, up to `grace_s` for it to go, then
    SIGTERM to what is left of the group and up to `rest_grace_s` more (within `grace_s`) before
    SIGKILL (then up to 10 s more for it to go); a no-op when nothing of it runs.

    The leader first because a `ray start --block` head stops its own processes in order: 3.6 s
    here, against 33.6 s with SIGTERM to every process of the group at once (its raylet gone after
    10 s, its GCS after 32 s; docs/benchmarks.md). What the leader does not stop (an autoscaler's
    fake worker nodes) is in the group and gets the group's SIGTERM; with the head gone it serves
    nothing, yet its raylets took 10-45 s to exit (they wait on the GCS that went), hence the short
    second grace."""
    if not group_alive(pid, proc):
        return
    deadline = time.time() + grace_s
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:  # the leader went already; the rest of its group may not have
        pass
    while _leader_alive(pid, proc) and time.time() < deadline:
        time.sleep(0.1)
    rest = min(deadline, time.time() + rest_grace_s)
    for sig, until in ((signal.SIGTERM, rest), (signal.SIGKILL, max(rest, time.time()) + 10)):
        if not group_alive(pid, proc):
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:  # went between the check and the signal
            return
        while group_alive(pid, proc) and time.time() < until:
            time.sleep(0.2)
