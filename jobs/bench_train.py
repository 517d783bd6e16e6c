"""Training benchmark on a local Ray cluster, printed as JSON.

    python jobs/bench_train.py [--steps 30] [--data data/bundled]

Side by side, same data and seed: k3-tiny with 1 worker and with 2 workers (ep_size 2) under
Quantile Balancing (histograms through the coordinator), and 2 workers under loss-free
balancing and under no balancing. Per run: tokens/s, time per step split into compute,
expert all-to-all and coordinator wait (steps after the first 5), and per-layer MaxVio
(mean over the last half of the run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import ray

from k3.platform.data import prepare
from k3.platform.launch import fit
from k3.platform.local_ray import init_local_ray
from k3.platform.train import TrainConfig

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--data", default="data/bundled")
args = p.parse_args()

prepare("bundled", args.data, progress=False)
init_local_ray(num_cpus=2, log_to_driver=False)
runs = {"1 worker, QB": dict(num_workers=1, ep_size=1, balance={"method": "quantile_hist"}),
        "2 workers ep2, QB": dict(num_workers=2, ep_size=2, balance={"method": "quantile_hist"}),
        "2 workers ep2, loss-free": dict(num_workers=2, ep_size=2, balance={"method": "loss_free"}),
        "2 workers ep2, no balancing": dict(num_workers=2, ep_size=2, balance={"method": "none"})}
out = {"steps": args.steps, "micro_batch_per_worker": args.micro_batch, "lr": args.lr, "runs": {}}
with tempfile.TemporaryDirectory() as storage:
    for i, (label, kw) in enumerate(runs.items()):
        cfg = TrainConfig(data=args.data, storage_path=storage, name=f"bench{i}", steps=args.steps,
                          micro_batch=args.micro_batch, lr=args.lr, log_every=5, checkpoint_every=args.steps,
                          seed=0, **kw)
        h = fit(cfg)["history"]
        timed = h[5:]
        step_s = statistics.mean(x["step_s"] for x in timed)
        half = h[len(h) // 2:]
        n_layers = len(h[-1]["maxvio"])
        out["runs"][label] = {
            "tokens_per_s": round(sum(x["tokens"] for x in timed) / sum(x["step_s"] for x in timed), 1),
            "step_s": round(step_s, 4),
            "all_to_all_s": round(statistics.mean(x["all_to_all_s"] for x in timed), 4),
            "coordinator_wait_s": round(statistics.mean(x["wait_s"] for x in timed), 4),
            "compute_s": round(step_s - statistics.mean(x["all_to_all_s"] + x["wait_s"] for x in timed), 4),
            "final_loss": round(h[-1]["loss"], 4),
            "maxvio_second_half_per_layer": [round(statistics.mean(x["maxvio"][j] for x in half), 3)
                                             for j in range(n_layers)],
        }
        out["runs"][label]["maxvio_second_half_mean"] = round(
            statistics.mean(out["runs"][label]["maxvio_second_half_per_layer"]), 3)
ray.shutdown()
print(json.dumps(out, indent=2))
