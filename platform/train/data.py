"""Token data: a corpus in, fixed-length token shards (Parquet) and a manifest out.

Input: a directory of text files (*.txt, *.py, *.md, ...), a JSONL file or directory of them
(field `text`), a Parquet file or directory (column `text` of strings; null rows are skipped),
or "bundled" (the Python standard library's source). A directory holds one of these kinds (one
that mixes them is refused) and not the output directory. Output directory:

    tokenizer.json
    shard-00000.parquet ...    column `tokens`: list<int32> of seq_len + 1 tokens per row; with
                               doc_starts, also `doc_start`: list<int8>, 1 where a document begins;
                               rows_per_shard rows a shard, at most SHARD_TOKENS tokens' worth
    manifest.json              tokenizer hash, input fingerprint, counts, shard list; dropped_tokens:
                               the stream's tokens after its last whole row, left out

Rows hold seq_len + 1 tokens so a row is one training example (inputs and shifted labels).
Documents follow each other in the rows, each ended by <eos>; `doc_start` (asked for with
doc_starts, for long rows that hold many documents) lets training keep them apart: the KDA
state resets and MLA masks at each start (k3.platform.train.context_parallel.stream_cu_seqlens).
A rerun with the same input (its paths and contents, input_fingerprint) and settings finds
the manifest and does nothing. The directory is read from a path or a URI
(k3.platform.train.storage); `prepare` writes a local directory.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import blake3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from k3.model.tokenizer import SPECIAL_TOKENS, special_ids, tokenizer_hash, train_bpe
from k3.model.directory import write_beside

from . import storage
from .corpus import stdlib_corpus

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".c", ".h", ".json", ".html", ".js", ".ts", ".go", ".rs", ".java"}
MANIFEST = "manifest.json"
MEDIA_DIR = "media"  # k3.platform.train.vision_data writes the media set there
# A shard holds at most this many tokens (64 MiB as int32), whatever --rows-per-shard asks
# (shard_rows): at --seq-len 1,048,576 that is 15 rows a shard, at 256 the 1024 rows asked.
SHARD_TOKENS = 1 << 24


@dataclass
class Manifest:
    version: int
    input: str
    input_fingerprint: str
    settings: dict
    tokenizer: str
    tokenizer_hash: str
    vocab_size: int
    special_ids: dict
    seq_len: int
    num_sequences: int
    num_tokens: int
    shards: list[str]
    # the stream's tokens after its last whole row (fewer than seq_len + 1), in no row; None in a
    # manifest written before it was kept
    dropped_tokens: int | None = None

    def shard_paths(self, root: str | Path) -> list[str]:
        """Each shard's path (or URI, under a URI root)."""
        return [storage.join(str(root), s) for s in self.shards]

    def rows_hash(self) -> str:
        """A hash of what decides the rows (the input's fingerprint, the settings, the tokenizer,
        the counts and the shards), not of where the directory is: a copy moved to a shared mount
        or a bucket keeps it, a re-prepare from other input or settings does not (nor does a
        manifest written before `dropped_tokens` was kept: the rows are the same). A checkpoint
        keeps it, and `--resume` compares it (k3.platform.train.launch.check_resume)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("input", "dropped_tokens")}
        return blake3.blake3(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def _files(root: Path, suffixes: set[str]) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in suffixes)


def resolve_input(source: str) -> tuple[str, list[Path]]:
    """(kind, files) for a corpus path; ValueError naming the problem otherwise. A directory holds
    one kind of file: one that mixes them is refused, naming the kinds, rather than one kind read
    and the others dropped without a word."""
    if source == "bundled":
        return "bundled", stdlib_corpus().files
    p = Path(source)
    if not p.exists():
        raise ValueError(f"input {source!r} does not exist")
    if p.is_file():
        kind = {".jsonl": "jsonl", ".parquet": "parquet"}.get(p.suffix, "text")
        return kind, [p]
    found = {kind: files for kind, suf in (("jsonl", {".jsonl"}), ("parquet", {".parquet"}), ("text", TEXT_SUFFIXES))
             if (files := _files(p, suf))}
    if not found:
        raise ValueError(f"input directory {source!r} holds no text, .jsonl or .parquet files")
    if len(found) > 1:
        kinds = ", ".join(f"{len(fs)} {kind} (e.g. {fs[0].relative_to(p)})" for kind, fs in found.items())
        raise ValueError(f"input directory {source!r} mixes kinds of files: {kinds}; pass a directory (or file) "
                         f"of one kind")
    [(kind, files)] = found.items()
    return kind, files


def _check_out(source: str, out: Path) -> None:
    """Refuse an output directory inside the input directory: a rerun would read its shards (and
    a killed writer's stage beside it) as input."""
    if source == "bundled" or not Path(source).is_dir():
        return
    src, dest = Path(source).resolve(), out.resolve()
    if dest == src or src in dest.parents:
        raise ValueError(f"output directory {str(out)!r} is inside input directory {source!r}: a rerun would "
                         f"read its shards as input; pass an output directory outside the input")


def iter_texts(kind: str, files: list[Path]) -> Iterator[str]:
    for f in files:
        if kind in ("text", "bundled"):
            yield f.read_text(encoding="utf-8", errors="replace")
        elif kind == "jsonl":
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{f}:{n}: not valid JSON ({e.msg})") from None
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        raise ValueError(f"{f}:{n}: each JSONL line needs a string field 'text'")
                    yield row["text"]
        else:
            try:
                table = pq.read_table(f, columns=["text"])
            except Exception as e:  # pyarrow raises several types for corrupt files
                raise ValueError(f"{f}: cannot read a 'text' column from Parquet ({e})") from None
            column = table.column("text")
            if not _is_strings(column.type):
                raise ValueError(f"{f}: column 'text' holds {column.type}, not strings")
            yield from (t for t in column.to_pylist() if t)  # null (and empty) rows are skipped


def _is_strings(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):  # a categorical column written by pandas
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def fingerprint(kind: str, files: list[Path]) -> str:
    """A hash of the input's paths and contents. Not of its mtimes: a file rewritten within the same
    second at the same size, or restored with its old mtime (cp -p, tar), still changes it. It costs
    a read of the input: the bundled corpus's 470 files, 8 MB, in ~22 ms (page cache warm, 2 cores),
    beside the ~0.9 s a rerun takes to find them."""
    h = blake3.blake3()
    h.update(kind.encode())
    for f in files:
        h.update(f"\0{f}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def read_manifest(data: str | Path) -> Manifest:
    """The manifest of a prepared-data directory (a path or a URI, k3.platform.train.storage);
    ValueError when it is missing or lists missing shards."""
    data = str(data)
    if not storage.exists(storage.join(data, MANIFEST)):
        raise ValueError(f"no {MANIFEST} in {data}: run jobs/prepare_data.py first")
    m = Manifest(**json.loads(storage.read_bytes(storage.join(data, MANIFEST))))
    missing = storage.missing(m.shard_paths(data))
    if missing:
        raise ValueError(f"{data}: manifest lists missing shards, e.g. {missing[0]}")
    return m


def read_tokenizer(data: str | Path, manifest: Manifest) -> str:
    """The tokenizer (its JSON) the data was made with."""
    return storage.read_bytes(storage.join(str(data), manifest.tokenizer)).decode()


def _is_shard(rel: str) -> bool:
    return rel.startswith("shard-")  # with a killed old-style writer's shard-*.parquet.tmp


def _owned(rel: str) -> bool:
    """What `prepare` writes in its output directory (another writer's files, e.g. media/, stay)."""
    return rel in (MANIFEST, "tokenizer.json") or _is_shard(rel)


def _up_to_date(out: Path, fp: str, settings: dict) -> Manifest | None:
    """The manifest of `out` when it was made from the same input and settings; ValueError when
    `out` holds files that are not prepared data (they would be mixed with it)."""
    if (out / MANIFEST).exists():
        try:
            old = read_manifest(out)
            if old.input_fingerprint == fp and old.settings == settings:
                return old
        except (ValueError, TypeError):
            pass  # a broken or older manifest: rebuild
        return None
    foreign = sorted(p.name for p in out.iterdir() if p.name != MEDIA_DIR and not _owned(p.name)) \
        if out.is_dir() else []
    if foreign:
        raise ValueError(f"{out} holds other files and no {MANIFEST} ({', '.join(foreign[:3])}): pass a new or "
                         f"empty directory for prepared data")
    return None


def _read_texts(source: str, kind: str, files: list[Path], max_bytes: int | None) -> tuple[list[str], int]:
    """(the input's documents, their UTF-8 bytes). With max_bytes, its documents in order until
    they hold max_bytes bytes: documents are kept whole (the one that reaches the budget too), and
    the input after it is not read."""
    texts, total = [], 0
    for t in iter_texts(kind, files):
        if max_bytes is not None and total >= max_bytes:
            break
        texts.append(t)
        total += len(t.encode())
    if not any(t.strip() for t in texts):
        raise ValueError(f"input {source!r} has no text")
    return texts, total


def _token_stream(tok, texts: list[str], eos: int, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens end to end, each ended by eos ([n] int32); and the offsets where each
    begins ([documents] int64). In numpy, 4 bytes a token: as a Python list of ints the stream took
    ~36, which at a long --seq-len's corpus is what bounds the machine."""
    chunks: list[np.ndarray] = []
    lengths: list[int] = []
    end = np.array([eos], dtype=np.int32)
    for i in tqdm(range(0, len(texts), 256), desc="tokenize", unit="batch", disable=not progress):
        for enc in tok.encode_batch(texts[i:i + 256]):
            chunks += [np.asarray(enc.ids, dtype=np.int32), end]
            lengths.append(len(enc.ids) + 1)
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) if lengths else np.zeros(0, np.int64)
    return stream, starts


def _doc_start_flags(starts: np.ndarray, first: int, n: int) -> np.ndarray:
    """Tokens [first, first + n) of the stream as 0/1 flags ([n] int8): 1 where a document begins."""
    flags = np.zeros(n, dtype=np.int8)
    lo, hi = np.searchsorted(starts, [first, first + n])
    flags[starts[lo:hi] - first] = 1
    return flags


def shard_rows(row: int, rows_per_shard: int) -> int:
    """Rows a shard holds: rows_per_shard, but at most SHARD_TOKENS tokens' worth (and at least one
    row), so a long --seq-len makes more, smaller shards rather than one of rows_per_shard x seq_len
    tokens (1024 rows of 1M tokens: 4 GiB as int32, each built whole before it is written)."""
    return max(1, min(rows_per_shard, SHARD_TOKENS // row))


def _write_shards(stream: np.ndarray, starts: np.ndarray | None, row: int, rows_per_shard: int, out: Path,
                  progress: bool) -> list[str]:
    """Rows of `row` tokens, `shard_rows(row, rows_per_shard)` per Parquet file (with their doc_start
    flags when `starts` is given); returns the file names. Each column is built from a slice of
    the stream and one offsets array, not a Python list per row."""
    n_rows = len(stream) // row
    if n_rows == 0:
        raise ValueError(f"the input's {len(stream):,} tokens are fewer than one row of seq_len + 1 = {row:,} "
                         f"(--seq-len {row - 1}): pass --seq-len <= {len(stream) - 1}")
    per_shard = shard_rows(row, rows_per_shard)
    shards = []
    for s, start in enumerate(tqdm(range(0, n_rows, per_shard), desc="shards", disable=not progress)):
        n = min(per_shard, n_rows - start)
        offsets = pa.array(np.arange(n + 1, dtype=np.int32) * row)
        columns = {"tokens": pa.ListArray.from_arrays(offsets, pa.array(stream[start * row:(start + n) * row]))}
        if starts is not None:
            columns["doc_start"] = pa.ListArray.from_arrays(offsets, pa.array(_doc_start_flags(starts, start * row,
                                                                                               n * row)))
        shards.append(f"shard-{s:05d}.parquet")
        pq.write_table(pa.table(columns), out / shards[-1])
    return shards


def prepare(source: str, out_dir: str | Path, vocab_size: int = 4096, seq_len: int = 256,
            rows_per_shard: int = 1024, max_bytes: int | None = None, progress: bool = True,
            doc_starts: bool = False) -> tuple[Manifest, bool]:
    """Tokenize a corpus into shards. Returns (manifest, whether anything was written). The new
    version is written beside `out_dir` and swapped in whole (k3.model.directory): a
    prepare killed midway leaves the previous version as it was, and its rerun starts over.
    doc_starts: also write each row's `doc_start` column (see the module docstring)."""
    if seq_len < 2:
        raise ValueError(f"seq_len (--seq-len) must be >= 2, got {seq_len}")
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard (--rows-per-shard) must be >= 1, got {rows_per_shard}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes (--max-bytes) must be >= 1 (bytes of text to use; leave it out for all), got "
                         f"{max_bytes}")
    out = Path(out_dir)
    _check_out(source, out)
    kind, files = resolve_input(source)
    fp = fingerprint(kind, files)
    # The special tokens are a setting: data made before a new one (the media tokens) is rebuilt.
    settings = {"vocab_size": vocab_size, "seq_len": seq_len, "rows_per_shard": rows_per_shard, "max_bytes": max_bytes,
                "special_tokens": SPECIAL_TOKENS}
    if doc_starts:  # only when asked: data prepared before the option stays up to date
        settings["doc_starts"] = True
    current = _up_to_date(out, fp, settings)
    if current is not None:
        return current, False
    texts, n_bytes = _read_texts(source, kind, files, max_bytes)
    # Before the tokenizer's training (minutes on a large input): a token holds at least one byte of
    # text, and each document adds its <eos>, so the input gives at most n_bytes + documents tokens.
    most = n_bytes + len(texts)
    if seq_len + 1 > most:
        raise ValueError(f"seq_len (--seq-len) {seq_len} needs rows of {seq_len + 1:,} tokens, but the input's "
                         f"{n_bytes:,} bytes of text in {len(texts):,} documents give at most {most:,} (a token holds "
                         f"at least one byte, and each document adds <eos>): pass --seq-len <= {most - 1}"
                         f"{' or a larger --max-bytes' if max_bytes is not None else ''}")
    tok = train_bpe(texts, vocab_size=vocab_size)
    ids = special_ids(tok)
    stream, starts = _token_stream(tok, texts, ids["eos"], progress)
    del texts  # the stream holds what the shards need
    with write_beside(out, stale=_is_shard) as stage:  # the old version's shards never outlive it
        shards = _write_shards(stream, starts if doc_starts else None, seq_len + 1, rows_per_shard, stage,
                               progress)
        tok.save(str(stage / "tokenizer.json"))
        n_rows = len(stream) // (seq_len + 1)
        m = Manifest(version=1, input=source, input_fingerprint=fp, settings=settings, tokenizer="tokenizer.json",
                     tokenizer_hash=tokenizer_hash(tok), vocab_size=tok.get_vocab_size(), special_ids=ids,
                     seq_len=seq_len, num_sequences=n_rows, num_tokens=n_rows * (seq_len + 1), shards=shards,
                     dropped_tokens=len(stream) - n_rows * (seq_len + 1))
        (stage / MANIFEST).write_text(json.dumps(asdict(m), indent=2) + "\n")
    return m, True
