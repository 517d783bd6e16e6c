"""Benchmark expert load balancing on a synthetic router: QB (exact, histogram) vs the baselines.

For each (E, k, N) grid point and each regime (stationary popularity, drifting popularity) it
runs every method side by side on the same batches for --steps steps and records MaxVio
(max load / mean load - 1) per step, next to the noise floor: the MaxVio of a perfectly fair
random assignment of the same N, E, k, which no bias computed from earlier batches can beat.

    python jobs/bench_balance.py                       # default grid: ~690 CPU-seconds
    python jobs/bench_balance.py --threads 1           # faster when other jobs share the cores
    python jobs/bench_balance.py --extra 896,16,65536  # one more grid point (--grid replaces them)
    python jobs/bench_balance.py --quick               # smoke run

Prints a JSON summary; writes the full JSON (every step) and a PNG plot to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform as stdlib_platform
import resource
import sys
import time

import torch

from k3.platform.balance import (
    BalanceConfig,
    make_balancer,
    exact_thresholds,
    expert_loads,
    max_violation,
    route,
    switch_aux_loss,
)

# (E, k, N): every E and every k at least once, plus the two noise-floor examples of the issue
DEFAULT_GRID = [(64, 8, 65536), (256, 8, 16384), (896, 16, 4096), (64, 2, 4096)]
HIST_BINS = (64, 256, 1024)

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--grid", nargs="*", default=None, help="E,k,N points (replace the default grid)")
parser.add_argument("--extra", nargs="*", default=[], help="E,k,N points added to the default grid")
parser.add_argument("--steps", type=int, default=200, help="training steps per run")
parser.add_argument("--regimes", default="stationary,drift", help="comma list: stationary, drift")
parser.add_argument("--skew", type=float, default=1.0, help="std of the per-expert popularity logit offset")
parser.add_argument("--drift-period", type=float, default=1000.0, help="steps per full turn of the popularity (drift)")
parser.add_argument("--dim", type=int, default=64, help="token feature width of the synthetic router")
parser.add_argument("--aux-lr", type=float, default=1e-3, help="Adam lr of the router offsets trained by the aux loss")
parser.add_argument("--error-every", type=int, default=20, help="measure histogram-vs-exact error every n steps (and at steps 1 and 5)")
parser.add_argument("--floor-draws", type=int, default=8, help="fair random assignments averaged for the floor")
parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default="runs/bench_balance", help="folder for the JSON and the PNG")
parser.add_argument("--quick", action="store_true", help="20 steps on small points (smoke test)")
args = parser.parse_args()

grid = [tuple(int(v) for v in p.split(",")) for p in args.grid] if args.grid else list(DEFAULT_GRID)
grid += [tuple(int(v) for v in p.split(",")) for p in args.extra]
steps = args.steps
if args.quick:
    grid, steps = [(64, 8, 4096), (256, 2, 4096)], 20
regimes = args.regimes.split(",")
torch.manual_seed(args.seed)
if args.threads:
    torch.set_num_threads(args.threads)

# every method sees the same batch each step; each keeps its own bias (or router offsets).
# Step 1 routes with no bias for all of them, so its MaxVio is the unbalanced router's.
METHODS: dict[str, BalanceConfig] = {
    "exact": BalanceConfig(method="quantile"),
    "exact_adaptive": BalanceConfig(method="quantile", gain="adaptive"),
    **{f"hist{b}": BalanceConfig(method="quantile_hist", bins=b) for b in HIST_BINS},
    "hist256_adaptive": BalanceConfig(method="quantile_hist", bins=256, gain="adaptive"),
    "loss_free": BalanceConfig(method="loss_free", loss_free_step=1e-3),
    "aux_loss": BalanceConfig(method="aux_loss", aux_loss_coef=1e-2),
}


def noise_floor(n: int, e: int, top_k: int, draws: int) -> tuple[float, float]:
    """MaxVio of fair random top-k assignments (k distinct experts per token, uniform)."""
    vals = [max_violation(expert_loads(torch.rand(n, e).topk(top_k, dim=1).indices, e)) for _ in range(draws)]
    mean = sum(vals) / draws
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / max(draws - 1, 1))


class SyntheticRouter:
    """logits = x W^T + p(t): random token features, fixed router weights, expert popularity p.

    Stationary: p = skew * z1. Drift: p(t) = skew * (cos(2 pi t / period) z1 + sin(...) z2),
    so which experts are popular turns over continuously while the skew stays the same.
    """

    def __init__(self, e: int, dim: int, skew: float, drift_period: float | None, gen: torch.Generator):
        self.w = torch.randn(e, dim, generator=gen) / math.sqrt(dim)
        self.z1, self.z2 = torch.randn(e, generator=gen), torch.randn(e, generator=gen)
        self.dim, self.skew, self.period, self.gen = dim, skew, drift_period, gen

    def logits(self, n: int, t: int) -> torch.Tensor:
        p = self.skew * self.z1
        if self.period:
            angle = 2 * math.pi * t / self.period
            p = self.skew * (math.cos(angle) * self.z1 + math.sin(angle) * self.z2)
        return torch.randn(n, self.dim, generator=self.gen) @ self.w.T + p


def run(e: int, top_k: int, n: int, regime: str) -> dict:
    gen = torch.Generator().manual_seed(args.seed * 1000 + e + top_k + n)
    router = SyntheticRouter(e, args.dim, args.skew, args.drift_period if regime == "drift" else None, gen)
    q = n * top_k / e
    balancers = {name: make_balancer(cfg, 1, e, top_k) for name, cfg in METHODS.items() if cfg.method != "aux_loss"}
    # the aux loss can only act through router parameters: a learnable logit offset per expert
    offsets = torch.zeros(e, requires_grad=True)
    opt = torch.optim.Adam([offsets], lr=args.aux_lr)
    maxvio = {name: [] for name in METHODS}
    errors = {f"hist{b}": [] for b in HIST_BINS}  # (step, error in bins, misplaced tokens / q)
    for t in range(1, steps + 1):
        logits = router.logits(n, t)
        scores = torch.sigmoid(logits)
        prev_bias = {name: bal.bias(0) for name, bal in balancers.items()}
        for name, bal in balancers.items():
            margins, idx = route(scores, prev_bias[name], top_k)
            loads = expert_loads(idx, e)
            bal.observe(0, margins, loads)
            info = bal.step()[0]
            maxvio[name].append(info["maxvio"])
            if name in errors and (t in (1, 5) or t % args.error_every == 0):
                exact = exact_thresholds(margins, q)
                hist_t = info["thresholds"]
                err_bins = float(((hist_t - exact).abs() / info["bin_width"]).max())
                # tokens between the two thresholds, i.e. how many the binning misplaces on this
                # batch. Each token's (k+1)-th expert sits exactly on that expert's old boundary
                # (m = -b), a point mass no threshold can split; leave it out.
                kth = torch.zeros_like(margins, dtype=torch.bool)
                kth[torch.arange(n), torch.topk(scores + prev_bias[name], top_k + 1, dim=1).indices[:, top_k]] = True
                m = margins.double().masked_fill(kth, float("nan"))
                between = ((m > hist_t) != (m > exact)).sum(0)
                errors[name].append((t, err_bins, float(between.max()) / q))
        s_aux = torch.sigmoid(logits + offsets)
        idx = torch.topk(s_aux.detach(), top_k, dim=1).indices
        maxvio["aux_loss"].append(max_violation(expert_loads(idx, e)))
        loss = switch_aux_loss(s_aux / s_aux.sum(-1, keepdim=True), idx, METHODS["aux_loss"].aux_loss_coef)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"maxvio": maxvio, "errors": errors}


def summarize(series: list[float], floor: float) -> dict:
    """Step 1 is the unbalanced router; steps 5-10 average out the noise of a single step."""
    mean = lambda xs: sum(xs) / len(xs)
    at5, early, last = series[min(4, len(series) - 1)], mean(series[4:10]), mean(series[len(series) // 2 :])
    return {
        "step1": round(series[0], 3),
        "step5": round(at5, 4),
        "steps5_10": round(early, 4),
        "last_half": round(last, 4),
        "final": round(series[-1], 4),
        "step5_over_floor": round(at5 / floor, 2),
        "steps5_10_over_floor": round(early / floor, 2),
        "last_half_over_floor": round(last / floor, 2),
    }


t_start = time.time()
results = []
for e, top_k, n in grid:
    floor, floor_sd = noise_floor(n, e, top_k, args.floor_draws)
    for regime in regimes:
        t0 = time.time()
        out = run(e, top_k, n, regime)
        methods = {}
        for name, series in out["maxvio"].items():
            methods[name] = summarize(series, floor)
            cfg = METHODS[name]
            if cfg.method == "quantile_hist":
                # what one worker sends per MoE layer per step: int32 histogram + int64 counts
                methods[name]["bytes_per_worker_step"] = e * cfg.bins * 4 + e * 8
                err = out["errors"].get(name)
                if err:
                    steady = [x for x in err if x[0] >= 20] or err
                    methods[name]["hist_err_bins_max"] = round(max(x[1] for x in err), 3)
                    methods[name]["hist_err_tokens_over_q_step1"] = round(err[0][2], 4)
                    methods[name]["hist_err_tokens_over_q_steady"] = round(sum(x[2] for x in steady) / len(steady), 4)
        results.append({
            "E": e, "top_k": top_k, "N": n, "q": round(n * top_k / e, 2), "regime": regime,
            "floor": round(floor, 4), "floor_sd": round(floor_sd, 4),
            "seconds": round(time.time() - t0, 1), "methods": methods, "maxvio": out["maxvio"],
        })
        print(f"# E={e} top_k={top_k} N={n} {regime}: {time.time() - t0:.0f}s", file=sys.stderr, flush=True)

meta = {
    "date": datetime.date.today().isoformat(),
    "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    "machine": f"{stdlib_platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, threads {torch.get_num_threads()}",
    "steps": steps, "skew": args.skew, "drift_period": args.drift_period, "aux_lr": args.aux_lr,
    "seconds": round(time.time() - t_start, 1),
    "cpu_seconds": round(sum(getattr(resource.getrusage(resource.RUSAGE_SELF), f) for f in ("ru_utime", "ru_stime")), 1),
}
os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "bench_balance.json"), "w") as f:
    json.dump({"meta": meta, "results": results}, f)
print(json.dumps({"meta": meta, "results": [{k_: v for k_, v in r.items() if k_ != "maxvio"} for r in results]}, indent=1))

# one panel per (grid point, regime): MaxVio per step, log scale, the floor dashed
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

fig, axes = plt.subplots(len(grid), len(regimes), figsize=(6 * len(regimes), 3.6 * len(grid)), squeeze=False)
for i, r in enumerate(results):
    ax = axes[i // len(regimes)][i % len(regimes)]
    for name, series in r["maxvio"].items():
        ax.plot(range(1, len(series) + 1), series, label=name, lw=1.6 if "exact" in name else 1.0)
    ax.axhline(r["floor"], color="k", ls="--", lw=1, label="noise floor")
    ax.set_yscale("log")
    ax.set_title(f"E={r['E']} top_k={r['top_k']} N={r['N']} ({r['regime']})", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("MaxVio")
axes[0][0].legend(fontsize=7, ncol=2)
fig.tight_layout()
fig.savefig(os.path.join(args.out, "bench_balance.png"), dpi=110)
print(f"# wrote {args.out}/bench_balance.json and bench_balance.png in {meta['seconds']}s", file=sys.stderr)
