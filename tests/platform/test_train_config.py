"""TrainConfig and jobs/pretrain.py refuse what cannot run, naming the field or file, before Ray
is imported (the checks that need prepared data are in test_pretrain.py)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3.platform.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def pretrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/pretrain.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("change,field", [
    (dict(lr=float("inf")), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(grad_clip=float("inf")), "grad_clip"),
    (dict(weight_decay=float("inf")), "weight_decay"),
    (dict(balance={"loss_free_step": float("inf")}), "loss_free_step"),
    (dict(model_overrides={"foo": 1}), "model_overrides"),
    (dict(name=""), r"name \(--name\)"),
    (dict(name="../../x"), r"name \(--name\)"),
    (dict(name="/tmp/x"), r"name \(--name\)"),
    (dict(name="a/b"), r"name \(--name\)"),
    (dict(name=".."), r"name \(--name\)"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**70), "seed"),
    # a --config file's strings and booleans are not numbers (pydantic's lax mode read true as 1)
    (dict(context_parallel=True), "context_parallel"),
    (dict(steps="2"), "steps"),
    (dict(lr="1e-3"), "lr"),
    (dict(zero_stage="2"), "zero_stage"),
    (dict(resume="yes"), "resume"),
    (dict(balance={"bins": "4"}), "bins"),
])
def test_train_config_refuses_and_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**change)


def test_a_plain_run_name_is_kept():
    assert TrainConfig(name="run-1.b").name == "run-1.b"


@pytest.mark.parametrize("content,match", [
    (None, "cannot read it as JSON"),
    ("{", "cannot read it as JSON"),
    ("[1, 2]", "must be a JSON object of TrainConfig fields, got list"),
    ('{"model_overrides": {"foo": 1}}', r"model_overrides: \['foo'\] are not K3Config fields"),
    ('{"lr": 1e999}', "lr"),
])
def test_pretrain_config_file_errors_name_the_file(tmp_path, content, match):
    path = tmp_path / "train.json"
    if content is not None:
        path.write_text(content)
    out = pretrain("--config", str(path))
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert str(path) in out.stderr and out.stderr.startswith("pretrain: ")
    assert re.search(match, out.stderr), out.stderr


@pytest.mark.parametrize("args, config, lines", [
    (["--context-parallel", "0"], None, ["pretrain: --context-parallel must be >= 1, got 0"]),
    (["--context-parallel", "0", "--lr", "-1", "--name", "a/b"], None,
     ["pretrain: --context-parallel must be >= 1, got 0", "pretrain: --lr must be > 0.0, got -1.0",
      "pretrain: name (--name) must be one plain directory name under storage_path, got 'a/b'"]),
    # a field the --config file set is named as its field, after the file
    (["--steps", "3"], '{"steps": 0, "micro_batch": 0, "lr": 1e999, "foo": 1}',
     ["pretrain: --config {config}: micro_batch must be >= 1, got 0",
      "pretrain: --config {config}: lr must be a finite number, got inf",
      "pretrain: --config {config}: foo is not a TrainConfig field, got 1"]),
])
def test_pretrain_names_each_bad_flag_in_one_line(tmp_path, args, config, lines):
    if config is not None:
        (tmp_path / "train.json").write_text(config)
        args = [*args, "--config", str(tmp_path / "train.json")]
    out = pretrain(*args)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    want = [line.format(config=tmp_path / "train.json") for line in lines]
    assert sorted(out.stderr.strip().splitlines()) == sorted(want), out.stderr


@pytest.mark.parametrize("name", ["", "../../x", "/tmp/x"])
def test_pretrain_refuses_a_name_that_is_not_one_directory(name):
    out = pretrain("--name", name)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert "name (--name) must be one plain directory name" in out.stderr


@pytest.mark.parametrize("args,match", [
    (["--sample", "-5"], "--sample must be >= 0"),
    (["--sample", "2000000"], "--sample 2000000 is more tokens than the model's 1048576 positions hold"),
    (["--summary-json", "README.md/s.json"], "cannot be written: README.md is not a folder"),
    (["--summary-json", "."], "is a directory"),
])
def test_pretrain_checks_what_runs_after_training_before_it(args, match):
    out = pretrain(*args)
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert match in out.stderr and out.stderr.startswith("pretrain: "), out.stderr


def test_a_json_list_is_still_a_balance_range():
    cfg = TrainConfig(balance={"method": "quantile_hist", "range_policy": "fixed", "fixed_range": [-2, 2]})
    assert cfg.balance.fixed_range == (-2.0, 2.0) and TrainConfig(**cfg.model_dump()) == cfg


# -- the model's positions: what a worker's forward receives --------------------------------------
@pytest.fixture(scope="module")
def rows_of_64(tmp_path_factory):
    """Data of 64-token sequences (rows of 65 tokens), without and with document starts."""
    from k3.platform.train.data import prepare

    root = tmp_path_factory.mktemp("positions")
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i}: the quick brown fox jumps over the lazy dog"}}\n'
                              for i in range(400)))
    for name, doc_starts in (("plain", False), ("docs", True)):
        prepare(str(corpus), root / name, vocab_size=300, seq_len=64, progress=False, doc_starts=doc_starts)
    return root


@pytest.mark.parametrize("data, positions, change", [
    # rows are seq_len + 1 tokens: a model of 64 positions cannot take data of --seq-len 64
    ("plain", 64, dict()),
    ("docs", 64, dict(micro_batch=1)),
    ("plain", 64, dict(micro_batch=2, context_parallel=2)),
])
def test_a_forward_longer_than_the_model_positions_is_refused_up_front(rows_of_64, data, positions, change):
    cfg = TrainConfig(**{"data": str(rows_of_64 / data), "num_workers": 2, "micro_batch": 8, "balance": {"method": "none"},
                         "model_overrides": {"max_position_embeddings": positions}, **change})
    with pytest.raises(ValueError, match=r"the data's seq_len 64 \(--seq-len\) gives rows of 65 tokens .* "
                                         r"max_position_embeddings 64: prepare the data with --seq-len <= 63"):
        cfg.check()


@pytest.mark.parametrize("data, positions, change", [
    ("plain", 65, dict()),  # [8, 65] rows: each row is one sequence of 65 positions
    # rows laid end to end as one stream each start a document: the stream of 8 x 65 tokens fits 65
    # positions (it was refused, the stream measured whole)
    ("docs", 65, dict()),
    ("plain", 65, dict(micro_batch=4, context_parallel=2)),
])
def test_a_forward_that_fits_the_positions_passes(rows_of_64, data, positions, change):
    TrainConfig(**{"data": str(rows_of_64 / data), "num_workers": 2, "micro_batch": 8, "balance": {"method": "none"},
                   "model_overrides": {"max_position_embeddings": positions}, **change}).check()


def test_pretrain_counts_the_sample_prompt_before_training(rows_of_64, tmp_path):
    """--sample 64 on a model of 65 positions: the prompt ("def ", 2+ tokens in this tokenizer) and
    the sample do not fit; generate refused it after training, with a traceback and no summary."""
    from k3.model.tokenizer import load_tokenizer

    prompt = len(load_tokenizer(rows_of_64 / "plain" / "tokenizer.json").encode("def ").ids)
    assert prompt >= 2
    config = tmp_path / "train.json"
    config.write_text('{"model_overrides": {"max_position_embeddings": 65}}')
    out = pretrain("--config", str(config), "--data", str(rows_of_64 / "plain"), "--sample", "64",
                   "--micro-batch", "1", "--num-workers", "1")
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("pretrain: ") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert f"--sample 64 + the sample prompt's {prompt} tokens ('def ') = {64 + prompt} is more than the model's 65 " \
           f"positions hold: --sample <= {65 - prompt}" in out.stderr, out.stderr
