"""Per-user policies (``policy_scope = "per_user"``): one LoRA adapter per user key on one base model.

Every user (an owner name of ``api.auth``: one per key) gets a ``Trainer`` of its own — the same one trainer loop
the shared policy runs, over per-user contracts:

* ``OwnerSamples`` is the user's view of the store: only the user's samples are leased and counted, steps,
  versions, rollbacks and requeues are recorded and read as the user's (``owner`` columns). Step and version
  numbers stay unique across the run, so a version number names one user's weights and the version an answer
  carries says whose adapter wrote it;
* ``AdapterSink`` publishes the user's accepted adapter to the embedded engine's adapter slots under the user's
  name (``HFEngine.publish_adapter``), the version number being the store's;
* the user's folder ``RUN_DIR/users/<owner>/`` holds its version history, checkpoints and metrics, so rollback
  and resume are the user's alone and forgetting the user removes one folder.

All users share one training model: its adapter weights are the active user's. ``UserPolicies.activate`` keeps
the previous user's adapter weights (a CPU copy; a few MB at rank 16) and loads the next one's; each user's
``Trainer`` keeps its own optimizer state (its own optimizer over the same parameter objects), its own
publication gate and its own accepted state. A new user starts from the fresh adapter (B = 0: exactly the base
model).

Scheduling (``next_owner``): among users whose samples may train now (a whole batch is ready, or the oldest has
waited ``batch_wait_s``, or the run has gone idle), the user trained longest ago goes first, so a user with a few
samples gets the next turn after their wait instead of queueing behind a busy one.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from clawloop.config import Config
from clawloop.engines.multi_lora import plain_lora_scaling
from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import TrainModels, load_train_models, load_trainable_state_dict, trainable_state_dict
from clawloop.trainer.teacher_client import TeacherClient

log = logging.getLogger(__name__)

USERS_FOLDER = "users"
LEASE_S = 3600.0
"""How long a batch's lease is held from the start of its step (the embedded loop's lease time)."""
OWNER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def user_dir(run_dir: str | Path, owner: str) -> Path:
    """The folder of ``owner``'s versions, checkpoints and metrics: ``RUN_DIR/users/<owner>``."""
    if not OWNER_NAME.match(owner):
        raise ValueError(f"owner name {owner!r} is not a per-user key's name")
    return Path(run_dir) / USERS_FOLDER / owner


def known_users(run_dir: str | Path) -> list[str]:
    """Users with a folder in the run (trained before), by name."""
    root = Path(run_dir) / USERS_FOLDER
    return sorted(p.name for p in root.iterdir() if p.is_dir() and OWNER_NAME.match(p.name)) if root.is_dir() else []


