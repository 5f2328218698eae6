"""The two shared helpers: atomic writes (whole or nothing, no leftovers) and retries with backoff."""

from __future__ import annotations

import asyncio

import pytest

from clawloop.atomic import write_folder_atomically, write_text_atomically
from clawloop.retry import Backoff, retry_async, retry_sync


def hidden(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_a_folder_appears_whole_and_replaces_the_old_one(tmp_path):
    final = tmp_path / "runs" / "v1"

    def write(tmp):
        (tmp / "weights.bin").write_bytes(b"new")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "meta.json").write_text("{}")

    write_folder_atomically(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"old"))
    assert write_folder_atomically(final, write, mode=0o755) == final
    assert (final / "weights.bin").read_bytes() == b"new" and (final / "sub" / "meta.json").read_text() == "{}"
    assert final.stat().st_mode & 0o777 == 0o755
    assert hidden(final.parent) == []


def test_a_failed_folder_write_keeps_the_old_folder_and_leaves_nothing(tmp_path):
    final = tmp_path / "v1"
    write_folder_atomically(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"old"))

    def broken(tmp):
        (tmp / "weights.bin").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_folder_atomically(final, broken)
    assert (final / "weights.bin").read_bytes() == b"old"
    assert hidden(tmp_path) == []


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "renamed-aside"])
def test_a_crash_while_the_old_folder_is_deleted_leaves_the_new_one(tmp_path, monkeypatch, swap):
    """The old folder is deleted only once the new one holds its name (swapped in one step where the system can,
    else renamed aside just before)."""
    import clawloop.atomic as atomic

    final = tmp_path / "v1"
    write_folder_atomically(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"old"))
    if not swap:
        monkeypatch.setattr(atomic, "exchange", lambda a, b: False)

    def crash(path, **_):
        raise KeyboardInterrupt  # the process dies while deleting

    monkeypatch.setattr(atomic.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        write_folder_atomically(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"new"))
    assert (final / "weights.bin").read_bytes() == b"new"


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "conf" / "openclaw.json"
    write_text_atomically(path, "one\n")
    write_text_atomically(path, "two\n")
    assert path.read_text() == "two\n"
    with pytest.raises(UnicodeEncodeError):  # fails while writing the temporary
        write_text_atomically(path, "bad \ud800")
    assert path.read_text() == "two\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["openclaw.json"]


def test_backoff_doubles_and_jitter_stays_within_half_to_one_and_a_half():
    plain = Backoff(retries=3, base_s=0.5)
    assert plain.attempts == 4 and [plain.delay(n) for n in range(3)] == [0.5, 1.0, 2.0]
    assert [plain.is_last(n) for n in range(4)] == [False, False, False, True]
    jittered = Backoff(retries=3, base_s=1.0, jitter=True)
    for n in range(3):
        assert all(0.5 * 2 ** n <= jittered.delay(n) < 1.5 * 2 ** n for _ in range(50))
    assert Backoff(retries=-1, base_s=1.0).attempts == 1
    assert plain.max_wait_s() == 3.5 and jittered.max_wait_s() == 1.5 * 7


def test_retry_sync_retries_what_is_retryable_and_reports_each_wait():
    calls, waits = [], []

    def flaky(n):
        calls.append(n)
        if n < 2:
            raise ConnectionError(f"try {n}")
        return "ok"

    out = retry_sync(flaky, Backoff(3, 0.001), retryable=lambda e: isinstance(e, ConnectionError),
                     on_retry=lambda n, exc, delay: waits.append((n, str(exc), delay)))
    assert out == "ok" and calls == [0, 1, 2]
    assert waits == [(0, "try 0", 0.001), (1, "try 1", 0.002)]


def test_retry_sync_raises_at_once_what_is_not_retryable_and_the_last_failure_when_tries_run_out():
    calls = []

    def refuse(n):
        calls.append(n)
        raise ValueError("bad request")

    with pytest.raises(ValueError, match="bad request"):
        retry_sync(refuse, Backoff(3, 0.001), retryable=lambda e: isinstance(e, ConnectionError))
    assert calls == [0]

    def down(n):
        raise ConnectionError(f"try {n}")

    with pytest.raises(ConnectionError, match="try 2"):
        retry_sync(down, Backoff(2, 0.001), retryable=lambda e: True)


def test_retry_async_tells_the_attempt_when_it_is_the_last():
    backoff = Backoff(2, 0.001)
    seen = []

    async def attempt(n):
        seen.append((n, backoff.is_last(n)))
        if not backoff.is_last(n):
            raise ConnectionError("again")
        return "last answer"

    assert asyncio.run(retry_async(attempt, backoff, retryable=lambda e: True)) == "last answer"
    assert seen == [(0, False), (1, False), (2, True)]


def test_a_sandbox_that_refuses_the_swap_gets_the_rename_instead(tmp_path, monkeypatch):
    """Some sandboxes answer renameat2 with EPERM: the folder is still replaced, by renaming the old one aside."""
    import ctypes
    import errno

    import clawloop.atomic as atomic

    class Refusing:
        def __init__(self, *args, **kwargs):
            pass

        class renameat2:  # noqa: N801 - stands for the C function of that name
            argtypes = None

            def __new__(cls, *args):
                ctypes.set_errno(errno.EPERM)
                return -1

    final = tmp_path / "v1"
    write_folder_atomically(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"old"))
    monkeypatch.setattr(atomic.ctypes, "CDLL", Refusing)
    write_folder_atomically(final, lambda tmp: (tmp / "weights.bin").write_bytes(b"new"))
    assert (final / "weights.bin").read_bytes() == b"new" and hidden(tmp_path) == []
