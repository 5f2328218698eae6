"""The real default model: converted from the shipped GGUF, served by the engine, answering sensibly."""

from __future__ import annotations

import asyncio

import pytest

from clawloop.engines import model_files
from clawloop.engines.base import SamplingParams, ScoreRequest
from clawloop.engines.hf import HFEngine


@pytest.mark.real_model
def test_default_model_answers_a_simple_question():
    model_dir = model_files.default_model_dir()
    assert model_files.resolve_model("default") == model_dir
    config = (model_dir / "config.json").read_text()
    assert "quantization_config" not in config  # saved as plain float weights
    engine = HFEngine("default", device="cpu", num_threads=2, max_batch_size=4)
    try:
        assert engine.max_context == 8192 and engine.eos_token_ids == {2}
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        prompt = list(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

        async def ask():
            g = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48))
            (scored,) = await engine.score([ScoreRequest(prompt, g.token_ids, temperature=1.0)])
            return g, scored

        g, scored = asyncio.run(ask())
    finally:
        engine.close_sync()
    assert "Paris" in g.text
    assert g.finish_reason == "stop" and g.token_ids[-1] == 2 and "<|im_end|>" not in g.text
    assert max(abs(a - b) for a, b in zip(g.logprobs, scored.logprobs_T.tolist())) < 1e-3
