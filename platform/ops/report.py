"""`k3 report RUN_DIR`: one HTML page with PNG plots of a pretraining run, for users without Grafana.

Reads the history the run recorded in its latest checkpoint (`<run>/checkpoint_*/k3/state.pt`:
one entry per step with loss, tokens, step seconds, per-layer MaxVio and router bias spread) and
draws loss, tokens/s, a per-layer MaxVio heatmap and the bias spread per layer over time.

    k3 report runs/my-run            # writes runs/my-run/report/index.html (+ PNGs), prints its path
"""
from __future__ import annotations

import html
import math
import os
from pathlib import Path


def latest_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The run's checkpoint with the highest step that holds a k3/state.pt."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"{run}: no such run directory")
    ckpts = [c for c in run.glob("checkpoint_*") if (c / "k3" / "state.pt").is_file()]
    if not ckpts:
        raise ValueError(f"{run}: no checkpoint with k3/state.pt (is this a `jobs/pretrain.py` run directory?)")
    import torch

    def step(c: Path) -> int:
        return torch.load(c / "k3" / "state.pt", weights_only=False)["step"]

    return max(ckpts, key=step)


def read_run(run_dir: str | os.PathLike) -> tuple[list[dict], dict]:
    """(history, config) of the run's latest checkpoint."""
    ckpt = latest_checkpoint(run_dir)  # a bad run directory is refused before torch loads
    import torch

    state = torch.load(ckpt / "k3" / "state.pt", weights_only=False)
    history = state.get("history") or []
    if not history:
        raise ValueError(f"{run_dir}: the latest checkpoint holds no training history")
    return history, state.get("config") or {}


def _matrix(history: list[dict], key: str) -> list[list[float]] | None:
    """[layers][steps] of a per-layer history field, or None when the run did not record it."""
    rows = [h.get(key) for h in history]
    if any(not r for r in rows):
        return None
    n = len(rows[0])
    if any(len(r) != n for r in rows):
        raise ValueError(f"history field {key!r} changes length between steps")
    return [[r[i] for r in rows] for i in range(n)]


def _plot(path: Path, draw) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    draw(fig, ax)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> Path:
    """Write index.html and its PNGs (to `<run_dir>/report` by default); returns the HTML path."""
    history, config = read_run(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    steps = [h["step"] for h in history]
    plots: list[tuple[str, str]] = []

    def add(name: str, caption: str, draw) -> None:
        _plot(out / name, draw)
        plots.append((name, caption))

    def loss(fig, ax):
        ax.plot(steps, [h["loss"] for h in history], lw=1)
        ax.set(xlabel="step", ylabel="loss", title="Training loss (mean over workers)")

    add("loss.png", "Training loss per step.", loss)

    def tps(fig, ax):
        ax.plot(steps, [h["tokens"] / h["step_s"] if h.get("step_s") else math.nan for h in history], lw=1)
        ax.set(xlabel="step", ylabel="tokens/s", title="Throughput (all workers)")

    add("tokens_per_s.png", "Tokens per second of each step, all workers together.", tps)

    for key, name, title, caption in (
            ("maxvio", "maxvio.png", "MaxVio per MoE layer", "MaxVio (max expert load / mean load - 1) per MoE "
             "layer and step: 0 is perfect balance."),
            ("bias_spread", "bias_spread.png", "Router bias spread per MoE layer", "Router bias spread (max - min "
             "over experts) per MoE layer and step: how far balancing has moved the bias.")):
        m = _matrix(history, key)
        if m is None:
            continue

        def heat(fig, ax, m=m, title=title):
            im = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis",
                           extent=(steps[0] - 0.5, steps[-1] + 0.5, len(m) - 0.5, -0.5))
            ax.set(xlabel="step", ylabel="MoE layer", title=title)
            fig.colorbar(im, ax=ax)

        add(name, caption, heat)

    last = history[-1]
    facts = {"run": str(Path(run_dir).resolve()), "steps": last["step"], "first loss": f"{history[0]['loss']:.4f}",
             "final loss": f"{last['loss']:.4f}",
             **{k: config[k] for k in ("preset", "num_workers", "ep_size", "micro_batch", "lr") if k in config}}
    if "balance" in config:
        facts["balance"] = config["balance"].get("method")
    rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts.items())
    figs = "".join(f'<figure><img src="{n}" alt="{html.escape(c)}"><figcaption>{html.escape(c)}</figcaption></figure>'
                   for n, c in plots)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>k3 run report</title>"
            f"<style>body{{font-family:sans-serif;margin:2em}}th{{text-align:left;padding-right:1em}}"
            f"figure{{margin:1em 0}}</style></head><body><h1>k3 run report</h1><table>{rows}</table>{figs}"
            f"</body></html>\n")
    path = out / "index.html"
    path.write_text(page)
    return path
