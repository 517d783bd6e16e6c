"""The Serve application's config: the handoff key that seals states and pool pages is drawn once
per validated config, so every replica of one application shares it and two applications do not."""
from __future__ import annotations

import pickle

import pytest

from k3.serve.config import LLMServingConfig

ARGS = {"model": {"preset": "k3-tiny"}}


def test_every_replica_of_an_application_gets_its_one_handoff_key():
    app = LLMServingConfig.model_validate(ARGS)
    # the builders bind one dump to every deployment; each replica validates what it receives
    replica = LLMServingConfig.model_validate(pickle.loads(pickle.dumps(app.model_dump())))
    assert replica.engine.handoff_key.get_secret_value() == app.engine.handoff_key.get_secret_value()
    assert LLMServingConfig.model_validate(ARGS).engine.handoff_key != app.engine.handoff_key
    assert app.engine.handoff_key.get_secret_value() not in repr(app)  # never printed with the config


def test_a_handoff_key_can_be_set_and_a_short_one_is_refused():
    key = "a-cluster-secret-0123456789"
    app = LLMServingConfig.model_validate({**ARGS, "engine": {"handoff_key": key}})
    assert app.engine.handoff_key.get_secret_value() == key
    with pytest.raises(ValueError, match="handoff_key"):
        LLMServingConfig.model_validate({**ARGS, "engine": {"handoff_key": "short"}})


def test_a_preset_serves_with_the_bundled_tokenizer_unless_given_one(tmp_path):
    from k3.model.tokenizer import BUNDLED_TOKENIZER

    src = LLMServingConfig.model_validate(ARGS).model
    assert src.tokenizer_file() == BUNDLED_TOKENIZER and src.tokenizer().encode("def f():").ids
    own = tmp_path / "tok.json"
    own.write_text(BUNDLED_TOKENIZER.read_text())
    given = LLMServingConfig.model_validate({"model": {"preset": "k3-tiny", "tokenizer_path": str(own)}}).model
    assert given.tokenizer_file() == own
    bare = tmp_path / "model"
    bare.mkdir()  # a model directory without a tokenizer.json: token ids only
    assert LLMServingConfig.model_validate({"model": {"path": str(bare)}}).model.tokenizer() is None


@pytest.mark.parametrize("model,problem", [
    ({"preset": "k3"}, "give model.tokenizer_path for preset 'k3'"),
    ({"preset": "k3-tiny", "tokenizer_path": "/nonexistent/tokenizer.json"}, "is not a file"),
])
def test_a_tokenizer_that_cannot_serve_is_refused_at_validation(model, problem):
    with pytest.raises(ValueError, match=problem):
        LLMServingConfig.model_validate({"model": model})
