"""The trainer's state and its unit of work, shared by the online loop and offline training.

``Trainer`` owns the training model, the optimizer, the step counter and the policy version, and turns one
leased batch into one committed step:

    prepare (join turns, drop what cannot train, with reasons) → train_step → gate → publish or restore
    → commit_step → metrics → checkpoint (every ``checkpoint_every`` steps)

Publication (docs/publication-gate.md): every ``gate_every`` steps the publication gate
(``clawloop.gate.gate``) checks the training model on the probe set. An accepted candidate gets a new version
number from the store (never one used before, across restarts), is written to the version history
(``trainer.versions``), recorded in the store and published; a rejected one is never served: the trainable
weights and the optimizer state go back to the last accepted version's, and a ``gate_rejected`` event records the
evidence. The rejected steps stay committed (their samples were consumed by them; the event names them), so
nothing is lost silently and nothing is trained forever. With ``gate`` off every step is published unchecked.

Ordering and crash safety:

* The optimizer update happens before anything is recorded; if training raises, the caller releases the
  lease and the samples go back to ready (nothing was updated).
* A sample whose loss or gradient is not finite is dropped with that reason and the rest of the batch trains
  (``trainer.step.finite_share``). A step that changed no weight is not committed, gated or published; its
  samples go back to ready once (``_void_update``).
* Weights are published before the step is committed so the step row carries the version those weights were
  actually served under. A publication failure does not undo the step: it is committed with the previous
  version label and publication is retried before the next step.
* The store commit marks the samples consumed by this step number. A crash after it but before the next
  checkpoint is repaired on resume by ``store.requeue_after_step(checkpoint step)``: every sample trains into
  the resumed weights exactly once. The lost steps keep their rows (marked requeued) and their numbers.
* Step numbers continue the store's and are never reused: starting without ``resume`` in a run that already has
  steps continues the numbering (with fresh weights, as asked), and so does a resume past lost steps. Version
  numbers likewise come from the store.
* Rollback (``rollback(version)``) loads a kept version's weights (and its optimizer state when kept, else a
  fresh optimizer), serves it under its own number and training continues from it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from clawloop.config import Config
from clawloop.gate.gate import PublicationGate
from clawloop.store import SampleRecord, Store
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer import versions as history
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.metrics import MetricsWriter, step_record
from clawloop.trainer.model import TrainModels, gate_reference, load_train_models, load_trainable_state_dict, \
    output_vocab_size, trainable_state_dict
from clawloop.trainer.old_policy import RefreshFn
from clawloop.trainer.publish import LocalVersion, publish_weights
from clawloop.trainer.resume import plan_resume
from clawloop.trainer.step import EXCLUDED, UPDATE_SKIPPED, VoidedUpdates, excluded_samples, make_optimizer, \
    train_step, update_applied

log = logging.getLogger(__name__)


def make_refresh(teacher: Any, loop: asyncio.AbstractEventLoop | None = None) -> RefreshFn | None:
    """A blocking ``(turn, hints, at_ids_T_K, temperature) -> [C, T, K]`` for the training thread.

    ``teacher`` may be a ``clawloop.teacher.Teacher`` (its async ``teacher_at_ids`` runs on ``loop``, the
    event loop that owns the engines) or already such a callable (tests)."""
    if teacher is None:
        return None
    method = getattr(teacher, "teacher_at_ids", None)
    if method is None:
        if callable(teacher):
            return teacher
        raise TypeError(f"{type(teacher).__name__} is neither a Teacher nor a callable")

    def refresh(turn: Any, hints: list[str], at_ids_T_K: torch.Tensor, temperature: float) -> torch.Tensor:
        result = method(turn, hints, at_ids_T_K, temperature=temperature)
        if not asyncio.iscoroutine(result):
            return result
        if loop is not None and loop.is_running():
            return asyncio.run_coroutine_threadsafe(result, loop).result()
        return asyncio.run(result)

    return refresh


@dataclass
class AcceptedState:
    """The last accepted version's trainable weights and optimizer state (CPU copies), restored on a rejection."""

    version: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


