"""`--init-from`: a training run takes its model config from a released checkpoint (checked on the
driver, before any worker starts); the workers load it with k3.model.hf_k3.load_pretrained."""
from __future__ import annotations

import json

import pytest
from release_reference import tiny_release_config

from k3.model.hf_k3_config import config_from_release
from k3.platform.train import TrainConfig


def test_init_from_replaces_the_preset(tmp_path):
    cfg = tiny_release_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tc = TrainConfig(init_from=str(tmp_path), preset="k3-tiny")
    assert tc.model_cfg() == config_from_release(cfg)


@pytest.mark.parametrize("fields,match", [
    ({"model_overrides": {"num_layers": 2}}, "model_overrides"),
    ({"init_from": "/nonexistent/k3"}, "config.json"),
])
def test_init_from_mistakes_fail_on_the_driver(tmp_path, fields, match):
    (tmp_path / "config.json").write_text(json.dumps(tiny_release_config()))
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"init_from": str(tmp_path), **fields}).check()
