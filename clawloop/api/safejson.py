"""JSON from users, bounded: nesting depth limited and no lone surrogate in any string.

Python's ``json`` accepts ``"\\ud800"`` escapes (a string that cannot be encoded as UTF-8, which later breaks the
tokenizer, the store and response headers) and nesting as deep as the C recursion limit allows (which later code
that walks the value recursively, such as ``json.dumps`` or a chat template, cannot). Every JSON value that comes
from a request (the body, and JSON held in strings such as tool-call arguments) goes through ``check_value`` or
``loads`` here, so the rest of the code never sees either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
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
    """Return ``value`` unchanged when it is within the limits, else raise ``JSONLimitError``. Iterative (a stack
    of the open containers' iterators, so it cannot itself run out of recursion), in memory of the nesting depth:
    the path of an offending value is built only when one is found (a path string per element made a 1 MB body
    with a 1 MB key cost gigabytes)."""
    if not isinstance(value, (dict, list)):
        if isinstance(value, str) and _bad_string(value):
            raise JSONLimitError("a string holds an invalid Unicode escape (lone surrogate)")
        return value
    if max_depth < 1:
        raise JSONLimitError(f"JSON nested deeper than {max_depth} levels")
    open_containers: list[tuple[Iterator[tuple[Any, Any]], Any]] = [(_children(value), None)]
    while open_containers:
        step, child = next(open_containers[-1][0], (_DONE, None))
        if step is _DONE:
            open_containers.pop()
            continue
        if isinstance(step, str) and _bad_string(step):
            raise JSONLimitError("a JSON object key holds an invalid Unicode escape (lone surrogate)",
                                 _path(open_containers))
        if isinstance(child, (dict, list)):
            open_containers.append((_children(child), step))
            if len(open_containers) > max_depth:
                raise JSONLimitError(f"JSON nested deeper than {max_depth} levels", _path(open_containers))
        elif isinstance(child, str) and _bad_string(child):
            raise JSONLimitError("a string holds an invalid Unicode escape (lone surrogate)",
                                 _path(open_containers, step))
    return value


_DONE = object()


def _children(container: dict | list) -> Iterator[tuple[Any, Any]]:
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


def _path(open_containers: list[tuple[Iterator[tuple[Any, Any]], Any]], *last: Any) -> str:
    """Where the check is: keys joined by dots, list indices in brackets ("messages[2].content")."""
    path = ""
    for step in [step for _, step in open_containers[1:]] + list(last):
        if isinstance(step, int):
            path += f"[{step}]"
        else:
            path = f"{path}.{step}" if path else str(step)
    return path


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` within the limits: ``ValueError`` (a ``JSONDecodeError`` or ``JSONLimitError``) otherwise,
    never ``RecursionError``."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONLimitError(f"JSON nested deeper than {max_depth} levels") from None
    return check_value(value, max_depth)
