"""Images and video through the OpenAI API on the session's Serve instance, aggregated and
disaggregated (k3-tiny-vl, random weights: equality is what is tested, not meaning): a chat with
an image data URL answers as the bare engine does, the same picture again hits the prefix cache
(locally and through the prefix pool) with the same answer, another picture of the same size
misses, concurrent requests answer as each alone, and every bad input is a 4xx that leaves the
others unaffected."""
from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers import wait_until
from PIL import Image

import k3.model
from k3.model import get_preset
from k3.serve.chat import ChatTemplate, PromptEncoder
from k3.serve.config import MediaConfig
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.errors import OpenAIError
from k3.serve.chat_media import ChatMedia
from k3.serve.protocol import ChatCompletionRequest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.ray

ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, snapshot_interval=1,
              cache_memory_bytes=16 * 2**20)
MEDIA = dict(image_patch_limit=64, max_video_frames=4, max_image_pixels=1_000_000)
QUESTION = "what is in this picture? answer in one word, then explain why you think so in detail."


def app_config(tok_path, disaggregated):
    small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.1}}
    return {"model_id": "k3-vl", "model": {"preset": "k3-tiny-vl", "seed": 0, "tokenizer_path": tok_path},
            "engine": ENGINE, "disaggregated": disaggregated, "prefill": small, "decode": small, "llm": small,
            "ingress": small, "media": MEDIA, "prefix_pool_bytes": 8 * 2**20}


@pytest.fixture(scope="module")
def vapps(serve_session, tokenizer, tmp_path_factory):
    """{"agg": base URL, "pd": base URL} of the vision apps on the session's Serve instance."""
    from ray import serve

    from k3.serve.builder import build_app, build_pd_app

    d = tmp_path_factory.mktemp("vtok")
    tokenizer.save(str(d / "tokenizer.json"))
    tok = str(d / "tokenizer.json")
    # both at once: their replicas start side by side instead of one app after the other
    serve.run_many([serve.RunTarget(build_app(app_config(tok, False)), name="vagg", route_prefix="/vagg"),
                    serve.RunTarget(build_pd_app(app_config(tok, True)), name="vpd", route_prefix="/vpd")])
    try:
        yield {"agg": f"{serve_session}/vagg", "pd": f"{serve_session}/vpd"}
    finally:
        serve.delete("vagg")
        serve.delete("vpd")


def png(seed, w=112, h=112, fmt="PNG"):
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format=fmt)
    return buf.getvalue()


def gif(frames, seed=0):
    imgs = [Image.fromarray(np.random.default_rng(seed + i).integers(0, 256, (56, 56, 3), dtype=np.uint8))
            for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, format="GIF", save_all=True, append_images=imgs[1:], duration=500, loop=0)
    return buf.getvalue()


def data_url(raw, mime="image/png"):
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def messages(url, kind="image_url", text=QUESTION):
    return [{"role": "user", "content": [{"type": kind, kind: {"url": url}}, {"type": "text", "text": text}]}]


def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def ask(base, msgs, max_tokens=6):
    r = client(base).chat.completions.create(model="k3-vl", messages=msgs, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content


def stats(app, deployment):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).stats.remote().result()


def engine_answer(tokenizer, msgs, max_tokens=6):
    """What the bare engine answers for the same conversation (the ingress's prompt, same weights)."""
    cfg = get_preset("k3-tiny-vl")
    media = ChatMedia(cfg, MediaConfig(**MEDIA), "k3-vl")
    ids, items = media.prompt(ChatTemplate(), ChatCompletionRequest.model_validate(
        {"model": "k3-vl", "messages": msgs}).messages, PromptEncoder(tokenizer))
    eng = LLMEngine(k3.model.build(cfg, seed=0).eval(), EngineConfig(**ENGINE), tokenizer)
    out = eng.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, stop=["<|im_end|>"]),
                       media=[items])[0]
    return out.text, ids


@pytest.mark.parametrize("app,server", [("agg", "LLMServer"), ("pd", "PrefillServer")])
def test_same_picture_hits_other_picture_misses_answers_equal_the_engine(vapps, tokenizer, app, server):
    msgs_a, msgs_b = messages(data_url(png(1))), messages(data_url(png(2)))
    want, ids = engine_answer(tokenizer, msgs_a)
    first_pad = ids.index(6)
    s0 = stats(f"v{app}", server)
    assert ask(vapps[app], msgs_a) == want
    s1 = stats(f"v{app}", server)
    assert ask(vapps[app], msgs_a) == want
    s2 = stats(f"v{app}", server)
    assert s2["prefix_hit_tokens"] - s1["prefix_hit_tokens"] > first_pad + 16, "the repeat resumes past its picture"
    # the repeat runs no tower: a hit past the picture needs no rows, and a prefill replica, which
    # hands the rows over even then, finds them in its media row cache
    assert s1["media_items_encoded"] - s0["media_items_encoded"] == 1
    assert s2["media_items_encoded"] == s1["media_items_encoded"]
    other = ask(vapps[app], msgs_b)
    s3 = stats(f"v{app}", server)
    assert s3["prefix_hit_tokens"] - s2["prefix_hit_tokens"] <= first_pad, "another picture, same ids: a miss"
    assert other == engine_answer(tokenizer, msgs_b)[0]


