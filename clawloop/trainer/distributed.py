"""The trainer as its own process, under ``python`` (world size 1) or ``torchrun`` (world size 1..N), with the
features of the in-process trainer: full fine-tuning or LoRA, the KL reference, several PPO epochs per batch,
the publication gate, checkpoints with optimizer state, and resume.

    torchrun --nproc_per_node 4 -m clawloop.trainer.distributed --api http://api:8000 --admin-key K \
        --config clawloop.toml [--set lora=true --set kl_coef=0.05 --set steps_per_batch=2]
    python -m clawloop.trainer.distributed --store runs/x/store.sqlite --max-steps 10     # local store file

Choices:

* The step is ``trainer.step.train_step`` with an ``FSDPRunner`` (``trainer.fsdp``: process group, FSDP2
  sharding of the policy and, with full fine-tuning and ``kl_coef > 0``, of the frozen reference; the
  state-dict collectives). With LoRA the KL reference is the same sharded model with its adapter switched off.
* Rank 0 alone talks to the store — the API's trainer routes (``RemoteStore``) or a local ``Store`` file: it
  leases a batch, keeps the lease alive with heartbeats while the step runs, and broadcasts the samples, their
  turns and the current policy version (``broadcast_object_list``). Every rank prepares the same items from
  them (same drop rules) and calls the step with the whole batch.
* No teacher in this process: where the old policy's student top-k differs from the stored provisional set,
  the provisional set is kept and scored exactly under the old policy (counted in the step metrics as
  ``student_topk_kept_provisional``), as offline training does; the in-process trainer would ask its teacher.
* The publication gate (``gate``, on by default) runs on rank 0 with an unsharded copy of the candidate
  (``trainer.rank0_gate``) every ``gate_every`` steps; the decision is broadcast. A rejected candidate is not
  published and every rank loads the last accepted weights and optimizer state back; its step is committed
  with ``published = 0`` (its samples were trained on), as in the in-process trainer. Steps between checks
  are not published.
* Publication, rank 0: full fine-tuning writes the full state dict (gathered with ``get_model_state_dict``,
  full, CPU-offloaded) as ``RUN_DIR/weights/v<version>/model.safetensors`` and reports it with
  ``kind="full"``; LoRA writes only the adapter as a PEFT folder (``adapter_config.json`` +
  ``adapter_model.safetensors``) and reports ``kind="lora"`` — the API merges it into the base weights for
  its embedded engine and hot-loads the folder on a vLLM engine with a ``LoRAPublisher``. Folders are written
  to a temporary name and renamed, so the API never reads half of one; once a newer one is reported, older
  ones are removed (the newest two stay). A failed report does not undo the step: it is committed under the
  previous version and the report is retried before the next batch.
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
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clawloop.config import Config
from clawloop.store import SampleRecord, TurnRecord
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.fsdp import FSDPRunner, checkpoint_weights_by_name, gather_optimizer, gather_weights, \
    init_distributed, load_checkpoint_state, shard_model
from clawloop.trainer.leasing import BatchLeaser
from clawloop.trainer.metrics import step_record
from clawloop.trainer.model import TrainModels, load_train_models, output_vocab_size
from clawloop.trainer.publish import FolderPublisher, unshared_tensors
from clawloop.trainer.rank0_gate import Rank0Gate
from clawloop.trainer.resume import plan_resume
from clawloop.trainer.step import EXCLUDED, UPDATE_SKIPPED, VoidedUpdates, excluded_samples, make_optimizer, \
    train_step, update_applied

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


def _store_counters(store: Any) -> tuple[int, int, int | None]:
    """(last committed step, policy version of the store's side, the API engine's version or None)."""
    last = store.last_step()
    step = last[0] if last else 0
    state = getattr(store, "state", None)
    if callable(state):
        engine_version = int(state()["policy_version"])
        return step, engine_version, engine_version
    version = int((last[1] or {}).get("policy_version", step)) if last else 0
    return step, version, None


def plan_start(store: Any, run_dir: Path,
               models: TrainModels) -> tuple[StartPlan, dict[str, torch.Tensor] | None, dict[str, Any] | None]:
    """Rank 0: read the newest checkpoint, check it fits this model, and reconcile it with the store (see the
    module docstring). Returns the plan, the checkpoint's weights keyed by parameter name, its optimizer state."""
    found = ckpt.load_latest(run_dir, map_location="cpu")
    weights = None
    if found is not None:  # checked before the store is touched
        if bool(found.state.get("lora", models.lora)) != models.lora:
            raise RuntimeError(f"checkpoint {found.path} was written with lora={found.state.get('lora')}, this "
                               f"run has lora={models.lora}")
        weights = checkpoint_weights_by_name(models, found.weights)
    store_step, _, engine_version = _store_counters(store)
    ckpt_step = found.step if found is not None else 0
    ckpt_version = found.policy_version if found is not None else 0
    store_ahead = store_step > ckpt_step
    # Without a checkpoint the store may be another trainer's run (the embedded trainer's, say): its steps are
    # counted, not retrained.
    resume = plan_resume(found.step if found is not None else None, store_step,
                         can_requeue=found is not None and hasattr(store, "requeue_after_step"))
    if resume.requeue_after is not None:
        requeued = store.requeue_after_step(resume.requeue_after)
        log.warning("%s (%d samples requeued)", resume.note, requeued)
    elif store_step != ckpt_step:
        log.warning("%s", resume.note)
    store_step, store_version, engine_version = _store_counters(store)
    plan = StartPlan(step=resume.step, version=max(store_version, ckpt_version),
                     checkpoint=str(found.path) if found is not None else None,
                     has_optimizer=found is not None and found.optimizer is not None)
    if engine_version is not None and (engine_version != ckpt_version or store_ahead):
        plan.republish_as = ckpt_version if engine_version < ckpt_version else engine_version + 1
    if found is not None:
        log.warning("resuming from %s (step %d, version %d)", found.path.name, plan.step, plan.version)
    return plan, weights, found.optimizer if found is not None else None