class Trainer:
    def __init__(self, config: Config, store: Store, engine: Any = None, *, run_dir: str | Path | None = None,
                 refresh: RefreshFn | None = None, models: TrainModels | None = None,
                 console: TextIO | None = sys.stderr, keep_checkpoints: int = 2, fuse_old: bool | None = None,
                 on_gate: Callable[[dict[str, Any]], None] | None = None):
        self.config = config
        self.store = store
        self.engine = engine if engine is not None else LocalVersion()
        self.run_dir = Path(run_dir if run_dir is not None else config.run_dir)
        self.refresh = refresh
        self.models = models if models is not None else load_train_models(config)
        self.optimizer = make_optimizer(self.models, config)
        self.step = self._last_recorded_step()  # step numbers go on across restarts, with or without resume
        self.policy_version = int(self.engine.policy_version)
        self.last_checkpoint_step = self.step
        self.needs_publish = False
        self.checkpoint_error: str | None = None
        """Why the last checkpoint write failed (None after a good one); a failed write is retried next step."""
        self.pending_version: int | None = None
        """An accepted version whose publication failed (retried before the next step)."""
        self.keep_checkpoints = keep_checkpoints
        self.fuse_old = fuse_old
        """None = read ℓ_old from the loss's own forward when one update per batch (see ``step``)."""
        self.metrics = MetricsWriter(self.run_dir, config.metrics_backends, console=console)
        self.last_metrics: dict[str, Any] = {}
        self.max_context = self._max_context()
        self.vocab_size = output_vocab_size(self.models)
        self.on_gate = on_gate
        """Called with every gate decision (see ``_gate_event``), e.g. to print it."""
        self.gate = self._make_gate() if config.gate else None
        self.steps_since_check = 0
        self.unchecked_steps: list[int] = []
        self.gate_checks = 0
        self.gate_rejections = 0
        self.gate_seconds = 0.0
        self.voided = VoidedUpdates()
        """Samples of updates skipped as non-finite (see ``_void_update``)."""
        self.accepted = self._snapshot(self.policy_version)
        if self.policy_version == 0 and not history.has_version(self.run_dir, 0):
            self._save_version(0, self.step, {"starting_weights": True})

    def _max_context(self) -> int | None:
        ctx = getattr(self.engine, "max_context", None)
        if isinstance(ctx, int):
            return ctx
        return getattr(self.models.causal_lm.config, "max_position_embeddings", None)

    def _make_gate(self) -> PublicationGate:
        from clawloop.engines.model_files import load_tokenizer

        c = self.config
        return PublicationGate(load_tokenizer(self.models.model_dir), min_guard_pass=c.gate_min_guard_pass,
                               max_kl=c.gate_max_kl, probe_tokens=c.gate_probe_tokens,
                               recent_prompts=lambda: self.store.recent_prompts(c.gate_recent_prompts))

    # ---- accepted state and version history ---------------------------------------------------------
    def _snapshot(self, version: int) -> AcceptedState:
        return AcceptedState(version=version, weights=trainable_state_dict(self.models),
                             optimizer=copy.deepcopy(self.optimizer.state_dict()))

    def _restore(self, state: AcceptedState) -> None:
        load_trainable_state_dict(self.models, state.weights)
        if state.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state.optimizer))
        else:
            self.optimizer = make_optimizer(self.models, self.config)

    def _save_version(self, version: int, step: int, evidence: dict[str, Any]) -> None:
        history.save_version(self.run_dir, version, step, self.accepted.weights if version == self.accepted.version
                             else trainable_state_dict(self.models), self.optimizer.state_dict(),
                             lora=self.models.lora, evidence=evidence,
                             keep=history.versions_to_keep(self.config, self.models.lora), serving=self.policy_version)

    def _gate_event(self, kind: str, step: int, version: int | None, detail: dict[str, Any]) -> None:
        self.store.record_event(kind, detail, step=step, version=version)
        if self.on_gate is not None:
            try:
                self.on_gate({"kind": kind, "step": step, "version": version, **detail})
            except Exception:  # noqa: BLE001 - a printing hook must not fail a step
                log.exception("trainer: the gate hook failed")

    # ---- resume / checkpoint ------------------------------------------------------------------------
    def resume(self) -> dict[str, int]:
        """Load the newest checkpoint (if any) and requeue samples of steps after it. Blocking."""
        found = ckpt.load_latest(self.run_dir, map_location=self.models.device)
        if found is not None and bool(found.state.get("lora", self.models.lora)) != self.models.lora:
            raise RuntimeError(f"checkpoint {found.path} was written with lora={found.state.get('lora')}, "
                               f"this run has lora={self.models.lora}")
        plan = plan_resume(found.step if found is not None else None, self._last_recorded_step())
        requeued = self.store.requeue_after_step(plan.requeue_after) if plan.requeue_after is not None else 0
        self.step = plan.step  # lost steps keep their numbers and rows
        if found is None:
            self.last_checkpoint_step = 0
            log.warning("trainer: no checkpoint in %s; %d consumed samples requeued, training again from the "
                        "starting weights as step %d on", self.run_dir, requeued, self.step + 1)
            return {"step": 0, "requeued": requeued}
        log.warning("trainer: %s", plan.note)
        self.last_checkpoint_step = found.step
        self.policy_version = found.policy_version
        if history.has_version(self.run_dir, found.policy_version):
            # Serve the version's own weights: the checkpoint may hold steps not yet checked by the gate.
            stored = history.load_version(self.run_dir, found.policy_version, map_location=self.models.device)
            load_trainable_state_dict(self.models, stored.weights)
            if found.policy_version > 0:
                self.policy_version = publish_weights(self.engine, self.models, version=found.policy_version)
            kept_optimizer = stored.optimizer if stored.optimizer is not None else found.optimizer
            self.accepted = AcceptedState(found.policy_version, trainable_state_dict(self.models),
                                          copy.deepcopy(kept_optimizer) if kept_optimizer is not None else None)
            load_trainable_state_dict(self.models, found.weights)
        else:  # a run from before the version history: the checkpoint's weights are its version's
            load_trainable_state_dict(self.models, found.weights)
            if found.step > 0 or found.policy_version > 0:
                self.policy_version = publish_weights(self.engine, self.models, version=found.policy_version)
        if found.optimizer is not None:
            self.optimizer.load_state_dict(found.optimizer)
        for group in self.optimizer.param_groups:  # the configured lr wins over the saved one
            group["lr"] = self.config.learning_rate
        if not history.has_version(self.run_dir, found.policy_version):
            self.accepted = self._snapshot(self.policy_version)
        log.warning("trainer: resumed from %s (step %d, version %d); %d samples requeued", found.path.name,
                    found.step, self.policy_version, requeued)
        return {"step": found.step, "requeued": requeued, "policy_version": self.policy_version}

    def _last_recorded_step(self) -> int:
        last = self.store.last_step()
        return last[0] if last else 0

    def save_checkpoint(self) -> Path:
        path = ckpt.save_checkpoint(
            self.run_dir, self.step, self.policy_version, trainable_state_dict(self.models),
            self.optimizer.state_dict(),
            extra={"lora": self.models.lora, "model_dir": str(self.models.model_dir), "method": self.config.method},
            keep_last=self.keep_checkpoints)
        self.last_checkpoint_step = self.step
        self.checkpoint_error = None
        return path

    def checkpoint_if_due(self, force: bool = False) -> Path | None:
        if self.step == self.last_checkpoint_step:
            return None
        if force or self.step % self.config.checkpoint_every == 0 or self.checkpoint_error is not None:
            return self.save_checkpoint()
        return None

    # ---- publication ----------------------------------------------------------------------------------
    def publish(self) -> bool:
        """Publish the training model's weights under ``pending_version``."""
        try:
            self.policy_version = publish_weights(self.engine, self.models, version=self.pending_version)
            self.needs_publish = False
            self.pending_version = None
            return True
        except Exception:
            log.exception("trainer: publishing weights failed; will retry before the next step")
            self.needs_publish = True
            return False

    def _accept(self, step: int, evidence: dict[str, Any]) -> bool:
        """Give the current weights a new version number, keep them, record them and publish them."""
        version = self.store.next_version(at_least=max(self.policy_version, self.accepted.version) + 1)
        self.accepted = self._snapshot(version)
        try:
            self._save_version(version, step, evidence)
        except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for the same disk full
            # The version is still served and kept in memory for the gate; only a later rollback to it is lost.
            # Disk full must not turn an accepted step into a failed one (its samples are consumed).
            evidence = {**evidence, "kept_on_disk": False, "keep_error": f"{type(exc).__name__}: {exc}"}
            log.error("trainer: keeping version %d in %s failed (%s); it is served but cannot be rolled back to",
                      version, self.run_dir, evidence["keep_error"])
        self.store.record_version(version, step, "accepted", evidence)
        self.pending_version = version
        self.unchecked_steps = []
        return self.publish()

    def _check(self, step: int) -> tuple[bool, dict[str, Any]]:
        """Run the gate when due. Returns (published, metrics about the gate)."""
        self.unchecked_steps.append(step)
        if self.gate is None:
            return self._accept(step, {"gate": "off"}), {}
        self.steps_since_check += 1
        if self.steps_since_check < self.config.gate_every:
            return False, {"gate_due_in": float(self.config.gate_every - self.steps_since_check)}
        self.steps_since_check = 0
        kl_to = "reference" if self.models.lora or self.models.reference is not None else "last_accepted"
        result = self.gate.check(self.models.causal_lm,
                                 lambda: gate_reference(self.models, self.accepted.weights), kl_to=kl_to)
        self.gate_checks += 1
        self.gate_seconds += result.seconds
        metrics = {"gate_accepted": 1.0 if result.accepted else 0.0, "gate_guard_pass": result.guard_pass,
                   "gate_kl": result.kl, "gate_s": result.seconds}
        evidence = result.evidence()
        steps = list(self.unchecked_steps)
        if result.accepted:
            published = self._accept(step, evidence)
            log.info("trainer: step %d accepted by the publication gate as version %d (%s)", step,
                     self.accepted.version, result.summary())
            self._gate_event("gate_accepted", step, self.accepted.version, {"steps": steps, **evidence})
            return published, metrics
        self.gate_rejections += 1
        self._restore(self.accepted)
        self.unchecked_steps = []
        self._gate_event("gate_rejected", step, self.policy_version,
                         {"steps": steps, "restored_version": self.accepted.version, **evidence})
        log.warning("trainer: step %d rejected by the publication gate (%s); back to version %d", step,
                    "; ".join(result.reasons), self.accepted.version)
        return False, metrics

    def rollback(self, version: int) -> dict[str, Any]:
        """Serve kept version ``version`` again and continue training from it. Blocking (training thread)."""
        stored = history.load_version(self.run_dir, version, map_location=self.models.device)
        if bool(stored.meta.get("lora", self.models.lora)) != self.models.lora:
            raise ValueError(f"version {version} was written with lora={stored.meta.get('lora')}, this run has "
                             f"lora={self.models.lora}")
        previous = self.policy_version
        load_trainable_state_dict(self.models, stored.weights)
        self.optimizer = make_optimizer(self.models, self.config)
        if stored.optimizer is not None:
            self.optimizer.load_state_dict(stored.optimizer)
            for group in self.optimizer.param_groups:  # the configured lr wins over the saved one
                group["lr"] = self.config.learning_rate
            optimizer = "restored"
        else:
            optimizer = "reset (not kept with this version)"
        self.policy_version = publish_weights(self.engine, self.models, version=version)
        self.needs_publish, self.pending_version = False, None
        self.accepted = self._snapshot(version)
        self.steps_since_check = 0
        self.unchecked_steps = []
        rolled_back = self.store.record_rollback(version, previous, {"optimizer": optimizer, "step": self.step})
        log.warning("trainer: rolled back from version %d to version %d (optimizer %s)", previous, version,
                    optimizer)
        return {"version": self.policy_version, "from_version": previous, "rolled_back": rolled_back,
                "optimizer": optimizer, "step": self.step}

    # ---- one batch ------------------------------------------------------------------------------------
    def run_batch(self, lease_id: str, samples: list[SampleRecord],
                  should_stop: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """Train one step on a leased batch and commit it. Returns the step metrics, or None when no sample
        was trainable (all dropped with reasons) or a stop was requested before training began (lease
        released). Raises on failure; the caller releases the lease."""
        if self.needs_publish:
            self.publish()
        items, drops, stats = prepare_items(self.store, samples, self.config, self.policy_version,
                                            self.max_context, self.vocab_size)
        for turn_id, reason in drops:
            self.store.drop_leased_sample(turn_id, reason)
        if not items:
            self.store.release_lease(lease_id)
            return None
        if should_stop is not None and should_stop():
            self.store.release_lease(lease_id)
            return None
        metrics = train_step(self.models, self.optimizer, items, self.config, refresh=self.refresh,
                             fuse_old=self.fuse_old)
        for turn_id, reason in excluded_samples(items):
            self.store.drop_leased_sample(turn_id, reason, lease_id=lease_id)
        items = [it for it in items if EXCLUDED not in it.info]
        if not update_applied(metrics):
            self._void_update(lease_id, items)
            return None
        step = self.step + 1
        published, gate_metrics = self._check(step)
        metrics.update(stats.as_metrics())
        metrics.update(gate_metrics)
        metrics.update({
            "step": step,
            "policy_version": self.policy_version,
            "published": 1.0 if published else 0.0,
            "dropped": float(len(drops)),
            "waiting": float(self.store.ready_count()),
        })
        turn_ids = [it.turn_id for it in items]
        self.store.commit_step(lease_id, step, self.policy_version, step_record(metrics), turn_ids)
        self.step = step  # only once the store agrees, so step numbers never skip
        self.last_metrics = metrics
        self.after_commit(metrics)
        return metrics

    def _void_update(self, lease_id: str, items: list[Any]) -> None:
        """A step that changed no weight (its update was skipped as non-finite, or no sample reached it) is not a
        step: nothing is committed, gated or published. Its samples go back to ready for another batch, except
        those already in such a step before, which are dropped (a sample cannot stall training forever)."""
        again = self.voided.second_time(items)
        for turn_id in again:
            self.store.drop_leased_sample(turn_id, UPDATE_SKIPPED, lease_id=lease_id)
        self.store.release_lease(lease_id)
        self.store.record_event("update_skipped", {"turn_ids": [it.turn_id for it in items], "dropped": again},
                                step=self.step, version=self.policy_version)
        log.error("trainer: the update on %d samples was not finite and is skipped (no step, nothing published); "
                  "%d go back to ready, %d dropped after a second try", len(items), len(items) - len(again),
                  len(again))

    def after_commit(self, metrics: dict[str, Any]) -> None:
        """Bookkeeping of a committed step. The step stands whatever happens here (its samples are consumed in
        the store), so a failure (disk full) is logged as what it is and never reported as a failed step."""
        try:
            self.metrics.write(metrics)
            self.metrics.progress(metrics, int(metrics["waiting"]))
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.error("trainer: writing the metrics of step %d failed (%s: %s); the step stands", self.step,
                      type(exc).__name__, exc)
        try:
            self.checkpoint_if_due()
        except Exception as exc:  # noqa: BLE001 - see the docstring
            self.checkpoint_error = f"{type(exc).__name__}: {exc}"
            log.error("trainer: writing the checkpoint of step %d failed (%s); the step stands and its samples "
                      "are consumed; the checkpoint is written again after the next step", self.step,
                      self.checkpoint_error)

    def close(self) -> None:
        """Close the metrics and let go of the weights and optimizer state (see ``HFEngine._release``)."""
        self.metrics.close()
        self.models = self.optimizer = None  # type: ignore[assignment]
        self.accepted = None  # type: ignore[assignment]
