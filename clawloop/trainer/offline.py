"""``clawloop train RUN_DIR``: train on the samples a run collected earlier, without serving.

The run's store is opened, interrupted leases are returned (``store.recover()``), the newest checkpoint of the
run is resumed when there is one (so offline training continues an online run, or an earlier offline one),
and then full batches of ``rollout_batch_size`` ready samples are trained one step each. The remainder smaller
than a batch is trained as a last, smaller step unless ``full_batches_only``. A checkpoint is written at the
end. It is the one trainer loop (``core.Trainer``) with a ``LocalVersion`` sink: no engine serves, so
publication only counts versions. A ``teacher`` given (a ``clawloop.teacher.Teacher``, run on a loop of its own,
or any ``TeacherClient``) scores the OPD branches at the old policy's exact top-k ids; without one, a sample's OPD
branch trains only where scores were recorded at those very ids, and is left out otherwise (see ``old_policy``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, TextIO

from clawloop.config import Config
from clawloop.store import LeaseLost, Store, find_store
from clawloop.trainer.core import CommitNotRecorded, Trainer
from clawloop.trainer.teacher_client import in_process
from clawloop.trainer.leasing import BatchLeaser
from clawloop.trainer.model import TrainModels
from clawloop.trainer.publish import LocalVersion

log = logging.getLogger(__name__)

def train_offline(config: Config, run_dir: str | Path | None = None, max_steps: int | None = None, *,
                  store: Store | None = None, teacher: Any = None, models: TrainModels | None = None,
                  full_batches_only: bool = False, resume: bool = True,
                  console: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Train over the ready samples of a stored run. Returns a summary (steps, samples, last metrics)."""
    run_dir = Path(run_dir if run_dir is not None else config.run_dir)
    own_store = store is None
    if store is None:
        store = Store(find_store(run_dir))
    store.recover()
    trainer = Trainer(config, store, LocalVersion(), run_dir=run_dir, teacher=in_process(teacher),
                      models=models, console=console)
    try:
        if resume:
            trainer.resume()
        leaser = BatchLeaser(store, int(config.rollout_batch_size), partial=not full_batches_only)
        steps = samples = 0
        while max_steps is None or steps < max_steps:
            lease_id, leased = leaser.lease()
            if not leased:
                break
            try:
                metrics = trainer.run_batch(lease_id, leased)
            except (LeaseLost, CommitNotRecorded):
                raise  # the update is in the weights: the batch is not given back (a lost lease gave it back)
            except BaseException:
                leaser.failed(lease_id, leased)  # back to ready (counted), then the command fails
                raise
            if metrics is None:
                continue
            steps += 1
            samples += int(metrics["samples"])
        trainer.checkpoint_if_due(force=True)
        return {"steps": steps, "samples": samples, "step": trainer.step, "policy_version": trainer.policy_version,
                "ready_left": store.ready_count(), "last_metrics": trainer.last_metrics}
    finally:
        trainer.close()
        if own_store:
            store.close()
