"""Chat rendering, tools and tool-call parsing: normalised messages -> prompt token ids, generated text -> message.

Rendering. The prompt is the tokenizer's own chat template applied to the normalised messages, then tokenised
without adding special tokens (the template already holds them); text from the request can never become a
special token (``clawloop.chat_tokens``). Templates that know about tools (their text
mentions ``tools``) receive the tool list natively. Templates that do not (SmolLM2's) get the tools written
into the system message by clawloop: an instruction, one JSON schema per line inside ``<tools>``, and the
answer format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The history is then written as
text such a model can read: an assistant message's tool calls become ``<tool_call>`` blocks after its text,
and each run of ``tool`` messages becomes one user message of ``<tool_response>`` blocks. ``tool_choice``
``none`` renders no tools at all (and nothing is parsed); ``required`` and a named function add
no sentence (the prompt depends on the shown tools alone, so a stored turn re-renders exactly from its
messages and tools); a named function is the only tool shown, ``required`` shows them all.

Parsing. Every ``<tool_call>...</tool_call>`` block (an unclosed last block counts, generation may stop at the
length limit) whose body is a JSON object with a string ``name`` becomes an OpenAI tool call with id
``call_<uuid>`` and its ``arguments`` re-serialised as a JSON string. A block that does not parse stays in the
content as text, so nothing the model wrote is lost silently. The content is the text outside the parsed
blocks, stripped; ``None`` when only tool calls remain.

Streaming. ``ToolCallStreamFilter`` passes text deltas through until a ``<tool_call>`` might be starting, then
holds the rest back; at the end it parses the whole text and returns the remaining content and the calls.

Log-prob tokens. ``TokenTexts`` gives the exact bytes of a token (byte-level BPE tokens are mapped back through
the GPT-2 byte alphabet) and its text as OpenAI reports it (invalid UTF-8 fragments as ``\\xNN`` escapes).
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from clawloop.chat_tokens import SafeChatTokenizer

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|\Z)", re.S)


# ------------------------------------------------------------------------------------------------- tools


def active_tools(tools: list[dict[str, Any]] | None, tool_choice: Any) -> list[dict[str, Any]] | None:
    """The tools the model is shown: none for tool_choice 'none', only the named one for a forced function."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [t for t in tools if t["function"]["name"] == name]
    return tools


def tools_instruction(tools: list[dict[str, Any]]) -> str:
    """The system-message text describing the tools and how to call them.

    It depends on the tools alone (not on ``tool_choice``), so re-rendering a stored turn from its messages and
    its shown tools reproduces the served prompt exactly (the teacher relies on that)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True) for t in tools)
    return "\n".join([
        "You have access to the following tools (functions). Their JSON schemas:",
        "<tools>",
        schemas,
        "</tools>",
        "To call a tool, reply with one block per call in exactly this form, holding nothing but JSON:",
        f'{TOOL_CALL_OPEN}\n{{"name": "<tool name>", "arguments": {{<arguments as a JSON object>}}}}\n'
        f"{TOOL_CALL_CLOSE}",
        "Tool results come back to you inside <tool_response></tool_response> blocks.",
        "If no tool is needed, answer the user directly in plain text.",
    ])


def _arguments_value(arguments: str) -> Any:
    """A call's argument string as an object when it is valid JSON (so the model sees its own format back)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):
        return arguments


def tool_call_block(name: str, arguments: str) -> str:
    body = json.dumps({"name": name, "arguments": _arguments_value(arguments)}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def text_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """Messages as plain {role, content} text for a template without tool support (see module docstring)."""
    out: list[dict[str, str]] = []
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "assistant" and msg.get("tool_calls"):
            blocks = [tool_call_block(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_run"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_run": "1"})
        else:
            out.append({"role": role, "content": content})
    for m in out:
        m.pop("_tool_run", None)
    if tools:
        instruction = tools_instruction(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" + instruction).lstrip()}
        else:
            out.insert(0, {"role": "system", "content": instruction})
    return out


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that handles tools itself (arguments as objects, as such templates expect)."""
    out = []
    for msg in messages:
        m: dict[str, Any] = {"role": msg["role"], "content": msg["content"]}
        for key in ("name", "tool_call_id"):
            if key in msg:
                m[key] = msg[key]
        if msg.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["function"]["name"],
                                             "arguments": _arguments_value(c["function"]["arguments"])}}
                               for c in msg["tool_calls"]]
        out.append(m)
    return out


# --------------------------------------------------------------------------------------------- rendering


@dataclass
class RenderedPrompt:
    text: str
    ids: list[int]
    tools: list[dict[str, Any]] | None
    """The tools the model was shown (None: none, so no tool calls are parsed)."""


class ChatRenderer:
    """Turns normalised messages (+ tools) into the prompt the engine sees."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.safe = SafeChatTokenizer(tokenizer)
        template = getattr(tokenizer, "chat_template", None) or ""
        if isinstance(template, dict):  # several named templates: the default one decides
            template = template.get("default", "") or ""
        self.native_tools = "tools" in template

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               tool_choice: Any = None) -> RenderedPrompt:
        shown = active_tools(tools, tool_choice)
        if self.native_tools:
            kwargs: dict[str, Any] = {"tools": shown} if shown else {}
            text, ids = self.safe.render(native_messages(messages), **kwargs)
        else:
            text, ids = self.safe.render(text_messages(messages, shown))
        return RenderedPrompt(text=text, ids=ids, tools=shown)

    def token_lower_bound(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        """A cheap lower bound on the prompt's length in tokens (the user text alone), to refuse a huge request
        before spending CPU on tokenising it."""
        return self.safe.token_lower_bound([messages, tools])


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


# ---------------------------------------------------------------------------------------- token strings


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-printable-character table used by byte-level BPE vocabularies."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Token id -> (text, bytes) as OpenAI's log-prob entries report them."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            piece = ""
        raw: bytes
        if token_id in self.special_ids:
            raw = piece.encode("utf-8")
        else:
            table = _byte_decoder()
            try:
                raw = bytes(table[ch] for ch in piece)
            except KeyError:  # not a byte-level vocabulary: let the tokenizer decode the piece
                raw = self.tokenizer.decode([int(token_id)]).encode("utf-8")
        text = raw.decode("utf-8", errors="backslashreplace")
        if len(self._cache) < 200_000:
            self._cache[token_id] = (text, raw)
        return text, raw

    def entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.get(token_id)
        return {"token": text, "logprob": float(logprob), "bytes": list(raw)}
