"""The state files through which one `k3` command finds what another started (`k3 cluster up`'s
head, `k3 monitor up`'s Prometheus), and where they live by default.

The default does not depend on the directory a command runs in, within a checkout: `k3 cluster
down` from `jobs/` finds the cluster `k3 cluster up` started from the checkout's root.

    $K3_STATE_DIR                  when set
    <checkout>/.cache              k3 run inside a k3 checkout (the nearest folder up from the
                                   current directory whose pyproject.toml is k3's)
    $XDG_CACHE_HOME/k3             elsewhere (~/.cache/k3 by default)

with `k3-cluster/state.json` and `k3-monitor/state.json` under it.
"""
from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Callable, TypeVar

from .process_group import start_time

T = TypeVar("T")

STATE_DIR_ENV = "K3_STATE_DIR"


def _is_k3_checkout(folder: Path) -> bool:
    try:
        return tomllib.loads((folder / "pyproject.toml").read_text()).get("project", {}).get("name") == "k3"
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def default_state_dir() -> Path:
    """Where state files go unless a command is given one (see the module's docstring)."""
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser().resolve()
    cwd = Path.cwd().resolve()
    for folder in (cwd, *cwd.parents):
        if _is_k3_checkout(folder):
            return folder / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").resolve() / "k3"


def default_cluster_state() -> Path:
    """`k3 cluster`'s state file (and the cluster `k3 monitor up` scrapes) by default."""
    return default_state_dir() / "k3-cluster" / "state.json"


def default_monitor_state() -> Path:
    """`k3 monitor`'s state file by default."""
    return default_state_dir() / "k3-monitor" / "state.json"


class StateFile:
    """One state file: `what` names what it records ("k3 cluster"), `down` the command that stops
    it ("k3 cluster down"), which `--force` removes a file that cannot be read. Every error is a
    ValueError naming the file."""

    def __init__(self, path: str | os.PathLike, what: str, down: str):
        self.path, self.what, self.down_command = Path(path), what, down

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: not a {self.what} state file ({why}): "
                          f"`{self.down_command} --state {self.path} --force` removes it")

    def read(self) -> dict | None:
        """The JSON object the file holds; None when there is no file."""
        if self.path.is_dir():
            raise ValueError(f"{self.path}: is a directory, not a {self.what} state file")
        if not self.path.exists():  # also when a parent is a file (ENOTDIR)
            return None
        try:
            state = json.loads(self.path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"{type(e).__name__}: {e}") from None
        if not isinstance(state, dict):
            raise self._bad(f"TypeError: a JSON {type(state).__name__}, not an object")
        return state

    def load(self, from_state: Callable[[dict], T]) -> T | None:
        """The handle `from_state` rebuilds from the file; None when there is no file."""
        state = self.read()
        if state is None:
            return None
        try:
            return from_state(state)
        except (KeyError, TypeError, ValueError, AttributeError, OSError) as e:
            raise self._bad(f"{type(e).__name__}: {e}") from None

    def prepare(self) -> None:
        """Make the file's folder, or say why the file cannot be written there (a directory in its
        place, a file where a folder must be): checked before anything starts, so that nothing
        runs unrecorded."""
        if self.path.is_dir():
            raise ValueError(f"{self.path}: is a directory, not a {self.what} state file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as e:
            raise ValueError(f"{self.path}: cannot hold a state file: {e.filename} is not a directory") from None

    def write(self, state: dict) -> None:
        """Write the file whole or not at all (a temporary file beside it, then renamed)."""
        self.prepare()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(state, indent=2) + "\n")
            os.replace(tmp, self.path)
        except OSError as e:
            raise ValueError(f"{self.path}: cannot write the state file: {e.strerror or e}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def stop(self, from_state: Callable[[dict], T], force: bool = False) -> str:
        """Stop what the file records (`from_state` rebuilds its handle: `alive()`, `stop()`,
        `pid`, `started`) and remove the file; what happened, in words. Signals nothing unless the
        recorded PID still names the process that was started. `force`: a file that cannot be
        read is removed too."""
        try:
            handle = self.load(from_state)
        except ValueError:
            if not (force and self.path.is_file()):
                raise
            self.path.unlink()
            return f"removed {self.path}, which was not a {self.what} state file; signalled nothing"
        if handle is None:
            return "was not running"
        if handle.alive():
            handle.stop()
            said = "stopped"
        elif handle.pid is not None and start_time(handle.pid) is not None:
            # the PID is taken: by another process, or (no start time recorded) no telling by whom
            said = (f"was not running: {self.path} was stale (pid {handle.pid} names another process now)"
                    if handle.started is not None else
                    f"was not running as far as k3 can tell: {self.path}, written by an older k3, records no start "
                    f"time to tell its pid {handle.pid} from another process (stop that by hand if it is yours)")
            said += "; removed it, signalled nothing"
        else:
            said = "was not running"
        self.path.unlink(missing_ok=True)
        return said
