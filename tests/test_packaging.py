"""`platform/` is k3.platform, never the top-level `platform` (the standard library's)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import platform, sysconfig, k3.platform.cli as cli; "
    "assert platform.__file__.startswith(sysconfig.get_paths()['stdlib']), platform.__file__; "
    "assert platform.system() and platform.python_version(); "
    "print(platform.__file__, cli.__file__)"
)


def test_platform_dir_has_no_init():
    assert not (REPO / "platform" / "__init__.py").exists(), "platform/__init__.py would shadow the stdlib module"


def test_import_platform_from_repo_root_gives_stdlib():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(REPO / "platform" / "cli.py") in out.stdout


@pytest.mark.ray
def test_import_platform_inside_ray_job_with_repo_working_dir(ray_local):
    import ray

    @ray.remote(runtime_env={"working_dir": str(REPO), "excludes": [".venv", ".git", ".cache", "runs", "out"]})
    def probe() -> tuple[str, str, bool]:
        import os
        import platform

        import k3.platform.cli as cli

        return platform.__file__, cli.__name__, os.path.exists("platform/cli.py")

    stdlib_file, cli_name, cwd_is_repo = ray.get(probe.remote(), timeout=180)
    assert cwd_is_repo, "the task did not run inside the uploaded working dir"
    assert "site-packages" not in stdlib_file and stdlib_file.endswith("platform.py")
    assert not stdlib_file.endswith("platform/__init__.py")
    assert cli_name == "k3.platform.cli"
