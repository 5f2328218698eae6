"""The online trainer: an asyncio component that trains while the server serves.

``OnlineTrainer(config, store, policy_engine, teacher=None)``:

* ``start()`` loads the training model (on the training thread: one thread for every model operation, at a lower
  CPU priority than serving, ``train_nice``), resumes from the newest checkpoint when asked,
  and starts the loop;
* the loop waits until ``store.ready_count() >= rollout_batch_size`` (woken early by ``wake()``, which the
  pipeline calls when it writes a sample; otherwise it polls), leases exactly one batch, and trains it in a
  worker thread — the event loop, and with it serving, never blocks on training. Publication swaps the
  engine's weights between requests (requests in flight finish on the weights they started with);
* samples do not wait forever for a full batch (``train_what_is_ready``): once the oldest ready sample has waited
  ``batch_wait_s``, or no new turn has been stored for ``idle_train_s`` and none waits to be judged (the user
  has gone idle), the loop leases what is ready (up to a batch) and trains it. One person a few turns a minute
  fills a batch of 16 in five minutes or more, and two or three conversations never did (docs/trainer.md);
* while nothing is ready, the shared policy's trainer works ahead, one piece at a time (``Trainer.prepare``): the
  retain term's targets and the gate's answers of the starting weights, which the first step and checks would
  otherwise compute on the way to the first new version;
* a step that fails before its update releases its lease (its samples become ready again) and the loop backs off
  (doubling from ``error_backoff_s`` up to ``max_backoff_s``) before trying again; the error is logged and counted.
  The failed batch's samples are then retried one per step, so samples that train fine go through and one that
  breaks every step it is in is isolated; after ``max_sample_failures`` failed steps it is dropped with reason
  ``train_error`` (never silently) instead of stopping training forever (``trainer.leasing``, which every trainer
  loop leases through);
* once the update is in the weights the batch is never given back: a store write that fails (disk full, database
  locked) is tried again until it goes through (``Trainer._persist``); only a lost lease gives up, and then the
  samples are not marked trained. A stop asked for while the store keeps failing leaves the lease to expire and
  writes no checkpoint holding that update;
* ``rollback(version)`` serves a kept version again (``Trainer.rollback``) once the step in progress, if any, has
  finished; requests keep being answered meanwhile. A rollback asked for while no server ran
  (``clawloop rollback RUN_DIR --to N``, recorded in the store's ``rollback_to``) is applied at ``start()``;
* ``stop()`` lets a running step finish (a step cannot be cut in half without losing its samples' accounting),
  releases anything still leased, writes a final checkpoint when steps were taken since the last one, and
  closes the metrics sinks.

The teacher, when given, scores each step's OPD branches at the old policy's exact top-k ids
(``trainer.old_policy``); its coroutines run on this event loop (``trainer.teacher_client.InProcessTeacher``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO, TypeVar

from clawloop.config import Config
from clawloop.memory import trim_heap
from clawloop.priority import lower_thread_priority
from clawloop.store import LeaseLost, Store, TurnState
from clawloop.trainer.contracts import PublishingEngine
from clawloop.trainer.core import CommitNotRecorded, PublicationPending, Trainer, prepare_ahead
from clawloop.trainer.teacher_client import in_process
from clawloop.trainer.leasing import BatchLeaser
from clawloop.trainer.per_user import OwnerSamples, UserPolicies
from clawloop.trainer.rollback import ROLLBACK_META
from clawloop.trainer.model import TrainModels

log = logging.getLogger(__name__)

T = TypeVar("T")

SWITCH_INTERVAL_S = 0.001
"""The interpreter's thread switch interval while an embedded trainer runs (see ``start``)."""



class TrainerStopped(RuntimeError):
    """A rollback asked for while the trainer stops (the server is shutting down): nothing was changed."""


