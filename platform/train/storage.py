"""Where a run reads its data and writes its checkpoints: a path, or a URI that pyarrow opens
(`s3://`, `gs://`, `file://`, `local://`, ...), checked on the driver before any worker starts.

- Inside a job submitted with `ray job submit`, the driver's working directory is Ray's unpacked
  copy of `--working-dir` (without what .gitignore keeps out, and deleted with the job's runtime
  env), so a relative path is refused with what to pass instead (`resolve`).
- On a cluster of more than one node, a location on the nodes' own filesystems (a plain path,
  `file://`, `local://`) must show every node the same files (a shared filesystem mounted at the
  same path): one tiny task per node compares a file's digest with the driver's
  (`check_every_node_sees`). Object stores look the same from every node.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # set by Ray's job supervisor for a submitted entrypoint
NODE_SCHEMES = {None, "file", "local"}  # locations on each node's own filesystem
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def scheme(location: str) -> str | None:
    m = _SCHEME.match(location)
    return m.group(1).lower() if m else None


def ray_job_submission_id() -> str | None:
    """The submission id when this process is the entrypoint of a `ray job submit` job."""
    try:
        return json.loads(os.environ.get(JOB_ENV) or "{}").get("metadata", {}).get("job_submission_id")
    except (ValueError, AttributeError):
        return None


def resolve(location: str, flag: str) -> str:
    """`location` as every process of the run must read it: an absolute path, or the URI as given.
    ValueError for a relative path inside a Ray job and for a URI pyarrow cannot open."""
    s = scheme(location)
    if s == "mock":
        raise ValueError(f"{flag} {location!r}: pyarrow's mock:// filesystem lives in one process, which the "
                         f"run's other processes cannot read")
    if s is not None:
        try:
            pafs.FileSystem.from_uri(location)
        except (pa.ArrowException, ValueError, OSError) as e:
            raise ValueError(f"{flag} {location!r}: pyarrow cannot open it ({e})") from None
        return location
    path = Path(location).expanduser()
    job = ray_job_submission_id()
    if not path.is_absolute() and job is not None:
        raise ValueError(
            f"{flag} {location!r} is relative, and this driver runs inside Ray job {job}: its working directory "
            f"{os.getcwd()} is Ray's unpacked copy of --working-dir, which leaves out what .gitignore lists "
            f"(data/, runs/) and is deleted with the job. Pass an absolute path that every node sees (\"$PWD/"
            f"{location}\" in the shell that submits the job) or a URI (s3://, gs://)")
    return str(path.resolve())


def filesystem(location: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path on it) of a path or URI."""
    if scheme(location) is None:
        return pafs.LocalFileSystem(), str(Path(location).absolute())
    return pafs.FileSystem.from_uri(location)


def join(location: str, *names: str) -> str:
    if scheme(location) is None:
        return str(Path(location, *names))
    return "/".join([location.rstrip("/"), *names])


def exists(location: str) -> bool:
    fs, path = filesystem(location)
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def missing(locations: list[str]) -> list[str]:
    """The locations (all on one filesystem) that do not exist, asked in one call."""
    if not locations:
        return []
    fs, _ = filesystem(locations[0])
    infos = fs.get_file_info([filesystem(loc)[1] for loc in locations])
    return [loc for loc, info in zip(locations, infos) if info.type == pafs.FileType.NotFound]


def read_bytes(location: str) -> bytes:
    fs, path = filesystem(location)
    with fs.open_input_stream(path) as f:
        return f.read()


def write_bytes(location: str, data: bytes) -> None:
    fs, path = filesystem(location)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as f:
        f.write(data)


def delete_file(location: str) -> None:
    fs, path = filesystem(location)
    fs.delete_file(path)


def node_path(location: str) -> str | None:
    """The path on the node's own filesystem of a plain path, file:// or local:// location; None for
    an object store."""
    return filesystem(location)[1] if scheme(location) in NODE_SCHEMES else None


def _digest(path: str) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _digests(paths: dict[str, str]) -> dict[str, str | None]:
    return {label: _digest(p) for label, p in paths.items()}


def check_every_node_sees(files: dict[str, str], timeout_s: float = 120.0) -> None:
    """On a Ray cluster of more than one alive node: every file in `files` ({label: location}) that
    lives on the nodes' own filesystems must have the same bytes on every node as on this one.
    ValueError names the first label some node sees otherwise, and how many nodes do. A node that
    leaves the cluster (or cannot run a zero-CPU task within `timeout_s`) is not counted."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    paths = {label: p for label, loc in files.items() if (p := node_path(loc)) is not None}
    if len(nodes) < 2 or not paths:
        return
    expected = _digests(paths)
    task = ray.remote(num_cpus=0)(_digests)
    refs = {n: task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(paths)
            for n in nodes}
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    seen = {}
    for node, ref in refs.items():
        if ref in ready:
            try:
                seen[node] = ray.get(ref)
            except ray.exceptions.RayError:  # the node left the cluster meanwhile
                pass
    for label in paths:
        blind = [n[:12] for n, s in seen.items() if s[label] != expected[label]]
        if blind:
            raise ValueError(
                f"{label} is not the same on every node: {len(blind)} of {len(seen)} nodes (node ids "
                f"{', '.join(blind)}...) do not see the files this node sees. Every node reads the data and "
                f"writes checkpoints itself: use a filesystem every node mounts at the same path, or an object "
                f"store URI (s3://, gs://)")
