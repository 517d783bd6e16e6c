"""`k3 report RUN_DIR`: the page to open first after a run, for users without Grafana.

Reads the history the run recorded in its latest checkpoint (`<run>/checkpoint_*/k3/state.pt`:
one entry per step with loss, tokens, step seconds, per-layer MaxVio and router bias spread, and
the run's config) and writes one HTML page with PNG plots: loss, tokens/s, a per-layer MaxVio
heatmap and the bias spread per layer over time; then the run's config, its checkpoints and the
tail of the job's log (`<run>/job.log`, or `--log FILE`: e.g. `ray job logs ID > runs/x/job.log`).
The page is static: no script, nothing fetched from the network. The folder is written beside
and swapped in whole (k3.model.directory.write_beside): a report written over an earlier one never
leaves a page whose plots are another run's or missing, and a failed write leaves the earlier
report as it was.

    k3 report runs/my-run            # writes runs/my-run/report/index.html (+ PNGs), prints its path
"""
from __future__ import annotations

import html
import math
import os
import time
from pathlib import Path

from k3.model.directory import owned, write_beside

ZERO_COLOUR = "#b0b0b0"  # heatmap cells exactly 0: grey, outside the colour map's range
LOG_TAIL_LINES = 60
# What a report owns in its folder: the page and its plots. An earlier report's plot that this one
# does not draw (a run without bias spread) goes; anything else a user put there stays.
REPORT_FILES = ("index.html", "*.png")


def _checkpoints(run: Path) -> list[Path]:
    return sorted(c for c in run.glob("checkpoint_*") if (c / "k3" / "state.pt").is_file())


def latest_checkpoint(run_dir: str | os.PathLike) -> Path:
    """The run's checkpoint with the highest step that holds a k3/state.pt."""
    run = Path(run_dir)
    if not run.is_dir():
        raise ValueError(f"{run}: no such run directory")
    ckpts = _checkpoints(run)
    if not ckpts:
        raise ValueError(f"{run}: no checkpoint with k3/state.pt (is this a `jobs/pretrain.py` run directory?)")
    from k3.model.training_checkpoint import read_state

    return max(ckpts, key=lambda c: read_state(c / "k3")["step"])


def read_run(run_dir: str | os.PathLike) -> tuple[list[dict], dict]:
    """(history, config) of the run's latest checkpoint."""
    ckpt = latest_checkpoint(run_dir)  # a bad run directory is refused before torch loads
    from k3.model.training_checkpoint import read_state

    state = read_state(ckpt / "k3")
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


def _line(steps, ys, ylabel, title):
    def draw(fig, ax):
        ax.plot(steps, ys, lw=1, marker="." if len(steps) < 40 else None)
        ax.set(xlabel="step", ylabel=ylabel, title=title)
    return draw


def _heat(steps, m, title, label):
    """One row per MoE layer; cells exactly 0 in ZERO_COLOUR (below the colour map's range), so
    perfect balance is told apart from small values."""
    def draw(fig, ax):
        import matplotlib as mpl
        import numpy as np

        a = np.asarray(m, dtype=float)
        positive = a[a > 0]
        lo = float(positive.min()) if positive.size else 1.0
        hi = max(float(a.max()), lo * (1 + 1e-9))
        cmap = mpl.colormaps["viridis"].with_extremes(under=ZERO_COLOUR)
        im = ax.imshow(a, aspect="auto", interpolation="nearest", cmap=cmap, vmin=lo, vmax=hi,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(m) - 0.5, -0.5))
        ax.set(xlabel="step", ylabel="MoE layer", title=title)
        zeros = bool((a == 0).any())
        bar = fig.colorbar(im, ax=ax, extend="min" if zeros else "neither")
        bar.set_label(label + (" (grey: exactly 0)" if zeros else ""))
    return draw


