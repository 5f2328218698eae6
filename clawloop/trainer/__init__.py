"""The trainer: leased samples in, optimizer steps, published weights and checkpoints out.

Modules, in the order a batch meets them:

* ``batch``      — join samples with their turns, drop what cannot train (with reasons), collate micro-batches;
* ``staleness``  — how many policy versions old a sample is, and drop / importance-correct / ignore;
* ``old_policy`` — the no-grad view of the weights before the step: ℓ_old, the student top-k side of the
  targets, refreshed teacher values, ℓ_ref;
* ``step``       — one optimizer step: per-sample objective from ``clawloop.losses``, gradient accumulation,
  AdamW, clipping, metrics;
* ``model``      — loading the policy (full or LoRA) and the reference; logits at response positions only;
* ``publish``    — merged weights to the serving engine; the weight sinks (``EngineSink``, ``FolderSink``);
* ``checkpoint`` — atomic checkpoints and the ``latest`` pointer;
* ``metrics``    — metrics.jsonl, TensorBoard / W&B when enabled, the console line;
* ``contracts``  — the typed contracts the loop runs over: sample source, weight sink, parallel, gate view;
* ``parallel``   — one process's ``Parallel`` and ``GateView``; ``fsdp_parallel`` / ``rank0_gate``: ``torchrun``'s;
* ``core``       — ``Trainer``: the one loop body (one leased batch to one committed step), resume, rollback;
* ``loop``       — ``OnlineTrainer``: the asyncio component that trains while serving;
* ``offline``    — ``train_offline``: ``clawloop train RUN_DIR``;
* ``distributed`` — the ``torchrun`` launcher of the same loop.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OnlineTrainer", "Trainer", "train_offline"]


def __getattr__(name: str) -> Any:  # imported on first use: loading torch and transformers is slow
    if name == "OnlineTrainer":
        from clawloop.trainer.loop import OnlineTrainer

        return OnlineTrainer
    if name == "Trainer":
        from clawloop.trainer.core import Trainer

        return Trainer
    if name == "train_offline":
        from clawloop.trainer.offline import train_offline

        return train_offline
    raise AttributeError(f"module 'clawloop.trainer' has no attribute {name!r}")
