"""The trainer as its own process, under ``python`` (world size 1) or ``torchrun`` (world size 1..N): a thin
launcher of the one trainer loop (``trainer.core.Trainer``) with FSDP parts — full fine-tuning or LoRA, the KL
reference, several PPO epochs per batch, the publication gate, version history with store-numbered versions
(``trainer.versions``), gate events in the store, checkpoints with optimizer state, and resume.

    torchrun --nproc_per_node 4 -m clawloop.trainer.distributed --api http://api:8000 --admin-key K \
        --config clawloop.toml [--set lora=true --set kl_coef=0.05 --set steps_per_batch=2]
    python -m clawloop.trainer.distributed --store runs/x/store.sqlite --max-steps 10     # local store file

Choices:

* The loop is the embedded trainer's, over ``fsdp_parallel.FSDPParallel`` (its store and sink calls run on rank 0
  and their results are broadcast), a ``publish.FolderSink`` and ``rank0_gate.Rank0GateView``. The teacher
  object given to ``run`` goes to the step as the embedded trainer's does.
* The step is ``trainer.step.train_step`` with an ``FSDPRunner`` (``trainer.fsdp``: process group, FSDP2
  sharding of the policy and, with full fine-tuning and ``kl_coef > 0``, of the frozen reference; the
  state-dict collectives). With LoRA the KL reference is the same sharded model with its adapter switched off.
* Rank 0 alone talks to the store — the API's trainer routes (``RemoteStore``) or a local ``Store`` file: it
  leases a batch, keeps the lease alive with heartbeats while the step runs, and broadcasts the samples, their
  turns and the current policy version (``broadcast_object_list``). Every rank prepares the same items from
  them (same drop rules) and calls the step with the whole batch.
* The publication gate (``gate``, on by default) runs on rank 0 with an unsharded copy of the candidate
  (``trainer.rank0_gate``) every ``gate_every`` steps; the decision is broadcast. An accepted candidate gets its
  number from the store (``next_version``), is kept in ``RUN_DIR/versions`` (so it can be rolled back to) and
  recorded with its evidence; a rejected one is not published and every rank loads the last accepted weights and
  optimizer state back; its step is committed with ``published = 0``. Gate decisions are events in the store
  (the API's, through its trainer routes, when leasing from an API). Steps between checks are not published.
* Publication, rank 0: full fine-tuning writes the full state dict (gathered with ``get_model_state_dict``,
  full, CPU-offloaded) as ``RUN_DIR/weights/v<version>/model.safetensors`` and reports it with
  ``kind="full"``; LoRA writes only the adapter as a PEFT folder (``adapter_config.json`` +
  ``adapter_model.safetensors``) and reports ``kind="lora"`` — the API merges it into the base weights for
  its embedded engine and hot-loads the folder on a vLLM engine with a ``LoRAPublisher``. Folders are written
  to a temporary name and renamed, so the API never reads half of one; once a newer one is reported, older
  ones are removed (the newest two stay). A failed report does not undo the step: it is committed under the
  previous version and the report is retried before the next batch. A commit that fails for any reason but a
  lost lease is retried until it goes through (the update is in the weights); a lost lease is logged, the rest
  of the lease released, and every rank goes on.
* Checkpoints: every ``checkpoint_every`` steps and at a clean exit, in the layout and format of
  ``trainer.checkpoint`` (written by ``save_checkpoint``, atomic): the full weights (or the adapter, PEFT
  keys) and the AdamW state, both gathered with ``torch.distributed.checkpoint.state_dict`` (full state dict,
  CPU-offloaded, so nothing depends on the world size). The optimizer state is stored keyed by parameter
  index, as ``optimizer.state_dict()`` of the single-process trainer keys it, so a checkpoint written by N
  ranks loads on M ranks and in the in-process trainer, and the other way round. Loading goes the other way:
  rank 0 reads the files, ``set_model_state_dict`` / ``set_optimizer_state_dict`` (``broadcast_from_rank0``)
  give every rank its shards, so only rank 0 needs to see ``RUN_DIR``. The configured learning rate wins over
  the saved one, as in the in-process trainer.
* Resume (automatic at start): the newest checkpoint's weights and optimizer state are loaded and reconciled
  with the store's last committed step by the rule the in-process trainer uses (``trainer.resume``): steps
  committed after the checkpoint have their samples requeued where the store can (a local store; the API's
  routes cannot, and a warning names the steps whose samples are missing from the weights), and step numbers
  go on after the highest one recorded. Without a checkpoint nothing is requeued (the store may hold another
  trainer's steps): training starts from the starting weights and continues the store's numbering.

  When the API's engine may serve other weights than the ones loaded (its version differs from the
  checkpoint's, or the store was ahead), the loaded weights are published again before training: under the
  checkpoint's version when the engine is behind it (a restarted API), otherwise under a new version, so one
  version number never names two different weights.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from clawloop.config import Config, ConfigError
from clawloop.store import LeaseLost, SampleRecord, Store, TurnRecord
from clawloop.store.run_lock import RunInUse, hold_run
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.contracts import SampleSource, WeightSink
from clawloop.trainer.core import Trainer, prepare_ahead
from clawloop.trainer.fsdp import checkpoint_weights_by_name, init_distributed, load_checkpoint_state, shard_model
from clawloop.trainer.fsdp_parallel import FSDPParallel
from clawloop.trainer.leasing import BatchLeaser
from clawloop.trainer.model import TrainModels, load_train_models
from clawloop.trainer.publish import FolderSink, WeightReport
from clawloop.trainer.rank0_gate import Rank0GateView
from clawloop.trainer.resume import plan_resume

log = logging.getLogger("clawloop.trainer.distributed")

KEEP_CHECKPOINTS = 2


# ---- a broadcast batch -----------------------------------------------------------------------------------
class _Turns:
    """``get_turn`` over the turns that came with a broadcast batch (what ``prepare_items`` reads)."""

    def __init__(self, turns: dict[int, TurnRecord]):
        self.turns = turns

    def get_turn(self, turn_id: int) -> TurnRecord:
        return self.turns[turn_id]


# ---- resume ------------------------------------------------------------------------------------------
@dataclass
class StartPlan:
    """What rank 0 decided at start (broadcast to every rank)."""

    step: int = 0
    version: int = 0
    checkpoint: str | None = None
    has_optimizer: bool = False
    republish_as: int | None = None
    """Publish the loaded weights under this version before training (the engine may serve others)."""
    error: str | None = None


def _store_counters(store: SampleSource, sink: WeightSink) -> tuple[int, int, int | None]:
    """(last committed step, policy version of the store's side, the API engine's version or None)."""
    last = store.last_step()
    step = last[0] if last else 0
    engine_version = sink.served_version()
    if engine_version is not None:
        return step, engine_version, engine_version
    version = int((last[1] or {}).get("policy_version", step)) if last else 0
    return step, version, None


def plan_start(store: SampleSource, sink: WeightSink, run_dir: Path, models: TrainModels, *,
               can_requeue: bool) -> tuple[StartPlan, dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    """Rank 0: read the newest checkpoint, check it fits this model, and reconcile it with the store (see the
    module docstring). Returns the plan, the checkpoint's weights keyed by parameter name, its optimizer state."""
    found = ckpt.load_latest(run_dir, map_location="cpu")
    weights = None
    if found is not None:  # checked before the store is touched
        if bool(found.state.get("lora", models.lora)) != models.lora:
            raise RuntimeError(f"checkpoint {found.path} was written with lora={found.state.get('lora')}, this "
                               f"run has lora={models.lora}")
        weights = checkpoint_weights_by_name(models, found.weights)
    store_step, _, engine_version = _store_counters(store, sink)
    ckpt_step = found.step if found is not None else 0
    ckpt_version = found.policy_version if found is not None else 0
    store_ahead = store_step > ckpt_step
    # Without a checkpoint the store may be another trainer's run (the embedded trainer's, say): its steps are
    # counted, not retrained.
    resume = plan_resume(found.step if found is not None else None, store_step,
                         can_requeue=found is not None and can_requeue)
    if resume.requeue_after is not None and isinstance(store, Store):
        requeued = store.requeue_after_step(resume.requeue_after)
        log.warning("%s (%d samples requeued)", resume.note, requeued)
    elif store_step != ckpt_step:
        log.warning("%s", resume.note)
    store_step, store_version, engine_version = _store_counters(store, sink)
    plan = StartPlan(step=resume.step, version=max(store_version, ckpt_version),
                     checkpoint=str(found.path) if found is not None else None,
                     has_optimizer=found is not None and found.optimizer is not None)
    if engine_version is not None and (engine_version != ckpt_version or store_ahead):
        plan.republish_as = ckpt_version if engine_version < ckpt_version else engine_version + 1
    if found is not None:
        log.warning("resuming from %s (step %d, version %d)", found.path.name, plan.step, plan.version)
    return plan, weights, found.optimizer if found is not None else None


