"""Shared fixtures. `ray_local`: one local Ray cluster per test session, started on first use.

Also: a session in which no test ran and passed fails (every test skipped or deselected would
otherwise exit 0, and CI would count it green).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before any test imports k3,
# so the Triton tests run in the interpreter on a machine without a GPU (tests/kernel_cases.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
# DeepSpeed's ops (the CPU shm all-reduce, cpu_adam; ~1-1.5 min each on 2 cores) build once, in
# torch's default directory (or TORCH_EXTENSIONS_DIR when set): in-process tests, spawned processes,
# Ray Train workers and the README's `ray job submit` jobs from a new terminal all use the same one.

# Under `pytest -n 2` (the Makefile's unit tier) each worker process keeps to one thread: two
# workers at torch's default of a thread per core would run four threads on the 2 cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: E402

    torch.set_num_threads(1)

import session_env  # noqa: E402,F401  (the environment before any test module is imported)

# Engines compile decode graphs by default on CPU (EngineConfig.compile_decode: seconds to minutes
# each, per model); the tests build ~120 engines on dozens of models, so here they run eagerly
# unless a test asks for graphs. Set after session_env: the README's commands, run as a user would
# (tests/test_readme.py), keep the default. The session's Ray cluster inherits it.
os.environ.setdefault("K3_COMPILE_DECODE", "0")
from k3.platform.ops.extensions import use_interpreter_ninja  # noqa: E402

# DeepSpeed's ops are built in test processes and in the README's cluster (whose PATH starts with
# the venv's bin): with the same ninja in both, or each rebuilds the other's (extensions.py). After
# session_env: the README's reader keeps a new terminal's PATH.
use_interpreter_ninja()

_passed = 0


def pytest_runtest_logreport(report):
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session, exitstatus):
    # under xdist the controller sees every worker's reports and decides; a worker may get no test
    if os.environ.get("PYTEST_XDIST_WORKER") is None and exitstatus == 0 and _passed == 0:
        print("\nno test ran and passed: failing the session", flush=True)
        session.exitstatus = 1


def pytest_collection_modifyitems(session, config, items):
    """The README's blocks run first. Its `ray job submit` blocks train on two Ray Train workers of
    the README's own cluster for minutes; run last, they shared the 2 cores with this session's
    Ray and its Serve apps (a dozen idle replicas, each polling), and one 100-step job outran its
    900 s limit in CI. First, nothing of the session is up yet."""
    readme = [i for i in items if i.path.name == "test_readme.py"]
    items[:] = readme + [i for i in items if i.path.name != "test_readme.py"]


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray on 127.0.0.1 with 2 CPUs, no dashboard; shut down at the end of the session.

    Never `ray stop`: it kills every Ray process on the machine, not only this session's.
    """
    ray = pytest.importorskip("ray")
    from k3.platform.ops.local_ray import init_local_ray

    if ray.is_initialized():  # someone else's session: use it as it is
        yield ray
        return
    init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
