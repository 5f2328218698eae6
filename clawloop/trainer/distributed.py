"""The trainer as its own process, under ``python`` (world size 1) or ``torchrun`` (world size 1..N).

    torchrun --nproc_per_node 4 -m clawloop.trainer.distributed --api http://api:8000 --admin-key K \
        --config clawloop.toml
    python -m clawloop.trainer.distributed --store runs/x/store.sqlite --max-steps 10     # local store file

Choices:

* ``torch.distributed`` with gloo on CPU, nccl on GPU (one device per local rank). Every rank loads the policy,
  then FSDP2 ``fully_shard`` is applied to each decoder layer and to the root module; the optimizer (the same
  AdamW as the single-process trainer) is built on the sharded parameters.
* Rank 0 alone talks to the store — the API's trainer routes (``RemoteStore``) or a local ``Store`` file: it
  leases a batch, keeps the lease alive with heartbeats while the step runs, and broadcasts the samples and
  their turns (``broadcast_object_list``). Every rank prepares the same items from them (same drop rules), the
  rewards are computed over the whole batch (group normalisation sees every sample), and sample ``i`` trains
  on rank ``i mod world``.
* Same objective: ``clawloop.losses.sample_objective`` through the trainer's ``objective_sample`` /
  ``settings_for`` / ``old_side_from_logits``. Each sample's loss is divided by the *global* batch size, so the
  sum over ranks of each rank's partial loss equals the single-process batch mean; FSDP averages gradients
  over ranks, so each rank back-propagates its partial loss times the world size, and the reduced gradient is
  the gradient of that batch mean.
* FSDP's collectives need every rank to run the same number of forwards and backwards: a rank with fewer
  micro-batches runs a one-token dummy forward whose loss is multiplied by 0.
* After the update the full state dict is gathered (``get_model_state_dict``, full, CPU-offloaded); rank 0
  writes it as safetensors under ``RUN_DIR/weights/v<version>/`` and reports it to the API
  (``/v1/trainer/weights``), then commits the step with the version the weights are served under.
* Supported here: full fine-tuning with one update per batch and no reference model (``kl_coef = 0``); LoRA,
  several PPO epochs and the KL reference still use the in-process trainer.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clawloop.config import Config
from clawloop.losses import MetricsAccumulator, ObjectiveSettings, sample_objective
from clawloop.store import SampleRecord, TurnRecord
from clawloop.trainer.batch import TrainItem, collate, micro_batches, prepare_items
from clawloop.trainer.model import TrainModels, load_train_models
from clawloop.trainer.old_policy import RefreshFn, old_side_from_logits
from clawloop.trainer.step import _item_metrics, make_optimizer, objective_sample, rewards_for, settings_for

log = logging.getLogger("clawloop.trainer.distributed")


# ---- process group -------------------------------------------------------------------------------------
def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, under plain ``python``, create a one-process) group. Returns (rank, world size, device)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def shard_model(models: TrainModels, device: torch.device) -> None:
    """FSDP2 on every decoder layer and the root (gradients averaged over ranks, FSDP's default)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if models.lora or models.use_reference:
        raise NotImplementedError("the distributed trainer supports full fine-tuning without a KL reference")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = models.causal_lm
    model.to(device)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def full_state_dict(models: TrainModels) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU (a collective: every rank calls it; rank 0 gets the tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(models.causal_lm,
                                options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ---- one step --------------------------------------------------------------------------------------------
class _Turns:
    """``get_turn`` over the turns that came with a broadcast batch (what ``prepare_items`` reads)."""

    def __init__(self, turns: dict[int, TurnRecord]):
        self.turns = turns

    def get_turn(self, turn_id: int) -> TurnRecord:
        return self.turns[turn_id]


def _scalar(x: Any) -> float:
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)


def distributed_train_step(models: TrainModels, optimizer: torch.optim.Optimizer, items: list[TrainItem],
                           config: Config, *, refresh: RefreshFn | None = None) -> dict[str, Any]:
    """One update on ``items`` (the whole batch, identical on every rank); returns the batch's metrics."""
    if int(config.steps_per_batch) != 1:
        raise NotImplementedError("the distributed trainer runs one update per batch")
    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = models.device
    settings = ObjectiveSettings.from_config(config)
    rewards = rewards_for(items, config)
    n = len(items)
    mine = list(range(rank, n, world))
    reward_of = {id(items[i]): rewards[i] for i in mine}
    groups = micro_batches([items[i] for i in mine], config.micro_batch_size)
    count = torch.tensor([len(groups)], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    model = models.causal_lm
    optimizer.zero_grad(set_to_none=True)
    acc = MetricsAccumulator()
    for g in range(int(count.item())):
        if g < len(groups):
            group = groups[g]
            mb = collate(group, device)
            logits_B_L_V = model(input_ids=mb.input_ids_B_L, attention_mask=mb.attention_mask_B_L,
                                 use_cache=False).logits
        else:  # keeps FSDP's collectives in step with the ranks that still have samples
            group = []
            one_B_L = torch.zeros((1, 1), dtype=torch.long, device=device)
            logits_B_L_V = model(input_ids=one_B_L, attention_mask=torch.ones_like(one_B_L), use_cache=False).logits
        total = logits_B_L_V.sum() * 0.0
        for i, item in enumerate(group):
            p, T = item.prompt_len, item.response_len
            logits_T_V = logits_B_L_V[i, p - 1:p - 1 + T]
            old_side_from_logits(item, logits_T_V, config, refresh)
            result = sample_objective(objective_sample(item, logits_T_V, reward_of[id(item)]),
                                      settings_for(item, settings))
            total = total + result.loss / n  # global n: the sum over ranks is the batch mean
            acc.add(result.metrics)
        # FSDP averages gradients over ranks (a plain sum needs PREMUL_SUM, which gloo lacks): scaling by the
        # world size turns that average back into the sum of the ranks' partial losses.
        (total * world).backward()
        del logits_B_L_V, total
    params = models.trainable_parameters()
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    grad_norm = _scalar(torch.nn.utils.clip_grad_norm_(params, max_norm))
    skipped = 0
    if math.isfinite(grad_norm):
        optimizer.step()
    else:
        skipped = 1
    optimizer.zero_grad(set_to_none=True)

    # Merge every rank's per-sample metrics and item info so rank 0 reports the whole batch.
    parts: list[Any] = [None] * world
    infos = {items[i].turn_id: items[i].info for i in mine}
    dist.all_gather_object(parts, (acc._sums, acc._counts, acc._samples, infos))
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    samples = 0
    for part_sums, part_counts, part_samples, part_infos in parts:
        for k, v in part_sums.items():
            sums[k] += v
            counts[k] += part_counts[k]
        samples += part_samples
        for it in items:
            if it.turn_id in part_infos:
                it.info.update(part_infos[it.turn_id])
    metrics: dict[str, Any] = {k: sums[k] / counts[k] for k in sums}
    metrics["num_samples"] = float(samples)
    metrics["grad_norm"] = grad_norm
    metrics["updates_skipped_nonfinite"] = float(skipped)
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["samples"] = float(n)
    metrics["tokens"] = float(sum(it.response_len for it in items))
    metrics["world_size"] = float(world)
    metrics["step_time_s"] = time.perf_counter() - t_start
    metrics.update(_item_metrics(items))
    return metrics


# ---- the loop ----------------------------------------------------------------------------------------------
@dataclass
class Batch:
    op: str
    """'train', 'wait' or 'stop'."""
    lease_id: str = ""
    samples: list[SampleRecord] | None = None
    turns: dict[int, TurnRecord] | None = None


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
    box = [batch]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _save_weights(state: dict[str, torch.Tensor], folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    # Clones: tied tensors share storage, which safetensors refuses to write twice.
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def run(config: Config, store: Any | None, *, max_steps: int = 0, lease_s: float = 600.0, poll_s: float = 2.0,
        idle_exit_s: float = 0.0, report_weights: bool = True) -> int:
    """Train until ``max_steps`` steps (0 = forever) or ``idle_exit_s`` without a batch. ``store`` is used on
    rank 0 only (``RemoteStore`` or ``Store``). Returns the number of steps trained."""
    rank, world, device = init_distributed()
    models = load_train_models(config)
    shard_model(models, device)
    optimizer = make_optimizer(models, config)
    vocab_size = int(config_vocab(models))
    max_context = getattr(models.causal_lm.config, "max_position_embeddings", None)
    start = [0, 0]
    if rank == 0:
        last = store.last_step()
        start[0] = last[0] if last else 0
        state = getattr(store, "state", None)
        start[1] = int(state()["policy_version"]) if callable(state) else start[0]
    dist.broadcast_object_list(start, src=0)
    step, version = start
    trained = 0
    idle_since = time.monotonic()
    run_dir = Path(config.run_dir)
    while max_steps <= 0 or trained < max_steps:
        batch = None
        if rank == 0:
            lease_id, samples = store.lease_samples(config.rollout_batch_size, lease_s=lease_s,
                                                    min_n=config.rollout_batch_size)
            if samples:
                batch = Batch("train", lease_id, samples, {s.turn_id: store.get_turn(s.turn_id) for s in samples})
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
        with _Heartbeat(store, batch.lease_id, lease_s) if rank == 0 else _nullcontext():
            items, drops, stats = prepare_items(_Turns(batch.turns), batch.samples, config, version, max_context,
                                                vocab_size)
            if rank == 0:
                for turn_id, reason in drops:
                    store.drop_leased_sample(turn_id, reason)
            if not items:
                if rank == 0:
                    store.release_lease(batch.lease_id)
                continue
            metrics = distributed_train_step(models, optimizer, items, config)
            state_dict = full_state_dict(models)
            if rank == 0:
                new_version = version + 1
                folder = _save_weights(state_dict, run_dir / "weights" / f"v{new_version}")
                if report_weights and hasattr(store, "report_weights"):
                    new_version = store.report_weights(str(folder), new_version, kind="full")
                step += 1
                metrics.update(stats.as_metrics())
                metrics.update({"step": step, "policy_version": new_version, "dropped": float(len(drops))})
                store.commit_step(batch.lease_id, step, new_version, _jsonable(metrics),
                                  [it.turn_id for it in items])
                version = new_version
                log.warning("step %d: loss %.4f, %d samples, version %d", step, metrics.get("loss", float("nan")),
                            len(items), version)
            del state_dict
        step, version = _broadcast_ints(step, version)
        trained += 1
    return trained


def config_vocab(models: TrainModels) -> int:
    return int(models.causal_lm.config.vocab_size)


def _broadcast_ints(*values: int) -> list[int]:
    box = list(values)
    dist.broadcast_object_list(box, src=0)
    return box


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _jsonable(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        v = float(v) if not isinstance(v, (str, bool)) and v is not None else v
        out[k] = None if isinstance(v, float) and not math.isfinite(v) else v
    return out


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
    finally:
        if store is not None:
            store.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
