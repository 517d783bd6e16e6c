"""Images and video through the engine: the rows spliced chunk by chunk equal one forward of
K3ForConditionalGeneration, batching/preemption change nothing, prefix caching tells pictures
apart by content, the prefill -> decode handoff and the prefix pool carry media-aware hashes,
and a k3 model directory with a vision tower loads into the engine."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from k3.model import K3ForConditionalGeneration, get_preset, load_model_dir, save_model_dir
from k3.model.vision_processor import ProcessorConfig, VisionProcessor
from k3.serve.engine import EngineConfig, LLMEngine, SamplingParams
from k3.serve.engine.cache_manager import CacheManager

PAD = 6  # media_placeholder_token_id of k3-tiny-vl
GREEDY = SamplingParams(max_tokens=6, temperature=0)
CFG = EngineConfig(page_size=8, snapshot_interval=1, max_num_batched_tokens=64)
KEY = CFG.handoff_key.get_secret_value()  # what a holder of the key could reseal a changed state with


@pytest.fixture(scope="module")
def vl_model():
    torch.manual_seed(0)
    return K3ForConditionalGeneration(get_preset("k3-tiny-vl")).eval()


@pytest.fixture(scope="module")
def proc(vl_model):
    return VisionProcessor(ProcessorConfig.for_vision(vl_model.cfg.vision_config))


def image(proc, seed, h=56, w=84):
    return proc.image(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def video(proc, seed, frames=8):
    return proc.video(list(np.random.default_rng(seed).integers(0, 256, (frames, 56, 56, 3), dtype=np.uint8)))


def prompt(items, seed, head=5, tail=20):
    """Text, then each item's placeholder run framed by two text tokens, then text."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 4000, (head,), generator=g).tolist()
    for it in items:
        ids += [1000, 1001] + [PAD] * it.num_tokens + [1002]
    return ids + torch.randint(10, 4000, (tail,), generator=g).tolist()


def reference(model, ids, items, n):
    """Greedy by full forwards of the whole model on the same ids (placeholder never chosen)."""
    toks = []
    with torch.no_grad():
        rows = torch.cat(model.encode_media(*VisionProcessor.collate(items))) if items else None
        for _ in range(n):
            logits = model(torch.tensor([ids + toks]), media_embeds=rows).logits[0, -1]
            logits[PAD] = float("-inf")
            toks.append(int(logits.argmax()))
    return toks


@pytest.mark.parametrize("chunk", [5, 256])  # 5 splits every placeholder run
@pytest.mark.parametrize("kind", ["image", "two images", "video"])
def test_chunked_prefill_equals_one_forward(vl_model, proc, chunk, kind):
    items = {"image": lambda: [image(proc, 1)], "two images": lambda: [image(proc, 1), image(proc, 2, 28, 112)],
             "video": lambda: video(proc, 3)}[kind]()
    ids = prompt(items, seed=chunk)
    eng = LLMEngine(vl_model, CFG.model_copy(update={"max_num_batched_tokens": chunk}))
    out = eng.generate([ids], GREEDY, media=[items])[0]
    assert out.token_ids == reference(vl_model, ids, items, GREEDY.max_tokens)
    assert eng.stats()["media_items_encoded"] == len(items), "the tower runs once per item, whatever the chunks"


def test_batched_and_preempted_multimodal_requests_equal_each_alone(vl_model, proc):
    media = [[image(proc, 10)], [image(proc, 11), image(proc, 12)], video(proc, 13), None]
    prompts = [prompt(m or [], seed=20 + i) for i, m in enumerate(media)]
    params = SamplingParams(max_tokens=16, temperature=0)
    alone = [LLMEngine(vl_model, CFG).generate([p], params, media=[m])[0].token_ids for p, m in zip(prompts, media)]
    sizing = CacheManager(vl_model.cfg, EngineConfig(max_num_seqs=4, page_size=8, enable_prefix_caching=False))
    small = EngineConfig(max_num_seqs=4, page_size=8, enable_prefix_caching=False, max_num_batched_tokens=24,
                         cache_memory_bytes=4 * sizing.slot_bytes + 16 * sizing.page_bytes, media_cache_bytes=0)
    eng = LLMEngine(vl_model, small)
    outs = eng.generate(prompts, params, media=media)
    assert eng.stats()["preemptions"] > 0, "the test did not force a preemption"
    assert [o.token_ids for o in outs] == alone
    assert eng.stats()["media_items_encoded"] == 5, "a preempted request keeps its rows (no second encode)"