def _start(trainer: Trainer, store: SampleSource | None, sink: WeightSink, run_dir: Path,
           can_requeue: bool) -> StartPlan:
    """Every rank: agree on the counters and load the newest checkpoint (if any)."""
    weights = optimizer_state = None
    plan = StartPlan()
    if dist.get_rank() == 0:
        try:
            assert store is not None
            plan, weights, optimizer_state = plan_start(store, sink, run_dir, trainer.models,
                                                        can_requeue=can_requeue)
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            plan = StartPlan(error=f"{type(exc).__name__}: {exc}")
    box: list[Any] = [dict(vars(plan))]  # plain dicts: pickling a class of ``__main__`` depends on how it ran
    dist.broadcast_object_list(box, src=0)
    plan = StartPlan(**box[0])
    if plan.error is not None:
        raise RuntimeError(f"cannot start the trainer: {plan.error}")
    if plan.checkpoint is not None:
        load_checkpoint_state(trainer.models, trainer.optimizer, weights, optimizer_state, plan.has_optimizer,
                              trainer.config.learning_rate)
        del weights, optimizer_state
    return plan


# ---- the launcher ------------------------------------------------------------------------------------------
@dataclass
class Batch:
    op: str
    """'train', 'wait' or 'stop'."""
    lease_id: str = ""
    samples: list[SampleRecord] | None = None
    turns: dict[int, TurnRecord] | None = None


