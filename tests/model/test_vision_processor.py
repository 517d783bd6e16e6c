"""The processor: K3's resize/pad/normalise rule, video chunks, prompt format, bad input."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from k3.model.vision_processor import (
    MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD, ProcessorConfig, VisionProcessor, encode_interleaved, fit_size,
    load_image,
)
from k3.model.tokenizer import special_ids, train_bpe


def encoded(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, fmt, **kw)
    return buf.getvalue()


def noise(h: int, w: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.mark.parametrize("w, h, limit", [(300, 512, 256), (1000, 90, 64), (50, 50, 16384), (28, 28, 4)])
def test_resize_fits_budget_keeps_aspect_and_pads_to_28(w, h, limit):
    cfg = ProcessorConfig(in_patch_limit=limit)
    nw, nh, pw, ph = fit_size(w, h, limit, cfg)
    if (w // 14) * (h // 14) <= limit:  # within budget: never scaled (up or down), only padded
        assert (nw, nh) == (w, h)
    else:
        assert (nw // 14) * (nh // 14) <= limit
        assert abs((nw / nh) / (w / h) - 1) < 0.05  # aspect ratio kept (up to rounding)
    assert pw % 28 == 0 and ph % 28 == 0 and 0 <= pw - nw < 28 and 0 <= ph - nh < 28
    item = VisionProcessor(cfg).image(noise(h, w))
    assert item.grid_thw == (1, ph // 14, pw // 14) and item.original_size == (w, h)
    assert item.num_tokens == (ph // 28) * (pw // 28)


def test_normalisation_padding_and_patch_order():
    img = np.zeros((30, 20, 3), dtype=np.uint8)
    img[:14, :14] = 255  # top-left patch white, the rest black
    img[14:28, 14:20] = 128
    item = VisionProcessor().image(img)
    assert item.grid_thw == (1, 4, 2)  # 30x20 -> padded 56x28
    pv = item.pixel_values.view(4, 2, 3, 14, 14)
    assert torch.all(pv[0, 0] == 1.0)  # (255 / 255 - 0.5) / 0.5
    torch.testing.assert_close(pv[1, 1, :, :, :6], torch.full((3, 14, 6), (128 / 255 - 0.5) / 0.5))
    assert torch.all(pv[1, 1, :, :, 6:] == -1.0)  # padding is black before normalisation
    assert torch.all(pv[3] == -1.0)


def test_video_sampled_at_two_fps_in_four_frame_chunks_with_timestamps():
    frames = [np.full((40, 60, 3), i, dtype=np.uint8) for i in range(30)]  # 3 s at 10 fps
    items = VisionProcessor().video(frames, fps=10)
    assert [it.grid_thw for it in items] == [(4, 4, 6), (2, 4, 6)]  # 6 sampled frames
    assert [it.timestamp for it in items] == ["00:00:00.000", "00:00:02.000"]
    assert all(it.num_tokens == 6 and it.kind == "video" for it in items)
    assert items[1].prompt() == f"00:00:02.000{MEDIA_BEGIN}video{MEDIA_CONTENT}{MEDIA_PAD * 6}{MEDIA_END}"
    # one frame every 0.5 s: the sixth sampled frame is source frame 25
    last = items[1].pixel_values.view(2, 4, 6, 3, 14, 14)[1, 0, 0, 0, 0, 0]
    torch.testing.assert_close(last, torch.tensor((25 / 255 - 0.5) / 0.5))


def test_animated_gif_is_a_video_and_not_an_image():
    frames = [Image.fromarray(noise(28, 28, s)) for s in range(4)]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=500, loop=0)
    items = VisionProcessor().video(buf.getvalue())  # 2 fps source: all 4 frames kept
    assert [it.grid_thw for it in items] == [(4, 2, 2)]
    with pytest.raises(ValueError, match="unsupported format GIF"):
        VisionProcessor().image(buf.getvalue())


def test_prompt_format_and_tokenizer_special_tokens():
    tok = train_bpe(["a photo of the digit 7, image 28x28"] * 20, vocab_size=300)
    ids = special_ids(tok)
    assert [ids[k] for k in ("media_begin", "media_content", "media_end", "media_pad")] == [3, 4, 5, 6]
    item = VisionProcessor().image(noise(28, 56))
    assert item.prompt() == f"{MEDIA_BEGIN}image 56x28{MEDIA_CONTENT}{MEDIA_PAD * 2}{MEDIA_END}"
    seq, items = encode_interleaved(["look: ", item, " digit"], lambda s: tok.encode(s).ids, tok.token_to_id)
    assert items == [item] and seq.count(6) == 2
    assert seq == tok.encode("look: " + item.prompt() + " digit").ids  # the tokenizer reads the same prompt


def test_content_hash_same_image_same_hash_different_image_differs():
    vp = VisionProcessor()
    a, b = noise(28, 28, 1), noise(28, 28, 2)
    assert vp.image(encoded(a)).content_hash == vp.image(a).content_hash
    assert vp.image(a).content_hash != vp.image(b).content_hash


def test_jpeg_and_data_url_sources():
    vp = VisionProcessor()
    data = encoded(noise(40, 40), "JPEG")
    url = "data:image/jpeg;base64," + base64.b64encode(data).decode()
    torch.testing.assert_close(vp.image(url).pixel_values, vp.image(data).pixel_values)
    # the bytes say what they are: a mislabelled or untyped picture is read alike
    for head in ("data:image/png;base64,", "data:;base64,", "data:application/octet-stream;base64,",
                 "DATA:Image/JPEG;name=cat.jpg;base64,"):
        torch.testing.assert_close(vp.image(head + url.partition(",")[2]).pixel_values, vp.image(data).pixel_values)
    pv, grids = vp.collate([vp.image(data), *vp.video([noise(28, 28)] * 4)])
    assert pv.shape == (16 + 16, 3, 14, 14) and grids.tolist() == [[1, 4, 4], [4, 2, 2]]


def _bmp() -> bytes:
    return encoded(noise(8, 8), "BMP")


@pytest.mark.parametrize("src, match", [
    (b"\x89PNG\r\n\x1a\nnot really a png", "corrupt"),
    (encoded(noise(64, 64))[:80], "corrupt"),
    (_bmp(), "unsupported format BMP"),
    ("http://example.com/cat.png", "remote URL"),
    ("https://example.com/cat.png", "remote URL"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:application/pdf;base64," + base64.b64encode(encoded(noise(8, 8))).decode(), "declares 'application/pdf'"),
    ("data:text/plain;base64,aGVsbG8=", "declares 'text/plain'; send an image"),
    ("/etc/passwd", "must be a data: URL"),
    (np.zeros((4, 4, 2), np.uint8), "array must be"),
    (np.full((4, 4), 2.0), r"in \[0, 1\]"),
    (12, "unsupported source type int"),
])
def test_bad_image_inputs_name_the_problem(src, match):
    with pytest.raises(ValueError, match=match):
        VisionProcessor().image(src)


def test_over_budget_is_resized_but_past_the_hard_limit_is_refused():
    vp = VisionProcessor(ProcessorConfig(in_patch_limit=64, max_image_pixels=500 * 500))
    assert vp.image(noise(400, 400)).num_tokens <= 64
    with pytest.raises(ValueError, match="past the hard limit"):
        vp.image(encoded(noise(600, 450)))
    with pytest.raises(ValueError, match="aspect ratio"):
        vp.image(noise(2, 500))


@pytest.mark.parametrize("frames, fps, match", [
    ([noise(28, 28)] * 9, 2.0, "9 sampled frames is more than allowed"),
    ([noise(28, 28), noise(28, 42)], 2.0, "frame 1 is 42x28"),
    ([], 2.0, "non-empty frame list"),
    (np.zeros((28, 28, 3), np.uint8), 2.0, r"\[T, H, W, 3\]"),
])
def test_bad_video_inputs_name_the_problem(frames, fps, match):
    with pytest.raises(ValueError, match=match):
        VisionProcessor(ProcessorConfig(max_video_frames=8)).video(frames, fps=fps)


def gif(frames: list[np.ndarray], duration: int = 500) -> bytes:
    imgs = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    imgs[0].save(buf, "GIF", save_all=True, append_images=imgs[1:], duration=duration, loop=0)
    return buf.getvalue()


def apng_claiming(frames: int, actual: int) -> bytes:
    """An animated PNG whose header claims `frames` frames but whose data holds `actual`."""
    imgs = [Image.fromarray(noise(28, 28, s)) for s in range(actual)]
    buf = io.BytesIO()
    imgs[0].save(buf, "PNG", save_all=True, append_images=imgs[1:], duration=500)
    import zlib

    data = bytearray(buf.getvalue())
    at = data.index(b"acTL")
    data[at + 4:at + 8] = frames.to_bytes(4, "big")
    data[at + 12:at + 16] = zlib.crc32(bytes(data[at:at + 12])).to_bytes(4, "big")  # a well-formed lie
    return bytes(data)


@pytest.mark.parametrize("data", [
    gif([noise(56, 56, s) for s in range(20)])[:-300],  # truncated in its last (sampled) frames
    apng_claiming(50, 3),
    (lambda g: g[:len(g) * 9 // 10])(gif([noise(56, 56, s) for s in range(20)], duration=20)),  # IndexError in a seek
])
def test_a_broken_animation_is_a_value_error_naming_it(data):
    with pytest.raises(ValueError, match=r"^video( frame \d+)?: corrupt"):
        VisionProcessor().video(data)


def test_only_the_sampled_frames_of_an_animation_are_decoded(monkeypatch):
    import k3.model.vision_processor as vp

    decoded = []
    real = vp._rgb
    monkeypatch.setattr(vp, "_rgb", lambda img, what: decoded.append(what) or real(img, what))
    items = VisionProcessor().video(gif([noise(28, 28, s) for s in range(40)], duration=20))  # 50 fps, 0.8 s
    assert decoded == ["video frame 0", "video frame 25"] and [it.grid_thw[0] for it in items] == [2]
    with pytest.raises(ValueError, match="40 frames of 28x28 is past the limit of 31,359 pixels to decode"):
        VisionProcessor(ProcessorConfig(max_video_decode_pixels=40 * 28 * 28 - 1)).video(
            gif([noise(28, 28, s) for s in range(40)], duration=20))


def test_sixteen_bit_grey_keeps_its_range():
    grey = np.linspace(0, 65535, 56 * 56).reshape(56, 56).astype(np.uint16)
    item = VisionProcessor().image(encoded(grey))
    values = item.pixel_values[:, 0].flatten()
    assert values.unique().numel() > 200 and (values == 1.0).float().mean() < 0.01  # was 99.6% white


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees to show
    item = VisionProcessor().image(encoded(noise(40, 100), "JPEG", exif=exif.tobytes()))
    assert item.original_size == (40, 100)  # as shown, not as stored


def test_a_phones_multi_picture_jpeg_is_an_image():
    buf = io.BytesIO()
    Image.fromarray(noise(28, 28)).save(buf, "MPO", save_all=True, append_images=[Image.fromarray(noise(28, 28, 1))])
    assert VisionProcessor().image(buf.getvalue()).original_size == (28, 28)


def test_pillows_bomb_warning_is_not_k3s_limit():
    from k3.model.vision_processor import PIL_MAX_PIXELS, _open

    big = encoded(np.zeros((9500, 9500), np.uint8))  # 90.25M pixels: past Pillow's warning, under k3's 100M
    assert _open(big, "image", ("PNG",), ProcessorConfig()).size == (9500, 9500)  # the header only
    with pytest.raises(ValueError, match="past the hard limit of 90,000,000 pixels"):
        _open(big, "image", ("PNG",), ProcessorConfig(max_image_pixels=90_000_000))
    with pytest.raises(ValueError, match="max_image_pixels must be <="):
        ProcessorConfig(max_image_pixels=PIL_MAX_PIXELS + 1)


def test_base64_wrapped_in_lines_or_unpadded_is_read():
    data = encoded(noise(28, 28))
    wrapped = base64.encodebytes(data).decode()  # a line break every 76 characters, as `base64` writes
    unpadded = base64.b64encode(data).decode().rstrip("=")
    for payload in (wrapped, unpadded):
        item = VisionProcessor().image("data:image/png;base64," + payload)
        assert item.content_hash == VisionProcessor().image(data).content_hash


def test_transparent_pictures_are_laid_over_white_from_every_source():
    """A transparent logo's black text (RGBA 0,0,0,255 on 0,0,0,0) stays visible: dropping the
    alpha showed it black on black."""
    logo = np.zeros((28, 28, 4), np.uint8)
    logo[8:20, 8:20, 3] = 255
    cfg = ProcessorConfig()
    out = load_image(encoded(logo), cfg)
    assert (out[0, 0] == 255).all() and (out[12, 12] == 0).all()
    # half-transparent colours: bytes, the PIL image, uint8 and float arrays give the same pixels
    rgba = np.random.default_rng(3).integers(0, 256, (28, 28, 4), dtype=np.uint8)
    want = load_image(Image.fromarray(rgba, "RGBA"), cfg)
    for src in (encoded(rgba), rgba, rgba.astype(np.float64) / 255):
        np.testing.assert_array_equal(load_image(src, cfg), want)
    assert not np.array_equal(want, rgba[..., :3])
    # a palette PNG whose transparent colour is a palette entry (tRNS), and grey with alpha
    pal = Image.fromarray(logo, "RGBA").convert("P")
    assert load_image(pal, cfg)[0, 0].tolist() == [255, 255, 255]
    buf = io.BytesIO()
    Image.fromarray(np.stack([np.zeros((28, 28), np.uint8), logo[..., 3]], -1), "LA").save(buf, "PNG")
    assert load_image(buf.getvalue(), cfg)[0, 0].tolist() == [255, 255, 255]
    # an opaque picture is as before
    rgb = noise(28, 28, 4)
    np.testing.assert_array_equal(load_image(np.concatenate([rgb, np.full((28, 28, 1), 255, np.uint8)], -1), cfg), rgb)


@pytest.mark.parametrize("h, w, limit", [(112, 112, 16384), (400, 90, 64), (1000, 30, 256), (29, 57, 4), (8, 8, 16)])
def test_a_header_gives_the_image_tokens_or_fewer_without_decoding(h, w, limit, monkeypatch):
    vp = VisionProcessor(ProcessorConfig(in_patch_limit=limit))
    raw = encoded(noise(h, w))
    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    tokens = vp.image(raw).num_tokens
    with monkeypatch.context() as m:  # no pixel decoded for the count
        m.setattr(Image.Image, "load", lambda self: (_ for _ in ()).throw(AssertionError("decoded")))
        assert 0 < vp.image_tokens_at_least(raw) == vp.image_tokens_at_least(url) <= tokens
    assert vp.image_tokens_at_least(Image.fromarray(noise(h, w))) <= tokens
    assert vp.image_tokens_at_least(noise(h, w)) == 0  # an array has no header: a lower bound of 0


def test_an_exif_rotated_header_counts_no_more_than_the_picture_shown():
    exif = Image.Exif()
    exif[0x0112] = 6
    raw = encoded(noise(40, 300), "JPEG", exif=exif.tobytes())
    vp = VisionProcessor(ProcessorConfig(in_patch_limit=64))
    assert vp.image_tokens_at_least(raw) <= vp.image(raw).num_tokens


@pytest.mark.parametrize("src, match", [
    ("http://example.com/cat.png", "remote URL"),
    (b"\x89PNG\r\n\x1a\nnot really a png", "corrupt"),
    (_bmp(), "unsupported format BMP"),
])
def test_a_header_count_refuses_what_the_image_refuses(src, match):
    with pytest.raises(ValueError, match=match):
        VisionProcessor().image_tokens_at_least(src)
