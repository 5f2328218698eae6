"""Fixtures for the publication gate's tests.

* ``base_model`` — a fresh copy of the tiny model (the reference of a check).
* ``perturb(model, scale, seed)`` — a seeded noisy copy of a model: a candidate that moved.
* ``scripted`` — ``scripted(monkeypatch, {model: {prompt text: answer text}})`` makes ``probe_answers`` answer
  each probe with the given text for that model, or with a list of texts a sampled probe's answers in the order
  drawn (the guard, the kept verdicts, the decision and the KL between the real models over those answers stay
  the gate's own); it returns the list of (model, prompt count) calls.
"""

from __future__ import annotations

import pytest
import torch

from clawloop.gate import gate as gate_module
from clawloop.gate.scoring import answer_logprobs


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture
def base_model(tiny_model_path):
    from clawloop.engines.model_files import load_model

    return load_model(tiny_model_path, device="cpu")


@pytest.fixture
def scripted(tiny_tokenizer):
    def install(monkeypatch, answers_by_model):
        calls = []
        drawn: dict[tuple[int, str], int] = {}  # a model's draws of a prompt so far, over all calls

        def replay(model, prompts, max_tokens, eos_ids, *, uniforms=None, temperature=1.0, done=None):
            script = answers_by_model[id(model)]
            texts = []
            for row, ids in enumerate(prompts):
                shown = tiny_tokenizer.decode(ids)
                key, answer = next((prompt, answer) for prompt, answer in script.items() if prompt in shown)
                if isinstance(answer, list):  # sampled answers, in the order they are drawn, cycling
                    assert uniforms is not None and uniforms[row] is not None
                    n = drawn.get((id(model), key), 0)
                    answer = answer[n % len(answer)]
                    drawn[(id(model), key)] = n + 1
                texts.append(answer)
            calls.append((id(model), len(prompts)))
            caps = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
            answers = [list(tiny_tokenizer(t, add_special_tokens=False)["input_ids"])[:cap]
                       for t, cap in zip(texts, caps)]
            return answers, answer_logprobs(model, prompts, answers)

        monkeypatch.setattr(gate_module, "probe_answers", replay)
        return calls

    return install


@pytest.fixture
def perturb():
    """``perturb(model, scale, seed)``: a copy of ``model`` with seeded noise of ``scale`` x each tensor's mean
    magnitude (a candidate that moved)."""
    import copy

    def make(model, scale: float, seed: int):
        out = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in out.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * scale * p.abs().mean())
        return out

    return make
