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
evidence (with ``gate_restore_after`` > 1, or ``gate_restore_after_v0`` while the starting weights are served,
only once that many candidates in a row were rejected; until then training goes on from the rejected weights,
which are never served). The rejected steps stay committed (their
samples were consumed by them; the event names them), so nothing is lost silently and nothing is trained forever.
With ``gate`` off every step is published unchecked.

Ordering and crash safety:

* The optimizer update happens before anything is recorded; if training raises, the caller releases the
  lease and the samples go back to ready (nothing was updated: a later PPO epoch that fails after an update
  ends the step with the updates it made instead of raising, ``train_step``).
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

import collections
import copy
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import torch

from clawloop.config import Config
from clawloop.gate.gate import GateResult, PublicationGate
from clawloop.gate.kept_answers import KeptAnswers
from clawloop.gate.knowledge import KNOWLEDGE
from clawloop.gate.scoring import PromptStates
from clawloop.memory import decoding_allocations
from clawloop.retry import Backoff, retry_sync
from clawloop.store import LeaseLost, SampleRecord
from clawloop.teacher import OPENING_TOKENS, hint_system
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer import versions as history
from clawloop.trainer.batch import TrainItem, prepare_items
from clawloop.trainer.contracts import GateView, Parallel, PublishingEngine, SampleSource, TurnSource, WeightSink
from clawloop.trainer.metrics import MetricsWriter, step_record
from clawloop.trainer.model import TrainModels, gate_reference, load_train_models, load_trainable_state_dict, \
    output_vocab_size, trainable_state_dict
from clawloop.trainer.parallel import LocalGateView, LocalParallel
from clawloop.trainer.publish import EngineSink, LocalVersion, unshared_tensors
from clawloop.trainer.resume import plan_resume
from clawloop.trainer.retain import (RetainExample, RetainTargets, RetainTerm, build_examples,
                                     build_opening_examples)
from clawloop.trainer.retain_prompts import RETAIN_PROMPTS
from clawloop.trainer.rollouts import rollout_items, wants_rollouts
from clawloop.trainer.teacher_client import TeacherClient
from clawloop.trainer.step import EXCLUDED, UPDATE_SKIPPED, VoidedUpdates, excluded_samples, make_optimizer, \
    train_step, update_applied, zero_momentum

log = logging.getLogger(__name__)

T = TypeVar("T")

STORE_BACKOFF = Backoff(retries=5, base_s=0.5)
"""One round of tries of a store write after the update (waits 0.5 s doubling to 8 s); rounds go on until it
goes through (``Trainer._persist``)."""


@dataclass
class AcceptedState:
    """The last accepted version's trainable weights and optimizer state (CPU copies, on the main process), restored
    on a rejection."""

    version: int
    weights: dict[str, torch.Tensor] | None
    optimizer: dict[str, Any] | None


class PublicationPending(RuntimeError):
    """The accepted version is not served yet (its publication failed again), and the sink serves the live
    training weights rather than the accepted snapshot: a step now would be published under that version's number
    once publication works, so no step trains until it does. The batch was given back untouched."""


class CommitNotRecorded(RuntimeError):
    """A stop was asked for while the store kept refusing a step's records (not its lease): the update is in the
    weights, so the batch is not given back; its lease expires, and no checkpoint holding that update is written
    (``uncommitted``), so after a restart its samples train once into the checkpointed weights."""


