"""One process at a time serves or trains in a run folder.

Two would both commit steps and write versions, and each would take the other's leased or claimed work for work
cut short by a crash (``Store.recover``). The process that writes a run holds ``RUN_DIR/run.lock`` with an
exclusive ``flock``; the kernel drops it when the process ends, so a crash leaves nothing to clean up. The file
holds the holder's pid, for the message a second process gets. Readers (the dashboard, ``clawloop records
export``) and the commands that are safe beside a running server (``clawloop rollback``; ``clawloop forget``, which
refuses to run while another writer has the store open) do not take it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

RUN_LOCK = "run.lock"


class RunInUse(RuntimeError):
    """Another process holds the run folder; ``holder`` is its pid when it wrote one."""

    def __init__(self, run_dir: Path, holder: int | None):
        self.run_dir, self.holder = run_dir, holder
        who = f" (pid {holder})" if holder is not None else ""
        if holder == os.getpid():
            super().__init__(f"this process already serves or trains in {run_dir}")
        else:
            super().__init__(f"another clawloop process{who} is serving or training in {run_dir}")


class RunLock:
    """The run folder held by this process; ``release`` lets it go (closing the file drops its lock)."""

    def __init__(self, fd: int):
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def hold_run(run_dir: str | Path) -> RunLock:
    """Hold ``run_dir`` for this process alone, or raise ``RunInUse``. A second call in the same process also
    raises: each call opens the file anew, and ``flock`` locks belong to the open file, not the process."""
    run_dir = Path(run_dir)
    fd = os.open(run_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        written = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        os.close(fd)
        raise RunInUse(run_dir, int(written) if written.isdigit() else None) from None
    except BaseException:
        os.close(fd)
        raise
    held = RunLock(fd)
    try:  # the pid is for the message only; a full disk must not leave the lock held by nobody's handle
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass
    return held
