"""load_tokenizer: a file that is not a tokenizer is a ValueError naming it."""
from __future__ import annotations

import re

import pytest

from k3.model.tokenizer import load_tokenizer


@pytest.mark.parametrize("text", ["{bad", "{\"a\" 1}", "", "[1, 2]", "{}"])
def test_a_file_that_is_not_a_tokenizer_is_named(tmp_path, text):
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{path}: not a tokenizer file (")):
        load_tokenizer(path)



@pytest.mark.parametrize("path", [None, "", 3])
def test_no_path_is_named_not_a_type_error(path):
    with pytest.raises(ValueError, match="the tokenizer's path must be a tokenizer.json file's path, got"):
        load_tokenizer(path)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=re.escape(f"tokenizer file not found: {tmp_path / 'nope.json'}")):
        load_tokenizer(tmp_path / "nope.json")
