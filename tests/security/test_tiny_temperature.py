"""A temperature too small to sample at is greedy, and is stored and trained as what it was.

``temperature: 1e-300`` used to be accepted as positive, became 0.0 in float32 inside the engine (which then
sampled at temperature 1 because another check still saw a positive number), and was stored as 1e-300: the
trainer divided logits by it, got a NaN loss and voided the whole step it landed in, other users' samples
included. The API now applies ``clawloop.temperature.effective_temperature``: served greedy, stored as 0.0.
"""

from __future__ import annotations

import httpx
import pytest

from clawloop.config import Config, ConfigError
from clawloop.engines.base import EngineError, SamplingParams, check_sampling
from clawloop.store import TurnState
from clawloop.teacher import train_temperature

QUESTION = {"model": "clawloop", "max_tokens": 8, "seed": 11,
            "messages": [{"role": "user", "content": "Name three colours of the rainbow."}]}


@pytest.mark.parametrize("tiny", [1e-300, 5e-324, 0.001])
def test_a_tiny_temperature_is_served_greedy_and_stored_as_greedy(make_server, tiny):
    server = make_server()
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        greedy = http.post("/v1/chat/completions", json={**QUESTION, "temperature": 0.0})
        sampled = http.post("/v1/chat/completions", json={**QUESTION, "temperature": tiny})
    assert greedy.status_code == 200 and sampled.status_code == 200, sampled.text
    assert sampled.json()["choices"][0]["message"] == greedy.json()["choices"][0]["message"]
    stored = server.store.turns(TurnState.AWAITING_NEXT)
    assert len(stored) == 2 and {t.temperature for t in stored} == {0.0}
    assert all(t.logprobs and all(lp <= 0.0 for lp in t.logprobs) for t in stored)
    # Training scores a greedy turn at temperature 1, a finite divisor.
    assert train_temperature(server.config, stored[-1]) == 1.0


def test_a_temperature_above_the_floor_still_samples(make_server):
    server = make_server()
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        answer = http.post("/v1/chat/completions", json={**QUESTION, "temperature": 0.7})
    assert answer.status_code == 200
    assert [t.temperature for t in server.store.turns()] == [pytest.approx(0.7)]


def test_settings_and_engines_refuse_a_tiny_positive_temperature(tiny_model_path):
    for name in ("default_temperature", "judge_temperature", "train_temperature"):
        with pytest.raises(ConfigError, match=name):
            Config.from_dict({"model": str(tiny_model_path), name: 1e-300})
    with pytest.raises(EngineError, match="temperature"):
        check_sampling(SamplingParams(temperature=1e-300))
    check_sampling(SamplingParams(temperature=0.0))
