"""The distributed trainer (FSDP2 on gloo, 2 processes under torchrun) trains a batch exactly like the
single-process trainer: the same loss, and after one update the same parameters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clawloop.serve import free_port
from clawloop.store import Store, TurnState
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.model import load_train_models
from clawloop.trainer.publish import merged_state_dict
from clawloop.trainer.step import make_optimizer, train_step
from tests.trainer.trainer_helpers import add_sample

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _fill(store: Store, base_model, tokenizer) -> None:
    # Hinted and un-hinted samples, mixed rewards; 5 samples so the ranks get unequal shares (3 and 2).
    add_sample(store, base_model, tokenizer, 0, reward=1.0, hints=["Answer in one word."])
    add_sample(store, base_model, tokenizer, 1, reward=-1.0)
    add_sample(store, base_model, tokenizer, 2, reward=1.0)
    add_sample(store, base_model, tokenizer, 3, reward=-1.0, hints=["Be precise.", "Check the units."])
    add_sample(store, base_model, tokenizer, 4, reward=0.0, hints=["Say please."])


@pytest.mark.timeout(150)
def test_two_gloo_ranks_match_single_process(make_config, base_model, tiny_tokenizer, tiny_model_path, tmp_path):
    run_dir = tmp_path / "run"
    store_file = run_dir / "store.sqlite"
    store = Store(store_file)
    _fill(store, base_model, tiny_tokenizer)
    settings = dict(rollout_batch_size=5, micro_batch_size=1, lr=1e-2, grad_clip=1.0)
    config = make_config(**settings)

    # The single-process reference on the same batch (samples read, not leased: the store stays untouched).
    samples = store.samples(TurnState.READY)
    assert len(samples) == 5
    torch.manual_seed(0)
    models = load_train_models(config)
    optimizer = make_optimizer(models, config)
    items, drops, _ = prepare_items(store, samples, config, 0, None, None)
    assert not drops
    expected = train_step(models, optimizer, items, config)
    expected_weights = merged_state_dict(models)
    store.close()

    args = [str(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "clawloop.trainer.distributed",
            "--store", str(store_file), "--max-steps", "1", "--poll-s", "0.1"]
    for key, value in dict(model=str(tiny_model_path), device="cpu", run_dir=str(run_dir), num_threads=1,
                           **settings).items():
        args += ["--set", f"{key}={value}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]

    store = Store(store_file)
    steps = store.steps()
    assert [s["step"] for s in steps] == [1]
    assert sorted(steps[0]["turn_ids"]) == sorted(s.turn_id for s in samples)
    assert store.count_samples() == {"consumed": 5}
    got = steps[0]["metrics"]
    assert got["world_size"] == 2.0
    assert got["samples"] == 5.0
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    store.close()

    weights = load_file(str(run_dir / "weights" / "v1" / "model.safetensors"))
    assert set(expected_weights) <= set(weights)
    # AdamW's first update is ~lr·sign(g): the grad-norm check above pins the gradient's scale, this pins its
    # direction. A coordinate whose gradient is ~0 may flip on float-order noise, so a handful (not a layer)
    # is allowed to differ, and by less than a tenth of a step.
    lr = settings["lr"]
    off = total = 0
    for name, want in expected_weights.items():
        diff = (weights[name] - want.float()).abs()
        assert float(diff.max()) < 0.1 * lr, name
        off += int((diff > 1e-5).sum())
        total += diff.numel()
    assert off <= 1e-4 * total, f"{off} of {total} parameters differ"
    # The update really happened (the comparison is not between two untouched copies).
    before = load_train_models(config).causal_lm.state_dict()
    assert any(not torch.allclose(before[k], weights[k]) for k in expected_weights)
