"""Chat rendering: normalised messages (+ tools) -> the prompt text and token ids the engine sees.

Rendering. The prompt is the tokenizer's own chat template applied to the normalised messages, then tokenised
without adding special tokens (the template already holds them); text from the request can never become a
special token (``clawloop.renderers.safe_tokenizer``). Templates that know about tools (their text
mentions ``tools``) receive the tool list natively. Templates that do not (SmolLM2's) get the tools written
into the system message by clawloop: an instruction, one JSON schema per line inside ``<tools>``, and the
answer format ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The history is then written as
text such a model can read: an assistant message's tool calls become ``<tool_call>`` blocks after its text,
and each run of ``tool`` messages becomes one user message of ``<tool_response>`` blocks. ``tool_choice``
``none`` renders no tools at all (and nothing is parsed); ``required`` and a named function add
no sentence (the prompt depends on the shown tools alone, so a stored turn re-renders exactly from its
messages and tools); a named function is the only tool shown, ``required`` shows them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from clawloop.renderers.safe_tokenizer import SafeChatTokenizer

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


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
    """Messages for a template that handles tools itself (arguments as objects, as such templates expect). The
    objects' keys are user text the template may write out; ``SafeChatTokenizer`` neutralises keys as well as
    strings."""
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


def template_default_system(tokenizer: Any) -> str:
    """The system prompt the tokenizer's chat template writes when a conversation has none ('' when it writes none,
    or when the template cannot say: no template, or one that refuses a system message).

    Found by rendering a conversation with a marked system message and the same conversation without one: the text
    the template put where the marked system prompt stood is its default (SmolLM2-135M-Instruct: "You are a helpful
    AI assistant named SmolLM, trained by Hugging Face")."""
    system, user = "\u2063system-marker\u2063", "\u2063user-marker\u2063"
    try:
        marked = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": user}], tokenize=False)
        plain = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False)
    except Exception:  # noqa: BLE001 - any template error means no default can be read
        return ""
    if not isinstance(marked, str) or not isinstance(plain, str) or system not in marked:
        return ""
    head, after = marked.split(system, 1)
    between = after.split(user, 1)[0]  # what closes the system block and opens the user's
    if not plain.startswith(head) or not between:
        return ""
    rest = plain[len(head):]
    end = rest.find(between)
    if end < 0 or not rest[end + len(between):].startswith(user):
        return ""
    return rest[:end]


def chat_render_fn(tokenizer: Any) -> Callable[..., list[int]]:
    """(messages, tools) -> prompt ids with the serving renderer: the judge and the teacher see a turn exactly as
    it was served."""
    renderer = ChatRenderer(tokenizer)

    def render(messages: Any, tools: Any = None) -> list[int]:
        return renderer.render(list(messages), tools).ids

    return render
