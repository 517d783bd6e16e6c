"""`k3 report`: the page a person opens first after a run, checked as data and in a real browser
(Chromium's headless shell: every image loads, nothing on the console, a full-page screenshot)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3.platform.ops.cli import main
from k3.platform.ops.report import ZERO_COLOUR, figures, write_report

from browser import HOW_TO_GET, find_chromium, render

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"preset": "k3-tiny", "num_workers": 2, "ep_size": 2, "lr": 0.003, "micro_batch": 4,
          "balance": {"method": "quantile_hist", "bins": 64}}


def history(steps: int, layers: int, with_bias: bool = True, zero_at: int | None = None) -> list[dict]:
    """One entry per step as the trainer records it; MaxVio of layer 0 exactly 0 at step zero_at."""
    return [{"step": s, "loss": 8.0 / s, "tokens": 512, "step_s": 0.5, "wait_s": 0.01, "all_to_all_s": 0.02,
             "maxvio": [0.0 if (s == zero_at and i == 0) else 0.5 / s + 0.1 * i for i in range(layers)],
             **({"bias_spread": [0.01 * s] * layers} if with_bias else {})} for s in range(1, steps + 1)]


def fake_run(root: Path, steps: int, layers: int, with_bias: bool = True, log_lines: int = 0) -> Path:
    run = root / "run"
    for n in (steps // 2, steps):  # two checkpoints: the report reads the later one
        d = run / f"checkpoint_{n:06d}" / "k3"
        d.mkdir(parents=True)
        torch.save({"step": n, "history": history(n, layers, with_bias), "config": CONFIG}, d / "state.pt")
    if log_lines:
        (run / "job.log").write_text("".join(f"step {i:5d}/{steps}  loss <{i}>\n" for i in range(log_lines)))
    return run


@pytest.mark.parametrize("with_bias, pngs", [(True, 4), (False, 3)])
def test_report_draws_the_latest_history_with_config_checkpoints_and_log(tmp_path, with_bias, pngs):
    page = write_report(fake_run(tmp_path, steps=12, layers=3, with_bias=with_bias, log_lines=100))
    text = page.read_text()
    assert text.count("<img ") == pngs and "final loss</td><td>0.6667" in text and "quantile_hist" in text
    for name in ["loss.png", "tokens_per_s.png", "maxvio.png"] + (["bias_spread.png"] if with_bias else []):
        assert (page.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "checkpoint_000006" in text and "checkpoint_000012" in text  # the checkpoint list
    assert "<td>balance.bins</td><td>64</td>" in text  # the config, nested fields flattened
    assert "loss &lt;99&gt;" in text and "loss &lt;39&gt;" not in text  # the log's last 60 lines, escaped
    assert "<script" not in text and "http" not in text  # static: nothing runs, nothing is fetched


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_report_over_an_earlier_one_is_whole_and_keeps_the_users_files(tmp_path):
    out = tmp_path / "out"
    write_report(fake_run(tmp_path / "a", steps=12, layers=3), out)  # 4 plots
    (out / "notes.txt").write_text("mine")
    page = write_report(fake_run(tmp_path / "b", steps=8, layers=2, with_bias=False), out)  # 3 plots
    text = page.read_text()
    assert text.rstrip().endswith("</html>") and "final loss</td><td>1.0000" in text
    drawn = {src.split('"')[0] for src in text.split('<img src="')[1:]}
    assert drawn == {"loss.png", "tokens_per_s.png", "maxvio.png"}
    assert set(snapshot(out)) == drawn | {"index.html", "notes.txt"}  # a's bias plot went with a's page
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]  # no stage left beside


def test_a_report_that_fails_midway_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    out = tmp_path / "out"
    write_report(fake_run(tmp_path / "a", steps=12, layers=3), out)
    before = snapshot(out)
    save, calls = Figure.savefig, []

    def disk_full_at_the_second_plot(fig, *args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", disk_full_at_the_second_plot)
    with pytest.raises(OSError, match="No space left"):
        write_report(fake_run(tmp_path / "b", steps=8, layers=2), out)
    assert len(calls) == 2 and snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "out"]


def test_report_without_a_log_says_how_to_get_one(tmp_path):
    text = write_report(fake_run(tmp_path, steps=4, layers=2)).read_text()
    assert "no log: save the job's output as" in text and "ray job logs JOB_ID" in text


def test_steps_on_integer_ticks_colour_bars_labelled():
    figs = figures(history(7, 3))
    for name, (_, fig) in figs.items():
        ax = fig.axes[0]
        assert all(float(t).is_integer() for t in ax.get_xticks()), (name, ax.get_xticks())
        if name in ("maxvio.png", "bias_spread.png"):
            assert all(float(t).is_integer() for t in ax.get_yticks())
            assert fig.axes[1].get_ylabel() in ("MaxVio", "bias spread (max - min)")  # the colour bar


@pytest.mark.parametrize("zero_at", [None, 3])
def test_maxvio_heatmap_shows_exactly_zero_apart(tmp_path, zero_at):
    import matplotlib.image as mpimg
    import numpy as np

    _, fig = figures(history(6, 3, zero_at=zero_at))["maxvio.png"]
    fig.savefig(tmp_path / "m.png")
    rgb = mpimg.imread(tmp_path / "m.png")[..., :3]
    grey = np.array([int(ZERO_COLOUR[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    grey_px = int((np.abs(rgb - grey).max(axis=-1) < 1.5 / 255).sum())
    # a cell is ~80 x 70 pixels; anti-aliased text leaves a few grey pixels anywhere
    if zero_at is None:
        assert grey_px < 100 and "exactly 0" not in fig.axes[1].get_ylabel()
    else:
        assert grey_px > 3000 and fig.axes[1].get_ylabel() == "MaxVio (grey: exactly 0)"


def test_report_bad_input_is_one_clear_line(tmp_path, capsys):
    run = fake_run(tmp_path, 4, 2)
    (tmp_path / "empty").mkdir()
    for args, msg in (([str(tmp_path / "empty")], "no checkpoint with k3/state.pt"),
                      ([str(tmp_path / "nope")], "no such run directory"),
                      ([str(run), "--log", str(tmp_path / "nope.log")], "no such log file"),
                      ([str(run), "--out", str(run)], "holds the run directory"),
                      ([str(run), "--out", str(tmp_path)], "holds the run directory")):
        rc = main(["report", *args])
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and msg in err, err


class _Runs:
    def __reduce__(self):  # unpickling this runs a command, as a handed-over state.pt could
        return (print, ("code ran",))


@pytest.mark.parametrize("content,msg", [
    (b"garbage", "cannot read it as a torch file"),
    (None, "cannot read it as a torch file"),  # truncated
    ("code", "cannot read it as a torch file"),
    ("list", "not a k3 training state"),
])
def test_report_on_a_damaged_or_hostile_state_file_names_it(tmp_path, capsys, content, msg):
    run = fake_run(tmp_path, 4, 2)
    path = next(run.glob("checkpoint_*")) / "k3" / "state.pt"
    if content is None:
        path.write_bytes(path.read_bytes()[:100])
    elif content == "code":
        torch.save({"step": 9, "x": _Runs()}, path)
    elif content == "list":
        torch.save([1, 2], path)
    else:
        path.write_bytes(content)
    rc = main(["report", str(run)])
    out, err = capsys.readouterr()
    assert rc == 1 and err.count("\n") == 1 and msg in err and str(path) in err, err
    assert "code ran" not in out


@pytest.mark.parametrize("break_it", [False, True])
def test_report_in_a_real_browser(tmp_path, break_it):
    chrome = find_chromium()
    if chrome is None:
        pytest.skip(HOW_TO_GET)
    page = write_report(fake_run(tmp_path, steps=12, layers=3, log_lines=80))
    if break_it:  # the check can fail: a plot missing from the folder
        (page.parent / "maxvio.png").unlink()
    seen = render(chrome, page, tmp_path / "shot.png")
    loaded = {src: ok for src, ok, *_ in seen["images"]}
    assert set(loaded) == {"loss.png", "tokens_per_s.png", "maxvio.png", "bias_spread.png"}
    shot = (tmp_path / "shot.png").read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and seen["height"] > 900  # the whole page, below the fold too
    if break_it:
        assert loaded["maxvio.png"] is False and any("maxvio.png" in c for c in seen["console"]), seen
    else:
        assert all(loaded.values()) and seen["console"] == [], seen


def test_the_screenshot_in_docs_is_a_whole_report_page():
    """docs/report.png, which the README shows as what `k3 report` writes, is a full-page shot
    (render()'s 1400 px window less the scrollbar), taller than one screen."""
    data = (REPO / "docs" / "report.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert 1300 <= width <= 1400 and height > 900, (width, height)
