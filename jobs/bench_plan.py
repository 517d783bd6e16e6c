"""`k3 plan` against measurement: k3-tiny training runs on this CPU, each number beside the
planner's prediction of it; JSON out.

    python jobs/bench_plan.py --out plan.json

Each case runs k3's Trainer (DeepSpeed ZeRO-1 on CPU, fp32, gloo; balancing off) in fresh worker
processes, one torch thread each, for two steps on random tokens:

- memory: the peak of live torch tensor bytes on a rank, from before its model is built to the end of
  the second step (the allocation events of torch's profiler: every parameter, gradient, optimizer
  state, ZeRO buffer and activation, nothing of the allocator's slack), against the planner's
  weights + gradients + optimizer + activations for the same layout, tokens and precision (fp32, the
  CPU KDA kernel's saved tensors);
- traffic (two ranks, EP 2): the bytes the expert all-to-all sent in the second step (the
  dispatchers' own count, `ExpertParallel.all_to_all_bytes`, forward and backward) and the
  payloads DeepSpeed and the expert gradient reduction hand to torch.distributed and to
  deepspeed.comm (counted by wrapping their collectives), against the planner's all-to-all bytes
  and gradient payloads;
- CP exchange (cases with `:cp2`): the bytes a rank sends through the context-parallel group's
  all-gathers (`ContextParallel.gather`: (C - 1) x its piece, KDA's (state, transition) pairs and
  MLA's latents) and their backward reduce-scatters ((C - 1) x its piece's gradient), forward,
  recompute and backward, against the planner's cp_exchange. The group's batch check (two int64
  per step) is counted apart.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--cases", default="1x1x4096:ckpt,1x1x4096:full,1x4x4096:ckpt,2x2x2048:ckpt,2x2x2048:full,"
                                  "2x1x4096:ckpt:cp2,2x1x4096:full:cp2",
               help="world x micro_batch x sequence length : ckpt (activation checkpointing) or full "
                    "[: cpC (context parallelism over C of the ranks)]")
p.add_argument("--out", type=Path)
args = p.parse_args()

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
               "broadcast", "reduce")


def count_collectives(dist, tally: dict, prefix: str = "") -> None:
    """Wrap a module's collectives to add each call's payload bytes (its first tensor argument:
    the output of an all-gather) to tally[prefix + name]."""
    def wrap(name, fn):
        def counted(*a, **kw):
            t = a[0] if a else next(iter(kw.values()))
            tensors = t if isinstance(t, (list, tuple)) else [t]
            tally[prefix + name] = tally.get(prefix + name, 0) + sum(x.numel() * x.element_size() for x in tensors)
            return fn(*a, **kw)
        return counted

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))


def count_deepspeed_collectives(tally: dict) -> None:
    """The same for deepspeed.comm, which ZeRO calls (its parameter all-gather after the step)."""
    import deepspeed.comm as dscomm

    count_collectives(dscomm, tally, prefix="deepspeed.")


def count_cp_exchange(tally: dict) -> None:
    """Count what ContextParallel.gather makes this rank send: (C - 1) x its piece in the
    all-gather, (C - 1) x the piece's gradient in the backward's reduce-scatter."""
    import torch

    from k3.platform.train.context_parallel import ContextParallel

    gather = ContextParallel.gather

    def add(key: str, n: int) -> None:
        tally[key] = tally.get(key, 0) + n

    def counted(self, x):
        out = gather(self, x)
        if self.size > 1:
            key = "cp_check" if x.dtype == torch.long else "cp_exchange"
            sent = (self.size - 1) * x.numel() * x.element_size()
            add(key, sent)
            if out.requires_grad:
                out.register_hook(lambda g: add(key, sent))
        return out

    ContextParallel.gather = counted


def peak_live_bytes(prof) -> int:
    live = peak = 0
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def worker(rank: int, world: int, port: int, case: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    from k3.platform.train.config import TrainConfig
    from k3.platform.ops.extensions import init_distributed
    from k3.platform.train.trainer import Trainer

    init_distributed("gloo")  # the ninja every k3 build uses; its build line on stderr
    tally: dict = {}
    cfg = TrainConfig(num_workers=world, ep_size=world, micro_batch=case["micro_batch"], steps=2, lr=1e-3,
                      warmup_steps=0, balance={"method": "none"}, seed=3,
                      activation_checkpointing=case["checkpointing"], context_parallel=case["cp"])
    g = torch.Generator().manual_seed(rank // case["cp"])  # a CP group's ranks read the same sequences
    vocab = cfg.model_cfg().vocab_size
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        t = Trainer(cfg, rank, world).build()
        t.start()
        count_collectives(dist, tally)  # from here: the steps' collectives only
        count_deepspeed_collectives(tally)
        count_cp_exchange(tally)
        steps = [t.train_step(t.make_batch({"tokens": torch.randint(0, vocab, (case["micro_batch"], case["seq"]),
                                                                     generator=g)}), s) for s in range(2)]
    result = {"peak_tensor_bytes": peak_live_bytes(prof), "all_to_all_bytes": t.ep.all_to_all_bytes(),
              "collective_payload_bytes_2_steps": tally, "step_s": [round(s.step_s, 2) for s in steps]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def predicted(case: dict) -> dict:
    from k3.model import get_preset
    from k3.platform.ops.plan.planner import cpu_run_setup
    from k3.platform.ops.plan.training import Layout, grad_payloads, plan_layout

    s = cpu_run_setup(get_preset("k3-tiny"), case["seq"], case["micro_batch"], case["checkpointing"])
    layout = Layout(case["world"] // case["cp"], case["cp"], case["world"])
    plan = plan_layout(s, layout, utilisation=1.0)
    return {"memory": plan.memory, "total_bytes": plan.total_bytes, "all_to_all_bytes": plan.traffic["all_to_all"],
            "cp_exchange_bytes": plan.traffic["cp_exchange"], "grad_payloads": grad_payloads(s, layout)}


def parse_case(text: str) -> dict:
    """`WORLDxMBxSEQ:ckpt|full[:cpC]` -> a case; a ValueError naming what is wrong otherwise."""
    shape, _, rest = text.partition(":")
    mode, *extra = rest.split(":")
    dims = shape.split("x")
    if len(dims) != 3 or not all(d.isdigit() and int(d) > 0 for d in dims):
        raise ValueError(f"case {text!r}: the shape must be WORLDxMICRO_BATCHxSEQ_LEN of positive integers")
    if mode not in ("ckpt", "full"):
        raise ValueError(f"case {text!r}: the mode must be ckpt or full, got {mode!r}")
    if len(extra) > 1 or (extra and not (extra[0].startswith("cp") and extra[0][2:].isdigit() and int(extra[0][2:]) > 0)):
        raise ValueError(f"case {text!r}: after the mode only cpC (C a positive integer) may follow")
    world, mb, seq = (int(d) for d in dims)
    cp = int(extra[0][2:]) if extra else 1
    if world % cp or seq % cp:
        raise ValueError(f"case {text!r}: cp{cp} must divide the world size ({world}) and the sequence length ({seq})")
    return {"world": world, "micro_batch": mb, "seq": seq, "checkpointing": mode == "ckpt", "cp": cp}


def run_case(case: dict) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from k3.platform.ops.local_ray import free_port

    world, cp = case["world"], case["cp"]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, free_port(), case, d), nprocs=world, join=True)
        ranks = [json.loads(Path(d, f"rank{r}.json").read_text()) for r in range(world)]
    pred = predicted(case)
    measured_peak = max(r["peak_tensor_bytes"] for r in ranks)
    out = case | {"ranks": ranks, "predicted": pred, "measured_peak_tensor_bytes": measured_peak,
                  "peak_error": round(pred["total_bytes"] / measured_peak - 1, 4)}
    if world > 1:
        a2a = sum(r["all_to_all_bytes"] for r in ranks) / world
        out["all_to_all_error"] = round(pred["all_to_all_bytes"] / a2a - 1, 4)
    if cp > 1:  # per rank and step: the tally covers both steps
        sent = sum(r["collective_payload_bytes_2_steps"].get("cp_exchange", 0) for r in ranks) / world / 2
        out["cp_exchange_measured_per_step"] = sent
        # nothing sent would be a broken count (the planner always predicts an exchange with cp > 1)
        out["cp_exchange_error"] = round(pred["cp_exchange_bytes"] / sent - 1, 4) if sent else None
    print(json.dumps({k: v for k, v in out.items() if k != "ranks"}), flush=True)
    return out


if __name__ == "__main__":
    try:  # every case checked before the first one runs
        cases = [parse_case(c) for c in args.cases.split(",")]
    except ValueError as e:
        p.error(str(e))
    t0 = time.perf_counter()
    summary = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
               "load_avg_1m_start": round(os.getloadavg()[0], 2),
               "cases": [run_case(c) for c in cases]}
    summary |= {"wall_s": round(time.perf_counter() - t0, 1), "load_avg_1m_end": round(os.getloadavg()[0], 2)}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    sys.exit(0)
