"""What stops a start in a run folder before any model loads: a resume whose checkpoint was written for another
model or another ``lora`` setting (clawloop/run_folder.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from clawloop.engines.model_files import tiny_model_dir
from clawloop.run_folder import RunFolderError, TrainedWith, check_resumable
from clawloop.trainer import checkpoint as ckpt


def checkpoint_for(run_dir, model_dir, lora):
    ckpt.save_checkpoint(run_dir, 1, 0, {"w": torch.zeros(2)}, None,
                         extra={"lora": lora, "model_dir": str(model_dir)})


def test_a_resume_onto_another_lora_setting_is_refused(tmp_path):
    checkpoint_for(tmp_path, tiny_model_dir(), lora=True)
    with pytest.raises(RunFolderError, match="written with lora=true, and this start has lora=false"):
        check_resumable(tmp_path, TrainedWith(tiny_model_dir(), lora=False))
    check_resumable(tmp_path, TrainedWith(tiny_model_dir(), lora=True))


def test_a_resume_onto_another_model_is_refused_and_a_moved_copy_is_not(tmp_path):
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    run_dir = tmp_path / "run"
    checkpoint_for(run_dir, other, lora=True)
    with pytest.raises(RunFolderError, match="trained on the model in .*other-model.*config.json differ"):
        check_resumable(run_dir, TrainedWith(tiny_model_dir(), lora=True))

    copy = tmp_path / "copy-of-tiny"
    shutil.copytree(tiny_model_dir(), copy)
    moved = tmp_path / "moved"
    checkpoint_for(moved, copy, lora=True)
    check_resumable(moved, TrainedWith(tiny_model_dir(), lora=True))  # the same config.json: the same model
    shutil.rmtree(copy)
    check_resumable(moved, TrainedWith(tiny_model_dir(), lora=True))  # gone: nothing to compare with
