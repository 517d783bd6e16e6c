"""The demo, run by `make demo`: the main job end to end on this machine.

    python jobs/demo.py [--steps 200] [--keep-cluster]

Top to bottom: start a local Ray cluster on 127.0.0.1 (`ray start --head`, token auth on, as
Ray clusters are by default), prepare the bundled corpus (the Python standard library's source;
nothing is downloaded), submit the pretraining job with `ray job submit` (k3-tiny, 2 workers,
expert parallelism 2, Quantile Balancing through the coordinator actor), which prints its
summary and a sample from the final checkpoint, then stop the cluster it started and write the
run's HTML report (`k3 report`), printing its path.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from k3.platform.local_ray import LocalRayHead
from k3.platform.ops.report import write_report

REPO = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=200, help="training steps (about 1 s each on 2 cores)")
p.add_argument("--micro-batch", type=int, default=8, help="sequences per worker per step")
p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
p.add_argument("--data", default=str(REPO / "data" / "bundled"), help="prepared data directory")
p.add_argument("--runs", default=str(REPO / "runs"), help="checkpoint storage")
p.add_argument("--name", default=f"demo-{time.strftime('%Y%m%d-%H%M%S')}", help="run name")
args = p.parse_args()


# 1. A private Ray cluster on loopback, every port chosen free, with its own auth token.
env = {"DS_ACCELERATOR": "cpu",
       "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
head = LocalRayHead(num_cpus=2, env=env)
print(f"demo: starting Ray on {head.gcs_address} (dashboard {head.address}, log {head.log_path})", flush=True)
# 2. Data (a no-op when already prepared), while Ray starts.
prep = subprocess.Popen([sys.executable, str(REPO / "jobs" / "prepare_data.py"), "--out", args.data, "--quiet"],
                        env=head.env, stdout=subprocess.DEVNULL)
rc = 1
try:
    head.start()
    if prep.wait() != 0:
        sys.exit("demo: preparing the data failed")
    # 3. The job, exactly as a user submits it.
    entry = ["python", "jobs/pretrain.py", "--data", args.data, "--preset", "k3-tiny", "--num-workers", "2",
             "--ep-size", "2", "--balance", "quantile_hist", "--steps", str(args.steps), "--micro-batch",
             str(args.micro_batch), "--lr", str(args.lr), "--log-every", "10", "--checkpoint-every", "50",
             "--storage-path", args.runs, "--name", args.name, "--sample", "120"]
    print(f"demo: ray job submit --address {head.address} --working-dir {REPO} -- " + " ".join(entry), flush=True)
    rc = head.submit_job(entry, working_dir=REPO).returncode
finally:
    # 4. Stop the cluster this script started (and only it).
    head.stop()
    print("demo: Ray stopped", flush=True)
# 5. The run's report: loss, tokens/s, MaxVio and router bias spread per layer (HTML + PNG).
if rc == 0:
    print(f"demo: run report {write_report(Path(args.runs) / args.name)}", flush=True)
sys.exit(rc)
