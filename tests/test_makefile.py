"""What the README's make targets set up on a fresh clone before their tests run (`make -n`: the
commands make would run, none run)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
@pytest.mark.parametrize("target", ["test", "test-fast"])
def test_a_fresh_clone_s_test_targets_fetch_prometheus_and_chromium_first(target, tmp_path):
    # the alerting-rule and monitor tests of the unit tier run promtool and Prometheus, the report's
    # browser test Chromium: a fresh clone's `make test-fast` failed 8 tests when it fetched neither
    stamp = tmp_path / "installed"
    stamp.touch()  # an installed venv (newer than pyproject.toml)
    out = subprocess.run(["make", "-n", target, f"STAMP={stamp}", f"PROM_DIR={tmp_path / 'prom'}",
                          f"CHROME_DIR={tmp_path / 'chrome'}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    fetch_prom = next(i for i, line in enumerate(lines) if "apt-get download prometheus" in line)
    fetch_chrome = next(i for i, line in enumerate(lines) if ".ci/fetch-chromium" in line)
    first_pytest = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert fetch_prom < first_pytest and fetch_chrome < first_pytest, out.stdout
