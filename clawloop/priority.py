"""CPU priority of the threads that do the learning loop's work, below the threads that answer users.

On a machine where serving and learning share the CPU (the default: everything on a laptop's cores), a user's
answer should not wait behind a training step or a teacher's scoring. Linux gives each thread its own nice value,
and a thread's new threads (PyTorch's parallel workers among them) inherit it, so lowering the priority of the
thread that trains, and of the frozen engine's worker that judges and scores for training, is enough. The
scheduler still gives them every cycle serving leaves idle.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Give the calling thread (and the threads it starts later) a nice value of at least ``nice``. Elsewhere than
    Linux, with ``nice`` 0, or when the system refuses, nothing changes."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), nice))
    except OSError as exc:
        log.warning("could not lower the CPU priority of thread %s (%s); it competes with serving as an equal",
                    threading.current_thread().name, exc)
