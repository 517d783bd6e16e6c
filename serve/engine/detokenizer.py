"""Incremental detokenization that never splits a UTF-8 character, and stop-string matching.

For byte-level BPE tokenizers (k3's) each token maps to exact bytes, which go through an
incremental UTF-8 decoder: a character split across tokens is emitted once its last byte
arrives. Other tokenizers fall back to decoding a sliding window and holding back text that
ends in U+FFFD.
"""
from __future__ import annotations

import codecs

from tokenizers import Tokenizer


def _byte_level_table(tok: Tokenizer) -> list[bytes] | None:
    # GPT-2's byte <-> printable-unicode map, which byte-level BPE vocabularies are written in.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    table: list[bytes] = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        s = tok.id_to_token(i)
        if s is None or s in special:
            table.append(b"")
            continue
        if any(ch not in inv for ch in s):
            return None  # not a byte-level vocabulary
        table.append(bytes(inv[ch] for ch in s))
    return table


class Detokenizer:
    """Shared per tokenizer; `stream()` gives one request's incremental state."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.table = _byte_level_table(tokenizer)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's exact bytes; b"" for an id the tokenizer lacks (a model's vocabulary may be
        larger than its tokenizer's)."""
        if self.table is not None:
            return self.table[token_id] if 0 <= token_id < len(self.table) else b""
        text = self.tokenizer.decode([token_id]) if self.tokenizer.id_to_token(token_id) is not None else ""
        return text.encode()

    def stream(self) -> "DetokStream":
        return DetokStream(self)


class DetokStream:
    def __init__(self, d: Detokenizer) -> None:
        self.d = d
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace") if d.table is not None else None
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        """The text that token_id completes (possibly empty)."""
        if self.decoder is not None:
            return self.decoder.decode(self.d.token_bytes(token_id))
        self.ids.append(token_id)
        tok = self.d.tokenizer
        prefix = tok.decode(self.ids[self.prefix_offset:self.read_offset])
        full = tok.decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        return self.decoder.decode(b"", final=True) if self.decoder is not None else ""


class StopMatcher:
    """Accumulates text, holds back what could still become a stop string, reports a match."""

    def __init__(self, stops: list[str], include: bool) -> None:
        self.stops, self.include = stops, include
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # everything accepted so far
        self.emitted = 0  # how much of text has been handed out

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text to emit now, whether a stop string matched)."""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        # The earliest match wins, whatever the order of the list; at one position, the longest.
        hits = [(i, -len(s), s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            i, _, s = min(hits)
            self.text = self.text[: i + (len(s) if self.include else 0)]
            return self._take(len(self.text)), True
        return self._take(max(self.emitted, len(self.text) - self.hold)), False

    def finish(self) -> str:
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out
