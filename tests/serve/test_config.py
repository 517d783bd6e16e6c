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
