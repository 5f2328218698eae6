"""Reading judge texts: boxed votes, hints, the majority vote and the hint candidates (docs/method.md, section 2).

Choices, all deliberate:

* A vote is the **last** match of ``\\boxed{<optional sign><one digit>}`` in the text. Anything else — no box,
  ``\\boxed{ 1 }`` (spaces), ``\\boxed{10}`` (two digits), ``\\boxed{1.0}`` — does not match the pattern at all, so
  an earlier well-formed box still counts (``... \\boxed{1} ... \\boxed{10}`` reads as 1), exactly as the original
  system read them. A matched value outside the allowed set (2, or 0 for a hint vote) makes the vote invalid: the
  judge's last word is what counts, and we do not go looking for an earlier, nicer one.
* Evaluative votes accept {+1, -1, 0}; hint votes accept {+1, -1} only.
* The hint is the text between the last ``[HINT_END]`` and the last ``[HINT_START]`` before it, stripped. A block
  without its end marker (e.g. the judge ran out of tokens) gives no hint: a cut-off sentence is not a hint.
* Majority: invalid votes are left out; no valid vote, or a tie for the most frequent value, gives 0.
* Candidates: hint votes scored +1 whose stripped hint is strictly longer than ``min_chars`` characters (Python
  code points, so "é" is one), deduplicated by exact text (first occurrence wins), sorted shortest first (stable,
  so equal lengths keep vote order), at most ``max_candidates``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BOX_RE = re.compile(r"\\boxed\{([+-]?[0-9])\}")  # ASCII digits only (\d would also accept "１")
HINT_START = "[HINT_START]"
HINT_END = "[HINT_END]"

EVAL_VALUES = frozenset({1, -1, 0})
HINT_VALUES = frozenset({1, -1})


@dataclass(frozen=True)
class ParsedVote:
    score: int | None
    """The vote, or None when the text holds no valid one."""
    hint: str = ""
    error: str = ""
    """Why the vote is invalid ('' when valid)."""


def last_box(text: str) -> str | None:
    """The content of the last well-formed ``\\boxed{±d}``, or None."""
    matches = BOX_RE.findall(text or "")
    return matches[-1] if matches else None


def _score(text: str, allowed: frozenset[int]) -> tuple[int | None, str]:
    box = last_box(text)
    if box is None:
        return None, "no \\boxed{±d} in the judge text"
    value = int(box)
    if value not in allowed:
        return None, f"boxed value {box} is not one of {sorted(allowed)}"
    return value, ""


def extract_hint(text: str) -> str:
    """The last complete ``[HINT_START] … [HINT_END]`` block, stripped; '' when there is none."""
    text = text or ""
    end = text.rfind(HINT_END)
    if end < 0:
        return ""
    start = text.rfind(HINT_START, 0, end)
    if start < 0:
        return ""
    return text[start + len(HINT_START):end].strip()


def parse_eval(text: str) -> ParsedVote:
    score, error = _score(text, EVAL_VALUES)
    return ParsedVote(score=score, error=error)


def parse_hint(text: str) -> ParsedVote:
    score, error = _score(text, HINT_VALUES)
    return ParsedVote(score=score, hint=extract_hint(text), error=error)


def majority(scores: Iterable[int | None]) -> int:
    """Most frequent valid vote; 0 on a tie for first place or when no vote is valid."""
    counts = Counter(s for s in scores if s is not None)
    if not counts:
        return 0
    ranked = counts.most_common()
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return 0
    return int(ranked[0][0])


def select_candidates(votes: Sequence[tuple[int | None, str]], min_chars: int = 10,
                      max_candidates: int = 3) -> list[str]:
    """Hint candidates from ``(score, hint)`` pairs of the hint votes, shortest first."""
    seen: set[str] = set()
    kept: list[str] = []
    for score, hint in votes:
        hint = (hint or "").strip()
        if score != 1 or len(hint) <= min_chars or hint in seen:
            continue
        seen.add(hint)
        kept.append(hint)
    kept.sort(key=len)  # list.sort is stable: equal lengths keep vote order
    return kept[:max_candidates]
