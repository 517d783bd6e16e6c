"""k3's bundled tokenizer (model/data/tokenizer.json): what jobs/prepare_data.py trains by default,
fitting the presets whose special ids are k3's, and refused by a preset whose ids are another's."""
from __future__ import annotations

import sys

import pytest

from k3.model import get_preset
from k3.model.tokenizer import (BUNDLED_TOKENIZER, SPECIAL_TOKENS, check_tokenizer_fits, load_tokenizer, special_ids,
                                tokenizer_hash, train_bpe)

BUILT_ON = (3, 11, 7)  # the CPython whose standard library it was trained on (model/data/tokenizer.md)
HASH = "2b3a0c83363c7e8c"


def test_it_is_the_recorded_tokenizer_of_k3s_special_tokens():
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    assert tokenizer_hash(tok) == HASH and tok.get_vocab_size() == 4096
    assert list(special_ids(tok).values()) == list(range(len(SPECIAL_TOKENS)))
    code = "def main():\n    return {'ok': 1}  # done\n"
    assert tok.decode(tok.encode(code).ids) == code
    assert len(tok.encode(code).ids) < len(code) / 2  # merges learned from Python source


@pytest.mark.skipif(sys.version_info[:3] != BUILT_ON, reason="the bundled corpus is this Python's standard library: "
                    f"the file was built on {'.'.join(map(str, BUILT_ON))}")
def test_prepare_data_trains_the_same_tokenizer_on_the_python_it_was_built_on():
    from k3.platform.train.data import iter_texts, resolve_input

    kind, files = resolve_input("bundled")
    assert tokenizer_hash(train_bpe(list(iter_texts(kind, files)), vocab_size=4096)) == HASH


@pytest.mark.parametrize("preset,problem", [
    ("k3-tiny", None), ("k3-tiny-vl", None), ("k3-small", None),
    ("k3", "media_placeholder_token_id is 163605"),  # the Kimi tokenizer's ids
    ("kimi-linear-48b-a3b", "bos_token_id is 163584"),
])
def test_it_fits_the_presets_whose_special_ids_are_k3s(preset, problem):
    tok = load_tokenizer(BUNDLED_TOKENIZER)
    if problem is None:
        check_tokenizer_fits(tok, get_preset(preset))
    else:
        with pytest.raises(ValueError, match=problem):
            check_tokenizer_fits(tok, get_preset(preset))
    with pytest.raises(ValueError, match="more than the model's vocab_size 1024"):
        check_tokenizer_fits(tok, get_preset("k3-tiny", vocab_size=1024))
    with pytest.raises(ValueError, match="tokenizer file not found"):
        load_tokenizer(BUNDLED_TOKENIZER.with_name("nope.json"))
