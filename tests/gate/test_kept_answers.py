"""The file of the starting weights' answers kept between runs (``clawloop.gate.kept_answers``): what names an
entry and a file, several writers, and a damaged file. How the gate uses it: ``test_gate_memory.py``."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from clawloop.gate.kept_answers import KeptAnswers, code_fingerprint, request_key, weights_fingerprint


def _key(**change):
    request = dict(name="What is rain?", prompt_ids=[1, 2, 3], cap=24, eos_ids=[2], samples=8, temperature=0.6,
                   dice_set=0, facts=("water",))
    request.update(change)
    return request_key(request.pop("name"), request.pop("prompt_ids"), **request)


def test_a_request_key_changes_with_everything_that_decides_the_answers_tokens():
    base = _key()
    for change in ({"name": "What is snow?"}, {"prompt_ids": [1, 2, 4]}, {"cap": 64}, {"eos_ids": [2, 0]},
                   {"samples": 4}, {"temperature": 0.7}, {"dice_set": 1}, {"facts": ("rain",)}):
        assert _key(**change) != base, change
    assert _key(eos_ids=[2]) == base
    # one greedy answer: no temperature, dice or early stop plays a part
    greedy = _key(samples=0, temperature=0.6, dice_set=0, facts=("water",))
    assert greedy == _key(samples=0, temperature=1.0, dice_set=3, facts=()) != base


def test_kept_answers_are_read_back_by_another_instance_and_two_writers_keep_both(tmp_path):
    path = tmp_path / "gate-answers" / "m.json"
    one, two = KeptAnswers(path), KeptAnswers(path)
    one.put({"a": [[1, 2], [3]]})
    two.put({"b": [[4]]})  # written after one's entry, without having read it: both are kept
    again = KeptAnswers(path)
    assert (again.get("a"), again.get("b"), len(again)) == ([[1, 2], [3]], [[4]], 2)
    assert two.get("a") == [[1, 2], [3]]  # a writer also takes up what it merged
    one.put({"c": [[6]]})
    assert two.get("c") == [[6]]  # and a reader what another writer added since it read the file
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_an_unreadable_file_is_read_as_empty_and_set_aside_by_the_next_writer(tmp_path, caplog):
    path = tmp_path / "m.json"
    path.write_text('{"format": 1, "answers": {"a": [[1, 2]', encoding="utf-8")  # cut off by a full disk
    kept = KeptAnswers(path)
    assert len(kept) == 0 and "unreadable" in caplog.text
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]  # a reader moves nothing another writer may replace
    kept.put({"b": [[5]]})
    assert sorted(p.name.startswith(".bad-m.json-") for p in tmp_path.iterdir() if p.suffix != ".lock") == [
        False, True]
    assert json.loads(path.read_text())["answers"] == {"b": [[5]]}
    path.write_text(json.dumps({"format": 999, "answers": {"b": [[5]]}}), encoding="utf-8")
    assert len(KeptAnswers(path)) == 0  # another layout's file is not read as this one's


def test_a_write_that_fails_keeps_the_answers_for_the_run_and_raises_nothing(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    kept = KeptAnswers(blocked / "m.json")
    kept.put({"a": [[1]]})
    assert kept.get("a") == [[1]] and "could not keep" in caplog.text


def test_the_model_fingerprint_names_the_weights_and_how_they_were_loaded(tmp_path, tiny_model_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    base = weights_fingerprint(model, dtype="torch.float32", device_type="cpu")
    assert weights_fingerprint(model, dtype="torch.float32", device_type="cpu") == base
    assert weights_fingerprint(model, dtype="torch.bfloat16", device_type="cpu") != base
    assert weights_fingerprint(model, dtype="torch.float32", device_type="cuda") != base
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)  # copytree keeps the times: another folder is still another model
    assert weights_fingerprint(copy, dtype="torch.float32", device_type="cpu") != base
    template = model / "tokenizer_config.json"
    text = template.read_text()
    template.write_text(text.replace("}", ', "x": 1}', 1))
    assert weights_fingerprint(model, dtype="torch.float32", device_type="cpu") != base
    template.write_text(text)
    weights = next(model.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # the last weight's last byte, at the same size and modification time
    stat = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights_fingerprint(model, dtype="torch.float32", device_type="cpu") != base
    with pytest.raises(FileNotFoundError):
        weights_fingerprint(tmp_path, dtype="torch.float32", device_type="cpu")
    assert len(code_fingerprint()) == 32


def test_a_model_s_file_lives_in_the_clawloop_cache_and_is_named_by_its_fingerprints(tmp_path, monkeypatch,
                                                                                    tiny_model_path):
    from clawloop.gate import kept_answers

    monkeypatch.setenv("CLAWLOOP_CACHE", str(tmp_path))
    assert kept_answers.cache_answers_root() == tmp_path / "gate-answers"
    monkeypatch.setattr(kept_answers, "answers_root", kept_answers.cache_answers_root)
    kept = KeptAnswers.for_model(tiny_model_path, dtype="torch.float32", device_type="cpu")
    assert kept.path.parent == tmp_path / "gate-answers"
    assert kept.path != KeptAnswers.for_model(tiny_model_path, dtype="torch.float32", device_type="cuda").path
