"""Prepare training data: train a byte-level BPE tokenizer and write token shards as Parquet.

    python jobs/prepare_data.py [--input bundled|DIR|FILE.jsonl|FILE.parquet] [--out data/bundled]
                                [--vocab-size 4096] [--seq-len 256]

The default input is the bundled corpus (the Python standard library's own source). Rerunning
with the same input and settings does nothing. Prints the manifest as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from k3.platform.data import prepare

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--input", default="bundled", help="corpus: 'bundled', a directory, a .jsonl or a .parquet file")
p.add_argument("--out", default="data/bundled", help="output directory (shards, tokenizer, manifest)")
p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (k3-tiny uses 4096)")
p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
p.add_argument("--rows-per-shard", type=int, default=1024, help="sequences per Parquet shard")
p.add_argument("--max-bytes", type=int, default=None, help="use at most this many bytes of text")
p.add_argument("--quiet", action="store_true", help="no progress bars")
args = p.parse_args()
try:
    manifest, wrote = prepare(args.input, args.out, args.vocab_size, args.seq_len, args.rows_per_shard,
                              args.max_bytes, progress=not args.quiet)
except ValueError as e:
    sys.exit(f"prepare_data: {e}")
print(("wrote" if wrote else "up to date:") + f" {manifest.num_sequences} sequences, {manifest.num_tokens:,} tokens, "
      f"{len(manifest.shards)} shards in {args.out}", file=sys.stderr)
print(json.dumps(asdict(manifest), indent=2))
