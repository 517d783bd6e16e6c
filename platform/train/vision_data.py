"""The bundled image-text and video-text set, and multimodal training batches.

Derived offline from data that packages ship, nothing downloaded:
- scikit-learn's 1,797 handwritten digits (8x8), rendered at 28, 42 and 56 pixels with a
  caption naming the digit ("The digit is #7.");
- 4-frame clips at 2 fps of a 42-pixel digit drifting in a straight line on a 56x56 canvas, at
  most 2 pixels per frame along each axis ("The moving digit is #7."): `train_clips` clips per
  training digit, each on its own path, and one per held-out digit;
- scikit-image's bundled photos (up to 1411x1411) with a short caption, which exercise the
  processor's resize-to-budget path.
The last `heldout` digits (images and clips made from them) are kept out of training for
jobs/eval_vision.py.

On disk (`<data>/media/`): `train.parquet` and `heldout.parquet`, one row per example with
columns kind ("image" | "video"), frames (list of PNG bytes), fps, caption, label (the digit,
-1 for photos), and `media.json` (counts, the processor budget).

A training example is one packed sequence: <bos> media prompt caption <eos>; a multimodal
batch packs text rows and examples into one row with cu_seqlens, plus the tower's input.
"""
from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from PIL import Image

from k3.model.vision_processor import MediaItem, ProcessorConfig, VisionProcessor, encode_interleaved
from k3.model.directory import write_beside

from . import storage
from .data import MEDIA_DIR

DIGIT_SIZES = (28, 42, 56)
CLIP_CANVAS, CLIP_DIGIT, CLIP_FRAMES, CLIP_FPS = 56, 42, 4, 2.0
# Pixels a clip's digit moves per frame along each axis, at most. sd2_tpool averages a chunk's
# four frames before the projector: a drift of a few pixels (under half a 14-pixel patch over the
# clip) keeps that mean a legible digit, while a slide across the canvas (the first version: up
# to 28 pixels) blurs it into a smear no tiny tower learned to read (clips stayed at chance).
CLIP_MAX_STEP = 2
PHOTOS = {  # scikit-image's bundled photos and what they show
    "astronaut": "an astronaut", "camera": "a man with a camera", "coffee": "a cup of coffee",
    "chelsea": "a cat", "rocket": "a rocket on its launch pad", "moon": "the surface of the moon",
    "page": "a page of printed text", "text": "text on a sign", "coins": "old coins",
    "clock": "a clock", "hubble_deep_field": "galaxies in deep space", "retina": "a human retina",
    "immunohistochemistry": "stained tissue under a microscope", "checkerboard": "a checkerboard",
}
# The digit follows '#' so byte-level BPE always sees it as its own pre-token: "0".."9" are then
# single tokens in any k3 tokenizer, and the eval compares exactly ten next-token logits.
IMAGE_PROMPT, VIDEO_PROMPT = " The digit is #", " The moving digit is #"
SCHEMA = pa.schema([("kind", pa.string()), ("frames", pa.list_(pa.binary())), ("fps", pa.float32()),
                    ("caption", pa.string()), ("label", pa.int32())])