def _start(models: TrainModels, optimizer: torch.optim.Optimizer, config: Config, store: Any,
           run_dir: Path) -> StartPlan:
    """Every rank: agree on the counters and load the newest checkpoint (if any)."""
    rank = dist.get_rank()
    weights = optimizer_state = None
    plan = StartPlan()
    if rank == 0:
        try:
            plan, weights, optimizer_state = plan_start(store, run_dir, models)
        except Exception as exc:  # every rank must hear of it, or the others wait forever
            plan = StartPlan(error=f"{type(exc).__name__}: {exc}")
    box: list[Any] = [dict(vars(plan))]  # plain dicts: pickling a class of ``__main__`` depends on how it ran
    dist.broadcast_object_list(box, src=0)
    plan = StartPlan(**box[0])
    if plan.error is not None:
        raise RuntimeError(f"cannot start the trainer: {plan.error}")
    if plan.checkpoint is not None:
        load_checkpoint_state(models, optimizer, weights, optimizer_state, plan.has_optimizer,
                              config.learning_rate)
        del weights, optimizer_state
    return plan


# ---- the loop ----------------------------------------------------------------------------------------------
@dataclass
class Batch:
    op: str
    """'train', 'wait' or 'stop'."""
    lease_id: str = ""
    samples: list[SampleRecord] | None = None
    turns: dict[int, TurnRecord] | None = None
    version: int = 0
    """The policy version the batch is prepared against (staleness), as rank 0 knows it."""


class _Heartbeat:
    """Rank 0 keeps a remote lease alive while a step runs (every third of the lease time)."""

    def __init__(self, store: Any, lease_id: str, lease_s: float):
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
        if hasattr(self.store, "extend_lease"):
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


