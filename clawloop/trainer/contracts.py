"""The small contracts the one trainer loop (``trainer.core.Trainer``) runs over, and nothing else.

The loop (lease → prepare → old-policy pass with the teacher → step → gate → publish or restore → commit →
checkpoint) is written once; what differs between the embedded trainer, offline training and ``torchrun`` is
which implementation of each contract a launcher hands it:

* ``SampleSource`` — where samples come from and where steps, versions and gate events are recorded:
  ``clawloop.store.Store`` in this process, ``trainer.remote.RemoteStore`` over the API's trainer routes.
* ``PublishingEngine`` — what publication needs of an engine that serves in this process (``HFEngine``,
  ``VLLMEngine``, or ``publish.LocalVersion`` when nothing serves).
* ``WeightSink`` — where accepted weights go: an engine in this process or nowhere (``publish.EngineSink``), a
  folder plus an HTTP report (``publish.FolderSink``).
* ``Parallel`` — how the step runs and how state moves between processes: ``parallel.LocalParallel`` (one
  process, every call direct) or ``fsdp_parallel.FSDPParallel`` (the collectives and broadcasts of
  ``torchrun``; rank 0 alone talks to the source and the sink).
* ``GateView`` — how the publication gate sees the candidate: the training model itself locally, rank 0's
  unsharded copy under FSDP (``rank0_gate``).

Protocols, not base classes: the store and the engines are not trainer classes and need not know of these.
Capabilities are members of a contract, never probed with ``hasattr``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from clawloop.gate.gate import GateResult, PublicationGate
from clawloop.store import SampleRecord, TurnRecord
from clawloop.trainer.model import TrainModels

T = TypeVar("T")


class TurnSource(Protocol):
    """Where a batch's turns are read when it is prepared: the store, or the turns broadcast with the batch."""

    def get_turn(self, turn_id: int) -> TurnRecord: ...


class SampleSource(Protocol):
    """The part of ``Store`` a trainer uses (``RemoteStore`` serves the same over HTTP)."""

    def lease_samples(self, n: int, lease_s: float = 3600.0,
                      min_n: int | None = None) -> tuple[str, list[SampleRecord]]: ...

    def get_turn(self, turn_id: int) -> TurnRecord: ...

    def extend_lease(self, lease_id: str, lease_s: float) -> int: ...

    def release_lease(self, lease_id: str) -> int: ...

    def drop_leased_sample(self, turn_id: int, reason: str, lease_id: str | None = None) -> bool: ...

    def commit_step(self, lease_id: str, step: int, policy_version: int, metrics: dict[str, Any],
                    turn_ids: list[int], scores: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        """Raises ``clawloop.store.LeaseLost`` when the lease no longer holds the samples; any other failure
        (disk full, database locked) is worth another try. ``scores``: the teacher scores trained on, by turn."""
        ...

    def ready_count(self) -> int: ...

    def last_step(self) -> tuple[int, dict[str, Any]] | None: ...

    def next_version(self, at_least: int = 0) -> int: ...

    def record_version(self, version: int, step: int, status: str, evidence: dict[str, Any]) -> None: ...

    def record_event(self, kind: str, detail: dict[str, Any], step: int | None = None,
                     version: int | None = None) -> None: ...

    def record_rollback(self, to_version: int, from_version: int, detail: dict[str, Any]) -> list[int]: ...

    def recent_prompts(self, n: int, *,
                       corrected: bool = False) -> list[tuple[int, list[int], list[dict[str, Any]]]]: ...


class PublishingEngine(Protocol):
    """An engine the trainer publishes to in this process."""

    takes_adapters: bool
    """A LoRA run hands it the PEFT model itself (vLLM hot-loading) rather than merged weights."""

    @property
    def policy_version(self) -> int: ...

    @property
    def max_context(self) -> int | None: ...

    def publish_sync(self, weights: Any, **kwargs: Any) -> int: ...


class WeightSink(Protocol):
    """Where accepted weights go. Called on the main process only. A sink that serves the live training weights
    rather than the ``weights`` it is handed sets ``serves_live_weights = True`` (``publish.EngineSink``): the
    trainer then takes no step while a publication it owes has not gone through."""

    @property
    def policy_version(self) -> int:
        """The version served now, as far as this process knows."""
        ...

    @property
    def max_context(self) -> int | None:
        """The longest prompt + response the serving side takes (None: the model's own limit applies)."""
        ...

    def publish(self, models: TrainModels, weights: dict[str, torch.Tensor] | None, version: int) -> int:
        """Serve the accepted weights under ``version``; returns the version now served. ``weights`` is the
        main process's CPU copy of the trainable state (a sharded model's only whole copy). Raises on failure;
        the loop calls it again with the same version before the next step."""
        ...

    def served_version(self) -> int | None:
        """What the serving side reports it serves (another process's engine), or None (this process's)."""
        ...


class Parallel(Protocol):
    """How the step runs and how state crosses processes. Every process calls every method in the same order
    (under ``torchrun`` they are collectives); locally they are direct calls."""

    main: bool
    """This process talks to the sample source and the weight sink."""
    runner: Any
    """Handed to ``train_step`` (None: its local runner)."""
    world_size: int
    gathers_candidate: bool
    """``gate_candidate`` gathers the trainable state (on every process alike), so it is reused when kept."""

    def share(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the main process; every process gets its result, or raises its failure."""
        ...

    def trainable_weights(self, models: TrainModels) -> dict[str, torch.Tensor] | None:
        """A CPU copy of the trainable state (``model.trainable_state_dict``'s keys) on the main process."""
        ...

    def gate_candidate(self, models: TrainModels) -> dict[str, torch.Tensor] | None:
        """What the ``GateView`` needs of the candidate: nothing locally (it checks the model itself), the
        gathered trainable state under FSDP (also kept and published when the candidate passes)."""
        ...

    def optimizer_state(self, models: TrainModels, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """A copy of the optimizer state, keyed by parameter index, on the main process."""
        ...

    def load(self, models: TrainModels, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor] | None,
             optimizer_state: dict[str, Any] | None, learning_rate: float) -> bool:
        """Every process back to the main process's ``weights`` and ``optimizer_state`` (None: keep the
        optimizer as it is). Returns whether an optimizer state was loaded."""
        ...


class GateView(Protocol):
    """The candidate as the publication gate checks it (main process only)."""

    def check(self, gate: PublicationGate, candidate: dict[str, torch.Tensor] | None,
              accepted: dict[str, torch.Tensor] | None) -> GateResult: ...

    def prepare(self, gate: PublicationGate) -> bool:
        """One piece of the gate's work on the fixed reference, ahead of the checks (``PublicationGate.prepare``);
        whether any is left (none without a fixed reference)."""
        ...
