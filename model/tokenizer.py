"""Byte-level BPE tokenizers trained with `tokenizers`, and the special tokens k3 uses."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .vision_processor import MEDIA_TOKENS

# The media tokens frame images and video chunks in the K3 prompt format; `<|media_pad|>` (id 6)
# is the placeholder the k3-tiny-vl preset's media_placeholder_token_id names.
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", *MEDIA_TOKENS]
SPECIAL_NAMES = ("pad", "bos", "eos", "media_begin", "media_content", "media_end", "media_pad")


def train_bpe(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2) -> Tokenizer:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for byte-level BPE, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# The tokenizer k3 ships (package data beside the release configs; model/data/tokenizer.md says
# how it was made): served with a preset's random weights when no other tokenizer is given.
BUNDLED_TOKENIZER = Path(__file__).with_name("data") / "tokenizer.json"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer in a tokenizer.json file; a ValueError naming the file when it is not one."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(f"the tokenizer's path must be a tokenizer.json file's path, got {path!r}")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"tokenizer file not found: {p}")
    try:
        return Tokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception, in serde's words only
        raise ValueError(f"{p}: not a tokenizer file ({e})") from None


def check_tokenizer_fits(tok: Tokenizer, cfg, where: str = "tokenizer") -> None:
    """ValueError unless every id `tok` produces is in `cfg`'s vocabulary and the special ids the
    model config names (bos, eos, pad, media placeholder) are `tok`'s for those tokens."""
    if tok.get_vocab_size() > cfg.vocab_size:
        raise ValueError(f"{where} has {tok.get_vocab_size()} tokens, more than the model's vocab_size {cfg.vocab_size}")
    ids = special_ids(tok)
    for name, fld in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "pad_token_id"),
                      ("media_pad", "media_placeholder_token_id")):
        want = getattr(cfg, fld)
        if want is not None and ids[name] != want:
            raise ValueError(f"{where} has {SPECIAL_TOKENS[SPECIAL_NAMES.index(name)]} at id {ids[name]}, but the "
                             f"model's {fld} is {want}")


def tokenizer_hash(tok: Tokenizer) -> str:
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def special_ids(tok: Tokenizer) -> dict[str, int]:
    """Ids of the special tokens by name (pad, bos, eos, media_*); None for one the tokenizer lacks."""
    return {name: tok.token_to_id(t) for name, t in zip(SPECIAL_NAMES, SPECIAL_TOKENS)}


# A chat template travels with the tokenizer, as in a Hugging Face checkpoint: the `chat_template`
# key of tokenizer_config.json beside tokenizer.json. Other keys in that file are kept.
TOKENIZER_CONFIG = "tokenizer_config.json"


def save_chat_template(directory: str | Path, chat_template: str) -> Path:
    """Store `chat_template` (a Jinja string) in `directory`/tokenizer_config.json, next to its tokenizer.json."""
    import json

    d = Path(directory)
    if not (d / "tokenizer.json").is_file():
        raise ValueError(f"directory has no tokenizer.json to go with the chat template: {d}")
    if not chat_template:
        raise ValueError("chat_template must be a non-empty string")
    path = d / TOKENIZER_CONFIG
    config = json.loads(path.read_text()) if path.exists() else {}
    config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def load_chat_template(directory: str | Path) -> str | None:
    """The chat template stored with the tokenizer in `directory`, or None when it has none."""
    import json

    path = Path(directory) / TOKENIZER_CONFIG
    if not path.exists():
        return None
    try:
        template = json.loads(path.read_text()).get("chat_template")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path} is not a JSON object: {e}") from e
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string, got {type(template).__name__}")
    return template
