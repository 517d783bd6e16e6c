"""The bundled image/video-text set and the multimodal batches built from it."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3.model import K3ForConditionalGeneration, get_preset
from k3.model.tokenizer import train_bpe
from helpers import run_killed_midway, tree_bytes
from k3.platform.train.vision_data import (
    ExampleEncoder, MediaSchedule, classify_digits, collate, read_vision_info, read_vision_rows, write_vision_set,
)


@pytest.fixture(scope="module")
def media_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl")
    info = write_vision_set(out, heldout=4, max_digits=12)
    return out, info


@pytest.fixture(scope="module")
def encoder(media_set):
    rows = read_vision_rows(media_set[0], "train")
    tok = train_bpe([r["caption"] for r in rows] * 4, vocab_size=320)
    return ExampleEncoder(lambda s: tok.encode(s).ids, tok.token_to_id, bos=1, eos=2)


def test_media_set_contents_and_rerun_is_a_no_op(media_set):
    out, info = media_set
    assert info["counts"]["train"] == {"rows": 8 * 5 + 14, "images": 8 * 3 + 14, "videos": 8 * 2}
    assert info["counts"]["heldout"] == {"rows": 4 * 4, "images": 12, "videos": 4}
    rows = read_vision_rows(out, "train")
    clip = next(r for r in rows if r["kind"] == "video")
    assert len(clip["frames"]) == 4 and clip["fps"] == 2.0 and clip["caption"].endswith(f"#{clip['label']}.")
    frames = [np.asarray(Image.open(io.BytesIO(f))) for f in clip["frames"]]
    assert all(f.shape == (56, 56, 3) for f in frames) and not all((a == frames[0]).all() for a in frames[1:])
    digits = [r for r in rows if r["kind"] == "image" and r["label"] >= 0]
    sizes = sorted({Image.open(io.BytesIO(r["frames"][0])).size for r in digits})
    assert sizes == [(28, 28), (42, 42), (56, 56)]
    assert max(Image.open(io.BytesIO(r["frames"][0])).size[0] for r in rows if r["label"] < 0) == 1411
    held = {r["frames"][0] for r in read_vision_rows(out, "heldout")}
    assert not held & {r["frames"][0] for r in rows}  # held-out digits never seen in training
    mtime = (out / "media" / "train.parquet").stat().st_mtime_ns
    assert write_vision_set(out, heldout=4, max_digits=12) == info
    assert (out / "media" / "train.parquet").stat().st_mtime_ns == mtime


def test_a_media_set_killed_midway_leaves_the_previous_version_whole_and_a_rerun_redoes_it(tmp_path):
    info = write_vision_set(tmp_path, heldout=4, max_digits=12, photos=False)
    before = tree_bytes(tmp_path / "media")
    # killed right after the new train.parquet is written, before heldout.parquet and media.json
    run_killed_midway(f"from k3.platform.train.vision_data import write_vision_set\n"
                      f"write_vision_set({str(tmp_path)!r}, heldout=4, max_digits=16, photos=False)",
                      "pyarrow.parquet:write_table", after=1)
    assert tree_bytes(tmp_path / "media") == before, "the killed writer changed the previous media set"
    assert read_vision_info(tmp_path) == info
    assert len(read_vision_rows(tmp_path, "train")) == info["counts"]["train"]["rows"]
    new = write_vision_set(tmp_path, heldout=4, max_digits=16, photos=False)
    assert new["settings"]["max_digits"] == 16 and read_vision_info(tmp_path) == new
    assert [len(read_vision_rows(tmp_path, s)) for s in ("train", "heldout")] == \
        [new["counts"][s]["rows"] for s in ("train", "heldout")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["media"], "a killed writer's leftovers stayed"


def _ink_box(frame: np.ndarray) -> tuple[int, int]:
    ys, xs = np.nonzero(frame[..., 0])
    return int(ys.min()), int(xs.min())


def test_clips_drift_a_few_pixels_per_frame_with_the_whole_digit_on_the_canvas(media_set):
    # sd2_tpool averages a clip's frames: a small straight drift keeps that mean a legible digit
    clips = [r for split in ("train", "heldout") for r in read_vision_rows(media_set[0], split) if r["kind"] == "video"]
    for clip in clips:
        frames = [np.asarray(Image.open(io.BytesIO(f))) for f in clip["frames"]]
        corners = [_ink_box(f) for f in frames]
        moves = {(b[0] - a[0], b[1] - a[1]) for a, b in zip(corners, corners[1:])}
        assert len(moves) == 1  # a straight line at constant speed
        (dy, dx), = moves
        assert (dy, dx) != (0, 0) and max(abs(dy), abs(dx)) <= 2, clip["caption"]
        assert len({int(f.sum()) for f in frames}) == 1  # no ink leaves the canvas


def test_examples_collate_and_train_through_the_model(media_set, encoder):
    rows = read_vision_rows(media_set[0], "train")
    photo = next(r for r in rows if r["label"] < 0 and "retina" in r["caption"])
    ex = [encoder.example(r) for r in (rows[0], rows[3], photo)]
    assert ex[2].items[0].num_tokens <= 64 // 4  # the 1411x1411 photo is resized to the budget
    b = collate(ex, pad_id=2)
    assert b["input_ids"].shape == (3, max(len(e.ids) for e in ex))
    assert int((b["input_ids"] == 6).sum()) == sum(it.num_tokens for e in ex for it in e.items)
    assert (b["labels"] == -100).sum() == b["input_ids"].numel() - sum(len(e.ids) for e in ex)
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(get_preset("k3-tiny-vl")).train()
    out = model(b["input_ids"], b["pixel_values"], b["grid_thws"], labels=b["labels"])
    out.loss.backward()
    assert torch.isfinite(out.loss) and model.vision_tower.patch_embed.proj.weight.grad.abs().sum() > 0


def test_classify_digits_counts_each_kind(media_set, encoder):
    torch.manual_seed(0)
    model = K3ForConditionalGeneration(get_preset("k3-tiny-vl"))
    res = classify_digits(model, encoder, read_vision_rows(media_set[0], "heldout"), batch=7)
    assert res["image_count"] == 12 and res["video_count"] == 4
    assert 0.0 <= res["image_top1"] <= 1.0 and 0.0 <= res["video_top1"] <= 1.0


def test_media_schedule_steps_slices_and_resume(media_set, encoder):
    rows = read_vision_rows(media_set[0], "train")
    scheds = [MediaSchedule(rows, encoder, micro_batch=3, text_every=3, seed=1, rank=r, world=2) for r in range(2)]
    assert [scheds[0].is_text_step(s) for s in range(6)] == [False, False, True, False, False, True]
    assert [scheds[0].text_steps_before(s) for s in (0, 2, 3, 6, 7)] == [0, 0, 1, 2, 2]
    a, b = scheds[0].examples(4), scheds[0].examples(4)
    assert [e.ids for e in a] == [e.ids for e in b]  # the same step draws the same examples (resume)
    assert [e.ids for e in a] != [e.ids for e in scheds[0].examples(5)]
    assert scheds[0].rows == rows[0::2] and scheds[1].rows == rows[1::2]  # the ranks split the rows
    with pytest.raises(ValueError, match="cannot fill a batch"):
        MediaSchedule(rows[:4], encoder, micro_batch=3, text_every=2, seed=0, rank=0, world=2)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="heldout"):
        write_vision_set(tmp_path, heldout=12, max_digits=12, photos=False)
    with pytest.raises(ValueError, match="train_clips"):
        write_vision_set(tmp_path, heldout=4, max_digits=12, photos=False, train_clips=0)
    with pytest.raises(ValueError, match="prepare_data.py --vision"):
        read_vision_rows(tmp_path / "none", "train")
