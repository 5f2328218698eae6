"""The two judge prompts (docs/method.md, section 2): the evaluative vote and the hindsight-hint vote.

Each prompt is a system message (the task, the role semantics of the next state, the output format) and one user
message with the evidence in labelled sections:

* the request context, per ``judge_context``: ``none`` (answer and next state only, as the original system),
  ``last_user`` (the last user message of the request, the default) or ``full`` (every request message with its
  role, most recent kept when long);
* the assistant's answer (its text and any tool calls it made);
* the next state: **all** messages that followed the answer, each flattened with its role (a user reply and the
  results of several tool calls can arrive together).

Long sections are clipped (the middle of an answer, the oldest part of a context) so a judge with a small context
window still sees the beginning and end of each; the limits are arguments, not constants hidden in the text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

EVAL_SYSTEM = """\
You grade one step of an AI assistant's work. You see what the assistant produced and what happened right after \
it (the next state). Use the next state as evidence of whether the assistant did what the user wanted.

How to read the next state:
- role user: the user's reply to the assistant.
- role tool: the output of a tool that the assistant itself called. It exists only because of the assistant's \
action. A normal result without an error means the action worked.

Scores:
\\boxed{1} good: the user moves on to something new, thanks or confirms, or the tool/environment reports success.
\\boxed{-1} bad: the user asks to redo, fix or change something ("no, I meant...", "change X to Y", "please \
fix..."), repeats or rephrases the same request, or the tool/environment reports an error caused by the action.
\\boxed{0} unclear: the next state is unrelated or does not say enough.

A request to change or correct the answer is always \\boxed{-1}, never a neutral new instruction.
Think briefly, then end with exactly one score: \\boxed{1}, \\boxed{-1} or \\boxed{0}."""

EVAL_TASK = """\
Is the next state (a) progress, (b) a correction, redo or change request, or (c) unclear? \
Say which, then give the score as \\boxed{1}, \\boxed{-1} or \\boxed{0}."""

HINT_SYSTEM = """\
You look back at one step of an AI assistant's work, knowing what came next. You see the assistant's answer \
(step t) and the next state (step t+1).

How to read the next state:
- role user: the user's reply to the assistant.
- role tool: the output of a tool that the assistant called. A normal result usually means the call was fine. \
Do not treat a tool's output as something the assistant should have known beforehand.

Decide whether the next state reveals something that would have made the answer better had the assistant known \
it: a correction, a missing requirement, a preference, or an error that points to the fix.

Write the hint as an instruction to the assistant, in the imperative, the way the user would have asked had \
they said it up front: "Give temperatures in Celsius." or "Put each shell command on its own line." or "Quote \
the error message exactly." Do not narrate what went wrong ("You forgot ...", "The user wanted ...", "That was \
too long."): state what to do. Keep the user's exact words for anything quoted.

Output format (strict):
- If yes: write \\boxed{1}, then a hint of 1 to 3 imperative sentences telling the assistant concretely what to \
do, between [HINT_START] and [HINT_END].
- If no: write \\boxed{-1} and no hint.
Give exactly one decision."""

HINT_TASK = """\
Give your decision and, if it is \\boxed{1}, the hint between [HINT_START] and [HINT_END]."""


def content_text(content: Any) -> str:
    """Flatten an OpenAI message content (string, list of parts, None) to plain text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                if isinstance(part.get("text"), str):
                    parts.append(part["text"])
                else:
                    parts.append(f"[{part.get('type', 'part')}]")
        return "".join(parts)
    return str(content)


def tool_calls_text(tool_calls: Any) -> str:
    """One line per tool call: ``[tool call] name {arguments}``."""
    lines = []
    for call in tool_calls or []:
        fn = call.get("function", call) if isinstance(call, dict) else {}
        name = fn.get("name", "?")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        lines.append(f"[tool call] {name} {args}".rstrip())
    return "\n".join(lines)


def message_text(message: dict[str, Any]) -> str:
    """A message's text plus its tool calls, if any."""
    text = content_text(message.get("content"))
    calls = tool_calls_text(message.get("tool_calls"))
    return "\n".join(p for p in (text, calls) if p)


def role_label(message: dict[str, Any]) -> str:
    role = message.get("role", "user")
    name = message.get("name")
    return f"[role: {role} ({name})]" if role == "tool" and name else f"[role: {role}]"


def flatten_messages(messages: Sequence[dict[str, Any]]) -> str:
    """Messages one after another, each under its role label."""
    return "\n\n".join(f"{role_label(m)}\n{message_text(m)}".rstrip() for m in messages)


def clip_middle(text: str, max_chars: int) -> str:
    """Keep the beginning and the end of a long text."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    half = max(1, (max_chars - 5) // 2)
    return text[:half] + "\n...\n" + text[-half:]


def clip_head(text: str, max_chars: int) -> str:
    """Keep the end (most recent part) of a long text."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    return "...\n" + text[-(max_chars - 4):]


def request_context(messages: Sequence[dict[str, Any]], judge_context: str, max_chars: int) -> str | None:
    """The part of the request the judge sees; None when it sees none."""
    if judge_context == "none":
        return None
    if judge_context == "last_user":
        users = [m for m in messages if m.get("role") == "user"]
        return clip_middle(message_text(users[-1]), max_chars) if users else None
    if judge_context == "full":
        return clip_head(flatten_messages(messages), max_chars) if messages else None
    raise ValueError(f"judge_context={judge_context!r} is not one of none, last_user, full")


def answer_text(assistant_message: dict[str, Any] | None, response_text: str = "") -> str:
    """The assistant's answer as the judge reads it: content and tool calls."""
    text = message_text(assistant_message or {})
    return text if text else response_text


def _user_message(sections: list[tuple[str, str]], task: str) -> str:
    body = "\n\n".join(f"## {title}\n{text if text.strip() else '(empty)'}" for title, text in sections)
    return f"{body}\n\n{task}"


def build_messages(
    kind: str,
    *,
    request_messages: Sequence[dict[str, Any]],
    answer: str,
    next_state: Sequence[dict[str, Any]],
    judge_context: str = "last_user",
    max_context_chars: int = 3000,
    max_answer_chars: int = 3000,
    max_next_state_chars: int = 3000,
) -> list[dict[str, str]]:
    """Chat messages for one vote. ``kind`` is 'eval' or 'hint'."""
    if kind not in ("eval", "hint"):
        raise ValueError(f"kind={kind!r} must be 'eval' or 'hint'")
    sections: list[tuple[str, str]] = []
    context = request_context(request_messages, judge_context, max_context_chars)
    if context is not None:
        sections.append(("User request" if judge_context == "last_user" else "Conversation so far", context))
    step_t, step_t1 = (" (step t)", " (step t+1)") if kind == "hint" else ("", "")
    sections.append((f"Assistant answer{step_t}", clip_middle(answer, max_answer_chars)))
    sections.append((f"Next state{step_t1}", clip_middle(flatten_messages(next_state), max_next_state_chars)))
    system, task = (EVAL_SYSTEM, EVAL_TASK) if kind == "eval" else (HINT_SYSTEM, HINT_TASK)
    return [{"role": "system", "content": system}, {"role": "user", "content": _user_message(sections, task)}]
