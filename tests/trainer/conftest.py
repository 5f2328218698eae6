"""Fixtures for trainer tests (helpers that are not fixtures live in ``trainer_helpers``).

* ``make_config(**overrides)`` — a validated ``Config`` for the tiny model on CPU, small batches, lr 1e-3,
  run folder under the test's ``tmp_path``, publication gate off (these tests are about what a step does; the
  gate's own tests turn it on).
* ``base_model`` — a fresh copy of the tiny model (plays the serving policy and the frozen teacher when test
  samples are made).
"""

from __future__ import annotations

import pytest
import torch

from clawloop.config import Config


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture
def make_config(tiny_model_path, tmp_path):
    def make(**overrides) -> Config:
        values = dict(model=str(tiny_model_path), device="cpu", run_dir=str(tmp_path / "run"),
                      rollout_batch_size=2, micro_batch_size=2, checkpoint_every=1000, lr=1e-3,
                      metrics_backends=["jsonl"], gate=False)
        values.update(overrides)
        return Config.from_dict(values)

    return make


@pytest.fixture
def base_model(tiny_model_path):
    from clawloop.engines.model_files import load_model

    return load_model(tiny_model_path, device="cpu")
