"""ChatMedia (serve/chat_media.py) without a Serve app: pictures that alone fill the context are
refused from their headers, before any is decoded; the count is a lower bound, so a request that
fits is decoded and written as before."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from k3.model import get_preset
from k3.model.tokenizer import BUNDLED_TOKENIZER, load_tokenizer
from k3.model.vision_processor import VisionProcessor
from k3.serve.chat import ChatTemplate, PromptEncoder
from k3.serve.chat_media import ChatMedia
from k3.serve.config import MediaConfig
from k3.serve.errors import OpenAIError
from k3.serve.protocol import ChatCompletionRequest


def picture_url(side: int, seed: int = 0) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*urls: str):
    parts = [{"type": "text", "text": "compare these"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return ChatCompletionRequest.model_validate({"model": "k3-vl", "messages": [
        {"role": "user", "content": parts}]}).messages


@pytest.fixture(scope="module")
def media():
    return ChatMedia(get_preset("k3-tiny-vl"), MediaConfig(image_patch_limit=256), "k3-vl")


@pytest.fixture(scope="module")
def encoder():
    return PromptEncoder(load_tokenizer(BUNDLED_TOKENIZER))


def test_pictures_that_alone_fill_the_context_are_refused_before_any_is_decoded(media, encoder, monkeypatch):
    msgs = chat(*(picture_url(224, seed) for seed in range(4)))  # 64 tokens each at 16 x 16 patches
    ids, items = media.prompt(ChatTemplate(), msgs, encoder, max_len=1000)  # fits: decoded as before
    assert [it.num_tokens for it in items] == [64] * 4 and len(ids) < 1000
    monkeypatch.setattr(VisionProcessor, "image", lambda self, src: pytest.fail("a picture was decoded"))
    with pytest.raises(OpenAIError) as e:
        media.prompt(ChatTemplate(), msgs, encoder, max_len=256)
    assert (e.value.status, e.value.code, e.value.param) == (400, "context_length_exceeded", "messages")
    assert "maximum context length is 256 tokens; however, the 4 image/video part(s) alone fill at least 256" \
        in e.value.message


def test_a_bad_picture_is_named_by_the_header_count_too(media, encoder):
    msgs = chat(picture_url(28), "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnope").decode())
    with pytest.raises(OpenAIError) as e:
        media.prompt(ChatTemplate(), msgs, encoder, max_len=1000)
    assert e.value.param == "messages[0].content[2].image_url.url" and "corrupt" in e.value.message
