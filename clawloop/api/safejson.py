"""JSON from users, bounded: nesting depth limited and no lone surrogate in any string.

Python's ``json`` accepts ``"\\ud800"`` escapes (a string that cannot be encoded as UTF-8, which later breaks the
tokenizer, the store and response headers) and nesting as deep as the C recursion limit allows (which later code
that walks the value recursively, such as ``json.dumps`` or a chat template, cannot). Every JSON value that comes
from a request (the body, and JSON held in strings such as tool-call arguments) goes through ``check_value`` or
``loads`` here, so the rest of the code never sees either.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64
"""Deepest nesting of arrays/objects accepted anywhere in user JSON."""


class JSONLimitError(ValueError):
    """User JSON outside the limits; ``str()`` says what, ``path`` where (dotted, may be empty)."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path


def _bad_string(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_value(value: Any, max_depth: int = MAX_DEPTH) -> Any:
    """Return ``value`` unchanged when it is within the limits, else raise ``JSONLimitError``. Iterative (an
    explicit stack), so it cannot itself run out of recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict):
            if depth > max_depth:
                raise JSONLimitError(f"JSON nested deeper than {max_depth} levels", path)
            for key, child in item.items():
                if isinstance(key, str) and _bad_string(key):
                    raise JSONLimitError("a JSON object key holds an invalid Unicode escape (lone surrogate)", path)
                stack.append((child, depth + 1, f"{path}.{key}" if path else str(key)))
        elif isinstance(item, list):
            if depth > max_depth:
                raise JSONLimitError(f"JSON nested deeper than {max_depth} levels", path)
            for i, child in enumerate(item):
                stack.append((child, depth + 1, f"{path}[{i}]"))
        elif isinstance(item, str) and _bad_string(item):
            raise JSONLimitError("a string holds an invalid Unicode escape (lone surrogate)", path)
    return value


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` within the limits: ``ValueError`` (a ``JSONDecodeError`` or ``JSONLimitError``) otherwise,
    never ``RecursionError``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONLimitError(f"JSON nested deeper than {max_depth} levels") from None
    return check_value(value, max_depth)
