"""The records the store keeps, the states a turn and a sample move through, and the packed id lists.

Ids and log-probs are stored as packed arrays (``array('i')`` / ``array('f')``): exact, and a fraction of the
size of JSON lists.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch


class TurnState(StrEnum):
    """A turn's state (``clawloop.store`` has the diagram). A turn with a sample is in its sample's state, from
    ``ready`` on: ``samples.move`` is the one place that writes both."""

    AWAITING_NEXT = "awaiting_next"
    JUDGEABLE = "judgeable"
    JUDGING = "judging"
    READY = "ready"
    LEASED = "leased"
    CONSUMED = "consumed"
    DROPPED = "dropped"


SAMPLE_STATES = (TurnState.READY, TurnState.LEASED, TurnState.CONSUMED, TurnState.DROPPED)
"""The states a sample can be in."""


class LeaseLost(RuntimeError):
    """A lease-checked write found its samples no longer held by the lease (it expired and they were leased again,
    or they were committed already). Only this means the caller's samples are not its own; any other failure of a
    write (a locked database, a full disk, an I/O error) propagates as the ``sqlite3`` error it is."""


@dataclass
class TurnRecord:
    """One main-line turn exactly as served."""

    session_id: str
    messages: list[dict[str, Any]]
    """The request messages (normalised), i.e. the context the answer was generated for."""
    prompt_ids: list[int]
    """The rendered prompt token ids the engine saw."""
    response_ids: list[int]
    """The generated token ids, exactly as sampled (trained on as-is, never re-rendered)."""
    logprobs: list[float]
    """Behaviour log-probs of ``response_ids`` under the sampling distribution."""
    temperature: float
    top_p: float
    policy_version: int
    response_text: str = ""
    assistant_message: dict[str, Any] = field(default_factory=dict)
    """The assistant message as returned to the client (content, tool_calls)."""
    tools: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    turn_index: int = 0
    created_at: float = field(default_factory=time.time)
    owner: str = ""
    """Fingerprint of the per-user key whose session this is ("" without per-user keys); never the key."""
    # Filled later:
    next_state: list[dict[str, Any]] | None = None
    """All messages that came after the stored answer in the session's next main request."""
    state: str = TurnState.AWAITING_NEXT
    reason: str = ""
    """Why the turn was dropped ("" for a turn that was not)."""
    sample_kind: str = ""
    """The kind of the turn's sample ('rl+opd', 'opd', 'rl', or 'context' for a teacher's answer stored as a turn
    of its own; "" while it has none): read from the sample."""
    id: int | None = None
    updated_at: float = 0.0


@dataclass
class VoteRecord:
    turn_id: int
    kind: str
    """'eval' or 'hint'."""
    index: int
    score: int | None
    """Parsed vote, None when invalid (timeout, HTTP error, no box)."""
    raw_text: str = ""
    hint: str = ""
    error: str = ""
    latency_s: float = 0.0
    attempt: int = 0


@dataclass
class SampleRecord:
    """A finished training sample: the turn's ids plus what the judge and teacher made of it."""

    turn_id: int
    reward: float
    """Majority evaluative vote in {+1, -1, 0}."""
    kind: str
    """'rl+opd', 'opd', 'rl' or 'context' (``clawloop.store.contexts``); 'rollout' in the trainer only
    (``clawloop.trainer.rollouts``, never stored)."""
    hints: list[str] = field(default_factory=list)
    targets: dict[str, torch.Tensor] | None = None
    """Teacher-side tensors of ``clawloop.losses.TopKTargets`` (and anything else the trainer needs), or None."""
    teacher_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    state: str = TurnState.READY
    lease_id: str = ""
    consumed_step: int | None = None
    created_at: float = field(default_factory=time.time)


def ids_blob(ids: Iterable[int]) -> bytes:
    return array("i", ids).tobytes()


def ids_from(blob: bytes | None) -> list[int]:
    a = array("i")
    if blob:
        a.frombytes(blob)
    return a.tolist()


def floats_blob(xs: Iterable[float]) -> bytes:
    return array("f", xs).tobytes()


def floats_from(blob: bytes | None) -> list[float]:
    a = array("f")
    if blob:
        a.frombytes(blob)
    return a.tolist()


ID_BYTES = array("i").itemsize
"""Bytes per stored token id."""
