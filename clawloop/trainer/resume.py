"""Where a restarted trainer starts: its newest checkpoint reconciled with the store's last committed step.

One rule for the in-process trainer (``Trainer.resume``) and the ``torchrun`` trainer (``distributed``):

* the weights come from the newest checkpoint (or are the starting weights when there is none);
* a step the store committed after that checkpoint was trained into weights that are now lost: its samples
  are requeued (``Store.requeue_after_step``, which keeps the step's row and marks it requeued), so every
  sample is trained into the resumed weights exactly once. Where the caller may not requeue (the API's
  trainer routes cannot; a ``torchrun`` trainer without a checkpoint may be reading a store another trainer
  wrote) those samples stay out of the weights, and the plan says so;
* step numbers go on after the highest one either side recorded: a number is never given to two steps;
* a store behind the checkpoint (an older store file) is reported; the checkpoint's counters win.

Versions are the callers' business (the in-process trainer serves a kept version's own weights and draws new
numbers from the store; the ``torchrun`` trainer asks the API), since they depend on what an engine serves.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResumePlan:
    step: int
    """The highest step number in use: the next committed step is ``step + 1``."""
    requeue_after: int | None
    """Requeue the samples consumed by steps after this one (None: nothing to requeue, or the store cannot)."""
    note: str
    """What the restart does, in a sentence for the log."""


def plan_resume(checkpoint_step: int | None, store_step: int, *, can_requeue: bool = True) -> ResumePlan:
    """``checkpoint_step``: the newest checkpoint's step (None: no checkpoint); ``store_step``: the store's last
    committed step (0: none); ``can_requeue``: whether samples of lost steps may be requeued."""
    start = 0 if checkpoint_step is None else int(checkpoint_step)
    store_step = int(store_step)
    step = max(start, store_step)
    weights = "the starting weights" if checkpoint_step is None else f"the checkpoint of step {start}"
    if store_step > start and can_requeue:
        return ResumePlan(step, start, f"the store is at step {store_step}: the samples of steps {start + 1}.."
                          f"{store_step} are trained again into {weights}; step numbers go on after {step}")
    if store_step > start:
        return ResumePlan(step, None, f"the store is at step {store_step}: the samples of steps {start + 1}.."
                          f"{store_step} are not requeued and are not in {weights}; step numbers go on after {step}")
    if store_step < start:
        return ResumePlan(step, None, f"the store is at step {store_step}, behind the checkpoint of step {start}"
                          " (an older store file?): the checkpoint's counters are used")
    return ResumePlan(step, None, f"continuing from {weights} at step {step}")
