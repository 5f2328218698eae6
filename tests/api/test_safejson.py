"""User JSON within bounds: where an offending value is reported, and what checking a large body costs."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from clawloop.api.safejson import JSONLimitError, loads


@pytest.mark.parametrize("text,where", [
    ('{"a": [1, {"b": "\\ud800"}]}', "a[1].b"),
    ('{"m": [{"c": [[1]]}]}', "m[0].c[0]"),
    ('{"\\ud800": 1}', ""),
])
def test_an_offending_value_is_named_by_its_path(text, where):
    with pytest.raises(JSONLimitError) as raised:
        loads(text, max_depth=4)
    assert raised.value.path == where


def test_checking_a_long_key_over_many_elements_costs_the_body_not_key_times_elements():
    """A 1 MB key over an array of 1,500 elements: the check held a path string per element (1,500 MB); now it
    holds the open containers only."""
    body = json.dumps({"messages": [], "k" * 1_000_000: [0] * 1500})
    tracemalloc.start()
    try:
        loads(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * len(body)  # the parsed value and the text, not a copy of the key per element
