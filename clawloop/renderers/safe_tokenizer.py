"""Chat-template rendering where only the template can write special tokens.

A chat template writes role markers (``<|im_start|>``, ``<|im_end|>``) as text around the messages, so the
rendered prompt has to be tokenised with special-token parsing on. Done naively, text a user typed (a message,
a name, a tool name or argument, a system prompt) that spells a marker becomes the real marker: a forged turn
the model is served and trained on.

``SafeChatTokenizer.render`` closes that hole. Before templating, every user string and every object key (a
template may write keys out: a tool's parameter names, the keys of call arguments, through ``tojson``) has each
occurrence of a special token's text, matched ignoring case, and any edge fragment that could join template text
into one (a trailing prefix or a leading suffix of a special), swapped for an opaque placeholder holding a
per-process random nonce that no request can guess. After templating, the only special-token texts left are the
template's own; the prompt is split at them, the placeholders are put back as literal text (JSON-escaped where
the template wrote them escaped), and each run between markers is tokenised with special-token parsing off. When
no user string holds any such text (nearly always), the prompt is tokenised in one call exactly as before, so
ordinary prompts get the same ids as a plain ``tokenizer(text)``; a call that yields another number of special ids
than the template wrote markers (a tokenizer that normalises text before matching its specials) is split the same
way.

The judge, the teacher and serving all render through here (see docs/security.md).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

import jinja2

OPEN, CLOSE = "\ue000", "\ue001"
"""Private-use characters around a placeholder: no special token's text holds them, so a placeholder never joins
the template's text into a marker."""


