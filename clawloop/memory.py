"""Process memory: keeping what PyTorch frees on CPU from staying with the process.

PyTorch on CPU allocates activations, gradients and KV caches through the C allocator (glibc's malloc on Linux).
Two of its habits keep freed memory resident, and this module holds the one switch for each:

* ``release_large_frees`` (once per process, when a training model is built) fixes glibc's mmap threshold.
  glibc serves an allocation above that threshold with its own mapping, returned to the system on free, and one
  below it from the heap, which only shrinks from the top. The threshold starts at 128 KiB but rises (up to
  32 MiB) each time a mapped block is freed, so after the first few layers every activation-sized tensor of a
  long sequence comes from the heap. A checkpointed forward interleaves the small tensors it keeps (each layer's
  input) with large transient ones, so the freed transients cannot be given back and resident memory grows with
  everything ever allocated: on SmolLM2-135M with LoRA, a checkpointed 1k-token forward kept 72 MB of tensors but
  raised resident memory by 880 MB; with the threshold fixed at 128 KiB, by 70 MB (docs/training-memory.md).
  Setting the threshold with ``mallopt`` also turns its growth off.
* ``trim_heap`` (after each training step, and when an engine lets go of its weights) asks glibc to return the
  free pages of its heaps (``malloc_trim``). glibc keeps what is freed in its heaps (one per thread that
  allocated) for reuse, and with the many differently sized tensors of a training step those heaps fragment: a
  135M-parameter run with ~2 GB of live tensors was seen holding 6-9 GB after a few steps, and the freed
  gigabytes of a stopped server stayed with the process.

Both are best effort and do nothing elsewhere than glibc (macOS, musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 << 10
"""glibc's own starting value, kept fixed: every tensor of a long sequence gets its own mapping, the small
bookkeeping allocations stay on the heap."""

_threshold_fixed = False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") or ("libc.so.6" if sys.platform.startswith("linux") else None)
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


@functools.cache
def _malloc_trim():  # noqa: ANN202 - a ctypes function or None
    libc = _libc()
    try:
        return None if libc is None else libc.malloc_trim
    except AttributeError:  # not glibc
        return None


def trim_heap() -> bool:
    """Return free heap memory to the OS; True when the allocator supports it (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    try:
        trim(0)
    except Exception:  # noqa: BLE001 - best effort; never let memory housekeeping fail a step
        log.debug("malloc_trim failed", exc_info=True)
        return False
    return True


def release_large_frees() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES`` for this process (once). True when applied."""
    global _threshold_fixed
    if _threshold_fixed:
        return True
    if not sys.platform.startswith("linux"):
        return False
    libc = _libc()
    try:
        mallopt = None if libc is None else libc.mallopt
    except AttributeError:
        mallopt = None
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("clawloop: could not set malloc's mmap threshold; long training steps may keep freed "
                    "memory resident")
        return False
    _threshold_fixed = True
    return True