def test_same_picture_hits_the_prefix_cache_another_of_the_same_size_misses(vl_model, proc):
    a, b = image(proc, 30), image(proc, 31)
    ids = prompt([a], seed=30, head=3, tail=40)  # the image's placeholders lie in the first pages
    assert ids == prompt([b], seed=30, head=3, tail=40), "same size: the same token ids"
    eng = LLMEngine(vl_model, CFG)
    first = eng.generate([ids], GREEDY, media=[[a]])[0]
    again = eng.generate([ids], GREEDY, media=[[a]])[0]
    assert again.token_ids == first.token_ids
    assert again.cached_tokens >= 40, "the repeated conversation resumes past its picture"
    assert eng.stats()["media_items_encoded"] == 1, "a hit past every placeholder needs no rows"
    other = eng.generate([ids], GREEDY, media=[[b]])[0]
    assert other.cached_tokens == 0, "another picture with the same ids must not hit (its first page holds it)"
    assert other.token_ids == LLMEngine(vl_model, CFG).generate([ids], GREEDY, media=[[b]])[0].token_ids


def test_same_picture_in_another_conversation_skips_the_tower(vl_model, proc):
    it = image(proc, 35)
    first, other = prompt([it], seed=35), prompt([it], seed=36)  # other text before it: no prefix hit
    eng = LLMEngine(vl_model, CFG)
    eng.generate([first], GREEDY, media=[[it]])
    out = eng.generate([other], GREEDY, media=[[it]])[0]
    assert out.cached_tokens == 0 and eng.stats()["media_items_encoded"] == 1
    cold = LLMEngine(vl_model, CFG.model_copy(update={"media_cache_bytes": 0}))
    assert out.token_ids == cold.generate([other], GREEDY, media=[[it]])[0].token_ids
    assert cold.stats()["media_items_encoded"] == 1


def drain(eng, rid):
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def handoff_state(eng, ids, items):
    return drain(eng, eng.add_request(None, ids, GREEDY, prefill_only=True, media=items))[0]


@pytest.mark.parametrize("decode_preempts", [False, True])
def test_handoff_with_a_picture_equals_one_engine(vl_model, proc, decode_preempts):
    items = [image(proc, 40), image(proc, 41)]
    ids = prompt(items, seed=40)
    params = SamplingParams(max_tokens=12, temperature=0)
    whole = LLMEngine(vl_model, CFG).generate([ids], params, media=[items])[0].token_ids
    pre = LLMEngine(vl_model, CFG)
    state = drain(pre, pre.add_request(None, ids, params, prefill_only=True, media=items))[0].cache_state
    assert len(state.media_spans) == 2 and state.media_rows.shape == (ids.count(PAD), 128)
    dec = LLMEngine(vl_model, CFG)
    if decode_preempts:  # a small cache and two busy requests: the import is preempted and recomputes
        sizing = CacheManager(vl_model.cfg, EngineConfig(max_num_seqs=4, page_size=8, enable_prefix_caching=False))
        dec = LLMEngine(vl_model, EngineConfig(max_num_seqs=4, page_size=8, enable_prefix_caching=False,
                                               cache_memory_bytes=4 * sizing.slot_bytes + 13 * sizing.page_bytes,
                                               handoff_key=CFG.handoff_key))  # the prefill engine's key
        for i in range(2):
            dec.add_request(f"busy{i}", prompt([], seed=i, head=20, tail=0), SamplingParams(max_tokens=20))
        dec.step()
    outs = drain(dec, dec.import_request(None, ids, state, params))
    assert [t for o in outs for t in o.new_token_ids] == whole
    assert (dec.stats()["preemptions"] > 0) == decode_preempts, "the test did not force the preemption it wants"
    assert dec.stats()["media_items_encoded"] == 0, "the decode side recomputes from the handed-over rows"


