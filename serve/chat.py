"""Chat templates: a conversation (OpenAI messages) rendered to the prompt text the model reads.

    template = ChatTemplate.from_checkpoint("runs/x/checkpoint_000100/k3")  # or ChatTemplate()
    prompt = template.render(request.messages)      # ends with the assistant's opening
    ids = tokenizer.encode(prompt).ids
    SamplingParams(..., stop=template.stop)        # the turn ends at <|im_end|>

Templates are Jinja strings, as in Hugging Face checkpoints (`chat_template` in
tokenizer_config.json, stored and loaded by `k3.model.tokenizer`), rendered in Jinja's
immutable sandbox: a template comes with a checkpoint, which may come from anyone, and must not
reach Python internals. A template sees `messages` (dicts with `role` and `content`, the content
a string or a list of part dicts), `add_generation_prompt`, and `raise_exception(msg)` to refuse a
conversation it cannot render (a 400 for the client).

The default template has the Kimi shape: every turn is `<|im_{kind}|>{role}<|im_middle|>{text}<|im_end|>`
(kind system, user or assistant) and the answer opens with `<|im_assistant|>assistant<|im_middle|>`.
The markers are plain text to k3's byte-level tokenizer unless it was trained with them as
special tokens; the model learns them either way.

What a client wrote stays text. Encoded whole, a rendered prompt would turn a message that spells
a special token (`<|eos|>`, or a checkpoint's `<|im_end|>` when its tokenizer holds the markers as
special tokens) into that token: an end of text, or a forged turn. `render_pieces` gives such a
string back as a `ClientText` piece of its own, and `PromptEncoder` encodes those pieces with the
tokenizer's special tokens read as plain characters. A conversation none of whose strings spells
(or could complete) a special token renders to one piece and encodes exactly as the whole text.
"""
from __future__ import annotations

import copy
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from k3.model.tokenizer import load_chat_template, save_chat_template

from .errors import OpenAIError
from .protocol import ChatMessage

TURN_END = "<|im_end|>"

# Text parts of one message are joined with a newline, as ChatMessage.text() joins them. A picture
# or video part renders its `placeholder` string, which the ingress (serve/chat_media.py) gives each
# part and later replaces by the item's token ids; a media part without one is refused.
DEFAULT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' %}<|im_system|>"
    "{%- elif m.role == 'user' %}<|im_user|>"
    "{%- elif m.role == 'assistant' %}<|im_assistant|>"
    "{%- else %}{{ raise_exception('unknown role: ' ~ m.role) }}{% endif -%}"
    "{{ m.role }}<|im_middle|>"
    "{%- if m.content is string %}{{ m.content }}"
    "{%- else %}{% for p in m.content %}"
    "{%- if p.type != 'text' and p.placeholder is not defined %}"
    "{{ raise_exception(p.type ~ ' parts need the vision path') }}{% endif -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif %}"
    "{%- if p.type == 'text' %}{{ p.text }}{% else %}{{ p.placeholder }}{% endif %}"
    "{%- endfor %}{% endif -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif -%}"
)


class ClientText(str):
    """A piece of a rendered prompt that a client wrote: encoded as text, special tokens' spellings included."""


class _Refused(Exception):
    """What a template's raise_exception raises: the conversation, not the template, is at fault."""


def _raise_exception(message: str) -> None:
    raise _Refused(message)


