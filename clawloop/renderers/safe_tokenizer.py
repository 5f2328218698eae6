"""Chat-template rendering where only the template can write special tokens.

A chat template writes role markers (``<|im_start|>``, ``<|im_end|>``) as text around the messages, so the
rendered prompt has to be tokenised with special-token parsing on. Done naively, text a user typed (a message,
a name, a tool name or argument, a system prompt) that spells a marker becomes the real marker: a forged turn
the model is served and trained on.

``SafeChatTokenizer.render`` closes that hole. Before templating, every user string has each occurrence of a
special token's text, and any edge fragment that could join template text into one (a trailing prefix or a
leading suffix of a special), swapped for an opaque placeholder holding a per-process random nonce that no
request can guess. After templating, the only special-token texts left are the template's own; the prompt is
split at them, the placeholders are put back as literal text, and each run between markers is tokenised with
special-token parsing off. When no user string holds any such text (nearly always), the prompt is tokenised in
one call exactly as before, so ordinary prompts get the same ids as a plain ``tokenizer(text)``.

The judge, the teacher and serving all render through here (see docs/security.md).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from typing import Any


def special_token_texts(tokenizer: Any) -> list[str]:
    """Texts of the tokenizer's special tokens, longest first."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            found.add(str(tok.content))
    return sorted((t for t in found if t), key=len, reverse=True)


def map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    """A copy of a JSON-like value with ``fn`` applied to every string (keys left alone)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [map_strings(v, fn) for v in value]
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


class SafeChatTokenizer:
    """Render messages with a tokenizer's chat template; user text never yields special tokens."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.specials = special_token_texts(tokenizer)
        self.special_re = re.compile("|".join(re.escape(s) for s in self.specials)) if self.specials else None
        self.prefixes = {s[:k] for s in self.specials for k in range(1, len(s))}
        self.suffixes = {s[k:] for s in self.specials for k in range(1, len(s))}
        self.longest = max((len(s) for s in self.specials), default=0)
        self.nonce = secrets.token_hex(8)
        self.placeholder_re = re.compile("\ue000" + self.nonce + r"(\d+)\ue001")
        self._max_token_bytes: int | None = None

    # ---- neutralising -----------------------------------------------------------------------------------
    def _neutralise(self, text: str, pieces: list[str]) -> str:
        if self.special_re is None or not text:
            return text

        def hide(fragment: str) -> str:
            pieces.append(fragment)
            return f"\ue000{self.nonce}{len(pieces) - 1}\ue001"

        head = ""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            if text[:k] in self.suffixes:
                head, text = hide(text[:k]), text[k:]
                break
        tail = ""
        for k in range(min(self.longest - 1, len(text)), 0, -1):
            if text[-k:] in self.prefixes:
                tail, text = hide(text[-k:]), text[:-k]
                break
        body = self.special_re.sub(lambda m: hide(m.group(0)), text)
        return head + body + tail

    def neutralise(self, value: Any, pieces: list[str] | None = None) -> tuple[Any, list[str]]:
        """(``value`` with special-token texts in its strings hidden, the hidden fragments by index); pass
        ``pieces`` to add to an earlier call's fragments."""
        pieces = [] if pieces is None else pieces
        return map_strings(value, lambda s: self._neutralise(s, pieces)), pieces

    # ---- encoding ------------------------------------------------------------------------------------------
    def encode_template_text(self, text: str, pieces: list[str]) -> tuple[str, list[int]]:
        """(the final prompt text, its ids) for template output whose user fragments are hidden in ``pieces``."""
        tok = self.tokenizer
        if not pieces:
            return text, list(tok(text, add_special_tokens=False)["input_ids"])
        restore = lambda s: self.placeholder_re.sub(lambda m: pieces[int(m.group(1))], s)  # noqa: E731
        parts: list[tuple[str, bool]] = []  # (text, is a template special)
        pos = 0
        assert self.special_re is not None
        for m in self.special_re.finditer(text):
            if m.start() > pos:
                parts.append((restore(text[pos:m.start()]), False))
            parts.append((m.group(0), True))
            pos = m.end()
        if pos < len(text):
            parts.append((restore(text[pos:]), False))
        runs = [p for p, special in parts if not special]
        run_ids = tok(runs, add_special_tokens=False, split_special_tokens=True)["input_ids"] if runs else []
        ids: list[int] = []
        next_run = iter(run_ids)
        for piece, special in parts:
            if special:
                ids.append(int(tok.convert_tokens_to_ids(piece)))
            else:
                ids.extend(int(i) for i in next(next_run))
        return "".join(p for p, _ in parts), ids

    def render(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> tuple[str, list[int]]:
        """(prompt text, prompt ids) of ``messages`` (and e.g. ``tools=``) with the generation prompt on."""
        safe_messages, pieces = self.neutralise(messages)
        kwargs = dict(template_kwargs)
        if kwargs.get("tools") is not None:
            kwargs["tools"], pieces = self.neutralise(kwargs["tools"], pieces)
        text = self.tokenizer.apply_chat_template(safe_messages, tokenize=False, add_generation_prompt=True,
                                                  **kwargs)
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
