"""`platform/` is k3.platform, never the top-level `platform` (the standard library's)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import platform, sysconfig, k3.platform.ops.cli as cli; "
    "assert platform.__file__.startswith(sysconfig.get_paths()['stdlib']), platform.__file__; "
    "assert platform.system() and platform.python_version(); "
    "print(platform.__file__, cli.__file__)"
)


def test_platform_dir_has_no_init():
    assert not (REPO / "platform" / "__init__.py").exists(), "platform/__init__.py would shadow the stdlib module"


def test_import_platform_from_repo_root_gives_stdlib():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(REPO / "platform" / "ops" / "cli.py") in out.stdout


@pytest.mark.ray
def test_import_platform_inside_ray_job_with_repo_working_dir(tmp_path):
    # A Ray job's working dir (here: the repository) goes on every worker's path; a driver of its
    # own, because Ray accepts a local working_dir only at ray.init.
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import os
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
ray.init(address="local", num_cpus=1, include_dashboard=False, _node_ip_address="127.0.0.1",
         runtime_env={{"working_dir": {str(REPO)!r}, "excludes": [".venv", ".git", ".cache", "runs", "data"]}})

@ray.remote
def probe():
    import os, platform
    import k3.platform.ops.cli as cli
    return platform.__file__, cli.__name__, os.path.exists("platform/ops/cli.py")

print("RESULT", ray.get(probe.remote(), timeout=180))
ray.shutdown()
""")
    out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, out.stderr[-2000:]
    stdlib_file, cli_name, cwd_is_repo = eval(line[len("RESULT "):])
    assert cwd_is_repo, "the task did not run inside the uploaded working dir"
    assert stdlib_file.endswith("platform.py") and "site-packages" not in stdlib_file
    assert cli_name == "k3.platform.ops.cli"