def special_token_texts(tokenizer: Any) -> list[str]:
    """Texts of the tokenizer's special tokens, longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted((t for t in found if t), key=len, reverse=True)


def map_json_text(value: Any, fn: Callable[[str], str]) -> Any:
    """A copy of a JSON-like value with ``fn`` applied to every string, object keys included (a template may write
    keys out, e.g. a tool's parameter names through ``tojson``)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {(fn(k) if isinstance(k, str) else k): map_json_text(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_json_text(v, fn) for v in value]
    return value


def string_bytes(value: Any) -> int:
    """UTF-8 size of every string (keys included) in a JSON-like value; iterative."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def ascii_json(text: str) -> str:
    """``text`` as it appears inside a JSON string written with only ASCII characters."""
    return json.dumps(text)[1:-1]


def alternatives(texts: list[str], flags: int = 0) -> re.Pattern[str] | None:
    return re.compile("|".join(re.escape(t) for t in texts), flags) if texts else None


class TemplateRefusedError(ValueError):
    """The chat template would not render these messages: it raised (``raise_exception``, as Qwen3's does for a
    system message that is not first) or met a field it needs missing. The messages are at fault, not the
    server: the API answers a 400."""


class SafeChatTokenizer:
    """Render messages with a tokenizer's chat template; user text never yields special tokens."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.specials = special_token_texts(tokenizer)
        self.special_ids = frozenset(int(i) for i in tokenizer.convert_tokens_to_ids(self.specials)) \
            if self.specials else frozenset()
        # The template's markers are matched exactly; user text is searched ignoring case, since a template may
        # change the case of what it writes (``upper``, ``lower``) and so turn ``<|IM_END|>`` into a marker.
        self.marker_re = alternatives(self.specials)
        self.hidden_re = alternatives(self.specials, re.IGNORECASE)
        self.prefixes = {s[:k].lower() for s in self.specials for k in range(1, len(s))}
        self.suffixes = {s[k:].lower() for s in self.specials for k in range(1, len(s))}
        self.longest = max((len(s) for s in self.specials), default=0)
        # Digits only, so a template that changes the case of what it writes leaves the placeholders intact.
        self.nonce = f"{secrets.randbelow(10**20):020d}"
        # A placeholder as written, or as a template's ``tojson(ensure_ascii=true)`` writes it (JSON escapes).
        escaped_open, escaped_close = re.escape(ascii_json(OPEN)), re.escape(ascii_json(CLOSE))
        self.placeholder_re = re.compile(
            f"{OPEN}{self.nonce}(\\d+){CLOSE}|{escaped_open}{self.nonce}(\\d+){escaped_close}", re.IGNORECASE)
        self._max_token_bytes: int | None = None

    # ---- neutralising -----------------------------------------------------------------------------------
    def _hide_edges(self, text: str, hide: Callable[[str], str]) -> tuple[str, str, str]:
        """(hidden head, middle, hidden tail): a leading suffix and a trailing prefix of a special token's text
        could join the template's text next to them into a marker."""
        head = tail = ""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            if text[:k].lower() in self.suffixes:
                head, text = hide(text[:k]), text[k:]
                break
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            if text[-k:].lower() in self.prefixes:
                tail, text = hide(text[-k:]), text[:-k]
                break
        return head, text, tail

    def _neutralise(self, text: str, pieces: list[str]) -> str:
        if self.hidden_re is None or not text:
            return text

        def hide(fragment: str) -> str:
            pieces.append(fragment)
            return f"{OPEN}{self.nonce}{len(pieces) - 1}{CLOSE}"

        head, middle, tail = self._hide_edges(text, hide)
        return head + self.hidden_re.sub(lambda m: hide(m.group(0)), middle) + tail

    def neutralise(self, value: Any, pieces: list[str] | None = None) -> tuple[Any, list[str]]:
        """(``value`` with special-token texts in its strings and object keys hidden, the hidden fragments by
        index); pass ``pieces`` to add to an earlier call's fragments."""
        pieces = [] if pieces is None else pieces
        return map_json_text(value, lambda s: self._neutralise(s, pieces)), pieces

    def restore(self, text: str, pieces: list[str]) -> str:
        """``text`` with every placeholder replaced by the fragment it hides, byte for byte (JSON-escaped where
        the placeholder was). An index no call handed out is left as it is."""

        def fragment(m: re.Match[str]) -> str:
            raw, escaped = m.group(1), m.group(2)
            index = int(raw if raw is not None else escaped)
            if index >= len(pieces):
                return m.group(0)
            return pieces[index] if raw is not None else ascii_json(pieces[index])

        return self.placeholder_re.sub(fragment, text)

    # ---- encoding ------------------------------------------------------------------------------------------
    def _count_special_ids(self, ids: list[int]) -> int:
        return sum(1 for i in ids if i in self.special_ids)

    def _count_markers(self, text: str) -> int:
        return 0 if self.marker_re is None else sum(1 for _ in self.marker_re.finditer(text))

    def _split_at_markers(self, text: str, pieces: list[str]) -> list[tuple[str, bool]]:
        """(text, is a template marker) runs of template output, user fragments restored in the others."""
        parts: list[tuple[str, bool]] = []
        pos = 0
        for m in self.marker_re.finditer(text) if self.marker_re is not None else ():
            if m.start() > pos:
                parts.append((self.restore(text[pos:m.start()], pieces), False))
            parts.append((m.group(0), True))
            pos = m.end()
        if pos < len(text):
            parts.append((self.restore(text[pos:], pieces), False))
        return parts

    def _encode_parts(self, parts: list[tuple[str, bool]]) -> list[int]:
        """Markers as their ids; every other run tokenised with special-token parsing off."""
        tok = self.tokenizer
        runs = [p for p, marker in parts if not marker]
        run_ids = tok(runs, add_special_tokens=False, split_special_tokens=True)["input_ids"] if runs else []
        ids: list[int] = []
        next_run = iter(run_ids)
        for piece, marker in parts:
            if marker:
                ids.append(int(tok.convert_tokens_to_ids(piece)))
            else:
                ids.extend(int(i) for i in next(next_run))
        return ids

    def encode_template_text(self, text: str, pieces: list[str]) -> tuple[str, list[int]]:
        """(the final prompt text, its ids) for template output whose user fragments are hidden in ``pieces``."""
        if not pieces:
            ids = [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
            # One call is safe only when every special id comes from a marker the template wrote; a tokenizer
            # that normalises text before matching its specials (full-width forms, say) could make more.
            if self._count_special_ids(ids) == self._count_markers(text):
                return text, ids
        parts = self._split_at_markers(text, pieces)
        return "".join(p for p, _ in parts), self._encode_parts(parts)

    def render(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> tuple[str, list[int]]:
        """(prompt text, prompt ids) of ``messages`` (and e.g. ``tools=``) with the generation prompt on. Every
        keyword's value is user data to the template, so it is neutralised like the messages."""
        safe_messages, pieces = self.neutralise(messages)
        safe_kwargs = {name: self.neutralise(value, pieces)[0] for name, value in template_kwargs.items()}
        try:
            text = self.tokenizer.apply_chat_template(safe_messages, tokenize=False, add_generation_prompt=True,
                                                      **safe_kwargs)
        except jinja2.TemplateError as exc:  # the template's own refusal (raise_exception), or a missing field
            raise TemplateRefusedError(str(exc)) from None
        return self.encode_template_text(text, pieces)

    # ---- size --------------------------------------------------------------------------------------------
    @property
    def max_token_bytes(self) -> int:
        """Longest vocabulary entry in UTF-8 bytes (a bound on the text one token can cover)."""
        if self._max_token_bytes is None:
            tok = self.tokenizer
            vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
            self._max_token_bytes = max((len(str(p).encode("utf-8")) for p in vocab), default=64) or 64
        return self._max_token_bytes

    def token_lower_bound(self, value: Any) -> int:
        """At least this many tokens are needed for the strings of ``value`` (cheap: no tokenisation)."""
        return string_bytes(value) // self.max_token_bytes
