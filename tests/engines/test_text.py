"""Incremental detokenisation and stop strings, on the real SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from clawloop.engines.detok import IncrementalDetokenizer, StopStrings


@pytest.mark.parametrize("text", ["héllo wörld 😀", "日本語のテキスト", "🦞 claws and <|im_start|> tags"])
def test_deltas_never_split_a_character_and_add_up_to_the_full_decode(tiny_tokenizer, text):
    ids = tiny_tokenizer(text).input_ids
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.add(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tiny_tokenizer.decode(ids) == text


def test_a_split_multibyte_character_is_held_until_complete(tiny_tokenizer):
    ids = tiny_tokenizer("🦞").input_ids
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = [detok.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦞"


def test_flush_releases_an_incomplete_tail_like_a_full_decode(tiny_tokenizer):
    ids = tiny_tokenizer("ok 🦞").input_ids[:-1]  # cut the emoji short
    detok = IncrementalDetokenizer(tiny_tokenizer)
    text = "".join(detok.add(i) for i in ids)
    assert text == "ok"
    assert text + detok.flush() == tiny_tokenizer.decode(ids)


def test_stop_strings_find_the_earliest_and_hold_back_possible_starts():
    stops = StopStrings(["END", "\n\nUser:"])
    assert stops.find("abc END x") == 4
    assert stops.find("a\n\nUser: b END") == 1
    assert stops.find("nothing here") is None
    # Only occurrences that end in the new text count (older text was already checked).
    assert stops.find("xxEND", new_from=4) == 2
    assert stops.holdback("text E") == 1
    assert stops.holdback("text EN") == 2
    assert stops.holdback("text\n\nUs") == 4
    assert stops.holdback("text ENX") == 0
    assert StopStrings([]).holdback("anything") == 0
    assert not StopStrings(["", ""])
