"""``torchrun``: the ``Parallel`` of the one trainer loop over FSDP2 ranks.

* ``share(fn)``: rank 0 runs ``fn`` (a store or sink call) and broadcasts its result (``broadcast_object_list``);
  a failure there is broadcast too and raised on every rank, so no rank waits forever in the next collective.
* The trainable state and the optimizer state are gathered full and CPU-offloaded on rank 0
  (``fsdp.gather_weights`` / ``gather_optimizer``: the keys ``model.trainable_state_dict`` and the
  single-process ``optimizer.state_dict()`` use), so versions, checkpoints and the accepted state a rejection
  returns to have one format whatever the world size.
* An optimizer that never stepped is not gathered (its state is None: a fresh optimizer), since gathering one
  initialises its state with a dummy step.
* ``load`` goes the other way: rank 0's copies reach every rank's shards (``fsdp.load_checkpoint_state``,
  ``broadcast_from_rank0``); the configured learning rate wins, as when a checkpoint is loaded.
* The step runs with ``fsdp.FSDPRunner``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from clawloop.trainer.fsdp import FSDPRunner, checkpoint_weights_by_name, gather_optimizer, gather_weights, \
    load_checkpoint_state
from clawloop.trainer.model import TrainModels

T = TypeVar("T")


class SharedCallFailed(RuntimeError):
    """What a rank other than 0 raises when rank 0's part of a shared call failed."""


class FSDPParallel:
    def __init__(self, device: torch.device):
        self.runner = FSDPRunner(device)
        self.main = dist.get_rank() == 0
        self.world_size = dist.get_world_size()
        self.gathers_candidate = True

    def share(self, fn: Callable[[], T]) -> T:
        box: list[Any] = [None]
        failure: BaseException | None = None
        if self.main:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then it is raised here as is
                failure = exc
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if failure is not None:
            raise failure
        if status == "error":
            raise SharedCallFailed(f"rank 0 failed: {value}")
        return value

    def trainable_weights(self, models: TrainModels) -> dict[str, torch.Tensor] | None:
        return gather_weights(models)

    def gate_candidate(self, models: TrainModels) -> dict[str, torch.Tensor] | None:
        return gather_weights(models)

    def optimizer_state(self, models: TrainModels, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        if not optimizer.state:
            # Never stepped (the same on every rank): gathering would initialise AdamW's state with a dummy step
            # (torch.distributed.checkpoint does), which shifts the bias correction of the first real update. A
            # fresh optimizer is what this state is.
            return None
        return gather_optimizer(models, optimizer)

    def load(self, models: TrainModels, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor] | None,
             optimizer_state: dict[str, Any] | None, learning_rate: float) -> bool:
        has_optimizer = bool(self.share(lambda: optimizer_state is not None))
        by_name = checkpoint_weights_by_name(models, weights) if self.main and weights is not None else None
        load_checkpoint_state(models, optimizer, by_name, optimizer_state, has_optimizer, learning_rate)
        return has_optimizer
