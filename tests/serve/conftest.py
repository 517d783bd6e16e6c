from __future__ import annotations

import pytest

from k3.model import get_preset
from k3.platform.train.corpus import stdlib_corpus
from k3.model.tokenizer import train_bpe
from serve_apps import tiny_lm


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_lm()


@pytest.fixture(scope="session")
def tokenizer():
    return train_bpe(stdlib_corpus(3_000_000).texts(), vocab_size=4096)


@pytest.fixture(scope="session")
def serve_session(ray_local):
    """One Ray Serve instance per test session on 127.0.0.1 (a free port); its base URL.
    Tests deploy their applications under their own names and delete them."""
    from ray import serve

    from k3.platform.ops.local_ray import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="session")
def apps(serve_session, tokenizer, tmp_path_factory):
    """{"pd": base URL, "agg": base URL}: the disaggregated and the aggregated app of
    tests/serve_apps.py, deployed once for the modules that test them."""
    from ray import serve

    from k3.serve.builder import build_app, build_pd_app
    from serve_apps import app_config

    d = tmp_path_factory.mktemp("tok")
    tokenizer.save(str(d / "tokenizer.json"))
    serve.run(build_pd_app(app_config(str(d / "tokenizer.json"), True)), name="pd", route_prefix="/pd")
    serve.run(build_app(app_config(str(d / "tokenizer.json"), False)), name="agg", route_prefix="/agg")
    try:
        yield {"pd": f"{serve_session}/pd", "agg": f"{serve_session}/agg"}
    finally:
        serve.delete("pd")
        serve.delete("agg")


@pytest.fixture(scope="session")
def default_app(serve_session):
    """serve/config.yaml's application as `serve run serve/config.yaml` deploys it on a fresh clone
    (tests/serve_apps.config_yaml_apps: only the CPU shares and the port differ), under the file's
    own name and route; {"url": its base URL, "model": its model_id}. A change to the file that
    breaks text or chat fails the tests that use it."""
    from ray import serve

    from serve_apps import config_yaml_apps

    [(name, prefix, app, args)] = config_yaml_apps()
    serve.run(app, name=name, route_prefix=prefix)
    try:
        yield {"url": serve_session + prefix.rstrip("/"), "model": args["model_id"]}
    finally:
        serve.delete(name)


@pytest.fixture(scope="session")
def engine_model():
    from k3.model import build

    return build(get_preset("k3-tiny"), seed=0).eval()  # the replicas' random weights
