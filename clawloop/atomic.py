"""Atomic writes: a file or a folder appears whole or not at all, even when the process dies half-way.

Everything is written under a hidden temporary name beside its final place (``.tmp-<name>-<random>``), flushed
to disk (files, then their folders) and renamed into place with ``os.replace``, which is atomic on one file
system. A folder that already exists under the final name is swapped with the new one in one step (Linux's
``renameat2`` with ``RENAME_EXCHANGE``; elsewhere renamed aside to ``.old-<name>-<random>`` just before) and
deleted only once the new one is in place, so readers see the old folder or the new one, never a mix, and a crash
while the old one is deleted leaves the new one. A failed write removes its temporary;
a crash may leave ``.tmp-``/``.old-`` leftovers, which readers never mistake for the real thing (checkpoint
pruning deletes them).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path


def hidden_sibling(final: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name beside ``final``: ``.<kind>-<name>-<8 hex digits>``."""
    return final.parent / f".{kind}-{final.name}-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new and renamed names) to disk; best effort where folders cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(folder: Path) -> None:
    """Flush every file below ``folder``, then every folder, deepest first."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_dir(Path(root))


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one atomic step (``renameat2(..., RENAME_EXCHANGE)``); False where the
    system or its file system cannot, and nothing moved."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:  # a name is missing: the caller's mistake, not the system's limit
        raise OSError(err, os.strerror(err), f"{a} or {b}")
    return False  # not supported here (an old kernel, a file system, a sandbox refusing the call): rename instead


def _replace_folder(tmp: Path, final: Path) -> None:
    """Put folder ``tmp`` in the place of folder ``final``; the old one is deleted once the new one is there."""
    if exchange(tmp, final):
        old = tmp  # the swap left the old folder under the temporary name
    else:
        old = hidden_sibling(final, "old")
        os.replace(final, old)
        os.replace(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_folder_atomically(final: Path, write: Callable[[Path], None], *, mode: int | None = None) -> Path:
    """Create folder ``final`` all at once: ``write(tmp)`` fills a hidden sibling folder, everything in it is
    flushed, and it is renamed into place (replacing an older folder of the same name). ``mode``: the finished
    folder's permission bits, for a folder another process (a model server) reads. Returns ``final``."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(final)
    tmp.mkdir()
    try:
        write(tmp)
        if mode is not None:
            os.chmod(tmp, mode)
        fsync_tree(tmp)
        if final.exists():  # e.g. the same step number again after a resume: the new one wins
            _replace_folder(tmp, final)
        else:
            os.replace(tmp, final)
            fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def write_text_atomically(path: Path, text: str, encoding: str = "utf-8") -> Path:
    """Replace file ``path`` with ``text`` all at once (a reader sees the old content or the new, never part).
    A failed write (disk full) leaves no stray file and the old content in place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = hidden_sibling(path)
    try:
        tmp.write_text(text, encoding=encoding)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return path