class Trainer:
    def __init__(self, config: Config, store: SampleSource | None, engine: PublishingEngine | None = None, *,
                 run_dir: str | Path | None = None, teacher: TeacherClient | None = None,
                 models: TrainModels | None = None, console: TextIO | None = sys.stderr, keep_checkpoints: int = 2,
                 fuse_old: bool | None = None, ask_in_loss_forward: bool | None = None,
                 on_gate: Callable[[dict[str, Any]], None] | None = None,
                 sink: WeightSink | None = None, parallel: Parallel | None = None,
                 gate_view: GateView | None = None, store_backoff: Backoff = STORE_BACKOFF):
        """``store`` is read and written on the main process only (None elsewhere under ``torchrun``). ``sink``
        defaults to publishing to ``engine`` (``LocalVersion``: nowhere); ``parallel`` to one process;
        ``gate_view`` to the training model itself. ``teacher`` scores the OPD branches in the step's old-policy pass
        (``trainer.teacher_client``; None: only scores recorded at the very ids are used)."""
        self.config = config
        self.store = store
        self.parallel: Parallel = parallel if parallel is not None else LocalParallel()
        self.engine = engine if engine is not None or sink is not None else LocalVersion()
        """The engine weights are published to in this process (None when ``sink`` goes elsewhere)."""
        self.sink: WeightSink = sink if sink is not None else EngineSink(self.engine)
        self.run_dir = Path(run_dir if run_dir is not None else config.run_dir)
        self.teacher = teacher
        self.models = models if models is not None else load_train_models(config)
        self.optimizer = make_optimizer(self.models, config)
        self.store_backoff = store_backoff
        self.store_retries = 0
        """Store writes after an optimizer step that failed and were tried again (disk full, database locked)."""
        self.uncommitted = False
        """A step's update is in the weights but its commit never went through (``CommitNotRecorded``)."""
        self.step = self.parallel.share(self._last_recorded_step)  # step numbers go on across restarts
        self.policy_version = int(self.parallel.share(lambda: self.sink.policy_version))
        self.last_checkpoint_step = self.step
        self.steps_since_checkpoint = 0
        """Steps committed since the last checkpoint (per-user policies number their steps in one sequence for
        the run, so a user's own steps need not land on multiples of ``checkpoint_every``)."""
        self.needs_publish = False
        self.checkpoint_error: str | None = None
        """Why the last checkpoint write failed (None after a good one); a failed write is retried next step."""
        self.pending_version: int | None = None
        """An accepted version whose publication failed (retried before the next step)."""
        self.keep_checkpoints = keep_checkpoints
        self.fuse_old = fuse_old
        """None = read ℓ_old from the loss's own forward when one update per batch (see ``step``)."""
        self.ask_in_loss_forward = ask_in_loss_forward
        """None = take the top-k ids the teacher is asked at from the loss's own forward when the step can
        (``train_step``); False = always from a no-gradient forward first (to compare the two)."""
        self.metrics = MetricsWriter(self.run_dir, config.metrics_backends, console=console) \
            if self.parallel.main else None
        self.last_metrics: dict[str, Any] = {}
        self.max_context = self._max_context()
        self.vocab_size = output_vocab_size(self.models)
        self.on_gate = on_gate
        """Called with every gate decision (see ``_gate_event``), e.g. to print it."""
        self.hint_counts: collections.Counter[str] = collections.Counter()
        """How often each hint came first on a sample trained since this trainer started (``_preference_hint``)."""
        self.gate = self._make_gate() if config.gate and self.parallel.main else None
        self.gate_view: GateView = gate_view if gate_view is not None else LocalGateView(self.models)
        self.steps_since_check = 0
        self.unchecked_steps: list[int] = []
        self.gate_checks = 0
        self.gate_rejections = 0
        self.trains_opening = False
        """Whether the last step trained the preference as one about how answers open (``opening_preference``)."""
        self.rejections_in_row = 0
        """Rejected candidates since the last accepted one (or restore): training goes back to the accepted
        weights when it reaches ``gate_restore_after`` (``_restore_after``). Not kept across a restart, which starts
        it at 0."""
        self.lr_scale = 1.0
        """The multiple of ``learning_rate`` training runs at: ``gate_reject_lr_scale`` per rejected candidate,
        down to ``gate_min_lr_scale``; 1 again at a rollback or restart."""
        self.gate_seconds = 0.0
        self.end_ids: tuple[list[int], int] | None = None
        """The ids that end an answer and the chat template's end of turn, read once the first rollout needs them."""
        self.retain: RetainTerm | None = None
        """The retain term once built (``_retain``); its targets are recomputed after a restart, the same ones."""
        self.voided = VoidedUpdates()
        """Samples of updates skipped as non-finite (see ``_void_update``)."""
        self.accepted = self._snapshot(self.policy_version)
        if self.policy_version == 0:
            self.parallel.share(self._keep_starting_weights)

    def _keep_starting_weights(self) -> None:
        if not history.has_version(self.run_dir, 0):
            self._save_version(0, self.step, {"starting_weights": True})

    def _max_context(self) -> int | None:
        ctx = self.sink.max_context
        if isinstance(ctx, int):
            return ctx
        # The Hugging Face model config (not clawloop's): an architecture may lack the field.
        return getattr(self.models.causal_lm.config, "max_position_embeddings", None)

    def _make_gate(self) -> PublicationGate:
        from clawloop.engines.model_files import load_tokenizer

        c = self.config
        store = self._source()
        tokenizer = load_tokenizer(self.models.model_dir)
        states = None
        if c.gate_prompt_state_tokens > 0:  # made by the first gate of these models, shared by the others
            if self.models.gate_prompt_states is None:
                self.models.gate_prompt_states = PromptStates(c.gate_prompt_state_tokens)
            states = self.models.gate_prompt_states
        return PublicationGate(tokenizer, min_guard_pass=c.gate_min_guard_pass,
                               max_kl=c.gate_max_kl, probe_tokens=c.gate_probe_tokens,
                               recent_prompts=lambda: store.recent_prompts(c.gate_recent_prompts),
                               knowledge=KNOWLEDGE if c.gate_knowledge else (),
                               fixed_prompts=lambda: store.recent_prompts(c.gate_fixed_prompts, corrected=True),
                               knowledge_samples=c.gate_knowledge_samples if c.default_temperature > 0 else 0,
                               knowledge_temperature=c.default_temperature or 1.0,
                               max_fact_drop=c.gate_max_fact_drop, reference_dice=c.gate_reference_dice,
                               preference_hint=self._preference_hint if c.gate_preference else None,
                               max_preference_drop=c.gate_max_preference_drop,
                               hint_system=hint_system(c, tokenizer), prompt_states=states,
                               kept_answers=kept_answers(self.models, self.config),
                               accepted_verdicts=c.gate_accepted_verdicts)

    def _preference_hint(self) -> str | None:
        """The hint the gate's preference check reads: the one most often first among the hints of the samples
        trained since this trainer started (None before any hinted sample)."""
        top = self.hint_counts.most_common(1)
        return top[0][0] if top else None

    def _retain(self) -> RetainTerm | None:
        """The retain term (``retain_coef > 0``); its targets come from the starting weights, a chunk at a time as
        its updates take them (``RetainTargets``) or while the trainer works ahead."""
        c = self.config
        if c.retain_coef <= 0:
            return None
        if self.retain is None:
            if self.models.retain_targets is None:
                self.models.retain_targets = RetainTargets(
                    RETAIN_PROMPTS, functools.partial(starting_retain_examples, self.models, c))
            # A resumed trainer goes on where the round-robin was, not back at its first prompts.
            builds_behind_hint = c.retain_behind_hint or c.opening_preference != "never"
            behind = functools.partial(opening_retain_examples, self.models, c) if builds_behind_hint else None
            self.retain = RetainTerm(self.models.retain_targets, coef=c.retain_coef, batch=c.retain_batch,
                                     seed=c.seed, start=self.step * c.retain_batch * c.steps_per_batch,
                                     behind_hint=behind)
        return self.retain

    def _opening_preference(self, retain: RetainTerm | None, hint: str | None) -> bool:
        """Whether this step trains the preference as one about how answers open (``opening_preference``); with
        ``auto``, measured on the retain term's prompts behind ``hint`` (built here the first time)."""
        mode = self.config.opening_preference
        if mode != "auto":
            return mode == "always"
        if hint is None or retain is None or retain.behind_hint is None:
            return False
        return retain.measure_opening(hint) >= self.config.opening_min_share

    def _config_for(self, opening: bool) -> Config:
        """The settings a step trains with: the configured ones, or for an opening preference those with the
        ``opening_*`` values in place (rollouts only where the method and the trainer can take them)."""
        c = self.config
        if not opening:
            return c
        rollouts_fit = c.trains_rollouts and self.parallel.world_size == 1
        return dataclasses.replace(c, support_coef=c.opening_support_coef if c.support_coef > 0 else 0.0,
                                   opd_rollouts=c.opening_rollouts if rollouts_fit else 0,
                                   gate_restore_after_v0=c.opening_restore_after_v0)

    def _rollouts(self, items: list[TrainItem], config: Config) -> list[TrainItem]:
        """The current weights' own answers to the batch's hinted prompts (``opd_rollouts``; one process only)."""
        if config.opd_rollouts <= 0 or not any(wants_rollouts(it, config) for it in items):
            return []
        if self.end_ids is None:
            from clawloop.engines.model_files import end_token_ids, load_tokenizer, turn_end_token_id
            tokenizer = load_tokenizer(self.models.model_dir)
            self.end_ids = (end_token_ids(tokenizer), turn_end_token_id(tokenizer))
        return rollout_items(self.models, items, config, step=self.step + 1, end_ids=self.end_ids[0],
                             turn_end=self.end_ids[1], max_context=self.max_context)

    def _source(self) -> SampleSource:
        """The store, on the main process (every call to it runs there)."""
        if self.store is None:
            raise RuntimeError("this process has no sample source (only the main process talks to it)")
        return self.store

    # ---- accepted state and version history ---------------------------------------------------------
    def _snapshot(self, version: int, weights: dict[str, torch.Tensor] | None = None, *,
                  gathered: bool = False) -> AcceptedState:
        """The current weights and optimizer state as the accepted ones (``gathered``: ``weights`` are the
        trainable state gathered already, on every process alike)."""
        if not gathered:
            weights = self.parallel.trainable_weights(self.models)
        return AcceptedState(version=version, weights=weights,
                             optimizer=self.parallel.optimizer_state(self.models, self.optimizer))

    def _restore(self, state: AcceptedState) -> None:
        if not self.parallel.load(self.models, self.optimizer, state.weights, state.optimizer,
                                  self.config.learning_rate):
            self.optimizer = make_optimizer(self.models, self.config)
        self._apply_lr_scale()

    def _apply_lr_scale(self) -> None:
        """Every parameter group at ``learning_rate`` × ``lr_scale``."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.learning_rate * self.lr_scale

    def _save_version(self, version: int, step: int, evidence: dict[str, Any]) -> None:
        """Main process: keep the accepted state (``self.accepted``, just taken) as version ``version``."""
        history.save_version(self.run_dir, version, step, self.accepted.weights, self.accepted.optimizer,
                             lora=self.models.lora, evidence=evidence,
                             keep=history.versions_to_keep(self.config, self.models.lora), serving=self.policy_version)

    def _gate_event(self, kind: str, step: int, version: int | None, detail: dict[str, Any],
                    should_stop: Callable[[], bool] | None = None) -> None:
        self._persist(lambda store: store.record_event(kind, detail, step=step, version=version),
                      f"the {kind} event of step {step}", should_stop)
        if self.on_gate is not None and self.parallel.main:
            try:
                self.on_gate({"kind": kind, "step": step, "version": version, **detail})
            except Exception:  # noqa: BLE001 - a printing hook must not fail a step
                log.exception("trainer: the gate hook failed")

    # ---- store writes after the optimizer step -----------------------------------------------------------
    def _persist(self, write: Callable[[SampleSource], T], what: str,
                 should_stop: Callable[[], bool] | None = None) -> T:
        """A store write after the optimizer step, on the main process, tried until it goes through: the update is
        in the weights, so giving the batch back would train its samples twice. ``LeaseLost`` is raised as it is
        (the samples are gone; nothing can be recorded for them). A stop asked for meanwhile raises
        ``CommitNotRecorded``."""
        def attempt(_: int) -> T:
            return write(self._source())

        def note(attempt_no: int, exc: BaseException, delay: float) -> None:
            self.store_retries += 1
            log.error("trainer: recording %s failed (%s: %s); trying again in %.1fs (the update is in the weights, "
                      "so the batch is kept)", what, type(exc).__name__, exc, delay)

        def until_recorded() -> T:
            while True:
                try:
                    return retry_sync(attempt, self.store_backoff, on_retry=note,
                                      retryable=lambda exc: not isinstance(exc, LeaseLost))
                except LeaseLost:
                    raise
                except Exception as exc:  # noqa: BLE001 - a round of tries ran out; the next round begins
                    delay = self.store_backoff.delay(self.store_backoff.retries)
                    note(self.store_backoff.retries, exc, delay)
                    if should_stop is not None and should_stop():
                        self.uncommitted = True
                        raise CommitNotRecorded(f"a stop was asked for while recording {what} kept failing "
                                                f"({type(exc).__name__}: {exc})") from exc
                    time.sleep(delay)

        return self.parallel.share(until_recorded)

    def _commit(self, lease_id: str, step: int, metrics: dict[str, Any], turn_ids: list[int],
                should_stop: Callable[[], bool] | None, scores: dict[int, dict[str, torch.Tensor]]) -> bool:
        """Record the step (retried like every write after the update). False when the lease was lost: the samples
        are not marked trained and the rest of the lease is given back; the update stays in the weights."""
        record = step_record(metrics)
        version = self.policy_version

        def commit(store: SampleSource) -> bool:
            try:
                store.commit_step(lease_id, step, version, record, turn_ids, scores)
                return True
            except LeaseLost as exc:
                log.error("trainer: step %d: the store refused the commit (lease %s lost: %s); its samples are not "
                          "marked trained and go back to ready", step, lease_id, exc)
            try:
                store.release_lease(lease_id)
            except Exception:  # noqa: BLE001 - the lease then expires on its own
                log.exception("trainer: releasing lease %s failed; its samples return when it expires", lease_id)
            return False

        return bool(self._persist(commit, f"step {step}", should_stop))

    # ---- resume / checkpoint ------------------------------------------------------------------------
    def resume(self) -> dict[str, int]:
        """Load the newest checkpoint (if any) and requeue samples of steps after it. Blocking; one process (the
        ``torchrun`` launcher plans its start in ``trainer.distributed``)."""
        store = self._source()
        found = ckpt.load_latest(self.run_dir, map_location=self.models.device)
        if found is not None and bool(found.state.get("lora", self.models.lora)) != self.models.lora:
            raise RuntimeError(f"checkpoint {found.path} was written with lora={found.state.get('lora')}, "
                               f"this run has lora={self.models.lora}")
        plan = plan_resume(found.step if found is not None else None, self._last_recorded_step())
        requeued = store.requeue_after_step(plan.requeue_after) if plan.requeue_after is not None else 0
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
                self.policy_version = self.sink.publish(self.models, stored.weights, found.policy_version)
            # The checkpoint's AdamW state is the version's only where both hold the same step; past it (steps
            # the gate has not checked, or rejected ones training went on from) a rejection restoring it would
            # bring back the momentum of discarded steps, so the version restarts with a fresh optimizer instead.
            same_step = int(stored.meta.get("step", -1)) == found.step
            kept_optimizer = stored.optimizer if stored.optimizer is not None else (
                found.optimizer if same_step else None)
            self.accepted = AcceptedState(found.policy_version, trainable_state_dict(self.models),
                                          copy.deepcopy(kept_optimizer) if kept_optimizer is not None else None)
            load_trainable_state_dict(self.models, found.weights)
        else:  # a run from before the version history: the checkpoint's weights are its version's
            load_trainable_state_dict(self.models, found.weights)
            if found.step > 0 or found.policy_version > 0:
                self.policy_version = self.sink.publish(self.models, found.weights, found.policy_version)
        if found.optimizer is not None:
            self.optimizer.load_state_dict(found.optimizer)
        self.lr_scale = 1.0
        self._apply_lr_scale()  # the configured lr wins over the saved one
        if not history.has_version(self.run_dir, found.policy_version):
            self.accepted = self._snapshot(self.policy_version)
        log.warning("trainer: resumed from %s (step %d, version %d); %d samples requeued", found.path.name,
                    found.step, self.policy_version, requeued)
        return {"step": found.step, "requeued": requeued, "policy_version": self.policy_version}

    def restart_at(self, step: int, version: int) -> None:
        """Counters decided by a launcher that loaded the weights itself (``torchrun``): the current weights and
        optimizer state become the accepted ones, kept as ``version``. Every process calls it."""
        self.step = self.last_checkpoint_step = int(step)
        self.policy_version = int(version)
        self.accepted = self._snapshot(self.policy_version)

    def _last_recorded_step(self) -> int:
        last = self._source().last_step()
        return last[0] if last else 0

    def save_checkpoint(self) -> Path:
        """Every process (under ``torchrun`` the gathers are collectives); the main process writes."""
        weights = self.parallel.trainable_weights(self.models)
        optimizer_state = self.parallel.optimizer_state(self.models, self.optimizer)

        def write() -> str:
            return str(ckpt.save_checkpoint(
                self.run_dir, self.step, self.policy_version, unshared_tensors(weights), optimizer_state,
                extra={"lora": self.models.lora, "model_dir": str(self.models.model_dir),
                       "method": self.config.method, "world_size": self.parallel.world_size},
                keep_last=self.keep_checkpoints))

        path = Path(self.parallel.share(write))
        self.last_checkpoint_step = self.step
        self.steps_since_checkpoint = 0
        self.checkpoint_error = None
        return path

    def checkpoint_if_due(self, force: bool = False) -> Path | None:
        if self.step == self.last_checkpoint_step or self.uncommitted:
            return None  # nothing new, or the weights hold an update whose samples the store does not count
        every = self.config.checkpoint_every
        if force or self.step % every == 0 or self.steps_since_checkpoint >= every \
                or self.checkpoint_error is not None:
            return self.save_checkpoint()
        return None

    # ---- publication ----------------------------------------------------------------------------------
    def publish(self) -> bool:
        """Publish the accepted weights under ``pending_version``."""
        version = self.pending_version
        try:
            served = self.parallel.share(lambda: self.sink.publish(self.models, self.accepted.weights,
                                                                   version if version is not None
                                                                   else self.policy_version + 1))
        except Exception:  # noqa: BLE001 - the step stands; publication is retried before the next one
            log.exception("trainer: publishing weights failed; will retry before the next step")
            self.needs_publish = True
            return False
        self.policy_version = int(served)
        self.needs_publish = False
        self.pending_version = None
        return True

    def _accept(self, step: int, evidence: dict[str, Any], should_stop: Callable[[], bool] | None,
                weights: dict[str, torch.Tensor] | None = None, gathered: bool = False) -> bool:
        """Give the current weights a new version number, keep them, record them and publish them."""
        at_least = max(self.policy_version, self.accepted.version) + 1
        version = int(self._persist(lambda store: store.next_version(at_least=at_least),
                                    f"the number of the version of step {step}", should_stop))
        self.accepted = self._snapshot(version, weights, gathered=gathered)

        def keep() -> dict[str, Any]:
            try:
                self._save_version(version, step, evidence)
                return evidence
            except Exception as exc:  # noqa: BLE001 - OSError, or safetensors' own error for the same disk full
                # The version is still served and kept in memory for the gate; only a later rollback to it is lost.
                # Disk full must not turn an accepted step into a failed one (its samples are consumed).
                kept = {**evidence, "kept_on_disk": False, "keep_error": f"{type(exc).__name__}: {exc}"}
                log.error("trainer: keeping version %d in %s failed (%s); it is served but cannot be rolled back to",
                          version, self.run_dir, kept["keep_error"])
                return kept

        evidence = self.parallel.share(keep)
        self._persist(lambda store: store.record_version(version, step, "accepted", evidence),
                      f"version {version}", should_stop)
        self.pending_version = version
        self.unchecked_steps = []
        return self.publish()

    def _check(self, step: int, should_stop: Callable[[], bool] | None) -> tuple[bool, dict[str, Any]]:
        """Run the gate when due. Returns (published, metrics about the gate)."""
        self.unchecked_steps.append(step)
        if not self.config.gate:
            return self._accept(step, {"gate": "off"}, should_stop), {}
        self.steps_since_check += 1
        if self.steps_since_check < self.config.gate_every:
            return False, {"gate_due_in": float(self.config.gate_every - self.steps_since_check)}
        self.steps_since_check = 0
        candidate = self.parallel.gate_candidate(self.models)

        def check() -> tuple[GateResult | None, str]:
            if self.gate is None:
                raise RuntimeError("the publication gate runs on the main process")
            try:
                return self.gate_view.check(self.gate, candidate, self.accepted.weights), ""
            except Exception as exc:  # noqa: BLE001 - an unchecked candidate is never served: it is rejected
                log.exception("trainer: step %d: the publication gate failed; the candidate is rejected", step)
                return None, f"{type(exc).__name__}: {exc}"

        result, error = self.parallel.share(check)
        self.gate_checks += 1
        steps = list(self.unchecked_steps)
        if result is None:
            metrics = {"gate_accepted": 0.0, "gate_error": 1.0}
            evidence: dict[str, Any] = {"accepted": False, "reasons": [f"the gate failed: {error}"]}
        else:
            self.gate_seconds += result.seconds
            metrics = {"gate_accepted": 1.0 if result.accepted else 0.0, "gate_s": result.seconds,
                       **{f"gate_{part}_s": s for part, s in result.seconds_by_part.items()}}
            if result.kl_measured:  # a check decided on the knowledge probes alone measured neither
                metrics.update(gate_guard_pass=result.guard_pass, gate_kl=result.kl)
            if result.preference is not None:
                metrics["gate_preference_drop"] = result.preference.drop
            if result.facts_reference_right:
                metrics["gate_facts_right"] = float(result.facts_right)
                metrics["gate_facts_reference_right"] = float(result.facts_reference_right)
                metrics["gate_facts_reference_bar"] = float(result.facts_reference_bar)
            evidence = result.evidence()
            if result.accepted:
                self.rejections_in_row = 0
                published = self._accept(step, evidence, should_stop, candidate,
                                         gathered=self.parallel.gathers_candidate)
                log.info("trainer: step %d accepted by the publication gate as version %d (%s)", step,
                         self.accepted.version, result.summary())
                self._gate_event("gate_accepted", step, self.accepted.version, {"steps": steps, **evidence},
                                 should_stop)
                return published, metrics
        self.gate_rejections += 1
        self.rejections_in_row += 1
        self.lr_scale = max(self.config.gate_min_lr_scale, self.lr_scale * self.config.gate_reject_lr_scale)
        self._apply_lr_scale()
        metrics["lr_scale"] = self.lr_scale
        restore = self.rejections_in_row >= self._restore_after()
        if restore:
            self._restore(self.accepted)
            if not self.config.gate_restore_momentum:
                zero_momentum(self.optimizer)
            self.rejections_in_row = 0
            self.unchecked_steps = []
        # else: the steps stay unchecked; the next decision (accepted, or a rejection that restores) names them
        self._gate_event("gate_rejected", step, self.policy_version,
                         {"steps": steps, "restored_version": self.accepted.version if restore else None,
                          **evidence}, should_stop)
        metrics["gate_restored"] = 1.0 if restore else 0.0
        reasons = result.reasons if result is not None else evidence["reasons"]
        then = f"back to version {self.accepted.version}" if restore else \
            f"training goes on from it ({self.rejections_in_row} rejected in a row)"
        log.warning("trainer: step %d rejected by the publication gate (%s); %s", step, "; ".join(reasons), then)
        return False, metrics

    def _restore_after(self) -> int:
        """Rejections in a row after which training goes back to the last accepted weights: ``gate_restore_after``,
        or ``gate_restore_after_v0`` (when set) while that is the starting weights. Read for the last step's kind of
        preference (``trains_opening``)."""
        c = self._config_for(self.trains_opening)
        if self.accepted.version == 0 and c.gate_restore_after_v0 > 0:
            return c.gate_restore_after_v0
        return c.gate_restore_after

    def rollback(self, version: int) -> dict[str, Any]:
        """Serve kept version ``version`` again and continue training from it. Blocking (training thread); every
        process calls it."""
        stored = history.load_version(self.run_dir, version, map_location=self.models.device) \
            if self.parallel.main else None
        lora = self.parallel.share(lambda: bool(stored.meta.get("lora", self.models.lora)))
        if lora != self.models.lora:
            raise ValueError(f"version {version} was written with lora={lora}, this run has lora={self.models.lora}")
        previous = self.policy_version
        # What the training model holds, should serving the version fail: the accepted state itself when no step
        # was taken since (no second copy of the weights and optimizer), else a snapshot.
        unchanged = not self.unchecked_steps and self.accepted is not None and self.accepted.version == previous
        before = self.accepted if unchanged else self._snapshot(previous)
        self.optimizer = make_optimizer(self.models, self.config)
        if self.parallel.load(self.models, self.optimizer, stored.weights if stored is not None else None,
                              stored.optimizer if stored is not None else None, self.config.learning_rate):
            optimizer = "restored"
        else:
            optimizer = "reset (not kept with this version)"
        lr_scale, self.lr_scale = self.lr_scale, 1.0
        self._apply_lr_scale()  # the configured lr wins over the saved one
        weights = stored.weights if stored is not None else None
        try:
            self.policy_version = int(self.parallel.share(lambda: self.sink.publish(self.models, weights, version)))
        except BaseException:  # nothing changed: training goes on from what it held, serving from what it served
            self.lr_scale = lr_scale
            self._restore(before)
            raise
        self.needs_publish, self.pending_version = False, None
        self.accepted = self._snapshot(version)
        if self.gate is not None:
            self.gate.forget_accepted()  # the probe verdicts kept for the last accepted version are not this one's
        self.steps_since_check = 0
        self.unchecked_steps = []
        self.rejections_in_row = 0
        rolled_back = self.parallel.share(lambda: self._source().record_rollback(
            version, previous, {"optimizer": optimizer, "step": self.step}))
        log.warning("trainer: rolled back from version %d to version %d (optimizer %s)", previous, version,
                    optimizer)
        return {"version": self.policy_version, "from_version": previous, "rolled_back": rolled_back,
                "optimizer": optimizer, "step": self.step}

    # ---- one batch ------------------------------------------------------------------------------------
    def run_batch(self, lease_id: str, samples: list[SampleRecord],
                  should_stop: Callable[[], bool] | None = None, *,
                  turns: TurnSource | None = None) -> dict[str, Any] | None:
        """Train one step on a leased batch and commit it (every process calls it with the same batch; ``turns``
        gives the samples' turns where the store is not at hand). Returns the step metrics, or None when no
        sample was trainable (all dropped with reasons), the update was void, or a stop was requested before
        training began (lease released). Raises ``LeaseLost`` when the commit was refused for a lost lease (the
        rest of the lease is released; the update stays in the weights) and ``CommitNotRecorded`` when a stop
        came while the store kept failing (the lease is kept). Any other failure happens before the update
        and is raised for the caller to release the lease."""
        if self.needs_publish:
            self.publish()
        if self.needs_publish and getattr(self.sink, "serves_live_weights", False):
            self.parallel.share(lambda: self._source().release_lease(lease_id))
            raise PublicationPending(f"version {self.pending_version} is accepted but not served yet (its "
                                     "publication failed); training waits for it")
        items, drops, stats = prepare_items(turns if turns is not None else self._source(), samples, self.config,
                                            self.policy_version, self.max_context, self.vocab_size)
        self.parallel.share(lambda: [self._source().drop_leased_sample(turn_id, reason)
                                     for turn_id, reason in drops])
        stop = bool(self.parallel.share(lambda: should_stop is not None and should_stop()))
        if not items or stop:
            self.parallel.share(lambda: self._source().release_lease(lease_id))
            return None
        retain = self._retain()
        # The hint most often first among everything trained so far, this batch included.
        counts = self.hint_counts + collections.Counter(it.sample.hints[0] for it in items if it.sample.hints)
        hint = counts.most_common(1)[0][0] if counts else None
        self.trains_opening = self._opening_preference(retain, hint)
        config = self._config_for(self.trains_opening)
        if retain is not None:
            retain.hint = hint
            retain.use_behind = self.config.retain_behind_hint or self.trains_opening
            retain.free_opening = self.trains_opening
        rollouts = self._rollouts(items, config)
        metrics = train_step(self.models, self.optimizer, items + rollouts, config, teacher=self.teacher,
                             fuse_old=self.fuse_old, ask_in_loss_forward=self.ask_in_loss_forward,
                             runner=self.parallel.runner, retain=retain)
        # The settings the step trained with, which an opening preference changes (``_config_for``).
        metrics.update({"opening_preference": 1.0 if self.trains_opening else 0.0,
                        "support_coef": config.support_coef, "opd_rollouts": float(config.opd_rollouts)})
        share = retain.opening_share(hint) if retain is not None and retain.behind_hint is not None and hint else None
        if share is not None:
            metrics["opening_moved_share"] = share
        # From here the update is in the weights: every store write is retried, never given up for the batch. Only
        # the stored samples (``items``) are dropped, committed or given back; their rollouts go with them.
        excluded = excluded_samples(items)
        if excluded:
            self._persist(lambda store: [store.drop_leased_sample(t, r, lease_id=lease_id) for t, r in excluded],
                          "the samples the step left out", should_stop)
        items = [it for it in items if EXCLUDED not in it.info]
        if not update_applied(metrics):
            self._void_update(lease_id, items)
            return None
        self.hint_counts.update(it.sample.hints[0] for it in items if it.sample.hints)
        step = self.step + 1
        published, gate_metrics = self._check(step, should_stop)
        metrics.update(stats.as_metrics())
        metrics.update(gate_metrics)
        metrics.update({
            "step": step,
            "policy_version": self.policy_version,
            "published": 1.0 if published else 0.0,
            "dropped": float(len(drops)),
            # A read, but after the update: retried like the writes, never a reason to give the batch back.
            "waiting": float(self._persist(lambda store: store.ready_count(), "the count of waiting samples",
                                           should_stop)),
        })
        if not self._commit(lease_id, step, metrics, [it.turn_id for it in items], should_stop,
                            {it.turn_id: it.scores.tensors() for it in items if it.scores is not None}):
            raise LeaseLost(f"step {step}: lease {lease_id} was lost before its commit")
        self.step = step  # only once the store agrees, so step numbers never skip
        self.steps_since_checkpoint += 1
        self.last_metrics = metrics
        self.after_commit(metrics)
        return metrics

    def _void_update(self, lease_id: str, items: list[Any]) -> None:
        """A step that changed no weight (its update was skipped as non-finite, or no sample reached it) is not a
        step: nothing is committed, gated or published. Its samples go back to ready for another batch, except
        those already in such a step before, which are dropped (a sample cannot stall training forever)."""
        again = self.voided.second_time(items)

        def give_back() -> None:
            store = self._source()
            for turn_id in again:
                store.drop_leased_sample(turn_id, UPDATE_SKIPPED, lease_id=lease_id)
            store.release_lease(lease_id)
            store.record_event("update_skipped", {"turn_ids": [it.turn_id for it in items], "dropped": again},
                               step=self.step, version=self.policy_version)

        self.parallel.share(give_back)
        log.error("trainer: the update on %d samples was not finite and is skipped (no step, nothing published); "
                  "%d go back to ready, %d dropped after a second try", len(items), len(items) - len(again),
                  len(again))

    def after_commit(self, metrics: dict[str, Any]) -> None:
        """Bookkeeping of a committed step. The step stands whatever happens here (its samples are consumed in
        the store), so a failure (disk full) is logged as what it is and never reported as a failed step."""
        if self.metrics is not None:
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

    def prepare(self) -> bool:
        """One piece of the work the first steps and checks would otherwise do on the way to a new version, done
        while nothing waits to be trained; returns whether any is left. First the retain term's targets, a chunk of
        prompts a call (all 50 took 59.5 s on one CPU thread for SmolLM2-135M), then the gate's answers
        and dice of the fixed reference (``PublicationGate.prepare``), then, once a step has set a hint, the
        retain term's examples behind it (``retain_behind_hint``), one piece a call so that a batch that arrives
        meanwhile waits for one piece at most. None changes what training or the gate decide: each computes the
        same things from the same starting weights, only sooner."""
        retain = self._retain()
        if retain is not None and not retain.targets.complete:
            retain.build_ahead()
            return True
        if self.gate is not None and self.gate_view.prepare(self.gate):
            return True
        # Last, the retain examples behind the hint (``retain_behind_hint``), once a step has set one.
        return retain is not None and retain.build_ahead()

    def has_work_ahead(self) -> bool:
        """Whether ``prepare`` has anything left that a step may have added (the retain examples behind a hint not
        built yet)."""
        return self.retain is not None and self.retain.behind_pending()

    def close(self) -> None:
        """Close the metrics and let go of the weights and optimizer state (see ``HFEngine._release``)."""
        if self.metrics is not None:
            self.metrics.close()
        if self.teacher is not None:
            self.teacher.close()
        self.models = self.optimizer = self.gate_view = None  # type: ignore[assignment]
        self.accepted = None  # type: ignore[assignment]


def kept_answers(models: TrainModels, config: Config) -> KeptAnswers | None:
    """The starting weights' kept answers (``gate_kept_answers``: the gate's shipped probes and the retain term's
    prompts), opened once for these models; None when off or when the model folder cannot be read for its
    fingerprint (the reference is then asked as before)."""
    if not config.gate_kept_answers:
        return None
    if models.gate_kept_answers is None:
        weight = next(models.causal_lm.parameters())
        try:
            models.gate_kept_answers = KeptAnswers.for_model(models.model_dir, dtype=str(weight.dtype),
                                                             device_type=weight.device.type)
        except OSError as exc:
            log.warning("trainer: the starting weights' answers are not kept between runs (%s: %s)",
                        type(exc).__name__, exc)
            return None
        log.info("trainer: %d answers of the starting weights kept from earlier runs (%s)",
                 len(models.gate_kept_answers), models.gate_kept_answers.path)
    return models.gate_kept_answers


def starting_retain_examples(models: TrainModels, config: Config, prompts: list[str]) -> list[RetainExample | None]:
    """The retain targets of ``prompts``, answered by the starting weights of ``models`` (``RetainTargets.build``;
    not bound to one trainer, since every user's trainer shares them)."""
    from clawloop.engines.model_files import end_token_ids, load_tokenizer

    tokenizer = load_tokenizer(models.model_dir)
    t0 = time.monotonic()
    # Inside a step's low mmap threshold when the step itself needs them (clawloop.memory): this is decoding.
    with decoding_allocations(), gate_reference(models, None) as starting:
        examples = build_examples(starting, tokenizer, prompts, k=config.retain_k, max_tokens=config.retain_tokens,
                                  end_ids=end_token_ids(tokenizer), opening=config.retain_opening,
                                  kept=kept_answers(models, config))
    log.info("retain term: targets of %d prompts in %.1fs (%d without a position to train)", len(prompts),
             time.monotonic() - t0, sum(e is None for e in examples))
    return examples


def opening_retain_examples(models: TrainModels, config: Config, prompts: list[str], hint: str
                            ) -> list[RetainExample | None]:
    """The retain targets of ``prompts`` behind ``hint``'s opening, from the starting weights of ``models``
    (``retain_behind_hint``; ``RetainTerm.behind_hint``)."""
    from clawloop.engines.model_files import end_token_ids, load_tokenizer

    tokenizer = load_tokenizer(models.model_dir)
    t0 = time.monotonic()
    with decoding_allocations(), gate_reference(models, None) as starting:
        examples = build_opening_examples(starting, tokenizer, prompts, hint, k=config.retain_k,
                                          max_tokens=config.retain_tokens, end_ids=end_token_ids(tokenizer),
                                          opening_tokens=OPENING_TOKENS, system=hint_system(config, tokenizer))
    log.info("retain term: %d of %d prompts built behind the hint's opening in %.1fs",
             sum(e is not None for e in examples), len(prompts), time.monotonic() - t0)
    return examples


def prepare_ahead(trainer: Trainer) -> bool:
    """``trainer.prepare()`` for a loop with nothing to train: whether to call it again. A failure is logged and
    ends the work ahead; the steps and checks then do that work themselves, as they would have."""
    t0 = time.perf_counter()
    try:
        more = trainer.prepare()
        log.info("trainer: a piece of work ahead took %.1f s%s", time.perf_counter() - t0,
                 "" if more else "; none left")
        return more
    except Exception:  # noqa: BLE001 - working ahead is an optimisation; training must not stop for it
        log.exception("trainer: working ahead of the first steps failed; the steps and checks do it instead")
        return False