def test_handoff_refuses_a_state_whose_media_do_not_match(vl_model, proc):
    items = [image(proc, 50)]
    ids = prompt(items, seed=50)
    state = handoff_state(LLMEngine(vl_model, CFG), ids, items).cache_state
    dec = LLMEngine(vl_model, CFG)
    other = dataclasses.replace(state, media_spans=[dataclasses.replace(state.media_spans[0], digest=b"x" * 16)])
    with pytest.raises(ValueError, match="page_hashes do not match"):
        dec.import_request(None, ids, other.seal(KEY), GREEDY)
    no_rows = dataclasses.replace(state, media_rows=None).seal(KEY)
    with pytest.raises(ValueError, match="media_rows"):
        dec.import_request(None, ids, no_rows, GREEDY)
    assert dec.stats()["running"] == 0 and not dec.has_unfinished()


def test_prefix_pool_pages_are_keyed_by_picture(vl_model, proc):
    a, b = image(proc, 60), image(proc, 61)
    ids = prompt([a], seed=60, head=3, tail=40)
    src = LLMEngine(vl_model, CFG)
    want = src.generate([ids], GREEDY, media=[[a]])[0].token_ids
    spans_a = src.media_spans(ids, [a])[1]
    pages = src.export_prefix(ids, spans_a)
    assert pages
    dst = LLMEngine(vl_model, CFG)
    with pytest.raises(ValueError, match="does not belong"):
        dst.import_prefix(ids, pages, src.media_spans(ids, [b])[1])
    assert dst.import_prefix(ids, pages, spans_a) == len(pages) * 8
    out = dst.generate([ids], GREEDY, media=[[a]])[0]
    assert out.token_ids == want and out.cached_tokens == len(pages) * 8


@pytest.mark.parametrize("case,needle", [
    ("more placeholders than rows", r"holds 7 media placeholder tokens \(id 6\) but its 1 media item\(s\) fill 6"),
    ("placeholders without media", r"holds 6 media placeholder tokens \(id 6\) but its 0 media item\(s\) fill 0"),
    ("not an item", "must be a MediaItem"),
    ("grid off", "pixel_values must be"),
    ("past the rotary table", "at most 4 frames and 64 patches per side"),
])
def test_bad_media_is_refused_and_others_continue(vl_model, proc, case, needle):
    it = image(proc, 70)
    ids = prompt([it], seed=70)
    eng = LLMEngine(vl_model, CFG)
    good = eng.add_request(None, ids, GREEDY, media=[it])
    bad_ids, media = ids, [it]
    if case == "more placeholders than rows":
        bad_ids = ids[:3] + [PAD] + ids[3:]
    elif case == "placeholders without media":
        media = None
    elif case == "not an item":
        media = [it.pixel_values]
    elif case == "grid off":
        media = [dataclasses.replace(it, grid_thw=(1, 2, 2))]
    else:
        media = [dataclasses.replace(it, grid_thw=(1, 2, 66), pixel_values=torch.zeros(132, 3, 14, 14), num_tokens=33)]
    with pytest.raises(ValueError, match=needle):
        eng.add_request(None, bad_ids, GREEDY, media=media)
    assert [o.token_ids for o in drain(eng, good) if o.finished] == [reference(vl_model, ids, [it], 6)]


def test_text_only_engine_refuses_media(tiny_model, proc):
    it = image(proc, 80)
    with pytest.raises(ValueError, match="no vision tower"):
        LLMEngine(tiny_model, CFG).add_request(None, prompt([it], seed=80), GREEDY, media=[it])


def test_model_directory_round_trips_the_vision_tower(vl_model, proc, tmp_path):
    save_model_dir(vl_model, tmp_path)
    back = load_model_dir(tmp_path, vision=True)
    assert back.cfg == vl_model.cfg and back.cfg.vision_config == vl_model.cfg.vision_config
    assert all(torch.equal(a, b) for a, b in zip(vl_model.state_dict().values(), back.state_dict().values()))
    from k3.serve.config import ModelSource
    from k3.serve.servers import load_model

    assert isinstance(load_model(ModelSource(path=str(tmp_path))), K3ForConditionalGeneration)
    text = load_model_dir(tmp_path, vision=False)
    assert set(text.state_dict()) == set(vl_model.language_model.state_dict())
    it = image(proc, 90)
    ids = prompt([it], seed=90)
    assert LLMEngine(back, CFG).generate([ids], GREEDY, media=[[it]])[0].token_ids == \
        reference(vl_model, ids, [it], GREEDY.max_tokens)