class OwnerSamples:
    """One user's part of the store, as the trainer loop's ``SampleSource`` (see the module docstring)."""

    def __init__(self, store: Store, owner: str):
        self.store = store
        self.owner = owner

    def lease_samples(self, n: int, lease_s: float = 3600.0,
                      min_n: int | None = None) -> tuple[str, list[SampleRecord]]:
        return self.store.lease_samples(n, lease_s, min_n, owner=self.owner)

    def get_turn(self, turn_id: int) -> TurnRecord:
        return self.store.get_turn(turn_id)

    def extend_lease(self, lease_id: str, lease_s: float) -> int:
        return self.store.extend_lease(lease_id, lease_s)

    def release_lease(self, lease_id: str) -> int:
        return self.store.release_lease(lease_id)

    def drop_leased_sample(self, turn_id: int, reason: str, lease_id: str | None = None) -> bool:
        return self.store.drop_leased_sample(turn_id, reason, lease_id)

    def commit_step(self, lease_id: str, step: int, policy_version: int, metrics: dict[str, Any],
                    turn_ids: list[int], scores: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        self.store.commit_step(lease_id, step, policy_version, metrics, turn_ids, scores, owner=self.owner)

    def ready_count(self) -> int:
        return self.store.ready_count(owner=self.owner)

    def last_step(self) -> tuple[int, dict[str, Any]] | None:
        return self.store.last_step(owner=self.owner)

    def next_version(self, at_least: int = 0) -> int:
        return self.store.next_version(at_least)

    def record_version(self, version: int, step: int, status: str, evidence: dict[str, Any]) -> None:
        self.store.record_version(version, step, status, evidence, owner=self.owner)

    def record_event(self, kind: str, detail: dict[str, Any], step: int | None = None,
                     version: int | None = None) -> None:
        self.store.record_event(kind, {**detail, "owner": self.owner}, step=step, version=version)

    def record_rollback(self, to_version: int, from_version: int, detail: dict[str, Any]) -> list[int]:
        return self.store.record_rollback(to_version, from_version, detail, owner=self.owner)

    def recent_prompts(self, n: int, *, corrected: bool = False) -> list[tuple[int, list[int], list[dict[str, Any]]]]:
        # The user's own prompts only: another user's can neither steer this user's gate nor be kept in its evidence.
        return self.store.recent_prompts(n, corrected=corrected, owner=self.owner)

    def requeue_after_step(self, step: int) -> int:
        return self.store.requeue_after_step(step, owner=self.owner)


class AdapterSink:
    """A user's accepted adapter goes to the engine's adapter slots under the user's name (``WeightSink``)."""

    def __init__(self, engine: Any, owner: str):
        self.engine = engine
        self.owner = owner

    @property
    def policy_version(self) -> int:
        version = self.engine.adapter_version(self.owner)
        return 0 if version is None else int(version)

    @property
    def max_context(self) -> int | None:
        return self.engine.max_context

    def publish(self, models: TrainModels, weights: dict[str, torch.Tensor] | None, version: int) -> int:
        adapter = weights if weights is not None else trainable_state_dict(models)
        return int(self.engine.publish_adapter_sync(self.owner, adapter, adapter_scaling(models), version=version))

    def served_version(self) -> int | None:
        return None


def adapter_scaling(models: TrainModels) -> float:
    """``alpha / r`` of the training model's adapter (plain LoRA only: the engine's slots compute nothing else)."""
    config = models.policy.peft_config["default"].to_dict()
    scaling = plain_lora_scaling(config)
    if scaling is None:
        raise ValueError("per-user adapters are plain LoRA (no DoRA, rank or alpha patterns, extra modules)")
    return scaling


class UserPolicies:
    """Every user's ``Trainer`` over one shared training model (see the module docstring). Blocking; every call
    runs on the training thread."""

    def __init__(self, config: Config, store: Store, engine: Any, *, run_dir: str | Path,
                 teacher: TeacherClient | None = None, models: TrainModels | None = None,
                 console: TextIO | None = None, on_gate: Callable[[dict[str, Any]], None] | None = None):
        self.config = config
        self.store = store
        self.engine = engine
        self.run_dir = Path(run_dir)
        self.teacher = teacher
        self.models = models if models is not None else load_train_models(config)
        self.console = console
        self.on_gate = on_gate
        self.start_weights = trainable_state_dict(self.models)
        """The fresh adapter (B = 0): every new user starts from the base model's own answers."""
        self.trainers: dict[str, Trainer] = {}
        self.kept_weights: dict[str, dict[str, torch.Tensor]] = {}
        """Each inactive user's adapter weights (``activate``)."""
        self.active: str | None = None
        self.last_trained: dict[str, float] = {}

    # ---- users ----------------------------------------------------------------------------------------
    def activate(self, owner: str) -> Trainer:
        """Load ``owner``'s adapter into the training model (keeping the active user's) and return its trainer,
        made on first use."""
        folder = user_dir(self.run_dir, owner)  # a name that is no key's is refused before anything changes
        if self.active != owner:
            if self.active is not None:
                self.kept_weights[self.active] = trainable_state_dict(self.models)
            load_trainable_state_dict(self.models, self.kept_weights.pop(owner, self.start_weights))
            self.active = owner
        trainer = self.trainers.get(owner)
        if trainer is None:
            folder.mkdir(parents=True, exist_ok=True)
            trainer = Trainer(self.config, OwnerSamples(self.store, owner), sink=AdapterSink(self.engine, owner),
                              run_dir=folder, teacher=self.teacher, models=self.models, console=self.console,
                              on_gate=self._gate_hook(owner))
            self.trainers[owner] = trainer
        return trainer

    def _gate_hook(self, owner: str) -> Callable[[dict[str, Any]], None] | None:
        hook = self.on_gate
        if hook is None:
            return None
        return lambda event: hook({**event, "owner": owner})

    def resume_all(self) -> dict[str, dict[str, int]]:
        """Resume every user trained before from their newest checkpoint (their adapters are served again)."""
        return {owner: self.activate(owner).resume() for owner in known_users(self.run_dir)}

    # ---- scheduling and steps -------------------------------------------------------------------------
    def next_owner(self, now: float, idle: Callable[[], bool]) -> tuple[str, bool] | None:
        """The user whose samples train next and whether a whole batch of theirs is ready (see the module
        docstring); None when no user's samples may train yet. ``idle()``: whether the run has gone idle, asked
        (two store reads) only when a user without a whole batch has not waited ``batch_wait_s``."""
        batch, wait_s = int(self.config.rollout_batch_size), float(self.config.batch_wait_s)
        due: list[tuple[float, str, bool]] = []
        for owner, (count, oldest) in self.store.ready_by_owner().items():
            if not OWNER_NAME.match(owner):
                continue  # turns without a per-user key have no adapter to train
            whole = count >= batch
            if whole or (wait_s > 0 and now - oldest >= wait_s) or idle():
                due.append((self.last_trained.get(owner, 0.0), owner, whole))
        if not due:
            return None
        _, owner, whole = min(due)
        return owner, whole

    def run_batch(self, owner: str, lease_id: str, samples: list[SampleRecord],
                  should_stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        if self.store.extend_lease(lease_id, LEASE_S) == 0:
            return None  # its samples went while the batch waited for the model (the user was forgotten)
        trainer = self.activate(owner)
        last = self.store.last_step()
        trainer.step = max(trainer.step, last[0] if last else 0)  # step numbers are the run's, one sequence
        self.last_trained[owner] = time.time()
        return trainer.run_batch(lease_id, samples, should_stop)

    def forget(self, owner: str) -> None:
        """Let go of everything of ``owner`` held here: their trainer, its optimizer state and gate, the gates'
        kept prompt states, and their adapter weights (the training model's adapter goes back to the fresh one when
        it was theirs). Their folder and records are the forget command's to delete."""
        trainer = self.trainers.pop(owner, None)
        if trainer is not None:
            close_keeping_teacher(trainer)
        self.kept_weights.pop(owner, None)
        self.last_trained.pop(owner, None)
        if self.models.gate_prompt_states is not None:
            # The gates' kept prompt states are computed from every user's recent prompts, theirs among them.
            self.models.gate_prompt_states.clear()
        if self.active == owner:
            load_trainable_state_dict(self.models, self.start_weights)
            self.active = None

    def rollback(self, owner: str, version: int) -> dict[str, Any]:
        """Serve ``owner``'s kept ``version`` again. ``FileNotFoundError`` when the user has no policy of their own
        (nothing of theirs trained, or a forget just deleted it): a trainer made for them here would create their
        folder again and serve an adapter under a forgotten name."""
        if owner not in self.trainers and not user_dir(self.run_dir, owner).is_dir():
            raise FileNotFoundError(f"user {owner} has no policy of their own in this run")
        return {**self.activate(owner).rollback(version), "owner": owner}

    def status(self) -> dict[str, dict[str, Any]]:
        """Per user: version served, steps taken here, gate checks and rejections."""
        return {owner: {"policy_version": t.policy_version, "step": t.step, "gate_checks": t.gate_checks,
                        "gate_rejections": t.gate_rejections,
                        "samples_waiting": self.store.ready_count(owner=owner)}
                for owner, t in list(self.trainers.items())}

    def checkpoint_all(self) -> None:
        """Write every user's checkpoint that has steps since its last (at shutdown); one that fails is logged and
        the others are still written."""
        for owner in list(self.trainers):
            try:
                self.activate(owner).checkpoint_if_due(force=True)
            except Exception:  # noqa: BLE001 - the next start resumes that user from their last good checkpoint
                log.exception("trainer: writing the checkpoint of user %s failed", owner)

    def close(self) -> None:
        for trainer in self.trainers.values():
            close_keeping_teacher(trainer)
        if self.teacher is not None:  # shared by every user's trainer: closed once, here
            self.teacher.close()
        self.trainers.clear()
        self.kept_weights.clear()
        self.models = None  # type: ignore[assignment]


def close_keeping_teacher(trainer: Trainer) -> None:
    """Close one user's trainer but not the teacher every user's trainer shares (``UserPolicies.close`` closes it)."""
    trainer.teacher = None
    trainer.close()
