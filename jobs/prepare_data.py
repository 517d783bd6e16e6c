"""Prepare training data: train a byte-level BPE tokenizer and write token shards as Parquet.

    python jobs/prepare_data.py [--input bundled|DIR|FILE.jsonl|FILE.parquet] [--out data/bundled]
                                [--vocab-size 4096] [--seq-len 256] [--doc-starts] [--vision]

The default input is the bundled corpus (the Python standard library's own source). --vision
also writes the bundled image-text and video-text set (scikit-learn digits at several sizes,
4-frame moving-digit clips, scikit-image photos; Parquet with PNG bytes) under <out>/media/,
which a multimodal preset (k3-tiny-vl) trains on mixed with the text. Rerunning with the same
input and settings does nothing. Prints the manifest as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from k3.platform.train.data import prepare

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--input", default="bundled", help="corpus: 'bundled', a directory, a .jsonl or a .parquet file")
p.add_argument("--out", default="data/bundled", help="output directory (shards, tokenizer, manifest)")
p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (k3-tiny uses 4096)")
p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
p.add_argument("--rows-per-shard", type=int, default=1024, help="sequences per Parquet shard, at most 16,777,216 "
               "tokens' worth (a long --seq-len makes more, smaller shards: 15 rows a shard at --seq-len 1048576)")
p.add_argument("--max-bytes", type=int, default=None, help="use the input's documents until they hold this many bytes "
               "of text (UTF-8; documents are kept whole, the one that reaches it too; the rest is not read); "
               "default: all of it")
p.add_argument("--doc-starts", action="store_true", help="also mark where each document starts in a row (column "
               "doc_start): training then resets the KDA state and masks MLA there; for long --seq-len (32768, 65536), "
               "where a row holds many documents")
p.add_argument("--quiet", action="store_true", help="no progress bars")
p.add_argument("--vision", action="store_true", help="also write the bundled image/video-text set (<out>/media)")
p.add_argument("--heldout-digits", type=int, default=300, help="digits kept out of training for eval_vision")
p.add_argument("--train-clips", type=int, default=2, help="moving-digit clips per training digit (one per held-out digit)")
args = p.parse_args()
try:
    manifest, wrote = prepare(args.input, args.out, args.vocab_size, args.seq_len, args.rows_per_shard,
                              args.max_bytes, progress=not args.quiet, doc_starts=args.doc_starts)
except ValueError as e:
    sys.exit(f"prepare_data: {e}")
# the tokens after the last whole row are in no row: say how many (a long --seq-len can leave out most of a small input)
left_out = "" if manifest.dropped_tokens is None else \
    f"; the last {manifest.dropped_tokens:,} tokens, less than one row of {manifest.seq_len + 1:,}, are left out"
print(("wrote" if wrote else "up to date:") + f" {manifest.num_sequences} sequences, {manifest.num_tokens:,} tokens, "
      f"{len(manifest.shards)} shards in {args.out}{left_out}", file=sys.stderr)
out = asdict(manifest)
if args.vision:
    from k3.platform.train.vision_data import write_vision_set

    try:
        out["media"] = write_vision_set(args.out, heldout=args.heldout_digits, train_clips=args.train_clips)
    except ValueError as e:
        sys.exit(f"prepare_data: {e}")
    print(f"media set: {out['media']['counts']}", file=sys.stderr)
print(json.dumps(out, indent=2))