def figures(history: list[dict]) -> dict[str, tuple[str, object]]:
    """{file name: (caption, matplotlib Figure)} of the run's plots; steps on integer ticks."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a cluster or in CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [h["step"] for h in history]
    plots = {"loss.png": ("Training loss per step (mean over workers).",
                          _line(steps, [h["loss"] for h in history], "loss", "Training loss")),
             "tokens_per_s.png": ("Tokens per second of each step, all workers together.",
                                  _line(steps, [h["tokens"] / h["step_s"] if h.get("step_s") else math.nan
                                                for h in history], "tokens/s", "Throughput (all workers)"))}
    for key, name, title, label, caption in (
            ("maxvio", "maxvio.png", "MaxVio per MoE layer", "MaxVio", "MaxVio (max expert load / mean load - 1) "
             "per MoE layer and step: 0 is perfect balance."),
            ("bias_spread", "bias_spread.png", "Router bias spread per MoE layer", "bias spread (max - min)",
             "Router bias spread (max - min over experts) per MoE layer and step: how far balancing has moved "
             "the bias.")):
        m = _matrix(history, key)
        if m is not None:
            plots[name] = (caption, _heat(steps, m, title, label))
    out = {}
    for name, (caption, draw) in plots.items():
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        draw(fig, ax)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if name in ("maxvio.png", "bias_spread.png"):
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        out[name] = (caption, fig)
    return out


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _checkpoint_rows(run: Path) -> list[tuple[str, str, str]]:
    """(name, MB, written) per checkpoint directory, oldest first."""
    rows = []
    for c in _checkpoints(run):
        files = [f for f in c.rglob("*") if f.is_file()]
        mb = sum(f.stat().st_size for f in files) / 2**20
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(f.stat().st_mtime for f in files)))
        rows.append((c.name, f"{mb:.1f}", written))
    return rows


def _table(rows, head: tuple[str, ...] | None = None) -> str:
    esc = lambda v: html.escape(str(v))  # noqa: E731
    top = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>" if head else ""
    return "<table>" + top + "".join("<tr>" + "".join(f"<td>{esc(v)}</td>" for v in r) + "</tr>" for r in rows) \
        + "</table>"


def _summary(run: Path, history: list[dict], config: dict) -> dict[str, object]:
    last = history[-1]
    tps = [h["tokens"] / h["step_s"] for h in history if h.get("step_s")]
    worst = max(last["maxvio"]) if last.get("maxvio") else None
    return {"run": str(run.resolve()), "steps": last["step"], "first loss": f"{history[0]['loss']:.4f}",
            "final loss": f"{last['loss']:.4f}", "mean tokens/s": f"{sum(tps) / len(tps):,.0f}" if tps else "-",
            "worst-layer MaxVio, last step": "-" if worst is None else f"{worst:.3f}",
            **{k: config[k] for k in ("preset", "num_workers", "ep_size", "micro_batch", "lr") if k in config},
            **({"balance": config["balance"].get("method")} if isinstance(config.get("balance"), dict) else {})}


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1500px}th{text-align:left;padding-right:1em}"
         "td{padding-right:1em}.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(600px,1fr));"
         "gap:1em}img{max-width:100%;height:auto}figure{margin:0}figcaption{font-size:90%;color:#444}"
         "pre{background:#f4f4f4;padding:1em;overflow-x:auto;font-size:85%}details{margin:1em 0}"
         "summary{font-weight:bold;cursor:pointer}")


def _save_plots(history: list[dict], folder: Path) -> list[str]:
    """Write the run's plots into folder; their <figure> elements."""
    import matplotlib.pyplot as plt

    plots = figures(history)
    figs = []
    try:
        for name, (caption, fig) in plots.items():
            fig.savefig(folder / name, format="png")
            figs.append(f'<figure><img src="{name}" alt="{html.escape(caption)}" width="700" height="360">'
                        f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    finally:
        for _, fig in plots.values():
            plt.close(fig)
    return figs


def _page(run: Path, history: list[dict], config: dict, figs: list[str], log_path: Path) -> str:
    tail = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:] if log_path.is_file() else None
    sections = [f"<h1>k3 run report</h1>{_table(_summary(run, history, config).items())}",
                f"<div class='plots'>{''.join(figs)}</div>",
                f"<h2>Checkpoints</h2>{_table(_checkpoint_rows(run), ('checkpoint', 'MB', 'written'))}",
                f"<h2>Job log</h2>" + (f"<p>last {len(tail)} lines of {html.escape(str(log_path))}</p>"
                                       f"<pre>{html.escape(chr(10).join(tail))}</pre>" if tail is not None else
                                       f"<p>no log: save the job's output as {html.escape(str(log_path))} "
                                       f"(<code>ray job logs JOB_ID &gt; {html.escape(str(log_path))}</code>) or "
                                       "pass <code>--log FILE</code></p>"),
                f"<details open><summary>Run config</summary>{_table(sorted(_flat(config).items()))}</details>"]
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>k3 run report: {html.escape(run.name)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(sections)}</body></html>\n")


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 log: str | os.PathLike | None = None) -> Path:
    """Write index.html and its PNGs (to `<run_dir>/report` by default); returns the HTML path.
    `log`: the job's log (default `<run_dir>/job.log` when it exists). The folder changes only
    when the whole report is written (write_beside); other files in it are kept."""
    run = Path(run_dir)
    history, config = read_run(run)
    log_path = Path(log) if log is not None else run / "job.log"
    if log is not None and not log_path.is_file():
        raise ValueError(f"{log_path}: no such log file")
    out = Path(out_dir) if out_dir else run / "report"
    if out.resolve() == run.resolve() or out.resolve() in run.resolve().parents:
        # the folder is rebuilt beside itself and swapped in: the run's own files would be copied,
        # and a file its job writes meanwhile lost
        raise ValueError(f"--out {out} holds the run directory {run}: write the report to a folder of its own "
                         f"(default {run / 'report'})")
    with write_beside(out, stale=owned(REPORT_FILES)) as stage:
        figs = _save_plots(history, stage)
        (stage / "index.html").write_text(_page(run, history, config, figs, log_path))
    return out / "index.html"
