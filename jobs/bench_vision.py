"""Benchmark: train k3-tiny-vl from scratch through `ray job submit`, then name the digit in
held-out images and 4-frame clips (jobs/eval_vision.py). Prints one JSON line.

    python jobs/bench_vision.py [--steps 1000] [--eval-limit 600]

Top to bottom: a private Ray cluster on 127.0.0.1 (LocalRayHead), the bundled text corpus plus
the image/video-text set (jobs/prepare_data.py --vision; a no-op when present), the pretraining
job submitted as a user would (2 workers, expert parallelism 2, Quantile Balancing, media and
text steps mixed), the cluster stopped, then the evaluation of the final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from k3.platform.ops.local_ray import LocalRayHead

REPO = Path(__file__).resolve().parents[1]

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
p.add_argument("--media-micro-batch", type=int, default=16, help="image/video examples per worker per media step")
p.add_argument("--micro-batch", type=int, default=2, help="text sequences per worker per text step")
p.add_argument("--text-every", type=int, default=10, help="every N-th step is a text step")
p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
p.add_argument("--warmup-steps", type=int, default=30, help="linear warmup steps (then cosine to 0.1 x lr)")
p.add_argument("--kda-chunk-size", type=int, default=32,
               help="KDA chunk length (a model override; the same math as the preset's 64 in fewer padded "
                    "positions: a media example is ~20-30 tokens)")
p.add_argument("--data", default=str(REPO / "data" / "bundled-vl"), help="prepared data directory")
p.add_argument("--runs", default=str(REPO / "runs"), help="checkpoint storage")
p.add_argument("--name", default=f"vision-{time.strftime('%Y%m%d-%H%M%S')}", help="run name")
p.add_argument("--eval-limit", type=int, default=None, help="evaluate only the first N held-out rows")
p.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (default: at the end)")
p.add_argument("--resume", action="store_true",
               help="continue run --name from its latest checkpoint up to --steps (the cosine schedule is --steps')")
args = p.parse_args()
# the job runs in Ray's copy of the working dir: it gets absolute paths
args.data, args.runs = str(Path(args.data).resolve()), str(Path(args.runs).resolve())

env = {"DS_ACCELERATOR": "cpu"}
head = LocalRayHead(num_cpus=2, env=env)
summary_path = Path(args.runs) / f"{args.name}.summary.json"
Path(args.runs).mkdir(parents=True, exist_ok=True)
# TrainConfig fields without a pretrain.py flag travel in a --config file
config_path = Path(args.runs) / f"{args.name}.config.json"
config_path.write_text(json.dumps({"warmup_steps": args.warmup_steps,
                                   "model_overrides": {"kda_chunk_size": args.kda_chunk_size}}) + "\n")
prep = subprocess.Popen([sys.executable, str(REPO / "jobs" / "prepare_data.py"), "--out", args.data, "--vision",
                         "--quiet"], env=head.env, stdout=subprocess.DEVNULL)
t_train = None
try:
    head.start()
    if prep.wait() != 0:
        sys.exit("bench_vision: preparing the data failed")
    entry = ["python", "jobs/pretrain.py", "--config", str(config_path), "--data", args.data, "--preset",
             "k3-tiny-vl", "--num-workers", "2", "--ep-size", "2", "--balance", "quantile_hist",
             "--steps", str(args.steps), "--micro-batch", str(args.micro_batch),
             "--media-micro-batch", str(args.media_micro_batch), "--text-every", str(args.text_every),
             "--lr", str(args.lr), "--log-every", "25", "--checkpoint-every", str(args.checkpoint_every or args.steps),
             "--storage-path", args.runs, "--name", args.name, "--sample", "0", "--summary-json", str(summary_path)]
    entry += ["--resume"] if args.resume else []
    print(f"bench_vision: ray job submit --address {head.address} --working-dir {REPO} -- " + " ".join(entry),
          flush=True)
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    rc = head.submit_job(entry, working_dir=REPO).returncode
    t_train = time.perf_counter() - t0
    load_end = os.getloadavg()[0]
    if rc != 0:
        sys.exit(f"bench_vision: the training job failed (exit {rc})")
finally:
    head.stop()

summary = json.loads(summary_path.read_text())
cmd = [sys.executable, str(REPO / "jobs" / "eval_vision.py"), "--checkpoint", summary["checkpoint"],
       "--data", args.data]
if args.eval_limit:
    cmd += ["--limit", str(args.eval_limit)]
ev = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
print(json.dumps({"steps": args.steps, "media_micro_batch": args.media_micro_batch, "text_every": args.text_every,
                  "lr": args.lr, "warmup_steps": args.warmup_steps, "kda_chunk_size": args.kda_chunk_size,
                  "train_wall_s": round(t_train, 1), "first_loss": summary["first_loss"],
                  "final_loss": summary["final_loss"], **{k: v for k, v in ev.items() if k != "checkpoint"},
                  "checkpoint": summary["checkpoint"], "load_avg_1m_train_start": load_start,
                  "load_avg_1m_train_end": load_end}))
