"""Images and video to MoonViT-V2 patches and K3 prompt text.

K3's rule: an image is resized (aspect ratio kept) to fit a patch budget, padded right and
bottom to a multiple of patch_size * merge (28), scaled to [0, 1] and normalised with mean and
std 0.5, then cut into [3, 14, 14] patches in (frame, row, column) order. A video is sampled at
up to 2 fps and cut into chunks of 4 frames; each chunk is one media item with its own
timestamp. In the prompt an item is

    image:  <|media_begin|>image {W}x{H}<|media_content|><|media_pad|> x n <|media_end|>
    video:  {HH:MM:SS.mmm}<|media_begin|>video<|media_content|><|media_pad|> x n <|media_end|>

where W x H is the original size and n the item's token count after the 2x2 merge.

Sources: PNG/JPEG bytes, `data:` URLs, PIL images, arrays ([H, W], [H, W, 3|4], uint8 or
floats in [0, 1]); videos as frame lists, [T, H, W, 3] arrays, or animated GIF/PNG bytes. Remote
URLs are refused: nothing is fetched. Every bad input is a ValueError that names it. A picture
with transparency (an alpha channel, a palette's or a PNG's transparent colour, a 4-channel array)
is laid over white, as it is shown on a page: dropping the alpha would show the colour hidden under
transparent pixels, often black, so a transparent logo's black text would vanish.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from .vision_config import K3VisionConfig

MEDIA_BEGIN, MEDIA_CONTENT = "<|media_begin|>", "<|media_content|>"
MEDIA_END, MEDIA_PAD = "<|media_end|>", "<|media_pad|>"
MEDIA_TOKENS = (MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD)
IMAGE_FORMATS = ("PNG", "JPEG", "MPO")  # still images (MPO: a phone's multi-picture JPEG, its first picture)
VIDEO_FORMATS = ("GIF", "PNG")  # animated GIF / APNG containers, decoded frame by frame
# k3 checks every source's size against its own limit (ProcessorConfig.max_image_pixels) from the
# header, before any pixel is decoded; Pillow's own bomb warning (at 89.5M pixels) would otherwise
# refuse sizes under that limit. Its hard error, at twice that, stays: max_image_pixels may not
# pass it. Set once here: a warnings filter changed per call is process-wide, not per thread.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)
PIL_MAX_PIXELS = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
# what a broken file raises while Pillow decodes it (frame counts, seeks, pixel data)
WHITE = (255, 255, 255, 255)
_DECODE_ERRORS = (OSError, EOFError, ValueError, SyntaxError, struct.error, IndexError)


@dataclass
class ProcessorConfig:
    """Sizes and limits of the processor. Budgets are in 14x14 patches."""

    patch_size: int = 14
    merge_kernel_size: tuple[int, int] = (2, 2)
    in_patch_limit: int = 16384  # an image with more patches is resized down to fit
    patch_limit_on_one_side: int = 512  # no side longer than this many patches
    video_patch_limit_per_frame: int = 4096  # budget of each video frame
    max_image_pixels: int = 100_000_000  # hard limit on a source's size: past it, refused
    max_aspect_ratio: float = 200.0  # longer side / shorter side, past it refused
    sample_fps: float = 2.0  # videos are sampled at up to this rate
    frames_per_chunk: int = 4  # frames per video item (the tower's init_pos_emb_time)
    max_video_frames: int = 256  # sampled frames per video; more is refused
    # a video's frames x width x height, decoded to be sampled: past it, refused before decoding
    max_video_decode_pixels: int = 1 << 30

    def __post_init__(self) -> None:
        for fld in ("patch_size", "in_patch_limit", "patch_limit_on_one_side", "video_patch_limit_per_frame",
                    "max_image_pixels", "frames_per_chunk", "max_video_frames", "max_video_decode_pixels"):
            v = getattr(self, fld)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ProcessorConfig.{fld} must be a positive int, got {v!r}")
        if PIL_MAX_PIXELS is not None and self.max_image_pixels > PIL_MAX_PIXELS:
            raise ValueError(f"ProcessorConfig.max_image_pixels must be <= {PIL_MAX_PIXELS:,} (Pillow refuses larger "
                             f"images), got {self.max_image_pixels:,}")
        if self.sample_fps <= 0 or self.max_aspect_ratio < 1:
            raise ValueError("ProcessorConfig.sample_fps must be > 0 and max_aspect_ratio >= 1")

    @classmethod
    def for_vision(cls, vc: K3VisionConfig, **overrides: Any) -> "ProcessorConfig":
        """The processor that matches a tower: its patch size, merge kernel and chunk length."""
        return cls(patch_size=vc.patch_size, merge_kernel_size=tuple(vc.merge_kernel_size),
                   frames_per_chunk=vc.init_pos_emb_time, **overrides)

    @property
    def factor(self) -> int:
        """Pixel multiple each side is padded to (patch * merge; 28 for K3)."""
        return self.patch_size * max(self.merge_kernel_size)


@dataclass
class MediaItem:
    """One image or one video chunk, ready for the tower and the prompt."""

    kind: str  # "image" or "video"
    pixel_values: torch.Tensor  # [t * h * w, 3, p, p] float32, normalised
    grid_thw: tuple[int, int, int]  # frames, rows, columns in patches
    num_tokens: int  # placeholders it fills
    original_size: tuple[int, int]  # (W, H) of the source
    content_hash: str  # sha256 of kind, size and pixels: same media -> same hash
    timestamp: str | None = None  # video chunks: time of the first frame, HH:MM:SS.mmm

    def prefix(self) -> str:
        if self.kind == "image":
            return f"{MEDIA_BEGIN}image {self.original_size[0]}x{self.original_size[1]}{MEDIA_CONTENT}"
        return f"{self.timestamp}{MEDIA_BEGIN}video{MEDIA_CONTENT}"

    def prompt(self) -> str:
        return self.prefix() + MEDIA_PAD * self.num_tokens + MEDIA_END


# -- decoding -----------------------------------------------------------------------------------
def _bytes_from_string(src: str, what: str) -> bytes:
    low = src[:16].lower()
    if low.startswith(("http://", "https://", "ftp://", "file://")):
        raise ValueError(f"{what}: remote URL {src[:64]!r} refused; send the content inline as a data: URL")
    if not low.startswith("data:"):
        raise ValueError(f"{what}: a string source must be a data: URL, got {src[:32]!r}")
    head, sep, payload = src.partition(",")
    if not sep or ";base64" not in head:
        raise ValueError(f"{what}: data URL must be base64 ('data:<type>;base64,<payload>')")
    # the declared type is not trusted (the bytes say what they are: a PNG labelled image/jpeg is
    # read), but one that is neither a picture nor a video nor untyped bytes is a client's mistake
    mime = head[5:].split(";", 1)[0].strip().lower()
    if mime and not mime.startswith(("image/", "video/")) and mime != "application/octet-stream":
        raise ValueError(f"{what}: data URL declares {mime[:64]!r}; send an image/* or video/* data URL")
    # line breaks (as `base64` and MIME encoders wrap) and missing padding are read, not refused
    payload = "".join(payload.split())
    payload += "=" * (-len(payload) % 4)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what}: data URL payload is not valid base64") from None


def _open(data: bytes, what: str, formats: Sequence[str], cfg: ProcessorConfig) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
    except Image.DecompressionBombError:
        raise ValueError(f"{what}: past the hard limit of {cfg.max_image_pixels:,} pixels") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{what}: corrupt or unrecognised image bytes ({type(e).__name__})") from None
    if img.format not in formats:
        raise ValueError(f"{what}: unsupported format {img.format}; accepted: {', '.join(formats)}")
    _check_size(img.size, what, cfg)
    return img


def _check_size(size: tuple[int, int], what: str, cfg: ProcessorConfig) -> None:
    w, h = size
    if w < 1 or h < 1:
        raise ValueError(f"{what}: empty image {w}x{h}")
    if w * h > cfg.max_image_pixels:
        raise ValueError(f"{what}: {w}x{h} is past the hard limit of {cfg.max_image_pixels:,} pixels")
    if max(w, h) / min(w, h) > cfg.max_aspect_ratio:
        raise ValueError(f"{what}: aspect ratio {max(w, h) / min(w, h):.0f} is past the limit {cfg.max_aspect_ratio:g}")


def _transparent(img: Image.Image) -> bool:
    """Whether a picture holds transparency: an alpha channel, a transparent colour (a PNG's tRNS,
    a GIF's), or a palette with alpha (Pillow >= 10.1's `has_transparency_data`, for 10.0 too)."""
    return (img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info
            or (img.mode == "P" and img.palette is not None and img.palette.mode.endswith("A")))


def _rgb(img: Image.Image, what: str) -> np.ndarray:
    try:
        if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
            # 16-bit grey: Pillow's own conversion clips at 255; scale the range down instead
            grey = (np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8)
            return np.repeat(grey[..., None], 3, axis=-1)
        if _transparent(img):
            rgba = img.convert("RGBA")
            return np.asarray(Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB"),
                              dtype=np.uint8)
        return np.asarray(img.convert("RGB"), dtype=np.uint8)
    except _DECODE_ERRORS as e:  # truncated or broken data shows up at decode time
        raise ValueError(f"{what}: corrupt image data ({type(e).__name__}: {e})") from None


def _upright(img: Image.Image, what: str) -> Image.Image:
    """The picture as it is shown: a JPEG's EXIF orientation applied (a phone's portrait photo is
    stored sideways with a tag saying so)."""
    try:
        return ImageOps.exif_transpose(img)
    except _DECODE_ERRORS as e:
        raise ValueError(f"{what}: corrupt image data ({type(e).__name__}: {e})") from None


def _array_rgb(a: np.ndarray, what: str, cfg: ProcessorConfig) -> np.ndarray:
    if a.ndim == 2:
        a = np.repeat(a[..., None], 3, axis=-1)
    elif not (a.ndim == 3 and a.shape[-1] in (3, 4)):
        raise ValueError(f"{what}: array must be [H, W], [H, W, 3] or [H, W, 4], got shape {a.shape}")
    _check_size((a.shape[1], a.shape[0]), what, cfg)
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all() or a.min() < 0 or a.max() > 1:
            raise ValueError(f"{what}: float arrays must hold finite values in [0, 1]")
        if a.shape[-1] == 4:  # over white
            a = a[..., :3] * a[..., 3:] + (1 - a[..., 3:])
        return np.round(a * 255).astype(np.uint8)
    if a.dtype != np.uint8:
        raise ValueError(f"{what}: array dtype must be uint8 or floating, got {a.dtype}")
    if a.shape[-1] == 4:  # over white, rounded as Pillow's alpha_composite rounds
        alpha = a[..., 3:].astype(np.uint32)
        a = ((a[..., :3] * alpha + 255 * (255 - alpha) + 127) // 255).astype(np.uint8)
    return a


def load_image(src: Any, cfg: ProcessorConfig, what: str = "image") -> np.ndarray:
    """Any still-image source -> [H, W, 3] uint8."""
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    if isinstance(src, np.ndarray):
        return _array_rgb(src, what, cfg)
    if isinstance(src, Image.Image):
        _check_size(src.size, what, cfg)
        return _rgb(src, what)
    if isinstance(src, str):
        src = _bytes_from_string(src, what)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _rgb(_upright(_open(bytes(src), what, IMAGE_FORMATS, cfg), what), what)
    raise ValueError(f"{what}: unsupported source type {type(src).__name__}")


def load_video(src: Any, cfg: ProcessorConfig, fps: float | None = None) -> tuple[list[np.ndarray], np.ndarray, float]:
    """Any video source -> (its sampled frames [H, W, 3] uint8, their indices, the source fps).
    Frame lists and arrays take `fps` (default: already at the sampling rate); animated GIF/PNG
    carry their own timing, and only the frames the sampling keeps are decoded into arrays."""
    if isinstance(src, torch.Tensor):
        src = src.detach().cpu().numpy()
    if isinstance(src, str):
        src = _bytes_from_string(src, "video")
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _animation_frames(_open(bytes(src), "video", VIDEO_FORMATS, cfg), cfg, fps)
    if isinstance(src, np.ndarray):
        if src.ndim != 4:
            raise ValueError(f"video: array must be [T, H, W, 3], got shape {src.shape}")
        src = list(src)
    if not isinstance(src, (list, tuple)) or not src:
        raise ValueError(f"video: expected a non-empty frame list, array or animated image, got {type(src).__name__}")
    if len(src) > cfg.max_video_frames * 64:
        raise ValueError(f"video: {len(src)} frames is more than allowed ({cfg.max_video_frames * 64} before sampling)")
    frames = [load_image(f, cfg, f"video frame {i}") for i, f in enumerate(src)]
    _same_size(frames, range(len(frames)))
    src_fps = fps or cfg.sample_fps
    idx = sampled_frames(len(frames), src_fps, cfg)
    return [frames[i] for i in idx], idx, src_fps


def _same_size(frames: Sequence[np.ndarray], idx: Sequence[int]) -> None:
    size = (frames[0].shape[1], frames[0].shape[0])
    odd = [(i, f) for i, f in zip(idx, frames) if (f.shape[1], f.shape[0]) != size]
    if odd:
        i, f = odd[0]
        raise ValueError(f"video: frame {i} is {f.shape[1]}x{f.shape[0]}, frame {idx[0]} is {size[0]}x{size[1]}; "
                         f"all frames must have one size")


def _animation_frames(img: Image.Image, cfg: ProcessorConfig,
                      fps: float | None) -> tuple[list[np.ndarray], np.ndarray, float]:
    """An animated GIF / APNG -> `load_video`'s triple. The frames' timing is read first (a pass
    of seeks); only the kept frames are held as arrays, and a file whose frames would take more
    than `max_video_decode_pixels` to decode is refused before any is."""
    try:
        n = getattr(img, "n_frames", 1)
        if n > cfg.max_video_frames * 64:
            raise ValueError(f"video: {n} frames is more than allowed ({cfg.max_video_frames * 64} before sampling)")
        w, h = img.size
        if n * w * h > cfg.max_video_decode_pixels:
            raise ValueError(f"video: {n} frames of {w}x{h} is past the limit of {cfg.max_video_decode_pixels:,} "
                             f"pixels to decode")
        total_ms = 0.0
        for i in range(n):
            img.seek(i)
            total_ms += float(img.info.get("duration", 500) or 500)
        src_fps = fps if fps is not None else 1000.0 * n / total_ms
        idx = sampled_frames(n, src_fps, cfg)
        frames = []
        for i in idx:
            img.seek(int(i))
            frames.append(_rgb(img, f"video frame {i}"))
    except ValueError:
        raise
    except _DECODE_ERRORS as e:
        raise ValueError(f"video: corrupt animation data ({type(e).__name__}: {e})") from None
    _same_size(frames, idx)
    return frames, idx, src_fps


def sampled_frames(n: int, src_fps: float, cfg: ProcessorConfig) -> np.ndarray:
    """Indices of the frames a video of `n` frames at `src_fps` is sampled at: one every
    1 / min(sample_fps, src_fps) seconds, so timestamps are on the sampling clock."""
    if src_fps <= 0 or not math.isfinite(src_fps):
        raise ValueError(f"video: fps must be positive, got {src_fps}")
    rate = min(cfg.sample_fps, src_fps)
    k = max(1, round(n * rate / src_fps))
    if k > cfg.max_video_frames:
        raise ValueError(f"video: {k} sampled frames is more than allowed ({cfg.max_video_frames})")
    return np.minimum(np.round(np.arange(k) * src_fps / rate), n - 1).astype(int)


# -- geometry -----------------------------------------------------------------------------------
def fit_size(w: int, h: int, patch_limit: int, cfg: ProcessorConfig) -> tuple[int, int, int, int]:
    """(new_w, new_h, padded_w, padded_h): scaled down (never up) so the patch count and each
    side fit, aspect ratio kept, then padded to a multiple of cfg.factor."""
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    scale = min(1.0, math.sqrt(patch_limit / (max(1, w // p) * max(1, h // p))), side * p / w, side * p / h)
    nw, nh = min(max(1, int(w * scale)), side * p), min(max(1, int(h * scale)), side * p)
    f = cfg.factor
    return nw, nh, -(-nw // f) * f, -(-nh // f) * f


def _prepare_frames(frames: list[np.ndarray], patch_limit: int, cfg: ProcessorConfig) -> np.ndarray:
    """Resize, pad and normalise same-size frames -> [T, 3, H', W'] float32."""
    h, w = frames[0].shape[:2]
    nw, nh, pw, ph = fit_size(w, h, patch_limit, cfg)
    out = np.zeros((len(frames), 3, ph, pw), dtype=np.float32)
    for i, f in enumerate(frames):
        if (nw, nh) != (w, h):
            f = np.asarray(Image.fromarray(f).resize((nw, nh), Image.Resampling.BICUBIC))
        out[i, :, :nh, :nw] = f.transpose(2, 0, 1) / 255.0
    return (out - 0.5) / 0.5  # padding is black before normalisation, as in the release


def patchify(x: np.ndarray, p: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[T, 3, H, W] -> patches [T * H/p * W/p, 3, p, p] in (frame, row, column) order."""
    t, c, H, W = x.shape
    a = x.reshape(t, c, H // p, p, W // p, p).transpose(0, 2, 4, 1, 3, 5)
    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1, c, p, p)), (t, H // p, W // p)


def _timestamp(seconds: float) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


class VisionProcessor:
    """Sources to MediaItems (`image`, `video`), items to tower input (`collate`)."""

    def __init__(self, cfg: ProcessorConfig | None = None) -> None:
        self.cfg = cfg or ProcessorConfig()

    def _item(self, kind: str, x: np.ndarray, size: tuple[int, int], timestamp: str | None = None) -> MediaItem:
        pv, grid = patchify(x, self.cfg.patch_size)
        kh, kw = self.cfg.merge_kernel_size
        digest = hashlib.sha256(f"{kind}:{size}:{grid}:".encode())
        digest.update(pv.numpy().tobytes())
        return MediaItem(kind=kind, pixel_values=pv, grid_thw=grid, num_tokens=(grid[1] // kh) * (grid[2] // kw),
                         original_size=size, content_hash=digest.hexdigest(), timestamp=timestamp)

    def image_tokens_at_least(self, src: Any) -> int:
        """The placeholders `image(src)` fills, or fewer, read from the image's header (no pixel is
        decoded; a JPEG's EXIF rotation may swap its sides, so the smaller count of the two); 0 for
        a source without a header to read. Refuses what `image` refuses for its bytes, format and
        size."""
        if isinstance(src, str):
            src = _bytes_from_string(src, "image")
        if isinstance(src, (bytes, bytearray, memoryview)):
            w, h = _open(bytes(src), "image", IMAGE_FORMATS, self.cfg).size
        elif isinstance(src, Image.Image):
            w, h = src.size
        else:
            return 0
        return min(self._tokens(w, h), self._tokens(h, w))

    def _tokens(self, w: int, h: int) -> int:
        p, (kh, kw) = self.cfg.patch_size, self.cfg.merge_kernel_size
        _, _, pw, ph = fit_size(w, h, self.cfg.in_patch_limit, self.cfg)
        return (ph // p // kh) * (pw // p // kw)

    def image(self, src: Any) -> MediaItem:
        rgb = load_image(src, self.cfg)
        size = (rgb.shape[1], rgb.shape[0])
        return self._item("image", _prepare_frames([rgb], self.cfg.in_patch_limit, self.cfg), size)

    def video(self, src: Any, fps: float | None = None) -> list[MediaItem]:
        """One MediaItem per chunk of up to frames_per_chunk sampled frames."""
        frames, idx, src_fps = load_video(src, self.cfg, fps)
        size = (frames[0].shape[1], frames[0].shape[0])
        n = len(idx)
        x = _prepare_frames(frames, self.cfg.video_patch_limit_per_frame, self.cfg)
        k = self.cfg.frames_per_chunk
        return [self._item("video", x[s:s + k], size, _timestamp(idx[s] / src_fps)) for s in range(0, n, k)]

    @staticmethod
    def collate(items: Sequence[MediaItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """Items (in placeholder order) -> pixel_values [N, 3, p, p], grid_thws [M, 3]."""
        if not items:
            raise ValueError("collate: no media items")
        return (torch.cat([it.pixel_values for it in items]),
                torch.tensor([it.grid_thw for it in items], dtype=torch.long))


# -- prompts ------------------------------------------------------------------------------------
def media_token_ids(token_to_id: Callable[[str], int | None]) -> dict[str, int]:
    """{'begin', 'content', 'end', 'pad'} ids; ValueError if the tokenizer lacks one."""
    ids = {name: token_to_id(tok) for name, tok in zip(("begin", "content", "end", "pad"), MEDIA_TOKENS)}
    missing = [MEDIA_TOKENS[i] for i, v in enumerate(ids.values()) if v is None]
    if missing:
        raise ValueError(f"tokenizer has no media special tokens {missing} (train it with k3.model.tokenizer)")
    return ids


def encode_interleaved(parts: Sequence[str | MediaItem], encode: Callable[[str], list[int]],
                       token_to_id: Callable[[str], int | None]) -> tuple[list[int], list[MediaItem]]:
    """Text and media in order -> (token ids with each item's prompt, the items in order).

    Special tokens are written by id (never left to the text tokenizer), so a caption that
    happens to contain '<|media_pad|>' cannot add placeholders."""
    ids_of = media_token_ids(token_to_id)
    ids: list[int] = []
    items: list[MediaItem] = []
    for part in parts:
        if isinstance(part, str):
            ids += encode(part)
            continue
        if not isinstance(part, MediaItem):
            raise ValueError(f"parts must be str or MediaItem, got {type(part).__name__}")
        if part.kind == "image":
            ids += [ids_of["begin"]] + encode(f"image {part.original_size[0]}x{part.original_size[1]}")
        else:
            ids += encode(part.timestamp) + [ids_of["begin"]] + encode("video")
        ids += [ids_of["content"]] + [ids_of["pad"]] * part.num_tokens + [ids_of["end"]]
        items.append(part)
    return ids, items
