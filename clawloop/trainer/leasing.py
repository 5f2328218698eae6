"""Which samples the next step trains, and what becomes of them when it fails: one leaser for every trainer loop.

The embedded loop (``trainer.loop``), offline training (``trainer.offline``) and rank 0 of the ``torchrun``
trainer (``trainer.distributed``) all take their batches from a ``BatchLeaser``; they differ in how they wait
(an asyncio wake-up, not at all, a broadcast to the other ranks) and in what a failure does: the embedded loop
reports it here and goes on (so the retry and drop rules below are its), offline training reports it and
stops the command, and a failed ``torchrun`` step stops every rank.

* ``lease()``: one batch of ``batch_size`` ready samples, oldest first, under a new lease (the store leases
  nothing unless a whole batch is ready: ``min_n``), or ``("", [])``. With ``partial``, fewer samples than a
  batch are leased too (offline training's last, smaller step). After a failed step, the failed batch's
  samples are leased one per step (``quarantine``): those that train go through, and the one that breaks
  every step it is in is isolated.
* ``succeeded(samples)``: the step committed; their failure counts are forgotten.
* ``failed(lease_id, samples)``: the step raised. Each sample's failure is counted; one that was in
  ``max_sample_failures`` failed steps is dropped with reason ``train_error`` (never silently), the rest go back
  to ready. Returns how many went back.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

log = logging.getLogger(__name__)


class BatchLeaser:
    def __init__(self, store: Any, batch_size: int, *, lease_s: float = 3600.0, max_sample_failures: int = 5,
                 partial: bool = False, count_first: bool = True):
        """``count_first``: read ``ready_count()`` before leasing, so a poll with too few samples writes
        nothing (a local store; the remote store's count is only as fresh as its last lease)."""
        self.store = store
        self.count_first = bool(count_first)
        self.batch_size = int(batch_size)
        self.lease_s = float(lease_s)
        self.max_sample_failures = int(max_sample_failures)
        self.partial = bool(partial)
        self.quarantine = 0
        """Single-sample steps still to take after a failed step."""
        self.sample_failures: Counter[int] = Counter()

    def lease(self) -> tuple[str, list[Any]]:
        n = 1 if self.quarantine > 0 else self.batch_size
        least = 1 if self.partial else n
        if self.count_first and self.store.ready_count() < least:
            return "", []
        lease_id, samples = self.store.lease_samples(n, self.lease_s, least)
        if samples and self.quarantine > 0:
            self.quarantine -= 1
        return lease_id, samples

    def succeeded(self, samples: list[Any]) -> None:
        for s in samples:
            self.sample_failures.pop(s.turn_id, None)

    def failed(self, lease_id: str, samples: list[Any]) -> int:
        for s in samples:
            self.sample_failures[s.turn_id] += 1
            if self.sample_failures[s.turn_id] >= self.max_sample_failures:
                self.store.drop_leased_sample(s.turn_id, "train_error")
                del self.sample_failures[s.turn_id]
                log.error("trainer: sample of turn %d was in %d failed steps; dropped (reason train_error)",
                          s.turn_id, self.max_sample_failures)
        kept = int(self.store.release_lease(lease_id))
        # Retry the failed samples one per step (they are the oldest ready, so they come first).
        self.quarantine = max(self.quarantine, kept)
        return kept
