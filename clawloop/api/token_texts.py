"""Token strings for OpenAI log-prob entries.

``TokenTexts`` gives the exact bytes of a token (byte-level BPE tokens are mapped back through
the GPT-2 byte alphabet) and its text as OpenAI reports it (invalid UTF-8 fragments as ``\\xNN`` escapes).
"""

from __future__ import annotations

import functools
from typing import Any


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
