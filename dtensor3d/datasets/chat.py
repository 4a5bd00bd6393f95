"""Chat data: conversations rendered with the tokenizer's own chat template, and the loss mask
of their tokens (`prepare-data --chat`, `generate --chat`).

A row of a `.jsonl` input holds `messages`, a list of {"role": ..., "content": ...}. It is
rendered with the tokenizer's Jinja chat template (`--chat-template FILE`, else
`chat_template.jinja` beside tokenizer.json, else `chat_template` in tokenizer_config.json) in
a sandboxed Jinja environment, as transformers' `apply_chat_template` does, and the whole
rendering is tokenized once (special tokens of the template recognised, none added), so the
ids are those of `tokenizer(render(messages))`.

Which tokens count in the loss: for each message whose role is in `roles`, the text that the
message adds to the rendering. For the assistant that is render(messages[:k + 1]) after
render(messages[:k], add_generation_prompt=True): the reply and its end-of-turn markup, not
the "assistant" header a prompt ends with; for another role, after render(messages[:k]).
A token counts when it starts inside such a span (character offsets of the one tokenization).
A template whose rendering of a conversation's first k messages is not a prefix of the
rendering of k + 1 cannot be split this way and is refused, naming the row.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import DataError

TEMPLATE_FILE = "chat_template.jinja"  # the name transformers saves beside tokenizer.json


def _folder(tokenizer_path: str) -> str:
    return tokenizer_path if os.path.isdir(tokenizer_path) else os.path.dirname(os.path.abspath(tokenizer_path))


def _config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _special(config: dict, key: str) -> str | None:
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special-token strings it may use (picklable: workers get it)."""

    source: str  # the template text
    origin: str  # where it was read, for messages
    bos_token: str | None = None
    eos_token: str | None = None


def find_template(tokenizer_path: str | None, template_file: str | None = None, what: str = "--chat") -> ChatTemplate:
    """The chat template of a tokenizer (see the module docstring); a DataError naming where
    it was looked for when there is none."""
    folder = _folder(tokenizer_path) if tokenizer_path else None
    config = _config(folder) if folder else {}
    bos, eos = _special(config, "bos_token"), _special(config, "eos_token")
    candidates = [template_file] if template_file else []
    candidates += [os.path.join(folder, TEMPLATE_FILE)] if folder and not template_file else []
    for path in candidates:
        try:
            with open(path, encoding="utf-8") as f:
                return ChatTemplate(f.read(), path, bos, eos)
        except OSError as e:
            if template_file:
                raise DataError(f"--chat-template {path!r}: cannot read it ({e.strerror})") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(source, str) and source:
        return ChatTemplate(source, os.path.join(folder, "tokenizer_config.json"), bos, eos)
    where = f"tokenizer {tokenizer_path!r}" if tokenizer_path else "this tokenizer"
    raise DataError(
        f"{what}: {where} has no chat template (no {TEMPLATE_FILE} beside it, no chat_template in "
        "tokenizer_config.json); give one with --chat-template FILE"
    )


def _environment():
    """A sandboxed Jinja environment like transformers' (trim_blocks, lstrip_blocks,
    raise_exception, tojson); `{% generation %}` blocks render their body unchanged."""
    from datetime import datetime

    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    def raise_exception(message):
        raise DataError(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env


class Renderer:
    """render(messages, add_generation_prompt) -> the template's text."""

    def __init__(self, template: ChatTemplate):
        from jinja2 import TemplateError

        self.template, self._error = template, TemplateError
        try:
            self.compiled = _environment().from_string(template.source)
        except TemplateError as e:
            raise DataError(f"chat template {template.origin!r}: not a valid Jinja template ({e})") from None

    def __call__(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        t = self.template
        try:
            return self.compiled.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=t.bos_token or "",
                eos_token=t.eos_token or "",
            )  # fmt: skip
        except self._error as e:
            raise DataError(f"chat template {t.origin!r} failed to render: {e}") from None


def row_messages(row: object, where: str, roles: tuple[str, ...]) -> list[dict]:
    """The `messages` of one .jsonl row, checked: a list of {role, content} strings holding at
    least one message of `roles`."""
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        what = f"keys: {sorted(row)[:8]}" if isinstance(row, dict) else f"a JSON {type(row).__name__}"
        raise DataError(f"{where}: no 'messages' list (--chat reads rows of role/content messages); {what}")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: messages[{k}] is not an object with string 'role' and 'content'")
    if not any(m["role"] in roles for m in messages):
        found = sorted({m["role"] for m in messages})
        raise DataError(
            f"{where}: no {' or '.join(map(repr, roles))} message (the roles --loss-roles counts), roles: {found}; "
            "nothing in it would be learned"
        )
    return messages


def _prefix(render: Renderer, messages: list[dict], generation_prompt: bool) -> str:
    """The rendering of the messages before one ("" where the template cannot render none)."""
    try:
        return render(messages, add_generation_prompt=generation_prompt)
    except (DataError, IndexError, KeyError, TypeError):
        return "" if not messages else render(messages, add_generation_prompt=generation_prompt)


def conversation_spans(render: Renderer, messages: list[dict], roles: tuple[str, ...], where: str):
    """(the rendering of the whole conversation, the character spans that count in the loss)."""
    full = render(messages)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] not in roles:
            continue
        end = render(messages[: k + 1])
        before = _prefix(render, messages[:k], m["role"] == "assistant")
        if not end.startswith(before) and m["role"] == "assistant":
            before = _prefix(render, messages[:k], False)
        if not (end.startswith(before) and full.startswith(end)):
            raise DataError(
                f"{where}: the chat template's rendering of the first {k} messages is not a prefix of the rendering "
                f"of {k + 1} (template {render.template.origin!r}); such a template cannot mark message {k}'s tokens"
            )
        spans.append((len(before), len(end)))
    return full, spans


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose first character lies in a span, else 0 (uint8)."""
    starts = np.fromiter((s for s, _ in offsets), np.int64, len(offsets))
    mask = np.zeros(len(offsets), np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return mask


def chat_tokenizer(tokenizer_json: str):
    """The tokenizer as chat encoding uses it: the template's special tokens recognised and
    character offsets untrimmed (no post-processor: with no special tokens added it changes
    only the offsets)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    tok.post_processor = None
    return tok


def encode_conversations(tok, texts: list[str], spans: list[list]) -> list[tuple[list[int], np.ndarray]]:
    """(ids, loss mask) of each rendered conversation (one encode_batch call)."""
    encoded = tok.encode_batch(texts, add_special_tokens=False) if texts else []
    return [(e.ids, token_mask(e.offsets, s)) for e, s in zip(encoded, spans)]
