"""Pretrain a K3-family model on Ray: DeepSpeed expert-parallel workers, Quantile Balancing.

    # against a running cluster (inside a job the working directory is Ray's: absolute paths or URIs)
    ray job submit --working-dir . -- python jobs/pretrain.py --data "$PWD/data/bundled" \
        --storage-path "$PWD/runs" --steps 300
    # or locally (starts a Ray instance on 127.0.0.1)
    python jobs/pretrain.py --data data/bundled --num-workers 2 --ep-size 2

Top to bottom: parse and validate the config (before any worker starts), connect to Ray,
create the named BalanceCoordinator actor, split the token shards with Ray Data, run a
TorchTrainer whose workers host the model shards, print a summary (losses, MaxVio per layer)
and a sample from the final checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import ValidationError
from tokenizers import Tokenizer

from k3.model.config import PRESETS
from k3.platform.balance import METHODS
from k3.platform.ops.local_ray import init_local_ray
from k3.platform.train.config import TrainConfig
from k3.platform.train.data import read_manifest, read_tokenizer

SAMPLE_PROMPT = "def "  # what the sample after training continues
# pydantic's checks as a flag's help would say them (the rest: its message, "Input should" -> "must")
BOUNDS = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le"),
          "less_than": ("<", "lt")}


def field_errors(e: ValidationError, flags: set[str], config: str | None) -> str:
    """One line per bad field: `pretrain: --context-parallel must be >= 1, got 0` for a field a
    flag set, `pretrain: --config FILE: steps must be ...` for one the --config file set (pydantic's
    own text is several lines a field, naming the field and not the flag)."""
    lines = []
    for err in e.errors():
        field = ".".join(map(str, err["loc"]))
        where = f"--{field.replace('_', '-')}" if err["loc"][0] in flags else f"--config {config}: {field}"
        if err["type"] == "value_error":  # a validator's own message names the field (and its flag)
            what = str(err["ctx"]["error"])
            lines.append(f"pretrain: {what}" if err["loc"][0] in flags else f"pretrain: --config {config}: {what}")
            continue
        if err["type"] in BOUNDS:
            op, key = BOUNDS[err["type"]]
            rule = f"must be {op} {err['ctx'][key]}"
        elif err["type"] == "extra_forbidden":
            rule = "is not a TrainConfig field"
        else:
            rule = err["msg"].replace("Input should be", "must be", 1)
        lines.append(f"pretrain: {where} {rule}, got {err['input']!r}")
    return "\n".join(lines)


p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--config", help="JSON file with TrainConfig fields (flags below override it)")
p.add_argument("--preset", help="model preset (default k3-tiny)")
p.add_argument("--init-from", help="start from a checkpoint directory's weights (a k3 training checkpoint or model "
               "directory, the K3 release or Kimi Linear layout; each expert-parallel rank reads only its own "
               "experts)")
p.add_argument("--data", help="prepared data directory (jobs/prepare_data.py): a path, absolute inside a Ray job and "
               "the same on every node, or a URI (s3://, gs://, file://, local://)")
p.add_argument("--num-workers", type=int, help="Ray Train workers")
p.add_argument("--ep-size", type=int, help="expert-parallel size")
p.add_argument("--context-parallel", type=int, help="ranks that split each sequence into contiguous pieces "
               "(context parallelism: ranks = data-parallel x this); must divide --num-workers and the data's seq_len")
p.add_argument("--zero-stage", type=int, choices=[1, 2], help="DeepSpeed ZeRO stage")
p.add_argument("--micro-batch", type=int, help="sequences per worker per step (per context-parallel group)")
p.add_argument("--steps", type=int, help="optimizer steps")
p.add_argument("--lr", type=float, help="peak learning rate")
p.add_argument("--optimizer", choices=["adamw", "muon"])
p.add_argument("--balance", choices=METHODS,
               help="expert balancing method")
p.add_argument("--activation-checkpointing", action="store_true", default=None)
p.add_argument("--checkpoint-every", type=int)
p.add_argument("--log-every", type=int)
p.add_argument("--storage-path", help="where checkpoints are persisted (default ./runs): a path or URI, as --data")
p.add_argument("--name", help="run name")
p.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
p.add_argument("--max-failures", type=int)
p.add_argument("--seed", type=int)
p.add_argument("--use-gpu", action="store_true", default=None)
p.add_argument("--fail-at-step", type=int, help="testing: one worker dies at this step (fault drill)")
p.add_argument("--media-micro-batch", type=int, help="multimodal presets: image/video examples per worker per step")
p.add_argument("--text-every", type=int, help="multimodal presets: every N-th step is a text batch (1: text only)")
p.add_argument("--sample", type=int, default=64, help="tokens to sample from the final checkpoint (0: none)")
p.add_argument("--summary-json", help="also write the summary here (with the sample and its sampling settings)")
args = p.parse_args()
# what runs after training is checked before it: a bad --sample or --summary-json would otherwise
# end a finished run with a traceback and no summary written
if args.sample < 0:
    sys.exit(f"pretrain: --sample must be >= 0 (tokens to sample; 0: none), got {args.sample}")
if args.summary_json:
    out = Path(args.summary_json)
    if out.is_dir():
        sys.exit(f"pretrain: --summary-json {out} is a directory; give a file path")
    # its folders may be made by the run (runs/<name>/summary.json): the nearest that exists must
    # be a folder this job can write in
    there = next(p for p in out.parents if p.exists())
    if not there.is_dir() or not os.access(there, os.W_OK | os.X_OK):
        sys.exit(f"pretrain: --summary-json {out} cannot be written: {there} is not a folder this job can write in")

# 1. Config, validated before anything starts.
fields = {}
if args.config:
    try:
        fields = json.loads(Path(args.config).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        sys.exit(f"pretrain: --config {args.config}: cannot read it as JSON ({e})")
    if not isinstance(fields, dict):
        sys.exit(f"pretrain: --config {args.config}: must be a JSON object of TrainConfig fields, "
                 f"got {type(fields).__name__}")
flags = set()  # the TrainConfig fields set by a flag (each flag is its field's name: --num-workers, num_workers)
for key in ["preset", "init_from", "data", "num_workers", "ep_size", "context_parallel", "zero_stage", "micro_batch",
            "steps", "lr", "optimizer", "activation_checkpointing", "checkpoint_every", "log_every", "storage_path",
            "name", "resume", "max_failures", "seed", "use_gpu", "fail_at_step", "media_micro_batch", "text_every"]:
    if getattr(args, key) is not None:
        fields[key] = getattr(args, key)
        flags.add(key)
if args.balance and isinstance(fields.get("balance", {}), dict):  # else TrainConfig names the bad balance
    fields["balance"] = {**fields.get("balance", {}), "method": args.balance}
try:
    cfg = TrainConfig(**fields)
except ValidationError as e:
    sys.exit(field_errors(e, flags, args.config))
try:
    if cfg.preset in PRESETS or cfg.init_from:  # before the data is read: a --sample no model holds
        positions = cfg.located().model_cfg().max_position_embeddings
        if args.sample >= positions:  # the sample's prompt takes a position too
            raise ValueError(f"--sample {args.sample} is more tokens than the model's {positions} positions hold")
    data_info = cfg.check()
    if args.sample:  # the prompt's tokens, in the data's tokenizer (the checkpoint keeps it), take positions too
        run = cfg.located()
        positions = run.model_cfg().max_position_embeddings
        tok = Tokenizer.from_str(read_tokenizer(run.data, read_manifest(run.data)))
        prompt = len(tok.encode(SAMPLE_PROMPT).ids)
        if prompt + args.sample > positions:
            raise ValueError(f"--sample {args.sample} + the sample prompt's {prompt} tokens ({SAMPLE_PROMPT!r}) = "
                             f"{prompt + args.sample} is more than the model's {positions} positions hold: "
                             f"--sample <= {positions - prompt}")
except ValueError as e:
    sys.exit(f"pretrain: invalid configuration{f' (--config {args.config})' if args.config else ''}: {e}")
sequences = cfg.micro_batch * cfg.num_workers // cfg.context_parallel
print(f"pretrain: {cfg.init_from or cfg.preset}, {cfg.num_workers} workers, ep_size {cfg.ep_size}, "
      f"context_parallel {cfg.context_parallel}, ZeRO-{cfg.zero_stage}, "
      f"balance {cfg.balance.method}, {cfg.steps} steps x {sequences} sequences of "
      f"{data_info['seq_len']} tokens", flush=True)

# 2. Ray: the job's cluster (RAY_ADDRESS, set by `ray job submit`), or a private local one.
import ray  # noqa: E402
import ray.train  # noqa: E402

from k3.platform.train.launch import fit  # noqa: E402
import k3.model

if os.environ.get("RAY_ADDRESS"):
    ray.init()
else:
    init_local_ray()  # a private one on loopback, never a stale `ray start` cluster

# 3. Train: coordinator, Ray Data splits, TorchTrainer (k3.platform.train.launch.fit).
try:
    summary = fit(cfg)
except (ValueError, RuntimeError) as e:
    sys.exit(f"pretrain: {e}")

# 4. Summary (per-layer MaxVio included) and a sample from the final checkpoint, loaded as one
# single-process model.
history = summary.pop("history")
print("summary " + json.dumps(summary))
if args.sample:
    from k3.model import SamplingConfig, generate
    from k3.model.tokenizer import load_tokenizer, special_ids

    with ray.train.Checkpoint(summary["checkpoint"]).as_directory() as d:
        model = k3.model.load(d)
        tok = load_tokenizer(Path(d) / "k3" / "tokenizer.json")
    # the request a client would send for it (the completions API: prompt, max_tokens, temperature,
    # top_p, seed), ended at <|eos|> as a served model ends it; the summary keeps both, so the
    # served checkpoint can be asked the same and must answer the same text (jobs/demo.py does)
    sample = {"prompt": SAMPLE_PROMPT, "max_tokens": args.sample, "temperature": 0.8, "top_p": 0.95, "seed": cfg.seed}
    new = generate(model, [tok.encode(sample["prompt"]).ids],
                   SamplingConfig(**{k: v for k, v in sample.items() if k != "prompt"},
                                  stop_token_ids=(special_ids(tok)["eos"],)))[0]
    sample["text"] = tok.decode(new)
    summary["sample"] = sample
    print("sample:\n" + sample["prompt"] + sample["text"])
if args.summary_json:
    Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.summary_json).write_text(json.dumps({**summary, "history": history}, indent=2) + "\n")
