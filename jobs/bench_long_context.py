"""Long-context training benchmark: tokens/s and peak memory per rank against the sequence length,
with context parallelism C = 1 and 2, printed as JSON (k3-tiny, fp32, CPU).

    python jobs/bench_long_context.py [--T 4096 8192 16384 32768 65536] [--C 1 2] [--json out.json]
                                      [--plot out.png [--include earlier.json ...]]

Every (T, C) runs in C fresh gloo processes of one torch thread each (torch.multiprocessing), the
ranks of one context-parallel group splitting one sequence of T tokens (one document) as
`k3.platform.train.context_parallel` does in a training job. Each rank builds k3-tiny with
activation checkpointing, then times one training step (forward, backward, gradients summed over
the group, AdamW) and measures its peak memory: the high-water RSS of the step minus the RSS
before it (the model, the optimizer state and the inputs not counted), with glibc told to return
every block >= 128 KB to the OS on free (MALLOC_MMAP_THRESHOLD_), so RSS follows the live
tensors instead of the allocator's cache. At C = 1 a no-grad forward with a timer on every
attention and feed-forward sub-layer then splits the forward's time by kind (KDA linear in T,
MLA quadratic).

--itemise T: where a step's memory goes instead, on one process, without activation
checkpointing: the bytes of every tensor autograd keeps for backward (each storage once, the
parameters not counted), by the kind of the outermost layer that saved it (KDA, MLA, MoE, the
dense MLP; "other": embeddings, norms, the AttnRes mixing, the loss), per token; and the step's
peak RSS with and without activation checkpointing.

Beside each measured step peak stands `k3 plan`'s prediction of it (`planned`), and at the end a
markdown table of the runs (and of the forward's split by kind) goes to stderr. With no --T the
script runs nothing and plots or tabulates the --include files.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time

from k3.platform.ops.proc_memory import reset_peak, status_kb


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", nargs="*", type=int, default=[4096, 8192, 16384, 32768, 65536], help="sequence lengths")
    p.add_argument("--C", nargs="*", type=int, default=[1, 2], help="context-parallel sizes")
    p.add_argument("--preset", default="k3-tiny")
    p.add_argument("--no-breakdown", action="store_true", help="skip the per-kind forward timing")
    p.add_argument("--itemise", type=int, metavar="T", help="itemise a step's memory at T tokens instead (see above)")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--plot", help="plot tokens/s and step peak memory per rank against T, one line per C (PNG)")
    p.add_argument("--include", nargs="*", default=[],
                   help="earlier --json results whose runs the plot and the table also show")
    return p.parse_args(argv)


def _forward_breakdown(model, ids, shard) -> dict[str, float]:
    """Seconds of a no-grad forward spent in each kind of sub-layer (KDA, MLA, MoE/dense MLP)."""
    import torch

    spent: dict[str, float] = {}
    started: dict[int, float] = {}

    def kind_of(layer, name):
        return type(layer.self_attn).__name__ if name == "self_attn" else "mlp"

    handles = []
    for layer in model.model.layers:
        for name in ("self_attn", "mlp"):
            mod, kind = getattr(layer, name), kind_of(layer, name)
            handles.append(mod.register_forward_pre_hook(lambda m, a: started.__setitem__(id(m), time.perf_counter())))
            handles.append(mod.register_forward_hook(
                lambda m, a, o, kind=kind: spent.__setitem__(kind, spent.get(kind, 0.0)
                                                             + time.perf_counter() - started[id(m)])))
    with torch.no_grad():
        model(ids, shard=shard, logits_at=torch.zeros(0, dtype=torch.long))
    for h in handles:
        h.remove()
    return {k: round(v, 3) for k, v in spent.items()}


KINDS = {"KimiDeltaAttention": "KDA", "GatedMLA": "MLA", "LatentMoE": "MoE", "GatedMLP": "dense MLP"}


def _saved_for_backward(model, ids) -> dict[str, int]:
    """Bytes autograd keeps between forward and backward on ids [1, T], by layer kind (see the
    module docstring)."""
    import torch

    params = {p_.untyped_storage().data_ptr() for p_ in model.parameters()}
    stack, seen = ["other"], {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = (stack[-1], t.untyped_storage().nbytes())
        return t

    handles = []
    for mod in model.modules():
        kind = KINDS.get(type(mod).__name__)
        if kind is not None:  # the outermost kind owns what its inner modules save
            handles.append(mod.register_forward_pre_hook(lambda m, a, kind=kind: stack.append(
                kind if stack[-1] == "other" else stack[-1])))
            handles.append(mod.register_forward_hook(lambda m, a, o: [stack.pop(), None][1]))  # None: keep o
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids, logits_at=torch.zeros(0, dtype=torch.long)).loss
    for h in handles:
        h.remove()
    out: dict[str, int] = {}
    for kind, nbytes in seen.values():
        out[kind] = out.get(kind, 0) + nbytes
    del loss
    return out


def _itemise_worker(rank: int, T: int, out: str, preset: str) -> None:
    import torch

    import k3.model
    from k3.model import get_preset

    torch.set_num_threads(1)
    model = k3.model.build(get_preset(preset), seed=0).train()
    ids = torch.randint(0, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    saved = _saved_for_backward(model, ids)
    result = {"T": T, "saved_bytes_per_token": {k: round(v / T) for k, v in sorted(saved.items())},
              "saved_mb": round(sum(saved.values()) / 2**20)}
    for ckpt in (False, True):
        model.model.activation_checkpointing = ckpt
        base_kb = status_kb("VmRSS")
        reset_peak()
        model(ids, labels=ids, logits_at=torch.zeros(0, dtype=torch.long)).loss.backward()
        model.zero_grad(set_to_none=True)
        result[f"step_peak_mb_checkpointing_{'on' if ckpt else 'off'}"] = round((status_kb("VmHWM") - base_kb) / 1024)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)


def _worker(rank: int, C: int, T: int, port: int, out: str, preset: str, breakdown: bool) -> None:
    import torch
    import torch.distributed as dist

    import k3.model
    from k3.model import get_preset
    from k3.platform.train.context_parallel import ContextParallel, cp_groups

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=C,
                            timeout=datetime.timedelta(hours=2))
    model = k3.model.build(get_preset(preset), seed=0).train()
    model.model.activation_checkpointing = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    cp = ContextParallel(cp_groups(rank, C, C), C, rank)
    stream, shard = cp.shard(tokens)
    sh = shard if C > 1 else None
    dist.barrier()
    base_kb = status_kb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    loss = model(stream, labels=stream, shard=sh, logits_at=torch.zeros(0, dtype=torch.long)).loss * C
    loss.backward()
    for p_ in model.parameters():  # the group's gradient, as DeepSpeed's all-reduce gives it
        if C > 1:
            dist.all_reduce(p_.grad)
    opt.step()
    dist.barrier()
    step_s = time.perf_counter() - t0
    result = {"T": T, "C": C, "rank": rank, "tokens": shard.end - shard.start, "step_s": round(step_s, 2),
              "tokens_per_s": round(T / step_s, 1), "step_peak_mb": round((status_kb("VmHWM") - base_kb) / 1024),
              "peak_rss_mb": round(status_kb("VmHWM") / 1024), "loss": float(loss.detach()) / C}
    if breakdown and C == 1:  # a property of T: a shard's attention runs outside the module hooks
        result["forward_s"] = _forward_breakdown(model, stream, sh)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    import torch
    import torch.multiprocessing as mp

    from k3.platform.ops.local_ray import free_port

    args = parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # read by each spawned process's glibc
    result = {"date": datetime.date.today().isoformat(), "machine": {
        "cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
        "torch": torch.__version__, "loadavg_before": os.getloadavg()}, "preset": args.preset, "runs": []}
    if args.itemise:
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_itemise_worker, args=(args.itemise, out, args.preset), nprocs=1, join=True)
            result["itemised"] = json.load(open(f"{out}/rank0.json"))
        args.T = []
    for T in args.T:
        for C in args.C:
            if T % C:
                sys.exit(f"bench_long_context: C={C} must divide T={T}")
            with tempfile.TemporaryDirectory() as out:
                mp.spawn(_worker, args=(C, T, free_port(), out, args.preset, not args.no_breakdown), nprocs=C,
                         join=True)
                runs = [json.load(open(f"{out}/rank{r}.json")) for r in range(C)]
            plan = planned(args.preset, T, C)
            for r in runs:
                r["planned_step_mb"], r["planned_parts_mb"] = plan["step_mb"], plan["parts_mb"]
            result["runs"].extend(runs)
            print(json.dumps(runs), file=sys.stderr, flush=True)
    result["machine"]["loadavg_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    runs = result["runs"] + [r for path in args.include for r in load_runs(path)]
    if runs:
        print(table(runs), file=sys.stderr)
        if any("forward_s" in r for r in runs):
            print(breakdown_table(runs), file=sys.stderr)
    if args.plot:
        plot(runs, args.plot)


MB = 2**20  # the step peaks are read in kB / 1024 (MiB); the planner's bytes are divided alike


def planned(preset: str, T: int, C: int) -> dict:
    """`k3 plan`'s prediction of a run's step peak per rank (MiB): the activations it keeps and
    recomputes for T / C tokens (activation checkpointing, fp32, the CPU KDA kernel) plus the
    gradients. Those are what a step adds to the RSS before it at the backward's end: the model and
    inputs exist before the step, and AdamW's moments are made in opt.step, after the activations
    are freed (k3-tiny's 2x 14 MiB, far below them). Layout: one sequence over C ranks (CP = C),
    every rank holding every expert (EP 1), as the workers above run it."""
    from k3.model import get_preset
    from k3.platform.ops.plan.planner import cpu_run_setup
    from k3.platform.ops.plan.training import Layout, activation_parts, plan_layout

    s = cpu_run_setup(get_preset(preset), T, micro_batch=1, checkpointing=True)
    plan = plan_layout(s, Layout(1, C, 1), utilisation=1.0)
    parts = activation_parts(s, plan.layout) | {"gradients": plan.memory["gradients"]}
    return {"step_mb": round((plan.memory["activations"] + plan.memory["gradients"]) / MB),
            "parts_mb": {k: round(v / MB) for k, v in parts.items()}}


def load_runs(path: str) -> list[dict]:
    """The runs of an earlier --json result, with the planner's prediction of today (a run's memory
    does not change when the planner does; a prediction recorded with the run is replaced)."""
    result = json.load(open(path))
    for r in result["runs"]:
        plan = planned(result["preset"], r["T"], r["C"])
        r["planned_step_mb"], r["planned_parts_mb"] = plan["step_mb"], plan["parts_mb"]
    return result["runs"]


def groups(runs: list[dict]) -> dict[tuple[int, int], list[dict]]:
    """The ranks' rows of each (T, C), sorted by T then C; a (T, C) measured twice keeps the rows
    of its last run (the ranks of one run share its step_s)."""
    out: dict[tuple[int, int], list[dict]] = {}
    for r in runs:
        key = (r["T"], r["C"])
        rows = out.setdefault(key, [])
        if any(o["rank"] == r["rank"] for o in rows):  # another run of this (T, C): start over
            rows.clear()
        rows.append(r)
    return dict(sorted(out.items()))


def table(runs: list[dict]) -> str:
    """A markdown row per (T, C): the group's step (its slowest rank) and tokens/s, the largest
    rank's step peak and peak RSS, and the planner's step peak with its error against the
    measurement."""
    lines = ["| T | C | tokens per rank | step s | tokens/s | step peak MB per rank | planned MB | planned vs "
             "measured | peak RSS MB per rank |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (T, C), rows in groups(runs).items():
        step = max(r["step_s"] for r in rows)
        peak = max(r["step_peak_mb"] for r in rows)
        plan = rows[0]["planned_step_mb"]
        lines.append(f"| {T:,} | {C} | {max(r['tokens'] for r in rows):,} | {step:.1f} | {T / step:,.0f} | "
                     f"{peak:,} | {plan:,} | {plan / peak - 1:+.0%} | {max(r['peak_rss_mb'] for r in rows):,} |")
    return "\n".join(lines)


def breakdown_table(runs: list[dict]) -> str:
    """The no-grad forward's seconds by kind of sub-layer at each T (C = 1), and how much each grew
    since the T before: linear work doubles when T doubles, quadratic work quadruples."""
    kinds = [("KimiDeltaAttention", "KDA"), ("GatedMLA", "MLA"), ("mlp", "MoE + dense MLP")]
    head = " | ".join(f"{name} s | x" for _, name in kinds)
    lines = [f"| T | {head} |", "|---:|" + "---:|---:|" * len(kinds)]
    before = None
    for (T, C), rows in groups(runs).items():
        if C != 1 or "forward_s" not in rows[0]:
            continue
        spent = rows[0]["forward_s"]
        cells = []
        for kind, _ in kinds:
            grew = f"{spent[kind] / before[1][kind]:.1f}" if before and before[0] * 2 == T else "-"
            cells.append(f"{spent[kind]:.2f} | {grew}")
        lines.append(f"| {T:,} | " + " | ".join(cells) + " |")
        before = (T, spent)
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    """tokens/s (the group's) and step peak MB (the largest rank's, and the planner's dashed)
    against T, a line per C."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    measured = groups(runs)
    for i, C in enumerate(sorted({C for _, C in measured})):
        Ts = [T for T, c in measured if c == C]
        mine = [measured[T, C] for T in Ts]
        colour = f"C{i}"
        ax_speed.plot(Ts, [T / max(r["step_s"] for r in rs) for T, rs in zip(Ts, mine)], "o-", color=colour,
                      label=f"C = {C}")
        ax_mem.plot(Ts, [max(r["step_peak_mb"] for r in rs) for rs in mine], "o-", color=colour,
                    label=f"C = {C}, measured")
        ax_mem.plot(Ts, [rs[0]["planned_step_mb"] for rs in mine], "x--", color=colour, alpha=0.7,
                    label=f"C = {C}, k3 plan")
    for ax, label in [(ax_speed, "training tokens/s (the group's)"), (ax_mem, "step peak memory per rank (MB)")]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({T for T, _ in measured}), [f"{T // 1024}K" for T in sorted({T for T, _ in measured})])
        ax.set_xlabel("sequence length T (tokens)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    ax_mem.set_yscale("log", base=2)  # memory linear in T: slope 1; 1/C: a constant gap
    ax_mem.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    fig.suptitle("k3-tiny training step, fp32, one CPU thread per rank, activation checkpointing")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
