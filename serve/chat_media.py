"""Images and video in chat requests, at the ingress: `image_url` / `video_url` parts to processed
MediaItems and the prompt's token ids.

Why at the ingress: it already owns text (chat template, tokenizer); writing a picture into the
prompt needs its token count and original size, which only decoding it gives; and every bad
picture becomes a 4xx before any engine is touched. The patches then travel to the server
deployment by reference (the ingress `ray.put`s them and nests the ref in GenerateRequest), so a
decode replica forwards a reference and only the replica that runs the prompt reads the patches.

Only `data:` URLs are accepted: the server fetches nothing (an http(s) URL is a 400). Each part
is processed by k3.model.vision_processor with the deployment's MediaConfig limits: an image over
the patch budget is resized to fit, one past the hard pixel limit is refused, a video with more
sampled frames than allowed is refused.

The chat template renders each media part as a one-off placeholder string (a random nonce per
request, so no text can forge one); the rendered prompt is cut at those strings and every piece of
text is tokenized, every item written by id (`encode_interleaved`); a client's text that spells a
media token is encoded as its characters (`ChatTemplate.render_pieces`, `PromptEncoder`), and the
placeholder count is still checked against the items.
"""
from __future__ import annotations

import re
import secrets

from k3.model.config import K3Config
from k3.model.vision_processor import MediaItem, ProcessorConfig, VisionProcessor, encode_interleaved

from .chat import ChatTemplate, ClientText, PromptEncoder
from .config import MediaConfig
from .errors import OpenAIError
from .protocol import ChatMessage, ImageURLPart


class ChatMedia:
    """The ingress's media processing for one served model.

    Args:
        model_cfg: the served model's config (its vision_config decides whether media is served).
        config: the deployment's limits.
        model_id: the name clients use, for error messages.
    """

    def __init__(self, model_cfg: K3Config, config: MediaConfig, model_id: str) -> None:
        self.model_id, self.config = model_id, config
        self.placeholder_id = model_cfg.media_placeholder_token_id
        self.processor = None
        if model_cfg.vision_config is not None:
            vc = model_cfg.vision_config
            # no side longer than the tower's rotary table: a long thin picture is resized, not refused
            self.processor = VisionProcessor(ProcessorConfig.for_vision(
                vc, in_patch_limit=config.image_patch_limit, patch_limit_on_one_side=min(512, vc.rope_max_grid),
                video_patch_limit_per_frame=config.video_patch_limit_per_frame,
                max_video_frames=config.max_video_frames, max_image_pixels=config.max_image_pixels,
                max_video_decode_pixels=config.max_video_decode_pixels))

    def _named(self, i: int, j: int, part, work):
        """work(kind, url) for part j of message i; its ValueError a 400 naming the part."""
        kind = "image_url" if isinstance(part, ImageURLPart) else "video_url"
        try:
            return work(kind, getattr(part, kind).url)
        except ValueError as e:
            raise OpenAIError(f"messages[{i}].content[{j}]: {e}", param=f"messages[{i}].content[{j}].{kind}.url",
                              code="invalid_media") from None

    def _process(self, i: int, j: int, part) -> list[MediaItem]:
        return self._named(i, j, part, lambda kind, url: [self.processor.image(url)] if kind == "image_url"
                           else self.processor.video(url))

    def _check_room(self, parts, max_len: int) -> None:
        """Pictures that alone fill the context, found from their headers before any is decoded
        (decoding and resizing is the ingress's heaviest work, here for a request the context
        refuses anyway). Videos count 0 here: a lower bound."""
        least = sum(self._named(i, j, p, lambda kind, url: self.processor.image_tokens_at_least(url)
                                if kind == "image_url" else 0) for i, j, p in parts)
        if least >= max_len:
            raise OpenAIError(f"This model's maximum context length is {max_len} tokens; however, the "
                              f"{len(parts)} image/video part(s) alone fill at least {least}. Send fewer or "
                              f"smaller images.", param="messages", code="context_length_exceeded")

    def prompt(self, chat: ChatTemplate, messages: list[ChatMessage], encoder: PromptEncoder | None,
               max_len: int | None = None) -> tuple[list[int], list[MediaItem]]:
        """(token ids, media items in placeholder order) of a conversation with media parts.
        Every refusal is an OpenAIError (400) naming the part; with max_len (the context), pictures
        that cannot fit it are refused before any is decoded."""
        parts = [(i, j, p) for i, m in enumerate(messages) if not isinstance(m.content, str)
                 for j, p in enumerate(m.content) if p.type != "text"]
        if self.processor is None:
            raise OpenAIError(f"model {self.model_id!r} has no vision tower: image_url and video_url parts are "
                              f"refused", param="messages", code="media_not_supported")
        if len(parts) > self.config.max_items:
            raise OpenAIError(f"{len(parts)} image/video parts; at most {self.config.max_items} per request",
                              param="messages")
        if encoder is None:
            raise OpenAIError("this model was deployed without a tokenizer: send token ids", param="messages")
        if max_len is not None:
            self._check_room(parts, max_len)
        per_part = [self._process(i, j, p) for i, j, p in parts]
        nonce = secrets.token_hex(8)
        mark = "\ue000" + nonce + ":{}\ue001"  # private-use characters around a per-request nonce
        plain, k = [], 0
        for m in messages:
            d = m.model_dump(exclude_none=True)
            if not isinstance(m.content, str):
                for pd in d["content"]:
                    if pd["type"] != "text":
                        pd["placeholder"], k = mark.format(k), k + 1
            plain.append(d)
        # the rendered prompt's pieces, each plain one cut at the placeholders
        pattern = re.compile("\ue000" + nonce + r":(\d+)\ue001")
        seq: list = []
        order: list[int] = []
        for piece in chat.render_pieces(plain, encoder.specials):
            if isinstance(piece, ClientText):
                seq.append(piece)
                continue
            for n, text in enumerate(pattern.split(piece)):
                if n % 2:
                    order.append(int(text))
                    seq.extend(per_part[int(text)])
                elif text:
                    seq.append(text)
        if sorted(order) != list(range(len(parts))):
            raise OpenAIError(f"the chat template placed {len(order)} media placeholders for {len(parts)} image/video "
                              f"parts", param="messages")
        try:
            ids, items = encode_interleaved(seq, encoder, encoder.tokenizer.token_to_id)
        except ValueError as e:
            raise OpenAIError(f"this deployment cannot write media into prompts: {e}", status=500,
                              type="server_error") from None
        got, need = sum(1 for t in ids if t == self.placeholder_id), sum(it.num_tokens for it in items)
        if got != need:
            raise OpenAIError(f"the prompt holds {got} media placeholder tokens but its {len(items)} media item(s) "
                              f"fill {need} (is a media token written in the text?)", param="messages")
        return ids, items
