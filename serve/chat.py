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
"""
from __future__ import annotations

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
        if not messages:
            raise OpenAIError("messages must not be empty", param="messages")
        plain = [m.model_dump(exclude_none=True) if isinstance(m, ChatMessage) else dict(m) for m in messages]
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