def _save_checkpoint(models: TrainModels, optimizer: torch.optim.Optimizer, config: Config, run_dir: Path,
                     step: int, version: int, gathered: bool, weights: dict[str, torch.Tensor] | None) -> bool:
    """Every rank (the gathers are collectives); rank 0 writes. With ``gathered`` the weights were gathered
    already for publication (``weights``: rank 0's copy, None elsewhere). Returns on every rank whether the
    write succeeded: a failed write (disk full) is logged and leaves the committed step standing."""
    if not gathered:
        weights = gather_weights(models)
    optimizer_state = gather_optimizer(models, optimizer)
    ok = 1
    if dist.get_rank() == 0:
        try:
            path = ckpt.save_checkpoint(
                run_dir, step, version, unshared_tensors(weights), optimizer_state,
                extra={"lora": models.lora, "model_dir": str(models.model_dir), "method": config.method,
                       "world_size": dist.get_world_size()},
                keep_last=KEEP_CHECKPOINTS)
            log.warning("checkpoint %s written", path.name)
        except Exception as exc:  # noqa: BLE001 - the step is committed; the write is retried next step
            ok = 0
            log.error("writing the checkpoint of step %d failed (%s: %s); the step stands and its samples are "
                      "consumed; the checkpoint is written again after the next step", step, type(exc).__name__,
                      exc)
    (ok,) = _broadcast_ints(ok)
    return bool(ok)


