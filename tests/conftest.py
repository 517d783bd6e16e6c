"""Shared fixtures. `ray_local`: one local Ray cluster per test session, started on first use.

Also: a session in which no test ran and passed fails (every test skipped or deselected would
otherwise exit 0, and CI would count it green).
"""
from __future__ import annotations

import pytest

_passed = 0


def pytest_runtest_logreport(report):
    global _passed
    if report.when == "call" and report.passed:
        _passed += 1


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0 and _passed == 0:
        print("\nno test ran and passed: failing the session", flush=True)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def ray_local():
    """A local Ray on 127.0.0.1 with 2 CPUs, no dashboard; shut down at the end of the session.

    Never `ray stop`: it kills every Ray process on the machine, not only this session's.
    """
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as ray_constants

    if ray.is_initialized():  # someone else's session: use it as it is
        yield ray
        return
    with pytest.MonkeyPatch.context() as mp:
        # Ray on Linux swaps 127.0.0.1 for the machine's outward address; this switch (read by
        # the driver now, and by raylet and workers from the environment) keeps it on loopback.
        mp.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        ray.init(
            address="local",  # always a fresh instance, never a cluster found on the machine
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
        try:
            yield ray
        finally:
            ray.shutdown()
