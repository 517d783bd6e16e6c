"""Packaging: `platform/` is k3.platform, never the top-level `platform` (the standard library's), and
`kernels/` is k3.kernels, never the top-level `kernels` (Hugging Face's, which transformers imports);
the wheel holds every source file and works installed on its own, outside the repository."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("model", "kernels", "platform", "jobs", "serve")  # k3.<root> is the folder <root>/
# Read by path from a checkout (`serve run serve/config.yaml`), like the recipes in cluster/.
REPO_ONLY = {"serve/config.yaml", "serve/vision.yaml"}  # Serve configs: `serve run` reads them from a checkout
PROBE = (
    "import platform, sysconfig, k3.platform.ops.cli as cli; "
    "assert platform.__file__.startswith(sysconfig.get_paths()['stdlib']), platform.__file__; "
    "assert platform.system() and platform.python_version(); "
    "print(platform.__file__, cli.__file__)"
)


@pytest.mark.parametrize("root", ["platform", "kernels"])
def test_dirs_named_like_other_packages_have_no_init(root):
    # From the checkout's root (`python -m pytest`, `python -c`, Ray's working_dir) a folder with an
    # __init__.py would be the top-level module of its name, ahead of the real one; a namespace
    # folder loses to any regular package on the path.
    assert not (REPO / root / "__init__.py").exists(), f"{root}/__init__.py would shadow the top-level {root!r}"


def test_import_kernels_from_repo_root_gives_the_installed_package(tmp_path):
    # transformers >= 5.25 requires Hugging Face's `kernels` and imports it when loading a model:
    # run in the checkout, `import kernels` must find that package, not k3's folder. A stand-in
    # package on PYTHONPATH (after the checkout's root, as site-packages is) plays it here.
    fake = tmp_path / "kernels"
    fake.mkdir()
    (fake / "__init__.py").write_text("OWNER = 'hub'\n")
    probe = "import kernels, k3.kernels.dispatch as d; print(kernels.OWNER, kernels.__file__, d.__name__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                         env=clean_env() | {"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["hub", str(fake / "__init__.py"), "k3.kernels.dispatch"]


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
    try:
        import kernels  # Hugging Face's when installed (transformers >= 5.25); else a bare namespace
        kernels_file = getattr(kernels, "__file__", None)
    except ImportError:
        kernels_file = None
    return platform.__file__, cli.__name__, os.path.exists("platform/ops/cli.py"), kernels_file

print("RESULT", ray.get(probe.remote(), timeout=180))
ray.shutdown()
""")
    out = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=300)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    assert line is not None, out.stderr[-2000:]
    stdlib_file, cli_name, cwd_is_repo, kernels_file = eval(line[len("RESULT "):])
    assert cwd_is_repo, "the task did not run inside the uploaded working dir"
    assert stdlib_file.endswith("platform.py") and "site-packages" not in stdlib_file
    assert cli_name == "k3.platform.ops.cli"
    assert kernels_file is None or "site-packages" in kernels_file, kernels_file


def source_files() -> set[str]:
    """Every file the wheel must hold, as its name in the wheel (k3/<root>/...)."""
    names = set()
    for root in ROOTS:
        for f in (REPO / root).rglob("*"):
            rel = f.relative_to(REPO).as_posix()
            if f.is_file() and "__pycache__" not in f.parts and rel not in REPO_ONLY:
                names.add(f"k3/{rel}")
    return names


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return env | {"PYTHONNOUSERSITE": "1"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The k3 wheel, built offline from a copy of the sources (a build writes build/ and
    k3.egg-info/ next to pyproject.toml, which stay out of the worktree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    shutil.copy2(REPO / "pyproject.toml", src)
    for root in ROOTS:
        shutil.copytree(REPO / root, src / root, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp / "dist"), str(src)], check=True, capture_output=True, timeout=600)
    (whl,) = (tmp / "dist").glob("k3-*.whl")
    return whl


def test_wheel_holds_every_source_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(source_files() - names)
    assert not missing, f"not in the wheel (list the package in pyproject's [tool.setuptools]): {missing}"
    assert "k3/platform/__init__.py" not in names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "k3 = k3.platform.ops.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


INSTALLED_PROBE = """
import contextlib, importlib, io, json, runpy, sys
from importlib.resources import files
modules, jobs = json.loads(sys.argv[1])
where = {}
for name in modules:
    m = importlib.import_module(name)
    where[name] = m.__file__ or next(iter(m.__path__))  # a namespace package has no __file__
exits = {}
for job in jobs:  # a job runs on import: --help stops it after its imports and argument parser
    sys.argv = [job, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_module(job, run_name="__main__", alter_sys=True)
        exits[job] = "ran past --help"
    except SystemExit as e:
        exits[job] = e.code
data = {f.name: len(json.loads(f.read_text())) for f in files("k3.model.data").iterdir() if f.name.endswith(".json")}
from k3.serve.config import ModelSource
served = ModelSource(preset="k3-tiny").tokenizer().get_vocab_size()  # the bundled tokenizer, from the wheel
print(json.dumps({"where": where, "jobs": exits, "data": data, "served_vocab": served}))
"""


def installed_venv(root: Path, wheel: Path) -> Path:
    """A venv holding only the k3 wheel; the dependencies come from the running environment's
    site-packages through a .pth line, which adds the folder but runs none of its .pth files, so
    an editable k3 installed there stays invisible."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    py = root / "bin" / "python"
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (Path(site) / "k3-test-deps.pth").write_text("".join(f"{d}\n" for d in deps))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=600)
    return root


@pytest.mark.slow
def test_installed_wheel_imports_every_module_and_runs_the_cli(wheel, tmp_path):
    venv = installed_venv(tmp_path / "venv", wheel)
    names = [n[:-3] for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")]
    jobs = [n.replace("/", ".") for n in names if n.startswith("k3/jobs/") and not n.endswith("__init__")]
    modules = [n.removesuffix("/__init__").replace("/", ".") for n in names]
    modules = [m for m in modules if m not in jobs] + ["k3.platform"]
    outside = tmp_path / "elsewhere"  # neither the repository nor its folders on the path
    outside.mkdir()
    out = subprocess.run([venv / "bin" / "python", "-c", INSTALLED_PROBE, json.dumps([modules, jobs])], cwd=outside,
                         env=clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    elsewhere = {m: f for m, f in got["where"].items() if not f.startswith(str(venv))}
    assert not elsewhere, f"imported from outside the installed wheel: {elsewhere}"
    assert got["jobs"] == dict.fromkeys(jobs, 0)
    assert set(got["data"]) == {"k3_release_config.json", "kimi_linear_48b_a3b_config.json", "tokenizer.json"}
    assert got["served_vocab"] == 4096
    cli = subprocess.run([venv / "bin" / "k3", "params", "--preset", "k3-tiny"], cwd=outside, env=clean_env(),
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert cli.stdout.startswith("preset          k3-tiny\ntotal ")