def run(config: Config, store: Any | None, *, max_steps: int = 0, lease_s: float = 600.0, poll_s: float = 2.0,
        idle_exit_s: float = 0.0, report_weights: bool = True) -> int:
    """Train until ``max_steps`` steps (0 = forever) or ``idle_exit_s`` without a batch, resuming from the
    newest checkpoint under ``config.run_dir`` first. ``store`` is used on rank 0 only (``RemoteStore`` or
    ``Store``). Returns the number of steps trained."""
    rank, world, device = init_distributed()
    models = load_train_models(config)
    shard_model(models, device)
    runner = FSDPRunner(device)
    optimizer = make_optimizer(models, config)
    vocab_size = output_vocab_size(models)
    max_context = getattr(models.causal_lm.config, "max_position_embeddings", None)
    run_dir = Path(config.run_dir)
    publisher = FolderPublisher(models, store, run_dir, report_weights) if rank == 0 else None
    # A failed step stops every rank (a rank cannot train around it alone), so nothing is retried here.
    leaser = BatchLeaser(store, config.rollout_batch_size, lease_s=lease_s, count_first=False) if rank == 0 else None

    plan = _start(models, optimizer, config, store, run_dir)
    step, version = plan.step, plan.version
    last_checkpoint_step = step  # nothing new to keep until a step is trained
    checkpoint_failed = False
    if plan.republish_as is not None and report_weights:
        weights = gather_weights(models)
        if rank == 0:
            served = publisher.publish(weights, plan.republish_as)
            if served is not None:
                version = served
            log.warning("weights republished as version %s", served)
        del weights
        step, version = _broadcast_ints(step, version)
    gate = Rank0Gate(config, store, device) if rank == 0 and config.gate else None
    if config.gate:  # the starting (or resumed) weights are the accepted version until a candidate passes
        weights, optimizer_state = gather_weights(models), gather_optimizer(models, optimizer)
        if gate is not None:
            gate.remember(weights, optimizer_state)
        del weights, optimizer_state

    trained = 0
    voided = VoidedUpdates()  # rank 0: samples of updates skipped as non-finite
    idle_since = time.monotonic()
    while max_steps <= 0 or trained < max_steps:
        batch = None
        if rank == 0:
            if publisher.pending is not None and (served := publisher.retry()) is not None:
                version = served
            try:
                lease_id, samples = leaser.lease()
            except Exception:  # noqa: BLE001 - rank 0 must reach the broadcast, or the other ranks wait forever
                log.exception("leasing a batch failed; trying again in %.1fs", poll_s)
                lease_id, samples = "", []
            if samples:
                batch = Batch("train", lease_id, samples, {s.turn_id: store.get_turn(s.turn_id) for s in samples},
                              version)
                idle_since = time.monotonic()
            elif idle_exit_s and time.monotonic() - idle_since > idle_exit_s:
                batch = Batch("stop")
            else:
                batch = Batch("wait")
        batch = _broadcast(batch)
        if batch.op == "stop":
            break
        if batch.op == "wait":
            time.sleep(poll_s)
            continue
        version = batch.version
        with _Heartbeat(store, batch.lease_id, lease_s) if rank == 0 else _nullcontext():
            items, drops, stats = prepare_items(_Turns(batch.turns), batch.samples, config, version, max_context,
                                                vocab_size)
            if rank == 0:
                _drop(store, batch.lease_id, drops)
            if not items:
                if rank == 0:
                    _release(store, batch.lease_id)
                continue
            metrics = train_step(models, optimizer, items, config, runner=runner)
            if rank == 0:
                _drop(store, batch.lease_id, excluded_samples(items))
            items = [it for it in items if EXCLUDED not in it.info]
            if not update_applied(metrics):  # the same on every rank: no weight moved, so no step and no version
                if rank == 0:
                    again = voided.second_time(items)
                    log.error("the update on %d samples was not finite and is skipped (no step, nothing "
                              "published); %d dropped after a second try, the rest go back to ready", len(items),
                              len(again))
                    _drop(store, batch.lease_id, [(turn_id, UPDATE_SKIPPED) for turn_id in again])
                    _release(store, batch.lease_id)
                continue
            weights = gather_weights(models)
            decision, gate_metrics = (PUBLISH, {}) if gate is None else _gate_decision(gate, weights, store,
                                                                                    step + 1, version)
            (decision,) = _broadcast_ints(decision)
            if decision == REJECT:  # every rank goes back to the accepted weights and optimizer state
                load_checkpoint_state(models, optimizer,
                                      checkpoint_weights_by_name(models, gate.accepted_weights) if gate else None,
                                      gate.accepted_optimizer if gate else None, True, config.learning_rate)
                weights = None  # what was gathered is the rejected candidate
            elif decision == PUBLISH and config.gate:
                optimizer_state = gather_optimizer(models, optimizer)
                if gate is not None:
                    gate.remember(weights, optimizer_state)
                del optimizer_state
            if rank == 0:
                served = publisher.publish(weights, version + 1) if decision == PUBLISH else None
                published = served is not None
                new_version = served if published else version
                step += 1
                metrics.update(stats.as_metrics())
                metrics.update(gate_metrics)
                metrics.update({"step": step, "policy_version": new_version, "published": float(published),
                                "dropped": float(len(drops))})
                if not _commit(store, batch.lease_id, step, new_version, metrics, [it.turn_id for it in items]):
                    step -= 1  # step numbers count committed steps only, as in the in-process trainer
                version = new_version  # published or not, a number once served is never given again
                log.warning("step %d: loss %.4f, %d samples, version %d", step, metrics.get("loss", float("nan")),
                            len(items), version)
        step, version = _broadcast_ints(step, version)
        trained += 1
        if step % max(1, int(config.checkpoint_every)) == 0 or checkpoint_failed:
            gathered = decision != REJECT  # after a rejection the weights are the accepted ones again: gather them
            checkpoint_failed = not _save_checkpoint(models, optimizer, config, run_dir, step, version, gathered,
                                                     weights)
            if not checkpoint_failed:
                last_checkpoint_step = step
        del weights
    if step != last_checkpoint_step:  # a clean exit keeps everything trained so far
        _save_checkpoint(models, optimizer, config, run_dir, step, version, False, None)
    return trained


PUBLISH, HOLD, REJECT = 0, 1, 2
"""What a trained step's weights become: published, kept unpublished until the next check, thrown away."""