def _png(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


def _digit_rgb(d8: np.ndarray, size: int) -> np.ndarray:
    """An 8x8 digit (values 0..16) as a size x size RGB image, white ink on black."""
    g = Image.fromarray((d8 * (255 / 16)).clip(0, 255).astype(np.uint8)).resize((size, size), Image.Resampling.BILINEAR)
    return np.repeat(np.asarray(g)[..., None], 3, axis=-1)


def _clip(d8: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Four frames of the digit drifting in a straight line, (dy, dx) pixels per frame with
    |dy|, |dx| <= CLIP_MAX_STEP and not both zero; the whole digit stays on the canvas."""
    digit = _digit_rgb(d8, CLIP_DIGIT)
    room, span = CLIP_CANVAS - CLIP_DIGIT, CLIP_FRAMES - 1
    steps = [(dy, dx) for dy in range(-CLIP_MAX_STEP, CLIP_MAX_STEP + 1)
             for dx in range(-CLIP_MAX_STEP, CLIP_MAX_STEP + 1) if (dy, dx) != (0, 0)]
    dy, dx = steps[rng.integers(len(steps))]
    # first position such that position + f * step stays in [0, room] for every frame f
    y0 = rng.integers(max(0, -dy * span), room - max(0, dy * span) + 1)
    x0 = rng.integers(max(0, -dx * span), room - max(0, dx * span) + 1)
    frames = []
    for f in range(CLIP_FRAMES):
        y, x = y0 + f * dy, x0 + f * dx
        canvas = np.zeros((CLIP_CANVAS, CLIP_CANVAS, 3), np.uint8)
        canvas[y:y + CLIP_DIGIT, x:x + CLIP_DIGIT] = digit
        frames.append(canvas)
    return frames


def _photos() -> list[dict]:
    import skimage.data

    rows = []
    for name, what in PHOTOS.items():
        a = np.asarray(getattr(skimage.data, name)())
        if a.dtype == bool:
            a = a.astype(np.uint8) * 255
        a = np.repeat(a[..., None], 3, axis=-1) if a.ndim == 2 else a[..., :3]
        rows.append({"kind": "image", "frames": [_png(np.ascontiguousarray(a))], "fps": 0.0,
                     "caption": f" A photo of {what}.", "label": -1})
    return rows


def _examples(digits, idx, split: str, train_clips: int, rng: np.random.Generator, photos: bool) -> list[dict]:
    """Rows of one split: each digit at every size, its clips, and (training) the photos."""
    rows = []
    for i in idx:
        d8, label = digits.images[i], int(digits.target[i])
        for size in DIGIT_SIZES:
            rows.append({"kind": "image", "frames": [_png(_digit_rgb(d8, size))], "fps": 0.0,
                         "caption": f"{IMAGE_PROMPT}{label}.", "label": label})
        for _ in range(train_clips if split == "train" else 1):
            rows.append({"kind": "video", "frames": [_png(f) for f in _clip(d8, rng)], "fps": CLIP_FPS,
                         "caption": f"{VIDEO_PROMPT}{label}.", "label": label})
    if split == "train" and photos:
        rows += _photos()
    return rows


def write_vision_set(out_dir: str | Path, heldout: int = 300, seed: int = 0, max_digits: int | None = None,
                     photos: bool = True, train_clips: int = 2) -> dict:
    """Write `<out_dir>/media/{train,heldout}.parquet` and `media.json`; returns the info.
    max_digits: use only the first that many digits after shuffling (quick tests). train_clips:
    clips per training digit (each drifts along its own random path; a digit has three images,
    so with 1 clips are a quarter of the examples and learned last). A rerun with the same
    settings finds media.json and does nothing. The new set is written beside media/ and swapped
    in whole (k3.model.directory): a writer killed midway leaves the previous set."""
    from sklearn.datasets import load_digits

    root = Path(out_dir) / MEDIA_DIR
    settings = {"heldout": heldout, "seed": seed, "sizes": list(DIGIT_SIZES), "max_digits": max_digits,
                "photos": photos, "train_clips": train_clips, "version": 3}
    if (root / "media.json").exists():
        info = json.loads((root / "media.json").read_text())
        if info.get("settings") == settings:
            return info
    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.target))[:max_digits]
    n = len(order)
    if not 0 < heldout < n:
        raise ValueError(f"heldout must be in (0, {n}) digits, got {heldout}")
    if not 1 <= train_clips <= 8:
        raise ValueError(f"train_clips must be in [1, 8] clips per training digit, got {train_clips}")
    splits = {"train": order[:-heldout], "heldout": order[-heldout:]}
    counts = {}
    with write_beside(root) as stage:
        for split, idx in splits.items():
            rows = _examples(digits, idx, split, train_clips, rng, photos)
            pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), stage / f"{split}.parquet")
            counts[split] = {"rows": len(rows), "images": sum(r["kind"] == "image" for r in rows),
                             "videos": sum(r["kind"] == "video" for r in rows)}
        info = {"settings": settings, "counts": counts, "files": {s: f"{s}.parquet" for s in splits}}
        (stage / "media.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def read_vision_rows(data_dir: str | Path, split: str) -> list[dict]:
    """The rows of one split of the media set under a prepared-data path or URI."""
    loc = storage.join(str(data_dir), MEDIA_DIR, f"{split}.parquet")
    if not storage.exists(loc):
        raise ValueError(f"no {split} media set at {loc}: run jobs/prepare_data.py --vision")
    fs, path = storage.filesystem(loc)
    return pq.read_table(path, filesystem=fs).to_pylist()


def training_processor_config() -> ProcessorConfig:
    """The small budget the tiny model trains with: photos shrink to at most 64 patches."""
    return ProcessorConfig(in_patch_limit=64, video_patch_limit_per_frame=64)


@dataclass
class Example:
    """One training/eval sequence: token ids (placeholders included) and its media items."""

    ids: list[int]
    items: list[MediaItem]
    label: int


class ExampleEncoder:
    """Rows of the media set -> Examples: <bos> prompt(media) caption <eos>."""

    def __init__(self, encode: Callable[[str], list[int]], token_to_id: Callable[[str], int | None],
                 bos: int, eos: int, processor: VisionProcessor | None = None) -> None:
        self.encode, self.token_to_id, self.bos, self.eos = encode, token_to_id, bos, eos
        self.processor = processor or VisionProcessor(training_processor_config())

    def media(self, row: dict) -> list[MediaItem]:
        if row["kind"] == "image":
            return [self.processor.image(row["frames"][0])]
        return self.processor.video(list(row["frames"]), fps=row["fps"])

    def example(self, row: dict, caption: str | None = None, eos: bool = True) -> Example:
        parts: list = [*self.media(row), row["caption"] if caption is None else caption]
        ids, items = encode_interleaved(parts, self.encode, self.token_to_id)
        return Example([self.bos] + ids + ([self.eos] if eos else []), items, int(row["label"]))


def collate(examples: Sequence[Example], pad_id: int) -> dict:
    """Examples -> a right-padded batch for K3ForConditionalGeneration: input_ids [B, T],
    labels [B, T] (-100 on padding), last [B] (flat index of each row's last real token),
    pixel_values [N, 3, p, p] and grid_thws [M, 3] (None when no example has media).

    Right padding leaves every real position's causal context unchanged; rows are not packed
    because many short packed sequences cost the chunked KDA far more than a little padding."""
    if not examples:
        raise ValueError("collate: no examples")
    T = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), T), -100, dtype=torch.long)
    for r, e in enumerate(examples):
        ids[r, :len(e.ids)] = torch.tensor(e.ids)
        labels[r, :len(e.ids)] = ids[r, :len(e.ids)]
    lens = torch.tensor([len(e.ids) for e in examples])
    items = [it for e in examples for it in e.items]
    pv, grids = VisionProcessor.collate(items) if items else (None, None)
    return {"input_ids": ids, "labels": labels, "last": torch.arange(len(examples)) * T + lens - 1,
            "pixel_values": pv, "grid_thws": grids}


def digit_token_ids(encode: Callable[[str], list[int]]) -> list[int]:
    """The tokens of "0" ... "9": the ten classes the eval compares."""
    ids = [encode(str(d)) for d in range(10)]
    if any(len(i) != 1 for i in ids) or len({i[0] for i in ids}) != 10:
        raise ValueError(f"the tokenizer does not encode '0'..'9' as ten distinct single tokens: {ids}")
    return [i[0] for i in ids]


@torch.no_grad()
def classify_digits(model: torch.nn.Module, encoder: ExampleEncoder, rows: Sequence[dict], batch: int = 50) -> dict:
    """Top-1 over the ten digits for rows of the media set: the model reads the media and the
    caption up to the digit (" The digit is #" / " The moving digit is #") and the digit whose
    token gets the highest logit is its answer. Returns accuracy and counts per kind."""
    classes = torch.tensor(digit_token_ids(encoder.encode))
    hits = {"image": [0, 0], "video": [0, 0]}
    was_training = model.training
    model.eval()
    try:
        rows = [r for r in rows if r["label"] >= 0]
        for s in range(0, len(rows), batch):
            chunk = rows[s:s + batch]
            exs = [encoder.example(r, caption=IMAGE_PROMPT if r["kind"] == "image" else VIDEO_PROMPT, eos=False)
                   for r in chunk]
            b = collate(exs, pad_id=encoder.eos)
            logits = model(b["input_ids"], b["pixel_values"], b["grid_thws"], logits_at=b["last"]).logits
            pred = classes[logits[:, classes].argmax(-1)]
            for r, p in zip(chunk, pred.tolist()):
                hits[r["kind"]][0] += int(p == classes[r["label"]])
                hits[r["kind"]][1] += 1
    finally:
        model.train(was_training)
    return {f"{k}_top1": (h / n if n else None) for k, (h, n) in hits.items()} | \
        {f"{k}_count": n for k, (_, n) in hits.items()}


class MediaSchedule:
    """Which steps train on image/video examples and which on text, and the examples of each
    media step. Every text_every-th step (1-based) is a text step, the rest media steps, the same
    on every rank (the ranks' tower and MoE collectives stay in step). A worker draws its
    examples from its own slice of the media rows with a generator seeded by (seed, step, rank),
    so a resumed run draws the same batches."""

    def __init__(self, rows: Sequence[dict], encoder: ExampleEncoder, micro_batch: int, text_every: int,
                 seed: int, rank: int, world: int) -> None:
        if text_every < 1 or micro_batch < 1:
            raise ValueError(f"text_every and media micro_batch must be >= 1, got {text_every}, {micro_batch}")
        self.rows = list(rows)[rank::world]
        if len(self.rows) < micro_batch:
            raise ValueError(f"worker {rank}: {len(self.rows)} media rows cannot fill a batch of {micro_batch}")
        self.encoder, self.micro_batch, self.text_every = encoder, micro_batch, text_every
        self.seed, self.rank = seed, rank

    def is_text_step(self, step: int) -> bool:
        return (step + 1) % self.text_every == 0

    def text_steps_before(self, step: int) -> int:
        """Text batches consumed by steps [0, step): where a resumed run's text reader starts."""
        return step // self.text_every

    def examples(self, step: int) -> list[Example]:
        rng = np.random.default_rng([self.seed, step, self.rank])
        return [self.encoder.example(self.rows[i]) for i in rng.choice(len(self.rows), self.micro_batch, replace=False)]


def read_vision_info(data_dir: str | Path) -> dict:
    """media.json of a prepared-data path or URI; ValueError when the media set was never written."""
    loc = storage.join(str(data_dir), MEDIA_DIR, "media.json")
    if not storage.exists(loc):
        raise ValueError(f"{data_dir} has no media set (no {loc}): run jobs/prepare_data.py --vision")
    return json.loads(storage.read_bytes(loc))