class _Heartbeat:
    """Rank 0 keeps the lease alive while a step runs (every third of the lease time)."""

    def __init__(self, store: SampleSource, lease_id: str, lease_s: float):
        self.store, self.lease_id, self.lease_s = store, lease_id, lease_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lease-heartbeat")

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.store.extend_lease(self.lease_id, self.lease_s)
            except Exception:
                log.exception("lease heartbeat failed")

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _broadcast(batch: Batch | None) -> Batch:
    box: list[Any] = [dict(vars(batch)) if batch is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Batch(**box[0])


def run(config: Config, store: SampleSource | None, *, max_steps: int = 0, lease_s: float = 600.0,
        poll_s: float = 2.0, idle_exit_s: float = 0.0, report_weights: bool = True,
        api: WeightReport | None = None, teacher: Any = None) -> int:
    """Train until ``max_steps`` batches (0 = forever) or ``idle_exit_s`` without a batch, resuming from the
    newest checkpoint under ``config.run_dir`` first. ``store`` is used on rank 0 only (``RemoteStore`` or
    ``Store``); weights folders are reported to ``api`` (the ``RemoteStore``) unless ``report_weights`` is off.
    ``teacher`` goes to the step unchanged. Returns the number of batches trained."""
    rank, world, device = init_distributed()
    if world > 1 and config.opd_rollouts > 0:
        raise ConfigError(f"opd_rollouts > 0 runs in one process only; this trainer has {world} ranks (set "
                          "opd_rollouts = 0 or train in one process)")
    if world > 1 and config.retain_coef > 0:
        raise ConfigError(f"retain_coef > 0 runs in one process only; this trainer has {world} ranks (set "
                          "retain_coef = 0 or train in one process)")
    models = load_train_models(config)
    shard_model(models, device)
    run_dir = Path(config.run_dir)
    sink = FolderSink(run_dir, api if rank == 0 and report_weights else None)
    parallel = FSDPParallel(device)
    gate_view = Rank0GateView(config, device) if rank == 0 and config.gate else None
    trainer = Trainer(config, store if rank == 0 else None, run_dir=run_dir, teacher=teacher, models=models,
                      keep_checkpoints=KEEP_CHECKPOINTS, sink=sink, parallel=parallel, gate_view=gate_view,
                      console=sys.stderr if rank == 0 else None)
    # The API's trainer routes cannot requeue; a local store can.
    plan = _start(trainer, store, sink, run_dir, can_requeue=isinstance(store, Store))
    trainer.restart_at(plan.step, plan.version)
    if plan.republish_as is not None and api is not None:
        trainer.pending_version = plan.republish_as
        if trainer.publish():
            log.warning("weights republished as version %s", trainer.policy_version)
    # A failed step stops every rank (a rank cannot train around it alone), so nothing is retried here.
    leaser = BatchLeaser(store, config.rollout_batch_size, lease_s=lease_s, count_first=False) \
        if rank == 0 and store is not None else None
    trained = 0
    preparing = True
    idle_since = time.monotonic()
    try:
        while max_steps <= 0 or trained < max_steps:
            batch = None
            if leaser is not None:
                try:
                    lease_id, samples = leaser.lease()
                except Exception:  # noqa: BLE001 - rank 0 must reach the broadcast, or the other ranks wait forever
                    log.exception("leasing a batch failed; trying again in %.1fs", poll_s)
                    lease_id, samples = "", []
                if samples:
                    batch = Batch("train", lease_id, samples, {s.turn_id: leaser.store.get_turn(s.turn_id)
                                                               for s in samples})
                    idle_since = time.monotonic()
                elif idle_exit_s and time.monotonic() - idle_since > idle_exit_s:
                    batch = Batch("stop")
                else:
                    batch = Batch("wait")
            batch = _broadcast(batch)
            if batch.op == "stop":
                break
            if batch.op == "wait":
                # Rank 0, which holds the gate, works ahead while there is nothing to train; the others wait
                # for its next broadcast either way.
                if rank == 0 and preparing:
                    preparing = prepare_ahead(trainer)
                else:
                    time.sleep(poll_s)
                continue
            assert batch.samples is not None and batch.turns is not None
            beat = _Heartbeat(leaser.store, batch.lease_id, lease_s) if leaser is not None \
                else contextlib.nullcontext()
            with beat:
                try:
                    metrics = trainer.run_batch(batch.lease_id, batch.samples, turns=_Turns(batch.turns))
                except LeaseLost:  # logged where the commit was refused; every rank goes on
                    metrics = {}
            if metrics is None:
                continue
            trained += 1
            if metrics:
                log.warning("step %d: loss %.4f, %d samples, version %d", trainer.step,
                            metrics.get("loss", float("nan")), int(metrics.get("samples", 0)),
                            trainer.policy_version)
        trainer.checkpoint_if_due(force=True)  # a clean exit keeps everything trained so far
    finally:
        trainer.close()
    return trained


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clawloop.trainer.distributed", description=__doc__.split("\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--api", help="base URL of the API process (its /v1/trainer routes)")
    where.add_argument("--store", help="a local store file instead of an API (single machine)")
    parser.add_argument("--admin-key", default=os.environ.get("CLAWLOOP_ADMIN_KEY", ""))
    parser.add_argument("--config", help="clawloop config file (the same one the API process reads)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a setting")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0 = never)")
    parser.add_argument("--lease-s", type=float, default=600.0)
    parser.add_argument("--poll-s", type=float, default=2.0)
    parser.add_argument("--idle-exit-s", type=float, default=0.0, help="stop after this long without a batch")
    parser.add_argument("--no-teacher", action="store_true",
                        help="with --api: do not ask the API's teacher (stored teacher values are used as they are)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    overrides = dict(kv.split("=", 1) for kv in args.set)
    config = Config.load(args.config, cli=overrides)
    torch.set_num_threads(max(1, min(int(config.num_threads or 2), os.cpu_count() or 1)))
    rank = int(os.environ.get("RANK", "0"))
    store: Any = None
    api: WeightReport | None = None
    if rank == 0:
        if args.api:
            from clawloop.trainer.remote import RemoteStore

            store = api = RemoteStore(args.api, args.admin_key)
        else:
            try:  # this process writes the run's store: it must be the run's only writer
                held = hold_run(Path(args.store).parent)
            except RunInUse as exc:  # torchrun ends the other ranks when this one fails
                print(f"clawloop.trainer.distributed: {exc}; stop it first, or train through its API with --api",
                      file=sys.stderr)
                return 2
            store = Store(args.store)
            store.release_on_close(held.release)
    teacher = None
    if args.api and not args.no_teacher:  # every rank asks for its own samples
        from clawloop.trainer.teacher_client import RemoteTeacher

        teacher = RemoteTeacher(args.api, args.admin_key)
    try:
        run(config, store, max_steps=args.max_steps, lease_s=args.lease_s, poll_s=args.poll_s,
            idle_exit_s=args.idle_exit_s, report_weights=bool(args.api), api=api, teacher=teacher)
        leave_together()
    finally:
        if store is not None:
            store.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def leave_together() -> None:
    """Wait for every rank before the group is torn down: a rank tearing its group down while another still talks
    to it can abort in gloo."""
    if dist.is_initialized():
        dist.barrier()


def exit_now(code: int) -> NoReturn:
    """End a rank's process once its work is written and its group torn down, without the interpreter's teardown:
    on a loaded machine a rank has aborted there ("terminate called without an active exception", a C++ thread of
    the distributed runtime destroyed while still joinable) after a successful run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