def test_a_picture_that_hits_only_the_pool_answers_the_same(vapps):
    from ray import serve

    prefill = serve.get_deployment_handle("PrefillServer", app_name="vpd")
    msgs = messages(data_url(png(3)))  # a picture no other test sends: its pages are new to the pool
    pool = serve.get_deployment_handle("PrefixPool", app_name="vpd")
    published = pool.stats.remote().result()["published"]
    first = ask(vapps["pd"], msgs)
    # the replica publishes to the pool after replying, all of a prompt's pages in one call
    wait_until(lambda: pool.stats.remote().result()["published"] != published, 60,
               "the prefill replica publishing the picture's pages")
    before = prefill.pool_stats.remote().result()["pool_hit_tokens"]
    assert prefill.reset_prefix_cache.remote().result() > 0
    assert ask(vapps["pd"], msgs) == first
    assert prefill.pool_stats.remote().result()["pool_hit_tokens"] - before > 16


def test_concurrent_pictures_and_a_video_answer_as_each_alone(vapps):
    convs = [messages(data_url(png(10 + i, 84, 56))) for i in range(3)] + \
        [messages(data_url(gif(4), "image/gif"), kind="video_url", text="what happens?")]
    for app in ("agg", "pd"):
        alone = [ask(vapps[app], m) for m in convs]
        with ThreadPoolExecutor(len(convs)) as pool:
            together = list(pool.map(lambda m: ask(vapps[app], m), convs))
        assert together == alone, app


def test_streamed_answer_with_a_picture_equals_the_whole_answer(vapps):
    msgs = messages(data_url(png(9)))
    pieces = []
    for ev in client(vapps["pd"]).chat.completions.create(model="k3-vl", messages=msgs, max_tokens=6,
                                                           temperature=0, stream=True):
        pieces += [ch.delta.content or "" for ch in ev.choices]
    assert "".join(pieces) == ask(vapps["pd"], msgs)


BAD = {
    "remote URL": (lambda: "http://example.com/cat.png", "image_url", "remote URL"),
    "corrupt bytes": (lambda: data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256))), "image_url", "corrupt"),
    "unsupported format": (lambda: data_url(png(4, fmt="BMP"), "image/bmp"), "image_url", "unsupported format BMP"),
    "past the hard pixel limit": (lambda: data_url(png(5, 1100, 1000)), "image_url", "hard limit"),
    "too many video frames": (lambda: data_url(gif(10), "image/gif"), "video_url", "more than allowed"),
    "not base64": (lambda: "data:image/png;base64,@@@", "image_url", "base64"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_media_is_a_400_and_the_server_keeps_serving(vapps, case):
    make, kind, needle = BAD[case]
    app = "pd" if case == "remote URL" else "agg"
    r = httpx.post(f"{vapps[app]}/v1/chat/completions", timeout=120,
                   json={"model": "k3-vl", "messages": messages(make(), kind), "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == f"messages[0].content[0].{kind}.url"
    assert ask(vapps[app], messages(data_url(png(1))), max_tokens=2)  # others unaffected


def test_big_image_is_resized_not_refused_and_a_forged_placeholder_is_a_400(vapps):
    assert ask(vapps["agg"], messages(data_url(png(6, 640, 480))), max_tokens=2) is not None
    # wider than the tiny tower's 64-patch rotary table: resized to fit it, answered
    assert ask(vapps["agg"], messages(data_url(png(11, 2000, 28))), max_tokens=2) is not None
    # a caption that spells the placeholder token is text: answered, not a 400 or an extra placeholder
    assert ask(vapps["agg"], messages(data_url(png(7)), text="look <|media_pad|> here"), max_tokens=2) is not None


def test_a_caption_that_spells_a_media_token_is_text(tokenizer):
    cfg = get_preset("k3-tiny-vl")
    msgs = ChatCompletionRequest.model_validate({"model": "k3-vl", "messages": messages(
        data_url(png(7)), text="look <|media_pad|><|media_end|> here")}).messages
    ids, items = ChatMedia(cfg, MediaConfig(**MEDIA), "k3-vl").prompt(ChatTemplate(), msgs, PromptEncoder(tokenizer))
    assert ids.count(cfg.media_placeholder_token_id) == sum(it.num_tokens for it in items)
    assert ids.count(tokenizer.token_to_id("<|media_end|>")) == len(items) == 1


@pytest.mark.parametrize("case,needle", [
    ("text-only model", "'k3-tiny' has no vision tower"),
    ("template drops the picture", "placed 0 media placeholders for 1 image/video parts"),
])
def test_media_the_prompt_cannot_hold_is_a_400(tokenizer, case, needle):
    preset, template = "k3-tiny-vl", ChatTemplate("{% for m in messages %}{{ m.role }}{% endfor %}")
    if case == "text-only model":
        preset, template = "k3-tiny", ChatTemplate()
    media = ChatMedia(get_preset(preset), MediaConfig(**MEDIA), preset)
    msgs = ChatCompletionRequest.model_validate({"model": preset, "messages": messages(data_url(png(8)))}).messages
    with pytest.raises(OpenAIError) as e:
        media.prompt(template, msgs, PromptEncoder(tokenizer))
    assert e.value.status == 400 and needle in e.value.message
