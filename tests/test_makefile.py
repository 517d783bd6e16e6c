"""What the README's make targets set up on a fresh clone before their tests run (`make -n`: the
commands make would run, none run)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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

    def first(needle: str) -> int:
        found = [i for i, line in enumerate(lines) if needle in line]
        assert found, f"`make -n {target}` never runs {needle!r}:\n{out.stdout}"
        return found[0]

    fetch_prom, fetch_chrome = first("apt-get download prometheus"), first(".ci/fetch-chromium")
    first_pytest = first("-m pytest")
    assert fetch_prom < first_pytest and fetch_chrome < first_pytest, out.stdout
