"""Chat conversations: a record's `messages` rendered with the checkpoint's Jinja chat template, tokenized, and the
assistant tokens marked as targets -- the same ids and mask as transformers'
`apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`.

Template. Rendered with jinja2's ImmutableSandboxedEnvironment (trim_blocks, lstrip_blocks, the loopcontrols
extension, a `tojson` filter that keeps non-ASCII text and does not HTML-escape, a `raise_exception(msg)` global),
with the variables messages, tools (the record's tools field, or None), documents=None, add_generation_prompt=False
(True in `ChatTemplate.prompt`, for generation) and the checkpoint's named special tokens (bos_token, eos_token,
...). `strftime_now` is deliberately not provided: a template that prints today's date would render differently on
resume. A template that fails on a conversation (e.g. its raise_exception for roles that do not alternate) makes
that record a counted, logged skip.

Mask rule. The template marks the assistant's text with `{% generation %} ... {% endgeneration %}`; the characters
between the markers are assistant text, and a token is an assistant token iff its character span overlaps one of
those stretches (transformers' rule). A template without generation markers is refused with an error at start,
rather than guessed: rendering message-by-message prefixes and diffing them is wrong for templates that render
earlier turns differently once later turns exist (GLM and DeepSeek templates drop the reasoning of earlier assistant
turns), which would silently train on the wrong tokens. Set data.chat_template to a copy of the checkpoint's
template with the assistant part of each turn wrapped in the markers.

Implementation: the generation block writes two private-use characters (U+E000 / U+E001) around its text; they are
removed after rendering and their places are the stretches. A record whose strings contain them is skipped. (This
also places blocks inside macros correctly, where transformers' offsets of the yielded output do not.)

Messages. `messages` is a list (or a JSON string of a list) of objects with a role in ROLES and a content (a string,
a list of content parts, or absent, e.g. for an assistant turn with tool_calls); keys with a None value are dropped
and a turn's reasoning, under any name of REASONING, is also given as `reasoning_content` and `thinking` (both as
transformers does); everything else is passed to the template unchanged (tool_calls, tool_call_id, name ...).
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple

import numpy as np

from glmjax.data.sources import DataError, Skip

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING = ("reasoning_content", "thinking", "reasoning")  # names of a turn's reasoning; templates read the first two
START, END = "\ue000", "\ue001"
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class Chat(NamedTuple):
    messages: list
    tools: list | None


class Rendered(NamedTuple):
    text: str
    spans: np.ndarray  # int64 [k, 2]: character [start, end) of each generation block, in render order


def conversation(record, messages_field: str, tools_field: str | None) -> Chat | Skip:
    """A decoded record (dict) -> Chat, or Skip("malformed" / "empty", detail naming the field)."""
    if not isinstance(record, dict):
        return Skip("malformed", "a plain-text record has no messages")
    messages = record.get(messages_field)
    if isinstance(messages, (str, bytes)):
        try:
            messages = json.loads(messages)
        except ValueError as e:
            return Skip("malformed", f"field {messages_field!r} is a string but not JSON: {e}")
    if not isinstance(messages, list):
        return Skip("malformed", f"field {messages_field!r} is missing or not a list ({type(messages).__name__})")
    if not messages:
        return Skip("empty", f"field {messages_field!r} is an empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"field {messages_field!r}[{i}]"
        if not isinstance(m, dict):
            return Skip("malformed", f"{where} is a {type(m).__name__}, not an object")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if m.get("role") not in ROLES:
            return Skip("malformed", f"{where}.role={m.get('role')!r}: unknown role (known: {', '.join(ROLES)})")
        if not isinstance(m.get("content", ""), (str, list)):
            return Skip("malformed", f"{where}.content is a {type(m['content']).__name__}, not a string or a list")
        out.append(m)
    tools = record.get(tools_field) if tools_field else None
    if isinstance(tools, (str, bytes)):
        try:
            tools = json.loads(tools)
        except ValueError as e:
            return Skip("malformed", f"field {tools_field!r} is a string but not JSON: {e}")
    if tools is not None and not isinstance(tools, list):
        return Skip("malformed", f"field {tools_field!r} is not a list ({type(tools).__name__})")
    return Chat(out, tools)


class ChatTemplate:
    """A compiled chat template. `render(chat)` -> Rendered or Skip (training); `prompt(messages)` -> the text a model
    continues (generation). for_training=False accepts a template without generation markers (`prompt` needs none)."""

    def __init__(self, source: str | None, origin: str, special_tokens: dict[str, str], *, for_training: bool = True):
        import jinja2
        import jinja2.ext
        import jinja2.sandbox

        if source is None:
            raise DataError(f"{origin!r} has no chat template (chat_template in tokenizer_config.json or "
                            "chat_template.jinja); set data.chat_template to a template file")
        if for_training and not GENERATION_TAG.search(source):
            raise DataError(f"the chat template of {origin!r} has no {{% generation %}} ... {{% endgeneration %}} "
                            "block, so assistant tokens cannot be told from the rest; set data.chat_template to a "
                            "copy that wraps each assistant reply in one (see glmjax/data/chat.py)")

        class Generation(jinja2.ext.Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

            def _mark(self, caller):
                return START + caller() + END

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[Generation, jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
            json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise DataError(f"the chat template of {origin!r} does not compile ({type(e).__name__}: {e})") from e
        self.origin, self.special_tokens = origin, dict(special_tokens)

    def render(self, chat: Chat, add_generation_prompt: bool = False) -> Rendered | Skip:
        """The training render (add_generation_prompt=True: with the next assistant header, as PPO's tool episodes
        continue)."""
        if _contains_marker(chat):
            return Skip("malformed", "the conversation contains U+E000 / U+E001 (reserved for the generation markers)")
        try:
            text = self.template.render(messages=chat.messages, tools=chat.tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except Exception as e:  # noqa: BLE001 -- raise_exception, undefined variables, type errors in the template
            return Skip("malformed", f"chat template {self.origin!r} failed on this conversation "
                                     f"({type(e).__name__}: {str(e)[:200]})")
        clean, spans, at, open_at = [], [], 0, []
        for p in re.split(f"([{START}{END}])", text):
            if p == START:
                open_at.append(at)
            elif p == END:
                if not open_at:
                    return Skip("malformed", f"chat template {self.origin!r} cut a generation block apart")
                spans.append((open_at.pop(), at))
            else:
                clean.append(p)
                at += len(p)
        if open_at:
            return Skip("malformed", f"chat template {self.origin!r} cut a generation block apart")
        return Rendered("".join(clean), np.array(spans, np.int64).reshape(-1, 2))

    def prompt(self, messages: list, tools: list | None = None) -> str:
        """messages (and the tools offered) -> the template's text with add_generation_prompt=True (what the model
        continues); raises DataError if the template fails on them."""
        try:
            text = self.template.render(messages=messages, tools=tools, documents=None, add_generation_prompt=True,
                                        **self.special_tokens)
        except Exception as e:  # noqa: BLE001 -- as in render
            raise DataError(f"chat template {self.origin!r} failed on the prompt ({type(e).__name__}: "
                            f"{str(e)[:200]})") from e
        return text.replace(START, "").replace(END, "")


def _contains_marker(obj) -> bool:
    if isinstance(obj, str):
        return START in obj or END in obj
    if isinstance(obj, dict):
        return any(_contains_marker(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_contains_marker(v) for v in obj)
    return False


def assistant_mask(offsets: np.ndarray, spans: np.ndarray) -> np.ndarray:
    """bool [n]: token t (character span offsets[t] = [a, b)) overlaps a generation stretch. As transformers: the
    stretch tested is the first one ending after a; the token is in it iff b > its start."""
    n = len(offsets)
    if not len(spans) or not n:
        return np.zeros(n, bool)
    k = np.searchsorted(spans[:, 1], offsets[:, 0], side="right")
    inside = k < len(spans)
    return inside & (offsets[:, 1] > spans[np.minimum(k, len(spans) - 1), 0])
