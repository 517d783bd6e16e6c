"""Prepared token data (jobs/prepare_data.py, k3.platform.train.data.prepare): a rerun with the same
input is a no-op, a prepare killed midway leaves the previous version whole (and no half-written
manifest to trust), and the rerun after the kill redoes the work."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers import run_killed_midway, tree_bytes
from k3.model.tokenizer import load_tokenizer, tokenizer_hash
from k3.platform.train.data import prepare, read_manifest

SETTINGS = dict(vocab_size=300, rows_per_shard=16, progress=False)


def corpus(root: Path) -> Path:
    d = root / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    (d / "b.md").write_text("pack my box with five dozen liquor jugs. " * 150)
    return d


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
