"""`--init-from`: a training run takes its model config from a released checkpoint (checked on the
driver, before any worker starts); the workers load it with k3.model.load."""
from __future__ import annotations

import json

import pytest
from release_reference import tiny_release_config

from k3.model.hf_k3_config import config_from_release
from k3.platform.train.config import TrainConfig
import k3.model


def test_init_from_replaces_the_preset(tmp_path):
    cfg = tiny_release_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tc = TrainConfig(init_from=str(tmp_path), preset="k3-tiny")
    assert tc.model_cfg() == config_from_release(cfg)


@pytest.mark.parametrize("fields,match", [
    ({"model_overrides": {"num_layers": 2}}, "model_overrides"),
    ({"init_from": "/nonexistent/k3"}, "/nonexistent/k3: no such checkpoint directory"),
])
def test_init_from_mistakes_fail_on_the_driver(tmp_path, fields, match):
    (tmp_path / "config.json").write_text(json.dumps(tiny_release_config()))
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"init_from": str(tmp_path), **fields}).check()


def test_init_from_a_vision_language_directory_keeps_the_tower(tmp_path):
    """A k3 model directory with a vision tower starts training whole (tower and projector
    included), not as its language model alone."""
    import torch

    from k3.model import K3ForConditionalGeneration, get_preset
    from k3.model.pretrained import save_model_dir
    from k3.platform.train.trainer import initial_model

    src = k3.model.build(get_preset("k3-tiny-vl"), seed=3)
    save_model_dir(src, tmp_path)
    tc = TrainConfig(init_from=str(tmp_path))
    model = initial_model(tc, tc.model_cfg(), 0, 1, torch.device("cpu"))
    assert isinstance(model, K3ForConditionalGeneration)
    want = src.state_dict()
    got = model.state_dict()
    assert set(got) == set(want) and any(k.startswith("vision_tower.") for k in got)
    assert all(torch.equal(got[k], want[k].float()) for k in want)
