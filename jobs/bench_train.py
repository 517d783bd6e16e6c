"""Training benchmark on a local Ray cluster: expert balancing side by side, printed as JSON.

    python jobs/bench_train.py [--steps 30] [--micro-batch 8] [--lr 2e-3] [--plot docs/bench_train_maxvio.png]

One run per (balancing method, learning rate), all with 2 workers, ep_size 2, the same data and
seed: Quantile Balancing through the coordinator (`quantile_hist`), loss-free, Switch aux loss,
no balancing; at the demo's learning rate and at twice it. Per run: final loss, tokens/s, time
per step split into compute, expert all-to-all and coordinator wait (steps after the first 5),
and per-layer MaxVio (mean over the second half). Beside it, the fair-random noise floor: the
MaxVio that routing each token to k distinct experts uniformly at random gives for the same
tokens per step (Monte Carlo), and, per layer of each Quantile Balancing run's final model, the
fixed-bias floor: the MaxVio on held-out step-sized batches of the bias solved to its fixed point
on 16 other such batches. Tokens of one sequence are not independent, so loads vary from batch to
batch more than the fair-random floor says; no bias fixed before its batch is seen (the rule
DESIGN.md sets for QB: a bias applies to the next batch only) gets much below that floor.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile

import ray
import torch

from k3.platform.balance import expert_loads, max_violation, route, solve_batch
from k3.platform.train.data import prepare, read_manifest
from k3.platform.train.launch import fit
from k3.platform.ops.local_ray import init_local_ray
from k3.platform.train.config import TrainConfig
import k3.model


def random_routing_floor(n_tokens: int, num_experts: int, k: int, draws: int = 200, seed: int = 0) -> float:
    """Mean MaxVio of uniformly random top-k routing of n_tokens (k distinct experts each)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(draws):
        idx = torch.rand(n_tokens, num_experts, generator=g).topk(k, dim=1).indices
        loads = expert_loads(idx, num_experts).double()
        out.append(float(loads.max() / loads.mean() - 1))
    return statistics.mean(out)


def step_batches(data: str, micro_batch: int, workers: int, n: int, seed: int = 1) -> list[torch.Tensor]:
    """n batches [workers * micro_batch, T + 1] made as the job makes a step's: worker w draws
    micro_batch sequences from a window of 4 micro_batch consecutive ones of its split (Ray
    Data's local shuffle buffer over the stream order)."""
    import pyarrow.parquet as pq

    rows = torch.tensor([r for p in read_manifest(data).shard_paths(data)
                         for r in pq.read_table(p).column("tokens").to_pylist()])
    splits = rows[:len(rows) - len(rows) % workers].chunk(workers)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        parts = []
        for split in splits:
            start = int(torch.randint(0, len(split) - 4 * micro_batch, (1,), generator=g))
            window = split[start:start + 4 * micro_batch]
            parts.append(window[torch.randperm(len(window), generator=g)[:micro_batch]])
        out.append(torch.cat(parts))
    return out


@torch.no_grad()
def fixed_bias_floor(checkpoint: str, batches: list[torch.Tensor], k: int, pool: int = 16) -> list[float]:
    """Per MoE layer: mean MaxVio over batches[pool:] of the bias solved (to its fixed point) on
    the router scores of batches[:pool] together, for the checkpoint's model."""
    model = k3.model.load(checkpoint)
    scores = [[r.scores.double() for r in model.model(b, collect_router=True)[1]] for b in batches]
    floors = []
    for layer in range(len(scores[0])):
        fit_on = torch.cat([s[layer] for s in scores[:pool]])
        step = fit_on.shape[1] // math.gcd(fit_on.shape[1], k)  # solve_batch needs N k / E whole
        bias, _ = solve_batch(fit_on[:len(fit_on) - len(fit_on) % step], k, max_iters=30)
        vio = [max_violation(expert_loads(route(s[layer], bias, k)[1], s[layer].shape[1])) for s in scores[pool:]]
        floors.append(round(statistics.mean(vio), 3))
    return floors


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted({r["lr"] for r in out["runs"].values()})
    methods = list(dict.fromkeys(label.split(", lr")[0] for label in out["runs"]))
    color = {m: f"C{i}" for i, m in enumerate(methods)}  # one colour per method in every panel
    fig, axes = plt.subplots(1, len(lrs), figsize=(6 * len(lrs), 4), sharey=True, squeeze=False)
    axes = list(axes[0])
    for ax, lr in zip(axes, lrs):
        floor_drawn = False
        for label, r in out["runs"].items():
            if r["lr"] == lr:
                mv = r["maxvio_second_half_per_layer"]
                method = label.split(", lr")[0]
                ax.plot(range(1, len(mv) + 1), mv, marker="o", color=color[method], label=method)
                if "fixed_bias_floor_per_layer" in r and not floor_drawn:  # the first QB run's
                    floor_drawn = True
                    fl = r["fixed_bias_floor_per_layer"]
                    ax.plot(range(1, len(fl) + 1), fl, color="grey", ls="--", marker="x",
                            label="fixed-bias floor (QB's final model)")
        ax.set_xticks(range(1, max(len(r["maxvio_second_half_per_layer"]) for r in out["runs"].values()) + 1))
        ax.axhline(out["noise_floor_maxvio"], color="k", ls="--", lw=1, label="fair-random floor")
        ax.axhline(2 * out["noise_floor_maxvio"], color="k", ls=":", lw=1, label="2x floor")
        ax.set_title(f"lr {lr:g}, 2 workers, ep_size 2")
        ax.set_xlabel("MoE layer")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MaxVio, mean over 2nd half")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --methods: a balancing method, or Quantile Balancing with another solve of its after-step forward
