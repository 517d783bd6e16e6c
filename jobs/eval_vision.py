"""Evaluate a multimodal checkpoint: which digit is in each held-out image and 4-frame clip.

    python jobs/eval_vision.py --checkpoint runs/my-run/checkpoint_... --data data/bundled

The model reads each held-out item of the bundled media set (jobs/prepare_data.py --vision;
digits never seen in training, rendered at 28/42/56 px, and their moving clips) followed by
" The digit is #" (" The moving digit is #" for clips); its answer is the digit whose token gets
the highest logit. Prints JSON: top-1 per kind (chance is 0.1), counts, seconds.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from k3.model import K3ForConditionalGeneration
from k3.platform.train.data import read_manifest
from k3.model.tokenizer import load_tokenizer
from k3.platform.train.vision_data import ExampleEncoder, classify_digits, read_vision_rows
import k3.model

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--checkpoint", required=True, help="a training checkpoint directory (jobs/pretrain.py)")
p.add_argument("--data", default="data/bundled", help="the prepared data directory with media/heldout.parquet")
p.add_argument("--limit", type=int, default=None, help="evaluate only the first N held-out rows")
p.add_argument("--batch", type=int, default=50, help="examples per forward pass")
p.add_argument("--threads", type=int, default=1, help="torch threads")
p.add_argument("--out", help="also write the JSON here")
args = p.parse_args()
torch.set_num_threads(args.threads)

t0 = time.perf_counter()
try:
    model = k3.model.load(args.checkpoint)
    rows = read_vision_rows(args.data, "heldout")[:args.limit]
    manifest = read_manifest(args.data)
except ValueError as e:
    sys.exit(f"eval_vision: {e}")
if not isinstance(model, K3ForConditionalGeneration):
    sys.exit(f"eval_vision: {args.checkpoint} is a text-only model (its config has no vision_config)")
ckpt_tok = Path(args.checkpoint) / "k3" / "tokenizer.json"
tok = load_tokenizer(ckpt_tok if ckpt_tok.exists() else Path(args.data) / manifest.tokenizer)
ids = manifest.special_ids
encoder = ExampleEncoder(lambda s: tok.encode(s).ids, tok.token_to_id, bos=ids["bos"], eos=ids["eos"])
result = classify_digits(model, encoder, rows, batch=args.batch)
result |= {"checkpoint": str(args.checkpoint), "seconds": round(time.perf_counter() - t0, 1)}
print(json.dumps(result, indent=2))
if args.out:
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
