"""Tool-call parsing: generated text -> the assistant message, whole or streamed.

Parsing. Every ``<tool_call>...</tool_call>`` block (an unclosed last block counts, generation may stop at the
length limit) whose body is a JSON object with a string ``name`` becomes an OpenAI tool call with id
``call_<uuid>`` and its ``arguments`` re-serialised as a JSON string. A block that does not parse stays in the
content as text, so nothing the model wrote is lost silently. The content is the text outside the parsed
blocks, stripped; ``None`` when only tool calls remain.

Streaming. ``ToolCallStreamFilter`` passes text deltas through until a ``<tool_call>`` might be starting, then
holds the rest back; at the end it parses the whole text and returns the remaining content and the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from clawloop.renderers.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.S)


# ----------------------------------------------------------------------------------------------- parsing


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


@dataclass
class ParsedAnswer:
    content: str | None
    tool_calls: list[dict[str, Any]]


def _parse_block(body: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(body.strip())
    except (ValueError, RecursionError):  # the model wrote something that is not (sane) JSON
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        arguments = args
    else:
        arguments = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"].strip(), "arguments": arguments}}


def _split(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(text outside parsed blocks, unstripped; parsed calls in order)."""
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    pos = 0
    for m in _TOOL_CALL_RE.finditer(text):
        call = _parse_block(m.group(1))
        if call is None:
            continue  # left in the content as text
        pieces.append(text[pos:m.start()])
        calls.append(call)
        pos = m.end()
    pieces.append(text[pos:])
    return "".join(pieces), calls


def parse_answer(text: str, tools_active: bool) -> ParsedAnswer:
    """The assistant message fields for generated ``text``; tool calls only when tools were shown."""
    if not tools_active or TOOL_CALL_OPEN not in text:
        return ParsedAnswer(content=text, tool_calls=[])
    outside, calls = _split(text)
    if not calls:
        return ParsedAnswer(content=text, tool_calls=[])
    content = outside.strip()
    return ParsedAnswer(content=content or None, tool_calls=calls)


def assistant_message(parsed: ParsedAnswer) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        msg["tool_calls"] = parsed.tool_calls
    return msg


class ToolCallStreamFilter:
    """Streams content deltas while holding back anything that may be tool-call markup."""

    def __init__(self, tools_active: bool):
        self.tools_active = tools_active
        self.text = ""
        self.sent = 0

    def feed(self, delta: str) -> str:
        """Text safe to send now."""
        self.text += delta
        if not self.tools_active:
            out = self.text[self.sent:]
            self.sent = len(self.text)
            return out
        start = self.text.find(TOOL_CALL_OPEN, self.sent)
        if start >= 0:
            limit = start
        else:
            # Hold back a suffix that could be the beginning of "<tool_call>".
            limit = len(self.text)
            for k in range(min(len(TOOL_CALL_OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if TOOL_CALL_OPEN.startswith(self.text[-k:]):
                    limit = len(self.text) - k
                    break
        out = self.text[self.sent:limit]
        self.sent = max(self.sent, limit)
        return out

    def finish(self) -> tuple[str, ParsedAnswer]:
        """(content not yet sent, the parsed answer of the whole text)."""
        parsed = parse_answer(self.text, self.tools_active)
        if not parsed.tool_calls:
            rest = self.text[self.sent:]
        else:
            outside, _ = _split(self.text)
            rest = outside[self.sent:]
            if not rest.strip():
                rest = ""
            elif not self.text[:self.sent].strip():
                rest = rest.strip()
            else:
                rest = rest.rstrip()
        self.sent = len(self.text)
        return rest, parsed
