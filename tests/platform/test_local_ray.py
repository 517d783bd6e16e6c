"""LocalRayHead's set-up, without starting Ray (the start itself is proven by the job-submit test)."""
from __future__ import annotations

import pytest

from k3.platform.local_ray import LocalRayHead


def test_every_port_is_chosen_and_distinct(tmp_path):
    head = LocalRayHead(num_cpus=1, workdir=tmp_path)
    ports = list(head.ports.values())
    assert len(set(ports)) == len(ports) == 9
    assert head.env["RAY_AUTH_MODE"] == "token" and head.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert "RAY_ADDRESS" not in head.env
    assert head.address.startswith("http://127.0.0.1:") and head.gcs_address.startswith("127.0.0.1:")
    head.stop()  # never started: a no-op


def test_bad_cpu_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match="num_cpus"):
        LocalRayHead(num_cpus=0, workdir=tmp_path)
