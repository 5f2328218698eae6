"""The trainer as its own process, under ``python`` (world size 1) or ``torchrun`` (world size 1..N), with the
features of the in-process trainer: full fine-tuning or LoRA, the KL reference, several PPO epochs per batch,
checkpoints with optimizer state, and resume.

    torchrun --nproc_per_node 4 -m clawloop.trainer.distributed --api http://api:8000 --admin-key K \
        --config clawloop.toml [--set lora=true --set kl_coef=0.05 --set steps_per_batch=2]
    python -m clawloop.trainer.distributed --store runs/x/store.sqlite --max-steps 10     # local store file

Choices:

* ``torch.distributed`` with gloo on CPU, nccl on GPU (one device per local rank). Every rank loads the policy,
  then FSDP2 ``fully_shard`` is applied to each decoder layer and to the root module; the optimizer (the same
  AdamW as the single-process trainer) is built on the sharded parameters. LoRA is sharded the same way: FSDP2
  shards every parameter on its own (a ``DTensor`` each, no flat parameter), all-gathers a unit's frozen base
  weights and trainable adapter matrices together and reduce-scatters only the gradients that exist, so a
  unit may mix both. The optimizer holds the adapter matrices only.
* Rank 0 alone talks to the store — the API's trainer routes (``RemoteStore``) or a local ``Store`` file: it
  leases a batch, keeps the lease alive with heartbeats while the step runs, and broadcasts the samples, their
  turns and the current policy version (``broadcast_object_list``). Every rank prepares the same items from
  them (same drop rules), the rewards are computed over the whole batch (group normalisation sees every
  sample), and sample ``i`` trains on rank ``i mod world``.
* Same objective and same step as ``trainer.step.train_step``: ``clawloop.losses.sample_objective`` through
  ``objective_sample`` / ``settings_for`` / ``old_side_from_logits``. With one update per batch ℓ_old is read
  from the loss's own forward; with ``steps_per_batch > 1`` a no-grad old-policy forward fills ℓ_old (and the
  student top-k side) once before the first epoch and every epoch reuses it. Each sample's loss is divided by
  the *global* batch size, so the sum over ranks of each rank's partial loss equals the single-process batch
  mean; FSDP averages gradients over ranks, so each rank back-propagates its partial loss times the world size,
  and the reduced gradient is the gradient of that batch mean. Epoch metrics are merged over ranks, then
  averaged over epochs, as the single-process step reports them.
* No teacher in this process: where the old policy's student top-k differs from the stored provisional set,
  the provisional set is kept and scored exactly under the old policy (counted in the step metrics as
  ``student_topk_kept_provisional``), as offline training does; the in-process trainer would ask its teacher.
* Logits come from the root module's forward (so FSDP's hooks gather the embedding and output head), with
  ``logits_to_keep`` cutting them to the micro-batch's response region; prompt logits are never materialised.
* KL reference (``kl_coef > 0``): with LoRA, the same sharded model with its adapter switched off; with full
  fine-tuning, the frozen copy of the starting weights, sharded like the policy (its own FSDP units). ℓ_ref is
  computed per micro-batch next to ℓ_old, exactly where the single-process step computes it.
* FSDP's collectives need every rank to run the same number of forwards and backwards: a rank with fewer
  micro-batches runs a one-token dummy forward (policy, reference, old-policy pass alike) whose loss is
  multiplied by 0.
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
* Resume (automatic at start): the newest checkpoint's weights and optimizer state are loaded; the counters
  come from it, reconciled with the store's last committed step:

  - store at the checkpoint's step: continue from there;
  - store ahead of the checkpoint (a crash after a commit but before the next checkpoint): a local store
    requeues the samples of the steps after the checkpoint and marks those steps requeued
    (``store.requeue_after_step``), exactly as the in-process ``Trainer.resume`` does, so every sample trains
    into the resumed weights once; step numbers go on after the store's last step. A store without ``requeue_after_step`` (today the API's routes) cannot do
    that: a warning names the steps whose samples are missing from the weights, and training continues from
    the checkpoint's weights with the store's counters (step numbers never repeat);
  - no checkpoint but steps in the store: a warning; training starts from the starting weights and continues
    the store's numbering (the store is never rewound without a checkpoint to rewind to);
  - store behind the checkpoint (an older store file): a warning; the checkpoint's counters are used.

  When the API's engine may serve other weights than the ones loaded (its version differs from the
  checkpoint's, or the store was ahead), the loaded weights are published again before training: under the
  checkpoint's version when the engine is behind it (a restarted API), otherwise under a new version, so one
  version number never names two different weights.
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import shutil
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from clawloop.atomic import write_folder_atomically
from clawloop.config import Config
from clawloop.losses import MetricsAccumulator, ObjectiveSettings, logprobs_at, sample_objective
from clawloop.store import SampleRecord, TurnRecord
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.batch import TrainItem, collate, micro_batches, prepare_items
from clawloop.trainer.model import TrainModels, load_train_models
from clawloop.trainer.old_policy import RefreshFn, old_side_from_logits
from clawloop.trainer.step import item_metrics, make_optimizer, mean_dicts, objective_sample, rewards_for, \
    settings_for

log = logging.getLogger("clawloop.trainer.distributed")

KEEP_CHECKPOINTS = 2
KEEP_PUBLISHED = 2


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


def _shard(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_model(models: TrainModels, device: torch.device) -> None:
    """FSDP2 on every decoder layer and the root (gradients averaged over ranks, FSDP's default), for the
    policy and, with full fine-tuning and ``kl_coef > 0``, for the frozen reference copy.

    With LoRA the root is the underlying causal LM (LoRA layers injected), not the peft wrapper: every forward
    here calls that module, so its FSDP hooks run; the wrapper's ``parameters()`` are the same (now sharded)
    tensors, which is what the optimizer and the state-dict helpers see."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    models.causal_lm.to(device)
    _shard(models.causal_lm, mesh)
    if models.reference is not None:
        models.reference.to(device)
        _shard(models.reference, mesh)


# ---- state dicts (collectives: every rank calls them; rank 0 gets the tensors) ------------------------
def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _peft_key_map(models: TrainModels) -> dict[str, str]:
    """PEFT adapter key (as ``get_peft_model_state_dict`` and adapter folders name it) -> the parameter's
    name in the peft model (the name ``torch.distributed.checkpoint`` uses), from peft's own renaming."""
    from peft import get_peft_model_state_dict

    names = [n for n, p in models.policy.named_parameters() if p.requires_grad]
    probe = {n: torch.zeros(1) for n in names}
    name_of = {id(t): n for n, t in probe.items()}
    return {k: name_of[id(v)] for k, v in get_peft_model_state_dict(models.policy, state_dict=probe).items()}


def gather_weights(models: TrainModels) -> dict[str, torch.Tensor] | None:
    """What a checkpoint holds and what is published: the full state dict (keys of the causal LM's
    ``state_dict``) or, with LoRA, the adapter (PEFT keys, as ``trainable_state_dict``). Rank 0 gets it on the
    CPU; other ranks get None."""
    if not models.lora:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(models.causal_lm, options=_options(cpu_offload=True))
        return state if dist.get_rank() == 0 else None
    # The adapter only: gather the trainable parameters one by one (the frozen base is never moved).
    gathered: dict[str, torch.Tensor] = {}
    for name, param in models.policy.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if dist.get_rank() == 0:
                gathered[name] = full.detach().cpu().clone()
    if dist.get_rank() != 0:
        return None
    key_map = _peft_key_map(models)
    return {peft_key: gathered[name] for peft_key, name in key_map.items()}


def _optimizer_names(models: TrainModels, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's own order: index ``i`` of ``optimizer.state_dict()``."""
    name_of = {id(p): n for n, p in models.policy.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_optimizer(models: TrainModels, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The AdamW state as the single-process ``optimizer.state_dict()`` has it (keyed by parameter index,
    full tensors), on rank 0; None elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(models.policy, optimizer, options=_options(cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    index = {name: i for i, name in enumerate(_optimizer_names(models, optimizer))}
    groups = []
    for group in named["param_groups"]:
        groups.append({**group, "params": [index[name] for name in group["params"]]})
    return {"state": {index[name]: value for name, value in named["state"].items()}, "param_groups": groups}


def _named_optimizer_state(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of ``gather_optimizer``'s re-keying: parameter index -> parameter name."""
    count = sum(len(g["params"]) for g in saved["param_groups"])
    if count != len(names):
        raise RuntimeError(f"the checkpoint's optimizer holds {count} parameters, this model trains {len(names)}")
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": {names[int(i)]: v for i, v in saved["state"].items()}, "param_groups": groups}


def _checkpoint_weights_to_names(models: TrainModels, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights keyed as ``set_model_state_dict`` wants them, checked against this model."""
    if models.lora:
        key_map = _peft_key_map(models)
        unknown = [k for k in weights if k not in key_map]
        missing = [k for k in key_map if k not in weights]
        if unknown or missing:
            raise RuntimeError(f"checkpoint adapter does not match this model: unknown {unknown[:5]}, "
                               f"missing {missing[:5]}")
        return {key_map[k]: v for k, v in weights.items()}
    expected = set(models.causal_lm.state_dict().keys())
    tied = bool(getattr(models.causal_lm.config, "tie_word_embeddings", False))
    # Tied output weights may be stored once; anything else missing means a different architecture.
    missing = [k for k in expected - set(weights) if not (tied and k.endswith("lm_head.weight"))]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}")
    return dict(weights)


def load_checkpoint_state(models: TrainModels, optimizer: torch.optim.Optimizer,
                          weights: dict[str, torch.Tensor] | None, optimizer_state: dict[str, Any] | None,
                          has_optimizer: bool, learning_rate: float) -> None:
    """Every rank calls this; rank 0 passes the checkpoint's weights (checked, keyed by parameter name) and
    optimizer state (index-keyed), the others None. Afterwards every rank holds its shards of both."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rank0 = dist.get_rank() == 0
    # Separate calls: ``set_state_dict`` takes an empty model dict (the other ranks') as "optimizer only".
    set_model_state_dict(models.policy, weights if rank0 else {},
                         options=_options(broadcast_from_rank0=True, strict=False))
    if has_optimizer:
        named = _named_optimizer_state(optimizer_state, _optimizer_names(models, optimizer)) if rank0 else {}
        set_optimizer_state_dict(models.policy, optimizer, named, options=_options(broadcast_from_rank0=True))
    for group in optimizer.param_groups:  # the configured lr wins over the saved one
        group["lr"] = learning_rate


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


def _response_logits(model: torch.nn.Module, group: list[TrainItem],
                     device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Root forward over a micro-batch: (the kept logits ``[B, K, V]``, each sample's raw ``[T_i, V]`` logits at
    the positions predicting its response). ``K`` covers the response region of every row (right padding), so
    prompt logits before it are never computed. An empty group runs a one-token dummy forward (no samples)."""
    if not group:
        one_B_L = torch.zeros((1, 1), dtype=torch.long, device=device)
        logits = model(input_ids=one_B_L, attention_mask=torch.ones_like(one_B_L), use_cache=False,
                       logits_to_keep=1).logits
        return logits, []
    mb = collate(group, device)
    length = int(mb.input_ids_B_L.shape[1])
    first = min(mb.prompt_lens) - 1  # the first position that predicts a response token
    keep = length - first
    logits_B_K_V = model(input_ids=mb.input_ids_B_L, attention_mask=mb.attention_mask_B_L, use_cache=False,
                         logits_to_keep=keep).logits
    per = [logits_B_K_V[i, p - 1 - first:p - 1 - first + t]
           for i, (p, t) in enumerate(zip(mb.prompt_lens, mb.response_lens))]
    return logits_B_K_V, per


@torch.no_grad()
def _fill_reference(models: TrainModels, group: list[TrainItem], device: torch.device) -> None:
    """ℓ_ref at the sampled ids (as ``old_policy.fill_reference``), through the sharded reference."""
    with models.reference_model() as ref:
        logits, per = _response_logits(ref, group, device)
        for item, logits_T_V in zip(group, per):
            item.ref_logprobs_T = logprobs_at(logits_T_V, item.response_ids_T.to(logits_T_V.device),
                                              item.temperature).float()
        del logits, per


@torch.no_grad()
def _fill_old_side(models: TrainModels, groups: list[list[TrainItem]], rounds: int, config: Config,
                   refresh: RefreshFn | None, device: torch.device) -> None:
    """The separate old-policy pass of ``steps_per_batch > 1`` (``old_policy.fill_old_side``), in step with the
    other ranks."""
    for g in range(rounds):
        group = groups[g] if g < len(groups) else []
        logits, per = _response_logits(models.causal_lm, group, device)
        for item, logits_T_V in zip(group, per):
            old_side_from_logits(item, logits_T_V, config, refresh)
        del logits, per
        if models.use_reference:
            _fill_reference(models, group, device)


def _merge(parts: list[tuple[dict[str, float], dict[str, int], int]]) -> dict[str, float]:
    acc = MetricsAccumulator()
    for sums, counts, samples in parts:
        acc.merge(sums, counts, samples)
    return acc.result()


def distributed_train_step(models: TrainModels, optimizer: torch.optim.Optimizer, items: list[TrainItem],
                           config: Config, *, refresh: RefreshFn | None = None) -> dict[str, Any]:
    """``steps_per_batch`` updates on ``items`` (the whole batch, identical on every rank); returns the batch's
    metrics, the same keys and meaning as ``trainer.step.train_step``'s."""
    if not items:
        raise ValueError("distributed_train_step needs at least one sample")
    t_start = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = models.device
    settings = ObjectiveSettings.from_config(config)
    epochs = int(config.steps_per_batch)
    fuse = epochs == 1
    rewards = rewards_for(items, config)
    n = len(items)
    mine = list(range(rank, n, world))
    reward_of = {id(items[i]): rewards[i] for i in mine}
    groups = micro_batches([items[i] for i in mine], config.micro_batch_size, config.micro_batch_tokens)
    count = torch.tensor([len(groups)], dtype=torch.long, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    rounds = int(count.item())
    model = models.causal_lm
    params = models.trainable_parameters()
    max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
    timings: dict[str, float] = defaultdict(float)

    if not fuse:
        t0 = time.perf_counter()
        _fill_old_side(models, groups, rounds, config, refresh, device)
        timings["time_old_forward_s"] += time.perf_counter() - t0

    epoch_parts: list[tuple[dict[str, float], dict[str, int], int]] = []
    grad_norms: list[float] = []
    skipped = 0
    for _ in range(epochs):
        optimizer.zero_grad(set_to_none=True)
        acc = MetricsAccumulator()
        for g in range(rounds):
            group = groups[g] if g < len(groups) else []  # [] keeps FSDP's collectives in step
            if fuse and models.use_reference:
                t0 = time.perf_counter()
                _fill_reference(models, group, device)
                timings["time_old_forward_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            logits_B_K_V, per = _response_logits(model, group, device)
            total = logits_B_K_V.sum() * 0.0
            for item, logits_T_V in zip(group, per):
                if fuse:
                    old_side_from_logits(item, logits_T_V, config, refresh)
                result = sample_objective(objective_sample(item, logits_T_V, reward_of[id(item)]),
                                          settings_for(item, settings))
                total = total + result.loss / n  # global n: the sum over ranks is the batch mean
                acc.add(result.metrics)
            # FSDP averages gradients over ranks (a plain sum needs PREMUL_SUM, which gloo lacks): scaling by the
            # world size turns that average back into the sum of the ranks' partial losses.
            (total * world).backward()
            del logits_B_K_V, per, total
            timings["time_forward_backward_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        grad_norm = _scalar(torch.nn.utils.clip_grad_norm_(params, max_norm))  # the same on every rank
        if math.isfinite(grad_norm):
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
        timings["time_optimizer_s"] += time.perf_counter() - t0
        grad_norms.append(grad_norm)
        epoch_parts.append(acc.parts())

    # Merge every rank's per-sample metrics (per epoch) and item info so rank 0 reports the whole batch.
    parts: list[Any] = [None] * world
    infos = {items[i].turn_id: items[i].info for i in mine}
    dist.all_gather_object(parts, (epoch_parts, infos))
    for _, part_infos in parts:
        for it in items:
            if it.turn_id in part_infos:
                it.info.update(part_infos[it.turn_id])
    metrics: dict[str, Any] = mean_dicts([_merge([p[0][e] for p in parts]) for e in range(epochs)])
    metrics.update(timings)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["updates_skipped_nonfinite"] = float(skipped)
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["samples"] = float(n)
    metrics["tokens"] = float(sum(it.response_len for it in items))
    metrics["world_size"] = float(world)
    metrics["step_time_s"] = time.perf_counter() - t_start
    metrics.update(item_metrics(items))
    return metrics


# ---- publication (rank 0) -------------------------------------------------------------------------------
def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tied tensors share storage, which safetensors refuses to write twice: clone the second and later ones."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        v = v.detach().contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def write_publication(models: TrainModels, weights: dict[str, torch.Tensor], folder: Path) -> tuple[Path, str]:
    """Rank 0: the full weights (``model.safetensors``) or, with LoRA, a PEFT adapter folder. Returns the folder
    and the ``kind`` the API's ``/v1/trainer/weights`` takes for it."""
    from safetensors.torch import save_file

    if not models.lora:
        write_folder_atomically(folder, lambda tmp: save_file(_unshared(weights), str(tmp / "model.safetensors")))
        return folder, "full"
    adapter = getattr(models.policy, "active_adapter", "default")
    if isinstance(adapter, (list, tuple)):
        adapter = adapter[0]
    peft_config = copy.deepcopy(models.policy.peft_config[adapter])
    peft_config.inference_mode = True  # as peft's save_pretrained writes it

    def write(tmp: Path) -> None:
        peft_config.save_pretrained(str(tmp))
        save_file(_unshared(weights), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})

    write_folder_atomically(folder, write)
    return folder, "lora"


def _prune_published(root: Path, keep: int) -> None:
    def number(p: Path) -> int | None:
        try:
            return int(p.name[1:]) if p.is_dir() and p.name.startswith("v") else None
        except ValueError:
            return None

    found = sorted((v, p) for p in root.iterdir() if (v := number(p)) is not None)
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


class _Publisher:
    """Rank 0's publication state: writes folders, reports them to the API (when there is one), remembers a
    failed report so it is retried before the next batch."""

    def __init__(self, models: TrainModels, store: Any, run_dir: Path, report: bool):
        self.models = models
        self.store = store
        self.root = run_dir / "weights"
        self.report = report and hasattr(store, "report_weights")
        self.pending: tuple[Path, str, int] | None = None

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> int | None:
        """Write ``weights`` as version ``version`` and report them. Returns the version they are served under,
        or None when the report failed (kept for ``retry``)."""
        folder, kind = write_publication(self.models, weights, self.root / f"v{version}")
        if not self.report:
            return version
        self.pending = (folder, kind, version)
        return self.retry()

    def retry(self) -> int | None:
        if self.pending is None:
            return None
        folder, kind, version = self.pending
        try:
            served = int(self.store.report_weights(str(folder), version, kind=kind))
        except Exception:
            log.exception("reporting weights %s failed; will retry before the next step", folder)
            return None
        self.pending = None
        try:
            _prune_published(self.root, KEEP_PUBLISHED)
        except OSError:
            log.exception("removing old weight folders failed")
        return served


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
        weights = _checkpoint_weights_to_names(models, found.weights)
    store_step, _, engine_version = _store_counters(store)
    ckpt_step = found.step if found is not None else 0
    ckpt_version = found.policy_version if found is not None else 0
    store_ahead = store_step > ckpt_step
    if store_ahead and found is not None and hasattr(store, "requeue_after_step"):
        requeued = store.requeue_after_step(ckpt_step)
        log.warning("store was at step %d, newest checkpoint at step %d: %d samples of the steps after it "
                    "requeued", store_step, ckpt_step, requeued)
    elif store_ahead and found is not None:
        log.warning("store is at step %d but the newest checkpoint is at step %d: the samples of steps %d..%d "
                    "are not in the resumed weights; continuing from the checkpoint's weights with the store's "
                    "step numbers", store_step, ckpt_step, ckpt_step + 1, store_step)
    elif store_ahead:
        log.warning("no checkpoint in %s but the store is at step %d: training starts from the starting weights "
                    "and continues the store's step numbers", ckpt.checkpoints_dir(run_dir), store_step)
    elif store_step < ckpt_step:
        log.warning("store is at step %d, behind the checkpoint's step %d: continuing with the checkpoint's "
                    "counters", store_step, ckpt_step)
    store_step, store_version, engine_version = _store_counters(store)
    plan = StartPlan(step=max(store_step, ckpt_step), version=max(store_version, ckpt_version),
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
                run_dir, step, version, _unshared(weights), optimizer_state,
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
    optimizer = make_optimizer(models, config)
    vocab_size = int(config_vocab(models))
    max_context = getattr(models.causal_lm.config, "max_position_embeddings", None)
    run_dir = Path(config.run_dir)
    publisher = _Publisher(models, store, run_dir, report_weights) if rank == 0 else None

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

    trained = 0
    idle_since = time.monotonic()
    while max_steps <= 0 or trained < max_steps:
        batch = None
        if rank == 0:
            if publisher.pending is not None and (served := publisher.retry()) is not None:
                version = served
            try:
                lease_id, samples = store.lease_samples(config.rollout_batch_size, lease_s=lease_s,
                                                        min_n=config.rollout_batch_size)
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
                for turn_id, reason in drops:
                    store.drop_leased_sample(turn_id, reason)
            if not items:
                if rank == 0:
                    store.release_lease(batch.lease_id)
                continue
            metrics = distributed_train_step(models, optimizer, items, config)
            weights = gather_weights(models)
            if rank == 0:
                served = publisher.publish(weights, version + 1)
                published = served is not None
                new_version = served if published else version
                step += 1
                metrics.update(stats.as_metrics())
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
            checkpoint_failed = not _save_checkpoint(models, optimizer, config, run_dir, step, version, True,
                                                     weights)
            if not checkpoint_failed:
                last_checkpoint_step = step
        del weights
    if step != last_checkpoint_step:  # a clean exit keeps everything trained so far
        _save_checkpoint(models, optimizer, config, run_dir, step, version, False, None)
    return trained


def _commit(store: Any, lease_id: str, step: int, version: int, metrics: dict[str, Any],
            turn_ids: list[int]) -> bool:
    """Rank 0: record the step. A refused commit (the lease was lost: it expired and the batch went back or to
    another trainer) is logged and the rest of the lease released, and the ranks go on: raising here would end
    rank 0 and with it the whole job (the other ranks wait in the next broadcast until their connection drops). The update stays in the weights, as it does when the
    in-process trainer's commit fails."""
    try:
        store.commit_step(lease_id, step, version, _jsonable(metrics), turn_ids)
        return True
    except Exception:  # noqa: BLE001 - see the docstring
        log.exception("step %d: the store refused the commit (lease %s lost?); its samples are not marked trained "
                      "and go back to ready", step, lease_id)
        try:
            store.release_lease(lease_id)
        except Exception:  # noqa: BLE001 - the lease then expires on its own
            log.exception("releasing lease %s failed; its samples return when it expires", lease_id)
        return False


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
