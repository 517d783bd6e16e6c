from __future__ import annotations

import pytest
import torch

from k3.model import K3ForCausalLM, get_preset
from k3.platform.train.corpus import stdlib_corpus
from k3.model.tokenizer import train_bpe


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    m = K3ForCausalLM(get_preset("k3-tiny")).eval()
    with torch.no_grad():
        m.model.attn_res.queries.normal_(0, 0.05)
    return m


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
