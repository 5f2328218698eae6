"""From generated token ids to the text a client sees: incremental decoding and stop strings.

* ``IncrementalDetokenizer`` decodes a growing id list into text deltas. It re-decodes a short window
  (the ids since the last emitted boundary) and emits only when the window's text grew and does not end in
  U+FFFD, so a multi-byte character split across tokens is never emitted half-way. ``flush()`` releases
  whatever is pending at the end (then a genuinely invalid byte sequence shows as U+FFFD, as a full decode
  would). Concatenating all deltas equals ``tokenizer.decode(ids)`` for byte-level BPE tokenizers.
* ``StopStrings`` finds the earliest stop string in the text and says how much of the text's tail must be
  held back from a stream because it could still grow into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix_offset = 0  # start of the re-decoded window
        self._read_offset = 0  # ids before this are already turned into emitted text

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Append one id; return the newly complete text (maybe empty)."""
        self.ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Return any text still pending (called once, when the sequence ends)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self.ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            return new_text[len(prefix_text) :]
        return ""


class StopStrings:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._max_len = max((len(s) for s in self.stops), default=0)

    def __bool__(self) -> bool:
        return bool(self.stops)

    def find(self, text: str, new_from: int = 0) -> int | None:
        """Index of the earliest stop string in ``text`` that ends at or after ``new_from`` (None: no stop)."""
        if not self.stops:
            return None
        start = max(0, new_from - self._max_len + 1)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        for n in range(min(len(text), self._max_len - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