def _gate_decision(gate: Rank0Gate, weights: dict[str, torch.Tensor], store: Any, step: int,
                   version: int) -> tuple[int, dict[str, float]]:
    """Rank 0: check the candidate when due. Returns the decision and the step's gate metrics; a local store
    also gets the decision as an event with its evidence."""
    if not gate.due():
        return HOLD, {"gate_due_in": float(gate.every - gate.steps_since_check)}
    try:
        result = gate.check(weights)
    except Exception:  # noqa: BLE001 - rank 0 must reach the broadcast; an unchecked candidate is never served
        log.exception("step %d: the publication gate failed; the candidate is rejected", step)
        return REJECT, {"gate_accepted": 0.0, "gate_error": 1.0}
    metrics = {"gate_accepted": 1.0 if result.accepted else 0.0, "gate_guard_pass": result.guard_pass,
               "gate_kl": result.kl, "gate_s": result.seconds}
    if result.accepted:
        log.warning("step %d accepted by the publication gate (%s)", step, result.summary())
    else:
        log.warning("step %d rejected by the publication gate (%s); back to version %d", step,
                    "; ".join(result.reasons), version)
    if hasattr(store, "record_event"):
        try:
            store.record_event("gate_accepted" if result.accepted else "gate_rejected", result.evidence(),
                               step=step, version=version + 1 if result.accepted else version)
        except Exception:  # noqa: BLE001 - the decision stands without its record
            log.exception("recording the gate decision of step %d failed", step)
    return (PUBLISH if result.accepted else REJECT), metrics


def _commit(store: Any, lease_id: str, step: int, version: int, metrics: dict[str, Any],
            turn_ids: list[int]) -> bool:
    """Rank 0: record the step. A refused commit (the lease was lost: it expired and the batch went back or to
    another trainer) is logged and the rest of the lease released, and the ranks go on: raising here would end
    rank 0 and with it the whole job (the other ranks wait in the next broadcast until their connection drops).
    The update stays in the weights, as it does when the in-process trainer's commit fails."""
    try:
        store.commit_step(lease_id, step, version, step_record(metrics), turn_ids)
        return True
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("step %d: the store refused the commit (lease %s lost?); its samples are not marked trained "
                      "and go back to ready", step, lease_id)
        _release(store, lease_id)
        return False


def _drop(store: Any, lease_id: str, drops: list[tuple[int, str]]) -> None:
    """Rank 0: record the samples ``prepare_items`` left out. Like ``_commit``, a store error here is logged, not
    raised (it would end rank 0 mid-step): an unrecorded drop goes back to ready when the lease ends."""
    for turn_id, reason in drops:
        try:
            store.drop_leased_sample(turn_id, reason, lease_id=lease_id)
        except Exception:  # noqa: BLE001 - see the docstring
            log.exception("dropping the sample of turn %d (%s) failed; it returns when the lease ends", turn_id,
                          reason)


def _release(store: Any, lease_id: str) -> None:
    try:
        store.release_lease(lease_id)
    except Exception:  # noqa: BLE001 - the lease then expires on its own
        log.exception("releasing lease %s failed; its samples return when it expires", lease_id)


def _broadcast_ints(*values: int) -> list[int]:
    box = list(values)
    dist.broadcast_object_list(box, src=0)
    return box


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    overrides = dict(kv.split("=", 1) for kv in args.set)
    config = Config.load(args.config, cli=overrides)
    torch.set_num_threads(max(1, min(int(getattr(config, "num_threads", 0) or 2), os.cpu_count() or 1)))
    rank = int(os.environ.get("RANK", "0"))
    store: Any = None
    if rank == 0:
        if args.api:
            from clawloop.trainer.remote import RemoteStore

            store = RemoteStore(args.api, args.admin_key)
        else:
            from clawloop.store import Store

            store = Store(args.store)
    try:
        run(config, store, max_steps=args.max_steps, lease_s=args.lease_s, poll_s=args.poll_s,
            idle_exit_s=args.idle_exit_s, report_weights=bool(args.api))
        # Leave together: a rank tearing its group down while another still talks to it can abort in gloo.
        dist.barrier()
    finally:
        if store is not None:
            store.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The work is done and written (the group was torn down in main). Leave without running the interpreter's
    # teardown: on a loaded machine a rank has aborted there ("terminate called without an active exception",
    # a C++ thread of the distributed runtime destroyed while still joinable) after a successful run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
