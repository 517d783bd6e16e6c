"""Does the hybrid reach back? Multi-query associative recall (MQAR) at and past the training length.

    python jobs/bench_recall.py --variant hybrid --out recall-hybrid.json     # train + evaluate one variant
    python jobs/bench_recall.py --report recall-*.json --plot docs/bench_recall.png   # table + plot

A sequence holds `--pairs` key-value pairs right after BOS, then filler tokens, then the same keys
again in a new order, each followed by its value: the model is trained to produce every value of the
query part, which it can only do by finding the key's first occurrence. Keys, values and filler
come from three disjoint ranges of the vocabulary; keys are distinct within a sequence. Longer
evaluation sequences keep the pairs and queries and add filler, so the distance from a query back to
its pair grows with the length (4x the training length: about 4x the distance).

Variants (k3-tiny's shapes, random init, the same seed and data): `hybrid` (k3-tiny as is: 6 KDA +
2 MLA layers), `all_kda` and `all_mla` (every layer one kind). `--layers kda,mla` gives the hybrid
another layer pattern (the other two variants take its depth): a shallower stack of k3-tiny's
layers, its first layer's MLP dense and the others MoE as in k3-tiny. At k3-tiny's 8 layers the
loss sits at ln(values) for hundreds to thousands of steps (never left in 3,000 at lr 3e-3; left
at ~800 at 1e-3), while 2 layers of the same widths learn the task in a few hundred
(docs/benchmarks.md). One torch thread per run; two runs may go side by side, one per core.
Accuracy: the share of query values predicted exactly (greedy) over `--eval-batches` batches per
length.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

VARIANTS = {"hybrid": None, "all_kda": "kda", "all_mla": "mla"}

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--variant", choices=sorted(VARIANTS), help="train and evaluate this variant")
p.add_argument("--layers", help="the hybrid's layer kinds, comma-separated (kda, mla); default k3-tiny's 8")
p.add_argument("--train-len", type=int, default=256, help="tokens per training sequence")
p.add_argument("--eval-mults", default="1,4,16", help="evaluation lengths as multiples of --train-len")
p.add_argument("--pairs", type=int, default=16, help="key-value pairs per sequence (all queried)")
p.add_argument("--keys", type=int, default=256, help="size of the key range of the vocabulary")
p.add_argument("--values", type=int, default=256, help="size of the value range")
p.add_argument("--filler", type=int, default=256, help="size of the filler range")
p.add_argument("--steps", type=int, default=600)
p.add_argument("--batch", type=int, default=32, help="sequences per step")
p.add_argument("--lr", type=float, default=1e-3,
               help="peak, cosine after the warm-up (3e-3 kept 2 and 8 layers on the plateau longer here)")
p.add_argument("--warmup", type=int, default=50)
p.add_argument("--eval-batches", type=int, default=4)
p.add_argument("--eval-batch", type=int, default=16)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--threads", type=int, default=1)
p.add_argument("--out", type=Path, help="write the variant's result JSON here")
p.add_argument("--report", nargs="*", type=Path, help="result JSONs to tabulate (no training)")
p.add_argument("--plot", type=Path, help="with --report: accuracy against length, one line per variant")
args = p.parse_args()
if args.layers is not None and any(k not in ("kda", "mla") for k in args.layers.split(",")):
    p.error(f"--layers takes kda and mla, comma-separated; got {args.layers!r}")


def mqar_batch(gen, batch: int, length: int, pairs: int):
    """(ids [B, length], label positions [B, pairs], targets [B, pairs]): position t of a label
    is a query key, whose value the model must produce next."""
    import torch

    first_key, first_value = 16, 16 + args.keys
    first_filler = first_value + args.values
    keys = torch.rand(batch, args.keys, generator=gen).argsort(dim=1)[:, :pairs] + first_key
    values = torch.randint(first_value, first_value + args.values, (batch, pairs), generator=gen)
    order = torch.rand(batch, pairs, generator=gen).argsort(dim=1)
    qk, qv = keys.gather(1, order), values.gather(1, order)
    fill = length - 1 - 4 * pairs
    if fill < 0:
        raise ValueError(f"length {length} cannot hold BOS + {pairs} pairs + {pairs} queries")
    filler = torch.randint(first_filler, first_filler + args.filler, (batch, fill), generator=gen)
    bos = torch.ones(batch, 1, dtype=torch.long)
    ids = torch.cat([bos, torch.stack([keys, values], 2).flatten(1), filler, torch.stack([qk, qv], 2).flatten(1)], 1)
    start = 1 + 2 * pairs + fill
    at = start + 2 * torch.arange(pairs)  # the query keys
    return ids, at.expand(batch, -1), qv


def variant_model(name: str):
    import torch

    from k3.model import K3ForCausalLM, get_preset
    from k3.model.config import moe_schedule

    kind = VARIANTS[name]
    cfg = get_preset("k3-tiny")
    kinds = cfg.layer_types if args.layers is None else args.layers.split(",")
    cfg = cfg.replace(num_layers=len(kinds), layer_types=[kind] * len(kinds) if kind else kinds,
                      mlp_types=moe_schedule(len(kinds), 1))  # k3-tiny's rule: the first layer's MLP dense
    torch.manual_seed(args.seed)
    return K3ForCausalLM(cfg)


def recall_loss(model, ids, at, targets):
    """Cross-entropy and accuracy of the values at the query positions (logits only there)."""
    import torch
    import torch.nn.functional as F

    B, T = ids.shape
    flat = (at + T * torch.arange(B)[:, None]).reshape(-1)
    logits = model(ids, logits_at=flat).logits.float()
    loss = F.cross_entropy(logits, targets.reshape(-1))
    return loss, (logits.argmax(-1) == targets.reshape(-1)).float().mean()


def train_and_eval(name: str) -> dict:
    import torch

    from k3.platform.train.optim import cosine_lr

    torch.set_num_threads(args.threads)
    model = variant_model(name).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(args.seed)
    curve, t0 = [], time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, args.steps, args.warmup, args.lr)
        loss, acc = recall_loss(model, *mqar_batch(gen, args.batch, args.train_len, args.pairs))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            curve.append({"step": step, "loss": round(loss.item(), 4), "acc": round(acc.item(), 4),
                          "s": round(time.perf_counter() - t0, 1)})
            print(f"{name} step {step} loss {loss.item():.4f} acc {acc.item():.3f} "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)
    train_s = time.perf_counter() - t0
    model.eval()
    evals = {}
    egen = torch.Generator().manual_seed(10_000 + args.seed)  # held-out draws, the same for every variant
    with torch.no_grad():
        for mult in [int(m) for m in args.eval_mults.split(",")]:
            length = mult * args.train_len
            accs = [float(recall_loss(model, *mqar_batch(egen, args.eval_batch, length, args.pairs))[1])
                    for _ in range(args.eval_batches)]
            evals[str(mult)] = {"length": length, "accuracy": round(sum(accs) / len(accs), 4)}
            print(f"{name} eval x{mult} ({length} tokens): {evals[str(mult)]['accuracy']:.3f}", flush=True)
    cfg = model.cfg
    return {"variant": name, "layer_types": cfg.layer_types,
            "params": sum(p.numel() for p in model.parameters()), "train_s": round(train_s, 1),
            "eval": evals, "curve": curve, "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("report", "plot", "out")}}


def report(paths: list[Path]) -> None:
    runs = [json.loads(p.read_text()) for p in paths]
    mults = sorted({int(m) for r in runs for m in r["eval"]})
    print("| variant | layers | train steps | train time | " + " | ".join(f"x{m} ({runs[0]['eval'][str(m)]['length']})"
                                                                    for m in mults) + " |")
    print("|---|---|---|---|" + "---|" * len(mults))
    for r in runs:
        kinds = r["layer_types"]
        layers = f"{kinds.count('kda')} KDA + {kinds.count('mla')} MLA"
        cells = " | ".join(f"{100 * r['eval'][str(m)]['accuracy']:.1f}%" for m in mults)
        print(f"| {r['variant']} | {layers} | {r['args']['steps']} | {r['train_s']:.0f} s | {cells} |")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for r in runs:
            xs = [r["eval"][str(m)]["length"] for m in mults]
            ax.plot(xs, [100 * r["eval"][str(m)]["accuracy"] for m in mults], marker="o", label=r["variant"])
        ax.axvline(runs[0]["args"]["train_len"], color="grey", linestyle=":", label="training length")
        ax.axhline(100 / runs[0]["args"]["values"], color="red", linestyle="--", label="chance (1 / values)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("recall accuracy (%)")
        ax.set_ylim(0, 102)
        ax.set_title(f"MQAR, {runs[0]['args']['pairs']} pairs, k3-tiny widths, {len(runs[0]['layer_types'])} layers")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if args.report:
    report(args.report)
elif args.variant:
    result = train_and_eval(args.variant)
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("variant", "train_s", "eval")}))
else:
    p.error("give --variant (train and evaluate) or --report (tabulate)")
