"""One process: the ``Parallel`` and ``GateView`` of the embedded trainer and offline training.

Every call is direct: ``share`` just calls, the trainable state is copied from the model itself
(``model.trainable_state_dict``, CPU clones), the optimizer state is a deep copy of ``optimizer.state_dict()``,
and the gate checks the training model in place (``model.gate_candidate``: on the CPU a LoRA model with its adapter
merged into the base layers for the duration, as the embedded engine serves it) against ``model.gate_reference``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from clawloop.gate.gate import GateResult, PublicationGate
from clawloop.trainer.model import (TrainModels, gate_candidate, gate_reference, load_trainable_state_dict,
                                   trainable_state_dict)

T = TypeVar("T")


class LocalParallel:
    main = True
    runner = None
    world_size = 1
    gathers_candidate = False

    def share(self, fn: Callable[[], T]) -> T:
        return fn()

    def trainable_weights(self, models: TrainModels) -> dict[str, torch.Tensor]:
        return trainable_state_dict(models)

    def gate_candidate(self, models: TrainModels) -> None:
        return None  # the gate checks the training model in place

    def optimizer_state(self, models: TrainModels, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return copy.deepcopy(optimizer.state_dict())

    def load(self, models: TrainModels, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor] | None,
             optimizer_state: dict[str, Any] | None, learning_rate: float) -> bool:
        if weights is not None:
            load_trainable_state_dict(models, weights)
        if optimizer_state is None:
            return False
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))  # the kept copy must stay as it was
        return True


class LocalGateView:
    """The training model itself is the candidate."""

    def __init__(self, models: TrainModels):
        self.models = models
        self.kl_to = "reference" if models.lora or models.reference is not None else "last_accepted"

    def check(self, gate: PublicationGate, candidate: dict[str, torch.Tensor] | None,
              accepted: dict[str, torch.Tensor] | None) -> GateResult:
        models = self.models
        return gate.check(lambda: gate_candidate(models), lambda: gate_reference(models, accepted),
                          kl_to=self.kl_to)

    def prepare(self, gate: PublicationGate) -> bool:
        if self.kl_to != "reference":
            return False
        return gate.prepare(lambda: gate_reference(self.models, None))
