"""Prepared token data (jobs/prepare_data.py, k3.platform.train.data.prepare): a rerun with the same
input is a no-op and a changed one (even at the same size and mtime) is not, a prepare killed midway
leaves the previous version whole (and no half-written manifest to trust), the rerun after the kill
redoes the work, and bad input (a Parquet `text` column of other types, a directory of mixed kinds,
an output inside the input) is refused in one line naming it; the tokens after the last whole row
are counted and said, a --seq-len the input cannot fill is refused before the tokenizer is trained,
and --max-bytes is a budget of bytes (cut there) that must be >= 1."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import run_killed_midway, tree_bytes
from k3.model.tokenizer import load_tokenizer, tokenizer_hash
from k3.platform.train.data import prepare, read_manifest

SETTINGS = dict(vocab_size=300, rows_per_shard=16, progress=False)
REPO = Path(__file__).resolve().parents[2]
TEXTS = ["the quick brown fox jumps over the lazy dog. " * 200, "pack my box with five dozen liquor jugs. " * 150]


def corpus(root: Path) -> Path:
    d = root / "corpus"
    d.mkdir()
    (d / "a.txt").write_text(TEXTS[0])
    (d / "b.md").write_text(TEXTS[1])
    return d


def parquet(path: Path, column: pa.Array) -> Path:
    pq.write_table(pa.table({"text": column}), path)
    return path


def records(path: Path) -> Path:
    path.write_text('{"text": "a record"}\n' * 100)
    return path


def ints_parquet(root: Path) -> tuple[Path, Path]:
    """(input, out) of a Parquet file whose `text` column holds integers."""
    return parquet(root / "ints.parquet", pa.array([1, 2, 3])), root / "data"


def mixed_dir(root: Path) -> tuple[Path, Path]:
    """(input, out) of a directory of text files and a JSONL file."""
    src = corpus(root)
    records(src / "meta.jsonl")
    return src, root / "data"


def out_inside(root: Path) -> tuple[Path, Path]:
    src = corpus(root)
    return src, src / "prepared"


def assert_usable(data: Path):
    """The manifest, its tokenizer and every shard it lists agree."""
    m = read_manifest(data)
    assert tokenizer_hash(load_tokenizer(data / m.tokenizer)) == m.tokenizer_hash
    rows = sum(pq.read_table(p).num_rows for p in m.shard_paths(data))
    assert rows == m.num_sequences and {p.name for p in data.glob("shard-*")} == set(m.shards)
    return m


def test_rerun_with_the_same_input_is_a_no_op(tmp_path):
    src = corpus(tmp_path)
    m, wrote = prepare(str(src), tmp_path / "data", seq_len=16, **SETTINGS)
    before = tree_bytes(tmp_path / "data")
    again, wrote_again = prepare(str(src), tmp_path / "data", seq_len=16, **SETTINGS)
    assert wrote and not wrote_again and again == m and tree_bytes(tmp_path / "data") == before


@pytest.mark.parametrize("previous", [True, False])
def test_a_prepare_killed_midway_leaves_the_previous_version_whole_and_a_rerun_redoes_it(tmp_path, previous):
    src, data = corpus(tmp_path), tmp_path / "data"
    if previous:
        # seq_len 16 makes more shards than the new version's 32: none of them may survive it
        old, _ = prepare(str(src), data, seq_len=16, **SETTINGS)
        (data / "media").mkdir()
        (data / "media" / "media.json").write_text("{}\n")  # another writer's part of the directory
        before = tree_bytes(data)
    # killed right after its second shard is written
    run_killed_midway(f"from k3.platform.train.data import prepare\n"
                      f"prepare({str(src)!r}, {str(data)!r}, seq_len=32, vocab_size=300, rows_per_shard=16, "
                      f"progress=False)", "pyarrow.parquet:write_table", after=2)
    if previous:
        assert tree_bytes(data) == before, "the killed prepare changed the previous version"
        assert assert_usable(data) == old
    else:
        assert not data.exists(), "a killed first prepare left a half-written directory"
    new, wrote = prepare(str(src), data, seq_len=32, **SETTINGS)
    assert wrote and new.seq_len == 32 and assert_usable(data) == new
    if previous:
        assert len(new.shards) < len(old.shards) and (data / "media" / "media.json").read_text() == "{}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "data"], "a killed writer's leftovers stayed"


def test_prepare_refuses_a_directory_that_holds_something_else(tmp_path):
    src, out = corpus(tmp_path), tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files"):
        prepare(str(src), out, seq_len=16, **SETTINGS)
    assert tree_bytes(out) == {"todo.txt": b"mine"}


@pytest.mark.parametrize("seq_len", [15, 64])
def test_doc_starts_mark_the_first_token_of_every_document(tmp_path, seq_len):
    src = tmp_path / "docs"
    src.mkdir()
    for i, n in enumerate([3, 40, 1, 17, 90]):  # documents shorter and longer than a row
        (src / f"d{i}.txt").write_text(f"document {i} says " + "words and more words " * n)
    m, _ = prepare(str(src), tmp_path / "data", seq_len=seq_len, doc_starts=True, **SETTINGS)
    tables = [pq.read_table(p) for p in m.shard_paths(tmp_path / "data")]  # the rows, in stream order
    stream = [t for table in tables for row in table.column("tokens").to_pylist() for t in row]
    flags = [f for table in tables for row in table.column("doc_start").to_pylist() for f in row]
    eos = m.special_ids["eos"]
    want = [int(p == 0 or stream[p - 1] == eos) for p in range(len(stream))]
    assert flags == want and 2 <= sum(flags) <= 5
    # asked-for only: data prepared without it has no such column and stays up to date
    plain, _ = prepare(str(src), tmp_path / "plain", seq_len=seq_len, **SETTINGS)
    assert pq.read_table(plain.shard_paths(tmp_path / "plain")[0]).column_names == ["tokens"]


def test_a_shard_holds_at_most_shard_tokens_whatever_rows_per_shard_asks(tmp_path, monkeypatch):
    """At a long --seq-len a shard of --rows-per-shard rows was built whole as Python lists (~56
    bytes a token: ~60 GB at 1024 rows of 1M tokens); shards now hold at most SHARD_TOKENS tokens
    (here 100: three rows of 33 tokens), the rows and their flags as before."""
    from k3.platform.train import data

    monkeypatch.setattr(data, "SHARD_TOKENS", 100, raising=False)  # without the cap the sizes below fail
    src = tmp_path / "docs"
    src.mkdir()
    for i, n in enumerate([3, 40, 1, 17, 90]):
        (src / f"d{i}.txt").write_text(f"document {i} says " + "words and more words " * n)
    m, _ = prepare(str(src), tmp_path / "data", seq_len=32, doc_starts=True, **SETTINGS)  # rows_per_shard=16
    tables = [pq.read_table(p) for p in m.shard_paths(tmp_path / "data")]
    assert [t.num_rows for t in tables[:-1]] == [3] * (len(tables) - 1) and 1 <= tables[-1].num_rows <= 3
    assert tables[0].schema.field("tokens").type == pa.list_(pa.int32())
    assert tables[0].schema.field("doc_start").type == pa.list_(pa.int8())
    stream = [t for table in tables for row in table.column("tokens").to_pylist() for t in row]
    flags = [f for table in tables for row in table.column("doc_start").to_pylist() for f in row]
    tok = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    texts = [f.read_text() for f in sorted(src.iterdir())]
    want = [t for text in texts for t in [*tok.encode(text).ids, m.special_ids["eos"]]]
    assert stream == want[:len(stream)] and len(stream) == m.num_tokens == len(want) - m.dropped_tokens
    eos = m.special_ids["eos"]
    assert flags == [int(p == 0 or stream[p - 1] == eos) for p in range(len(stream))]


@pytest.mark.parametrize("column, type_name", [(pa.array([1, 2, 3]), "int64"), (pa.array([b"bytes"]), "binary"),
                                               (pa.array([["a", "b"]]), "list<")])
def test_a_parquet_text_column_of_another_type_is_refused_naming_the_file_and_the_type(tmp_path, column, type_name):
    src = parquet(tmp_path / "rows.parquet", column)
    with pytest.raises(ValueError, match=re.escape(f"rows.parquet: column 'text' holds {type_name}")):
        prepare(str(src), tmp_path / "data", seq_len=16, **SETTINGS)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("column", [pa.array([TEXTS[0], None, TEXTS[1], None]),
                                    pa.array([None, TEXTS[0], TEXTS[1]], type=pa.large_string()),
                                    pa.array([TEXTS[0], TEXTS[1], None]).dictionary_encode()],
                         ids=["string", "large_string", "dictionary"])
def test_a_parquet_text_column_is_read_without_its_null_rows(tmp_path, column):
    plain, _ = prepare(str(parquet(tmp_path / "plain.parquet", pa.array(TEXTS))), tmp_path / "plain", seq_len=16,
                       **SETTINGS)
    m, _ = prepare(str(parquet(tmp_path / "nulls.parquet", column)), tmp_path / "data", seq_len=16, **SETTINGS)
    assert (m.num_tokens, m.tokenizer_hash) == (plain.num_tokens, plain.tokenizer_hash)


@pytest.mark.parametrize("name, kind, write", [("meta.jsonl", "jsonl", records),
                                               ("rows.parquet", "parquet", lambda p: parquet(p, pa.array(TEXTS)))])
def test_a_directory_of_mixed_kinds_is_refused_naming_them(tmp_path, name, kind, write):
    src = corpus(tmp_path)
    write(src / name)
    found = f"1 {kind} (e.g. {name}), 2 text (e.g. a.txt)"
    with pytest.raises(ValueError, match=re.escape(f"mixes kinds of files: {found}")):
        prepare(str(src), tmp_path / "data", seq_len=16, **SETTINGS)
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("out", ["prepared", "nested/prepared", "."])
def test_an_output_directory_inside_the_input_is_refused_naming_both(tmp_path, out):
    src = corpus(tmp_path)
    before = tree_bytes(tmp_path)
    with pytest.raises(ValueError, match="is inside input directory") as e:
        prepare(str(src), src / out, seq_len=16, **SETTINGS)
    assert str(src / out) in str(e.value) and repr(str(src)) in str(e.value)
    assert tree_bytes(tmp_path) == before


def test_a_file_rewritten_at_the_same_size_and_mtime_is_prepared_again(tmp_path):
    src = corpus(tmp_path)
    old, _ = prepare(str(src), tmp_path / "data", seq_len=16, **SETTINGS)
    a = src / "a.txt"
    st = a.stat()
    a.write_text(a.read_text().replace("fox", "cat"))
    os.utime(a, ns=(st.st_atime_ns, st.st_mtime_ns))  # as cp -p and tar restore it
    assert (a.stat().st_size, a.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    new, wrote = prepare(str(src), tmp_path / "data", seq_len=16, **SETTINGS)
    assert wrote and new.input_fingerprint != old.input_fingerprint and assert_usable(tmp_path / "data") == new


@pytest.mark.parametrize("bad_input", [ints_parquet, mixed_dir, out_inside])
def test_prepare_data_refuses_bad_input_in_one_line(tmp_path, bad_input):
    src, out = bad_input(tmp_path)
    run = subprocess.run([sys.executable, str(REPO / "jobs" / "prepare_data.py"), "--input", str(src),
                          "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.startswith("prepare_data: ") and run.stderr.count("\n") == 1 \
        and str(src) in run.stderr and not run.stdout, run.stderr[-2000:]


def prepare_data(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "jobs" / "prepare_data.py"), "--quiet", *args],
                          capture_output=True, text=True, timeout=120)


def test_the_tokens_after_the_last_whole_row_are_counted_and_said(tmp_path):
    src = corpus(tmp_path)
    run = prepare_data("--input", str(src), "--out", str(tmp_path / "data"), "--vocab-size", "300", "--seq-len", "500")
    assert run.returncode == 0, run.stderr
    m = assert_usable(tmp_path / "data")
    tok = load_tokenizer(tmp_path / "data" / "tokenizer.json")
    stream = sum(len(tok.encode(t).ids) + 1 for t in TEXTS)  # each document ends with <eos>
    assert m.num_tokens == m.num_sequences * 501 and 0 < m.dropped_tokens == stream - m.num_tokens < 501
    assert f"the last {m.dropped_tokens:,} tokens, less than one row of 501, are left out" in run.stderr, run.stderr


def test_a_seq_len_the_input_cannot_fill_is_refused_before_the_tokenizer_is_trained(tmp_path, monkeypatch):
    from k3.platform.train import data

    monkeypatch.setattr(data, "train_bpe", lambda *a, **k: pytest.fail("the tokenizer was trained"))
    n_bytes = sum(len(t.encode()) for t in TEXTS)
    with pytest.raises(ValueError, match=rf"seq_len \(--seq-len\) 20000 needs rows of 20,001 tokens, but the input's "
                                         rf"{n_bytes:,} bytes of text in 2 documents give at most {n_bytes + 2:,} .*"
                                         rf"pass --seq-len <= {n_bytes + 1}$"):
        prepare(str(corpus(tmp_path)), tmp_path / "data", seq_len=20_000, **SETTINGS)
    run = prepare_data("--input", str(tmp_path / "corpus"), "--out", str(tmp_path / "data"), "--seq-len", "20000")
    assert run.returncode == 1 and run.stderr.startswith("prepare_data: seq_len (--seq-len) 20000 needs rows") \
        and run.stderr.count("\n") == 1, run.stderr


@pytest.mark.parametrize("max_bytes", [0, -5])
def test_max_bytes_below_one_is_refused_naming_the_flag(tmp_path, max_bytes):
    with pytest.raises(ValueError, match=rf"max_bytes \(--max-bytes\) must be >= 1 .*got {max_bytes}"):
        prepare(str(corpus(tmp_path)), tmp_path / "data", max_bytes=max_bytes, **SETTINGS)
    run = prepare_data("--input", str(tmp_path / "corpus"), "--out", str(tmp_path / "data"), "--max-bytes",
                       str(max_bytes))
    assert run.returncode == 1 and run.stderr.startswith("prepare_data: max_bytes (--max-bytes) must be >= 1"), \
        run.stderr


@pytest.mark.parametrize("max_bytes, documents", [(1, 1), (9_000, 1), (9_001, 2)])
def test_max_bytes_keeps_whole_documents_until_the_budget(tmp_path, max_bytes, documents):
    """Documents are kept whole, the one that reaches the budget too, and nothing after it is read
    (the data every test and the README prepare with --max-bytes stays what it was); the input's
    bytes are counted in the refusal of a --seq-len it cannot fill."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("a" * 9_000)
    (src / "b.txt").write_text("b" * 500)
    kept = 9_000 + 500 * (documents - 1)
    with pytest.raises(ValueError, match=f"the input's {kept:,} bytes of text in {documents:,} documents give at most "
                                         f"{kept + documents:,} "):
        prepare(str(src), tmp_path / "data", seq_len=100_000, max_bytes=max_bytes, **SETTINGS)