class OnlineTrainer:
    def __init__(self, config: Config, store: Store, policy_engine: PublishingEngine | None, teacher: Any = None, *,
                 run_dir: str | Path | None = None, resume: bool = False, poll_interval_s: float = 1.0,
                 error_backoff_s: float = 5.0, max_backoff_s: float = 300.0, max_sample_failures: int = 5,
                 models: TrainModels | None = None,
                 console: TextIO | None = sys.stderr, on_gate: Callable[[dict[str, Any]], None] | None = None):
        self.config = config
        self.store = store
        self.engine = policy_engine
        self.teacher = teacher
        self.run_dir = Path(run_dir if run_dir is not None else config.run_dir)
        self.resume = resume
        self.poll_interval_s = float(poll_interval_s)
        self.error_backoff_s = float(error_backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_sample_failures = int(max_sample_failures)
        self._models = models
        self._console = console
        self.core: Trainer | None = None
        """The shared policy's trainer (``policy_scope = "shared"``)."""
        self.policies: UserPolicies | None = None
        """Every user's trainer (``policy_scope = "per_user"``, ``trainer.per_user``)."""
        self.failures = 0
        self.last_error = ""
        self.resumed: dict[str, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._busy = False
        self.on_gate = on_gate
        self._model_lock: asyncio.Lock | None = None
        self._executor: ThreadPoolExecutor | None = None
        """The one thread every model operation runs on (``start``)."""
        self._saved_switch_interval: float | None = None
        """The interpreter's switch interval before ``start`` shortened it; put back by ``stop``."""
        self.short_batches = 0
        """Batches leased with fewer samples than ``rollout_batch_size`` (``train_what_is_ready``)."""
        self._leasers: dict[str | None, BatchLeaser] = {}
        """The shared policy's leaser (key None) or each user's (``_leaser``)."""
        self._next_publish_try = 0.0
        """When ``_retry_publications`` may try again (monotonic seconds)."""
        self._preparing = True
        """Whether the shared policy's trainer may still have work to do ahead (``Trainer.prepare``)."""

    # ---- status (read by the API's status/metrics endpoints) ------------------------------------------
    @property
    def per_user(self) -> bool:
        return self.config.policy_scope == "per_user"

    @property
    def step(self) -> int:
        if self.policies is not None:
            return max((t.step for t in list(self.policies.trainers.values())), default=0)
        return self.core.step if self.core else 0

    @property
    def policy_version(self) -> int:
        if self.core is not None:
            return self.core.policy_version
        return int(self.engine.policy_version) if self.engine is not None else 0

    @property
    def last_metrics(self) -> dict[str, Any]:
        return dict(self.core.last_metrics) if self.core else {}

    @property
    def training(self) -> bool:
        """True while a step is running."""
        return self._busy

    def status(self) -> dict[str, Any]:
        status = {"step": self.step, "policy_version": self.policy_version, "training": self._busy,
                  "failures": self.failures, "last_error": self.last_error,
                  "samples_waiting": self.store.ready_count(), "short_batches": self.short_batches,
                  "last_metrics": self.last_metrics, "gate": self.gate_status(),
                  "policy_scope": self.config.policy_scope}
        if self.policies is not None:
            status["users"] = self.policies.status()
        return status

    def serving_versions(self) -> int | dict[str, int] | None:
        """The version the trainer serves (per-user policies: each user's, by name); None before it started."""
        if self.policies is not None:
            return {owner: t.policy_version for owner, t in list(self.policies.trainers.items())}
        return self.core.policy_version if self.core is not None else None

    def gate_status(self) -> dict[str, Any]:
        core = self.core
        if core is None:
            return {}
        return {"on": core.gate is not None, "checks": core.gate_checks, "rejections": core.gate_rejections,
                "seconds_per_check": round(core.gate_seconds / core.gate_checks, 2) if core.gate_checks else None,
                "accepted_version": core.accepted.version if core.accepted is not None else None,
                "working_ahead": self._preparing}

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        # Every model operation runs on this one thread, below serving's CPU priority (``train_nice``); the threads
        # it starts for its own parallel work inherit that priority. The trainer's Python between kernels holds the
        # interpreter lock; a shorter switch interval than Python's 5 ms hands it back to the serving threads sooner.
        self._saved_switch_interval = sys.getswitchinterval()
        if self._saved_switch_interval > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="clawloop-train",
                                            initializer=lower_thread_priority, initargs=(int(self.config.train_nice),))
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._stopping = False
        self._model_lock = asyncio.Lock()
        teacher = in_process(self.teacher, self._loop)
        if self.per_user:
            self.policies = await self._on_train_thread(
                UserPolicies, self.config, self.store, self.engine, run_dir=self.run_dir, teacher=teacher,
                models=self._models, console=self._console, on_gate=self.on_gate)
            if self.resume:
                self.resumed = await self._on_train_thread(self.policies.resume_all)
            if self.store.get_meta(ROLLBACK_META):
                log.error("trainer: a rollback recorded while the server was stopped (clawloop rollback --to) names "
                          "no user, and every user has a policy of their own here; it is not applied. Roll a "
                          "user back with POST /v1/admin/rollback {\"version\": N, \"user\": \"k_...\"}")
                self.store.set_meta(ROLLBACK_META, "")
            self._task = asyncio.create_task(self._run(), name="clawloop-trainer")
            return
        self.core = await self._on_train_thread(
            Trainer, self.config, self.store, self.engine, run_dir=self.run_dir, teacher=teacher,
            models=self._models, console=self._console, on_gate=self.on_gate)
        if self.resume:
            self.resumed = await self._on_train_thread(self.core.resume)
        pending = self.store.get_meta(ROLLBACK_META)
        if pending:
            await self._on_train_thread(self.core.rollback, int(pending))
            self.store.set_meta(ROLLBACK_META, "")
        self._task = asyncio.create_task(self._run(), name="clawloop-trainer")

    def wake(self) -> None:
        """A sample became ready (safe to call from any thread)."""
        loop, event = self._loop, self._wake
        if loop is None or event is None or loop.is_closed():
            return
        try:
            if asyncio.get_running_loop() is loop:
                event.set()
                return
        except RuntimeError:
            pass
        loop.call_soon_threadsafe(event.set)

    async def stop(self) -> None:
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await self._task  # a running step finishes; the loop then exits
            except asyncio.CancelledError:
                pass
            self._task = None
        if self.core is not None or self.policies is not None:
            # Under the model's lock: a rollback or forget that came during the stop finishes first, on a trainer
            # still open, and one that comes after finds it stopped.
            async with self._model_lock if self._model_lock is not None else contextlib.nullcontext():
                await self._on_train_thread(self._shutdown)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._saved_switch_interval is not None:  # the process goes on without a trainer: Python's own again
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    async def rollback(self, version: int, owner: str | None = None) -> dict[str, Any]:
        """Serve kept version ``version`` again and train on from it (after the step in progress); per-user
        policies roll back ``owner``'s."""
        if (self.core is None and self.policies is None) or self._model_lock is None:
            raise RuntimeError("the trainer has not started")
        async with self._model_lock:
            if self._stopping:
                raise TrainerStopped("the trainer is stopping; the served version is unchanged")
            if self.policies is not None:
                if not owner:
                    raise ValueError("per-user policies: say whose policy to roll back (user)")
                return await self._on_train_thread(self.policies.rollback, owner, int(version))
            return await self._on_train_thread(self.core.rollback, int(version))

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No training step runs while the block runs (it waits for the step in progress). A batch leased
        meanwhile trains afterwards, or is skipped when its samples are gone (``UserPolicies.run_batch``)."""
        if self._model_lock is None:
            yield
            return
        async with self._model_lock:
            yield

    def call_paused(self, fn: Callable[[], T], timeout_s: float = 600.0) -> T:
        """``fn()`` on a worker thread inside ``paused()``, for a thread other than the event loop's: what reads the
        trainer's model from outside must hold it still, since between steps an idle trainer works ahead on the
        reference (``prepare``), which takes the adapter off the model for a while."""
        if self._loop is None:
            raise RuntimeError("the trainer has not started")

        async def paused_call() -> T:
            async with self.paused():
                return await asyncio.to_thread(fn)

        return asyncio.run_coroutine_threadsafe(paused_call(), self._loop).result(timeout_s)

    async def let_go_of_user(self, owner: str) -> None:
        """Per-user policies: drop ``owner``'s trainer, optimizer state, gate and adapter weights, so a forget can
        delete their folder. Call it inside ``paused()``, and keep the pause until their records are deleted."""
        if self.policies is None or self._executor is None:
            return
        await self._on_train_thread(self.policies.forget, owner)
        self._leasers.pop(owner, None)

    async def bring_back_user(self, owner: str) -> None:
        """Per-user policies: after ``let_go_of_user``, when the forget could not go on (nothing was deleted):
        ``owner``'s policy resumes as after a restart, from their newest checkpoint (steps after it train again
        from their samples) and with its adapter served again."""
        if self.policies is None or self._executor is None:
            return
        assert self.policies is not None
        await self._on_train_thread(lambda: self.policies.activate(owner).resume())

    async def _on_train_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` on the training thread (see ``start``)."""
        assert self._loop is not None and self._executor is not None
        return await self._loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    def _train_batch(self, lease_id: str, samples: list[Any], owner: str | None = None) -> None:
        try:
            if self.policies is not None:
                assert owner is not None
                self.policies.run_batch(owner, lease_id, samples, lambda: self._stopping)
                return
            assert self.core is not None
            self.core.run_batch(lease_id, samples, lambda: self._stopping)
            # A step can give the trainer new work ahead (the retain term's examples behind a new hint).
            self._preparing = self._preparing or self.core.has_work_ahead()
        finally:
            trim_heap()  # a step's freed activations and gradients go back to the OS (clawloop.memory)

    def _shutdown(self) -> None:
        if self.policies is not None:
            try:
                self.policies.checkpoint_all()
            finally:
                self.policies.close()
                self._models = None
            return
        assert self.core is not None
        try:
            self.core.checkpoint_if_due(force=True)
        finally:
            self.core.close()
            self._models = None

    # ---- the loop -----------------------------------------------------------------------------------
    async def _run(self) -> None:
        assert (self.core is not None or self.policies is not None) and self._wake is not None
        consecutive = 0
        while not self._stopping:
            try:
                leaser, owner, lease_id, samples = await asyncio.to_thread(self._lease_next)
            except Exception as exc:  # noqa: BLE001 - e.g. the database is locked for longer than its timeout
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("trainer: reading the store failed; retrying")
                await self._sleep(self.error_backoff_s)
                continue
            if not samples:
                await self._retry_publications()
                if not await self._prepare():  # after a piece of work ahead, look for samples again at once
                    await self._sleep(self.poll_interval_s)
                continue
            self._busy = True
            try:
                assert self._model_lock is not None
                async with self._model_lock:
                    await self._on_train_thread(self._train_batch, lease_id, samples, owner)
                consecutive = 0
                leaser.succeeded(samples)
            except CommitNotRecorded as exc:  # stopping: the update is in the weights, so the batch stays leased
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("trainer: %s; its lease is kept and expires, and no checkpoint holds the update", exc)
            except LeaseLost as exc:  # after the update: its samples went back to ready; they did nothing wrong
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("trainer: %s; the update stays in the weights and its samples train again", exc)
            except PublicationPending as exc:  # the samples did nothing wrong: back to ready, uncounted
                consecutive += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("trainer: %s", exc)
                await self._sleep(min(self.max_backoff_s, self.error_backoff_s * 2 ** (consecutive - 1)))
            except Exception as exc:  # noqa: BLE001 - a failed step must not end serving
                self.failures += 1
                consecutive += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("trainer: step failed; its %d samples go back to ready", len(samples))
                try:
                    await asyncio.to_thread(leaser.failed, lease_id, samples)
                except Exception:  # noqa: BLE001 - the lease then expires on its own
                    log.exception("trainer: releasing lease %s failed; it returns when it expires", lease_id)
                await self._sleep(min(self.max_backoff_s, self.error_backoff_s * 2 ** (consecutive - 1)))
            finally:
                self._busy = False

    async def _prepare(self) -> bool:
        """One piece of the shared policy's work ahead (``Trainer.prepare``) while nothing waits to be trained;
        whether one was done."""
        if self.core is None or not self._preparing or self._stopping:
            return False
        assert self._model_lock is not None
        async with self._model_lock:
            self._preparing = await self._on_train_thread(prepare_ahead, self.core)
        return True

    async def _retry_publications(self) -> None:
        """Per-user policies: an accepted adapter whose publication failed is published again while the loop is
        idle (at most every ``error_backoff_s``), not only before that user's next step, which may never come.
        ``AdapterSink`` publishes the accepted weights it is given, whichever user's adapter the model holds."""
        if self.policies is None or self._model_lock is None or time.monotonic() < self._next_publish_try:
            return
        if not any(t.needs_publish for t in list(self.policies.trainers.values())):
            return
        self._next_publish_try = time.monotonic() + self.error_backoff_s
        async with self._model_lock:  # a forget meanwhile has taken its user's trainer out
            for trainer in [t for t in list(self.policies.trainers.values()) if t.needs_publish]:
                await self._on_train_thread(trainer.publish)

    def _leaser(self, owner: str | None) -> BatchLeaser:
        """The leaser of the shared policy (``owner`` None) or of one user's (their own failure counts)."""
        leaser = self._leasers.get(owner)
        if leaser is None:
            source = self.store if owner is None else OwnerSamples(self.store, owner)
            leaser = BatchLeaser(source, int(self.config.rollout_batch_size),
                                 max_sample_failures=self.max_sample_failures)
            self._leasers[owner] = leaser
        return leaser

    def _lease_next(self) -> tuple[BatchLeaser, str | None, str, list[Any]]:
        """The next batch to train and whose it is (``None``: the shared policy's). Runs in a worker thread."""
        if self.policies is None:
            leaser = self._leaser(None)
            return (leaser, None, *self._lease(leaser))
        now = time.time()
        chosen = self.policies.next_owner(now, idle=lambda: self._idle(now))
        if chosen is None:
            return self._leaser(None), None, "", []
        owner, whole = chosen
        leaser = self._leaser(owner)
        lease_id, samples = leaser.lease()
        if not samples and not whole:
            lease_id, samples = leaser.store.lease_samples(leaser.batch_size, leaser.lease_s, min_n=1)
            if samples:
                self.short_batches += 1
        return leaser, owner, lease_id, samples

    def _lease(self, leaser: BatchLeaser) -> tuple[str, list[Any]]:
        """A whole batch when one is ready; otherwise what is ready (up to a batch), once
        ``train_what_is_ready`` gives a reason. Runs in a worker thread."""
        lease_id, samples = leaser.lease()
        if samples:
            return lease_id, samples
        why = self.train_what_is_ready(time.time())
        if why is None:
            return lease_id, samples
        lease_id, samples = self.store.lease_samples(leaser.batch_size, leaser.lease_s, min_n=1)
        if samples:
            self.short_batches += 1
            log.info("trainer: training %d ready samples without a full batch of %d: %s", len(samples),
                     leaser.batch_size, why)
        return lease_id, samples

    def train_what_is_ready(self, now: float) -> str | None:
        """Why the samples that are ready should train now without a full batch, or None to go on waiting:
        the oldest has waited ``batch_wait_s``, or the user has gone idle (no turn stored for ``idle_train_s``
        and none waiting to be judged, whose sample would join the batch). A setting of 0 turns its rule off."""
        oldest = self.store.oldest_ready_at()
        if oldest is None:
            return None
        wait_s, idle_s = float(self.config.batch_wait_s), float(self.config.idle_train_s)
        if wait_s > 0 and now - oldest >= wait_s:
            return f"the oldest waited {now - oldest:.0f}s (batch_wait_s {wait_s:g})"
        if self._idle(now):
            return f"no new turn for {idle_s:g}s (idle_train_s)"
        return None

    def _idle(self, now: float) -> bool:
        """No turn stored for ``idle_train_s`` and none waiting to be judged (0: never idle)."""
        idle_s = float(self.config.idle_train_s)
        return idle_s > 0 and self.store.turn_activity(now - idle_s)["turns"] == 0 and not self._judging()

    def _judging(self) -> bool:
        counts = self.store.count_turns()
        return counts.get(TurnState.JUDGEABLE, 0) + counts.get(TurnState.JUDGING, 0) > 0

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()
