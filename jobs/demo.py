"""The demo, run by `make demo`: the main job end to end on this machine.

    python jobs/demo.py [--steps 200] [--keep-cluster]

Top to bottom: start a local Ray cluster on 127.0.0.1 (`ray start --head`, token auth on, as
Ray clusters are by default), prepare the bundled corpus (the Python standard library's source;
nothing is downloaded), submit the pretraining job with `ray job submit` (k3-tiny, 2 workers,
expert parallelism 2, Quantile Balancing through the coordinator actor), which prints its
summary and a sample from the final checkpoint, then stop the cluster it started.
"""
from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=200, help="training steps (about 1 s each on 2 cores)")
p.add_argument("--micro-batch", type=int, default=8, help="sequences per worker per step")
p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
p.add_argument("--data", default=str(REPO / "data" / "bundled"), help="prepared data directory")
p.add_argument("--runs", default=str(REPO / "runs"), help="checkpoint storage")
p.add_argument("--name", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", help="run name")
args = p.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# 1. A private Ray cluster on loopback, with its own auth token.
tmp = Path(tempfile.mkdtemp(prefix="k3-demo-"))
token = tmp / "ray_token"
token.write_text(secrets.token_hex(32))
env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
       "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "DS_ACCELERATOR": "cpu",
       "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
env.pop("RAY_ADDRESS", None)
gcs, dash = free_port(), free_port()
print(f"demo: starting Ray on 127.0.0.1:{gcs} (dashboard 127.0.0.1:{dash})", flush=True)
head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
                         "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                         "--num-cpus", "2", "--include-dashboard", "true", "--disable-usage-stats"],
                        env=env, stdout=open(tmp / "ray.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
address = f"http://127.0.0.1:{dash}"
rc = 1
try:
    # 2. Data (a no-op when already prepared).
    subprocess.run([sys.executable, str(REPO / "jobs" / "prepare_data.py"), "--out", args.data, "--quiet"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    deadline = time.time() + 180
    while subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=env,
                         capture_output=True).returncode != 0:
        if head.poll() is not None or time.time() > deadline:
            sys.exit(f"demo: Ray did not start; see {tmp / 'ray.log'}")
        time.sleep(2)
    # 3. The job, exactly as a user submits it.
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", str(REPO), "--",
           "python", "jobs/pretrain.py", "--data", args.data, "--preset", "k3-tiny", "--num-workers", "2",
           "--ep-size", "2", "--balance", "quantile_hist", "--steps", str(args.steps), "--micro-batch",
           str(args.micro_batch), "--lr", str(args.lr), "--log-every", "10", "--checkpoint-every", "50",
           "--storage-path", args.runs, "--name", args.name, "--sample", "120"]
    print("demo: " + " ".join(cmd[2:]), flush=True)
    rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
finally:
    # 4. Stop the cluster this script started (and only it): `ray start --block` tears down on SIGTERM.
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    print("demo: Ray stopped", flush=True)
sys.exit(rc)
