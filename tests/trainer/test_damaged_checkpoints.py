"""Resume over damaged checkpoints: real checkpoints of real optimizer steps, then a file cut short as a full disk
or an unfinished copy leaves it. The trainer falls back to the newest intact checkpoint and says which it
skipped and which it used; with none intact it stops with an error naming each one, never a silent fresh start."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from clawloop.store import Store
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.core import Trainer
from clawloop.trainer.publish import LocalVersion

from trainer_helpers import train_steps


def cut_short(path: Path) -> None:
    """Keep the first half of a file, as a write that ran out of disk does."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _two_checkpoints(config, base_model, tiny_tokenizer):
    """A run with checkpoints step_1 and step_2 (the one ``latest`` names); returns its store and the trainable
    weights at step 1."""
    store = Store(Path(config.run_dir) / "store.sqlite")
    trainer = train_steps(config, store, base_model, tiny_tokenizer, steps=1)
    at_step_1 = [p.detach().clone() for p in trainer.models.trainable_parameters()]
    trainer.run_batch(*store.lease_samples(2))
    trainer.close()
    assert sorted(p.name for p in ckpt.checkpoints_dir(config.run_dir).glob("step_*")) == ["step_1", "step_2"]
    return store, at_step_1


@pytest.mark.parametrize("damaged", ["optimizer.pt", "weights.safetensors", "state.json"])
def test_resume_falls_back_to_the_newest_intact_checkpoint(make_config, base_model, tiny_tokenizer, caplog,
                                                           damaged):
    config = make_config(method="rl", lora=True, checkpoint_every=1)
    store, at_step_1 = _two_checkpoints(config, base_model, tiny_tokenizer)
    cut_short(ckpt.checkpoints_dir(config.run_dir) / "step_2" / damaged)

    resumed = Trainer(config, store, LocalVersion(), console=None)
    with caplog.at_level(logging.WARNING, logger="clawloop.trainer.checkpoint"):
        result = resumed.resume()
    assert result["step"] == 1 and result["requeued"] == 2  # step 2's samples train again, once
    for a, b in zip(at_step_1, resumed.models.trainable_parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    said = caplog.text
    assert "step_2" in said and damaged in said and "resuming from checkpoint step_1" in said


def test_with_no_intact_checkpoint_resume_stops_and_names_each(make_config, base_model, tiny_tokenizer):
    config = make_config(method="rl", lora=True, checkpoint_every=1)
    store, _ = _two_checkpoints(config, base_model, tiny_tokenizer)
    root = ckpt.checkpoints_dir(config.run_dir)
    cut_short(root / "step_2" / "optimizer.pt")
    cut_short(root / "step_1" / "weights.safetensors")
    resumed = Trainer(config, store, LocalVersion(), console=None)
    with pytest.raises(RuntimeError) as raised:  # ckpt.DamagedCheckpoints
        resumed.resume()
    message = str(raised.value)
    assert "step_2: optimizer.pt is cut short" in message and "step_1: weights.safetensors is cut short" in message
    assert [s.path.name for s in raised.value.skipped] == ["step_2", "step_1"]


def test_after_a_fallback_the_next_checkpoint_keeps_the_intact_one_not_the_damaged(make_config, base_model,
                                                                                   tiny_tokenizer):
    config = make_config(method="rl", lora=True, checkpoint_every=1)
    store, _ = _two_checkpoints(config, base_model, tiny_tokenizer)
    root = ckpt.checkpoints_dir(config.run_dir)
    cut_short(root / "step_2" / "optimizer.pt")
    resumed = Trainer(config, store, LocalVersion(), console=None)
    resumed.resume()
    resumed.run_batch(*store.lease_samples(2))  # step 3 (numbers go on), checkpointed with two kept
    assert sorted(p.name for p in root.glob("step_*")) == ["step_1", "step_3"]
    assert all(ckpt.checkpoint_problem(root / name) is None for name in ("step_1", "step_3"))
