"""From a training run to something servable: the newest checkpoint of a run, exported as a k3
model directory (config.json, model.safetensors, tokenizer.json, and tokenizer_config.json with
the chat template), which the Serve config's `model.path` points at."""
from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import Tokenizer

import k3.model
from k3.model.directory import MODEL_FILES, check_destination, owned, write_beside
from k3.model.pretrained import write_model_files
from k3.model.tokenizer import TOKENIZER_CONFIG, load_chat_template, save_chat_template, special_ids

# What an export writes besides the model: a tokenizer_config.json left from an earlier export
# would carry a stale chat template, so the export owns it even when it writes none.
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG)

from . import storage


def registered_checkpoints(run: str | Path) -> list[str]:
    """The checkpoints of a Ray Train run directory (a path or URI) that Ray Train registered, oldest
    first: each has every worker's files, since a checkpoint is registered only once all of them
    are persisted. A `checkpoint_*` directory a worker killed midway through its upload left
    behind is not among them. [] when the run has no checkpoint yet."""
    import ray.train

    run = str(run) if storage.scheme(str(run)) else str(Path(run).absolute())
    try:
        result = ray.train.Result.from_path(run)
    except RuntimeError:  # no run folder, or no checkpoint registered in it yet
        return []
    return [storage.join(run, Path(c.path).name) for c, _ in result.best_checkpoints]


def latest_checkpoint(run_dir: str | Path) -> str:
    """The newest complete checkpoint of a Ray Train run directory (see `registered_checkpoints`)."""
    found = registered_checkpoints(run_dir)
    if not found:
        raise ValueError(f"{run_dir}: no checkpoint registered by Ray Train (is this a Ray Train run directory?)")
    return found[-1]


def export_model(checkpoint: str | Path, out: str | Path, chat_template: str | None = None,
                 overwrite: bool = False) -> Path:
    """Write the checkpoint's model (all experts, one process) as a k3 model directory.

    Written beside `out` and swapped in when complete (k3.model.directory): a failure leaves the
    previous export as it was; files of `out` an export does not write stay. `out` may not be
    the checkpoint (or a folder holding it) unless `overwrite`."""
    ckpt = Path(checkpoint)
    k3dir = ckpt / "k3" if (ckpt / "k3").is_dir() else ckpt
    tok = k3dir / "tokenizer.json"
    if not tok.is_file():
        raise ValueError(f"{ckpt}: no tokenizer.json beside the weights; a served model needs its tokenizer")
    model = k3.model.load(ckpt)
    check_destination(model.source, out, overwrite)
    ids = special_ids(Tokenizer.from_file(str(tok)))
    # The served config names the tokenizer's special tokens, so generation stops at <|eos|>.
    model.cfg = model.cfg.replace(eos_token_id=ids["eos"], bos_token_id=ids["bos"], pad_token_id=ids["pad"])
    template = chat_template or load_chat_template(k3dir)
    with write_beside(out, stale=owned(MODEL_FILES + TOKENIZER_FILES)) as new:
        write_model_files(model, new)
        shutil.copy(tok, new / "tokenizer.json")
        if template is not None:
            save_chat_template(new, template)
    return Path(out)