class ChatTemplate:
    """A compiled chat template and the strings that end the assistant's turn.

    Args:
        template: Jinja source; the default is the Kimi-shaped DEFAULT_CHAT_TEMPLATE.
        stop: strings that end the generated turn (add them to the request's stop strings).
    """

    def __init__(self, template: str = DEFAULT_CHAT_TEMPLATE, stop: Sequence[str] = (TURN_END,)) -> None:
        if not template:
            raise ValueError("template must be a non-empty Jinja string")
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {list(stop)}")
        # trim/lstrip blocks as transformers renders checkpoint templates, so theirs render alike here
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._compiled = env.from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse (line {e.lineno}): {e.message}") from e
        self.source = template
        self.stop = list(stop)

    def render(self, messages: Sequence[ChatMessage | dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant's
        answer begins. A conversation the template refuses is a 400 (OpenAIError, param "messages")."""
        return self._render(_plain(messages), add_generation_prompt)

    def render_pieces(self, messages: Sequence[ChatMessage | dict[str, Any]], specials: Sequence[str] = (),
                      add_generation_prompt: bool = True) -> list[str]:
        """`render`'s text in pieces, in order: a client's string (a message's content, a text part,
        a name) that spells one of `specials`, or would complete one with the template's text beside
        it, is a ClientText piece of its own; the rest joins into plain str pieces (the whole text,
        one piece, when no string does). A template that does not show a client's strings as they
        were sent (it trims or splits them) cannot keep one that spells a special token apart: a 400
        naming it."""
        plain = _plain(messages)
        whole = self._render(plain, add_generation_prompt)
        specials = [t for t in specials if t]
        if not specials:
            return [whole]
        nonce = secrets.token_hex(8)
        sent: list[tuple[str, str]] = []  # (where, the client's string), by mark number

        def mark(text: Any, where: str) -> Any:
            if not isinstance(text, str) or not text:
                return text
            sent.append((where, text))
            return f"\ue000{nonce}:{len(sent) - 1}\ue001"

        apart = copy.deepcopy(plain)
        for i, m in enumerate(apart):
            if "name" in m:
                m["name"] = mark(m["name"], f"messages[{i}].name")
            if isinstance(m.get("content"), str):
                m["content"] = mark(m["content"], f"messages[{i}].content")
            elif isinstance(m.get("content"), list):
                for j, part in enumerate(m["content"]):
                    if isinstance(part, dict) and part.get("type") == "text":
                        part["text"] = mark(part.get("text"), f"messages[{i}].content[{j}].text")
        split = re.split("\ue000" + nonce + r":(\d+)\ue001", self._render(apart, add_generation_prompt))
        if "".join(sent[int(x)][1] if n % 2 else x for n, x in enumerate(split)) != whole:
            # the template changed what it was given: its strings cannot be found in the text
            for where, text in sent:
                found = [(text.index(t), t) for t in specials if t in text]
                if found:
                    token = min(found)[1]  # the first in the text
                    raise OpenAIError(f"{where} spells the special token {token!r}, and this model's chat template "
                                      f"changes the text it is given, so k3 cannot keep it as text", param=where)
            return [whole]
        pieces: list[str] = []
        run = ""  # text since the last ClientText piece
        for n, x in enumerate(split):
            if n % 2 and _touches(run, sent[int(x)][1], split[n + 1] if n + 1 < len(split) else "", specials):
                if run:
                    pieces.append(run)
                pieces.append(ClientText(sent[int(x)][1]))
                run = ""
            else:
                run += sent[int(x)][1] if n % 2 else x
        if run:
            pieces.append(run)
        return pieces

    def _render(self, plain: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return self._compiled.render(messages=plain, add_generation_prompt=add_generation_prompt)
        except _Refused as e:
            raise OpenAIError(f"the chat template refused the conversation: {e}", param="messages") from e
        except jinja2.exceptions.SecurityError as e:
            raise ValueError(f"the chat template tried an unsafe operation: {e}") from e
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed: {e}") from e

    def save(self, directory: str | Path) -> Path:
        """Store the template with the tokenizer in `directory` (which holds tokenizer.json)."""
        return save_chat_template(directory, self.source)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, stop: Sequence[str] = (TURN_END,)) -> ChatTemplate:
        """The template stored with the tokenizer in `directory`, or the default when none is."""
        stored = load_chat_template(directory)
        return cls(stored if stored is not None else DEFAULT_CHAT_TEMPLATE, stop)


def _plain(messages: Sequence[ChatMessage | dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise OpenAIError("messages must not be empty", param="messages")
    return [m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else dict(m) for m in messages]


def _touches(before: str, text: str, after: str, specials: Sequence[str]) -> bool:
    """Whether a special token's spelling lies in `text` or across either of its ends (the
    template's or another string's text `before` and `after` it)."""
    for t in specials:
        if t in text or any(
            (before.endswith(t[:n]) and (text[:len(t)] + after[:len(t)]).startswith(t[n:])) or
            (text.endswith(t[:n]) and after.startswith(t[n:])) for n in range(1, len(t))
        ):
            return True
    return False


class PromptEncoder:
    """A tokenizer's encode for rendered prompts: template pieces with their special tokens, a
    client's pieces (ClientText) with special tokens' spellings read as plain characters.

    `specials` are the tokenizer's special tokens' strings, what `ChatTemplate.render_pieces` keeps
    apart. Encoding lets go of the GIL (`encode_batch`), so a thread may run it beside an event loop."""

    def __init__(self, tokenizer) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer
        self.specials = sorted({t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special},
                               key=len, reverse=True)
        # a twin that reads special tokens' spellings as text: the flag is the tokenizer's own, so
        # flipping it on the shared one would race with other threads' encodes
        self._literal = Tokenizer.from_str(tokenizer.to_str())
        self._literal.encode_special_tokens = True

    def __call__(self, text: str) -> list[int]:
        tok = self._literal if isinstance(text, ClientText) else self.tokenizer
        return tok.encode_batch([str(text)])[0].ids

    def encode_pieces(self, pieces: Sequence[str]) -> list[int]:
        return [i for p in pieces for i in self(p)]