VARIANTS = {
    "quantile_hist": ("QB (coordinator)", {"method": "quantile_hist"}),
    "qb-layerwise-one": ("QB, layer by layer, one alternation", {"method": "quantile_hist", "layerwise": True,
                                                                 "solve_rounds": 1}),
    "qb-layerwise-two": ("QB, layer by layer, two alternations", {"method": "quantile_hist", "layerwise": True,
                                                                  "solve_rounds": 2}),
    "qb-two-rounds": ("QB, all layers per forward, two rounds", {"method": "quantile_hist", "layerwise": False,
                                                                 "solve_rounds": 2}),
    "qb-one-solve": ("QB, all layers from one forward", {"method": "quantile_hist", "layerwise": False,
                                                         "solve_rounds": 1}),
    "loss_free": ("loss-free", {"method": "loss_free"}),
    "aux_loss": ("aux loss", {"method": "aux_loss"}),
    "none": ("none", {"method": "none"}),
}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=30)
p.add_argument("--micro-batch", type=int, default=8)
p.add_argument("--lr", type=float, default=2e-3, help="the demo's peak learning rate; also run at 2x")
p.add_argument("--methods", default="quantile_hist,loss_free,aux_loss,none",
               help=f"comma-separated, of {', '.join(VARIANTS)} (the qb-* are quantile_hist with other solves)")
p.add_argument("--data", default="data/bundled")
p.add_argument("--plot", help="write the per-layer MaxVio plot (PNG) here")
args = p.parse_args()
runs = [(m, lr) for lr in (args.lr, 2 * args.lr) for m in args.methods.split(",")]
if unknown := sorted({m for m, _ in runs} - VARIANTS.keys()):
    p.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")

torch.set_num_threads(1)
manifest, _ = prepare("bundled", args.data, progress=False)
init_local_ray(num_cpus=2, log_to_driver=False)
first = TrainConfig(data=args.data)
mcfg = first.model_cfg()
tokens_per_step = 2 * args.micro_batch * (manifest.seq_len + 1)
out = {"steps": args.steps, "micro_batch_per_worker": args.micro_batch, "tokens_per_step": tokens_per_step,
       "noise_floor_maxvio": round(random_routing_floor(tokens_per_step, mcfg.num_experts,
                                                        mcfg.num_experts_per_token), 4),
       "runs": {}}
with tempfile.TemporaryDirectory() as storage:
    for i, (method, lr) in enumerate(runs):
        cfg = TrainConfig(data=args.data, storage_path=storage, name=f"bench{i}", steps=args.steps, num_workers=2,
                          ep_size=2, micro_batch=args.micro_batch, lr=lr, log_every=10, checkpoint_every=args.steps,
                          seed=0, balance=VARIANTS[method][1])
        summary = fit(cfg)
        h = summary["history"]
        timed = h[5:]
        step_s = statistics.mean(x["step_s"] for x in timed)
        half = h[len(h) // 2:]
        n_layers = len(h[-1]["maxvio"])
        per_layer = [round(statistics.mean(x["maxvio"][j] for x in half), 3) for j in range(n_layers)]
        out["runs"][f"{VARIANTS[method][0]}, lr {lr:g}"] = {
            "method": method, "balance": VARIANTS[method][1], "lr": lr,
            "final_loss": round(h[-1]["loss"], 4),
            "mean_loss_last_5": round(statistics.mean(x["loss"] for x in h[-5:]), 4),
            "tokens_per_s": round(sum(x["tokens"] for x in timed) / sum(x["step_s"] for x in timed), 1),
            "step_s": round(step_s, 3),
            "all_to_all_s": round(statistics.mean(x["all_to_all_s"] for x in timed), 4),
            "coordinator_wait_s": round(statistics.mean(x["wait_s"] for x in timed), 4),
            "maxvio_second_half_per_layer": per_layer,
            "maxvio_second_half_worst": max(per_layer),
            "worst_over_floor": round(max(per_layer) / out["noise_floor_maxvio"], 2),
        }
        if VARIANTS[method][1]["method"] == "quantile_hist":
            floor = fixed_bias_floor(summary["checkpoint"], step_batches(args.data, args.micro_batch, 2, 24),
                                     mcfg.num_experts_per_token)
            out["runs"][f"{VARIANTS[method][0]}, lr {lr:g}"] |= {
                "fixed_bias_floor_per_layer": floor,
                "over_fixed_bias_floor_per_layer": [round(a / b, 2) for a, b in zip(per_layer, floor)]}
        print(json.dumps({k: v for k, v in out["runs"][f"{VARIANTS[method][0]}, lr {lr:g}"].items()}), flush=True)
ray.shutdown()
if args.plot:
    plot(out, args.plot)
print(json.dumps(out, indent=2))
