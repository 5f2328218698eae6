"""Vote parsing, majority and hint candidates on the awkward texts real judges write."""

import pytest

from clawloop.judge.parse import (
    extract_hint,
    last_box,
    majority,
    parse_eval,
    parse_hint,
    select_candidates,
)


# ---- evaluative votes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("The user thanked the assistant. \\boxed{1}", 1),
    ("It failed. \\boxed{-1}", -1),
    ("Unclear. \\boxed{0}", 0),
    ("\\boxed{+1}", 1),
    ("\\boxed{-0}", 0),
    # several boxes: the last one counts
    ("First I thought \\boxed{1}, but the user asks to redo it, so \\boxed{-1}", -1),
    ("\\boxed{-1} ... on reflection \\boxed{0} ... final answer: \\boxed{1}.", 1),
    # malformed boxes do not match the pattern, so an earlier well-formed one still counts
    ("Score: \\boxed{-1}. (Not \\boxed{ 1 }.)", -1),
    ("\\boxed{1} and then \\boxed{10}", 1),
    # unicode around the box
    ("L'utilisateur a dit « merci » ✅ — \\boxed{1}", 1),
])
def test_eval_vote_reads_last_wellformed_box(text, expected):
    assert parse_eval(text).score == expected
    assert parse_eval(text).error == ""


@pytest.mark.parametrize("text", [
    "",
    "The answer is good.",
    "\\boxed{ 1 }",
    "\\boxed{10}",
    "\\boxed{1.0}",
    "\\boxed{one}",
    "boxed{1}",
    "\\boxed{2}",  # a well-formed box with a value outside {1, -1, 0}
    "\\boxed{1} but finally \\boxed{-3}",  # the last box is the judge's last word, even when out of range
    "\\boxed{１}",  # a full-width digit is not the ASCII digit the format asks for
    "\\boxed{−1}",  # nor is a Unicode minus sign
])
def test_eval_vote_invalid(text):
    vote = parse_eval(text)
    assert vote.score is None
    assert vote.error


def test_last_box_returns_raw_content():
    assert last_box("\\boxed{+1} \\boxed{-1}") == "-1"
    assert last_box("nothing") is None


# ---- hint votes ----------------------------------------------------------------------------------------

def test_hint_vote_with_hint():
    text = ("The user says the file is at /tmp/x.\n\\boxed{1}\n[HINT_START] Read the file from /tmp/x before "
            "answering. [HINT_END]")
    vote = parse_hint(text)
    assert vote.score == 1
    assert vote.hint == "Read the file from /tmp/x before answering."


def test_hint_vote_zero_is_invalid():
    vote = parse_hint("\\boxed{0} [HINT_START]something useful here[HINT_END]")
    assert vote.score is None
    assert vote.hint == "something useful here"  # recorded, but the vote does not count


def test_hint_vote_negative_has_no_hint():
    vote = parse_hint("Nothing to learn. \\boxed{-1}")
    assert vote.score == -1 and vote.hint == ""


def test_missing_hint_end_gives_no_hint():
    assert extract_hint("\\boxed{1} [HINT_START] Use the metric system for all") == ""
    assert parse_hint("\\boxed{1} [HINT_START] Use the metric system for all").score == 1


def test_last_complete_hint_block_wins():
    text = "[HINT_START]first hint text[HINT_END] \\boxed{1} [HINT_START] second hint text [HINT_END]"
    assert extract_hint(text) == "second hint text"
    # an unterminated block after a complete one does not replace it
    assert extract_hint(text + " [HINT_START] third, cut off") == "second hint text"
    # a stray start marker inside a block: the text after the last start before the end
    assert extract_hint("[HINT_START] a [HINT_START] b c d [HINT_END]") == "b c d"


def test_multiline_unicode_hint():
    text = "\\boxed{1}\n[HINT_START]\nÉcris la réponse en français.\nUtilise « ».\n[HINT_END]"
    assert parse_hint(text).hint == "Écris la réponse en français.\nUtilise « »."


# ---- majority --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("scores, expected", [
    ([1, 1, -1], 1),
    ([1, -1, None], 0),  # tie among valid votes
    ([0, 0, 1], 0),
    ([1], 1),
    ([-1, -1, 1], -1),
    ([None, None, None], 0),
    ([], 0),
    ([None, -1, None], -1),
    ([1, -1, 0], 0),  # three-way tie
    ([1, 1, -1, -1, 0], 0),
])
def test_majority(scores, expected):
    assert majority(scores) == expected


# ---- candidates ------------------------------------------------------------------------------------------

def test_candidates_strictly_longer_than_min_chars():
    exactly_10 = "abcdefghij"
    eleven = "abcdefghijk"
    assert len(exactly_10) == 10
    assert select_candidates([(1, exactly_10)]) == []
    assert select_candidates([(1, eleven)]) == [eleven]
    # length is measured after stripping
    assert select_candidates([(1, "   " + exactly_10 + "\n")]) == []


def test_candidates_unicode_length_in_code_points():
    ten_accented = "éééééééééé"
    assert len(ten_accented) == 10 and len(ten_accented.encode()) == 20
    assert select_candidates([(1, ten_accented)]) == []
    assert select_candidates([(1, ten_accented + "é")]) == [ten_accented + "é"]


def test_candidates_only_positive_votes():
    hint = "Use the metric system."
    assert select_candidates([(-1, hint), (None, hint), (0, hint)]) == []
    assert select_candidates([(-1, hint), (1, hint)]) == [hint]


def test_candidates_dedup_sort_and_cap():
    votes = [
        (1, "Answer in exactly three bullet points."),
        (1, "Use Celsius, not Fahrenheit."),
        (1, "Answer in exactly three bullet points."),  # duplicate
        (1, "  Use Celsius, not Fahrenheit.  "),  # duplicate after stripping
        (1, "Ask which city first."),
        (1, "Quote the error message before fixing it."),
    ]
    assert select_candidates(votes, max_candidates=3) == [
        "Ask which city first.",
        "Use Celsius, not Fahrenheit.",
        "Answer in exactly three bullet points.",
    ]
    assert select_candidates(votes, max_candidates=1) == ["Ask which city first."]


def test_candidates_equal_length_keep_vote_order():
    a, b = "Hint number A!", "Hint number B!"
    assert len(a) == len(b)
    assert select_candidates([(1, b), (1, a)]) == [b, a]
    assert select_candidates([(1, a), (1, b)]) == [a, b]


def test_candidates_custom_min_chars():
    assert select_candidates([(1, "short")], min_chars=3) == ["short"]
    assert select_candidates([(1, "short")], min_chars=5) == []
