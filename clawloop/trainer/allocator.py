"""Keep freed activation memory from staying resident: a fixed mmap threshold for glibc's malloc.

glibc serves an allocation above its mmap threshold with its own mapping, returned to the system on free, and
one below it from the heap, which only shrinks from the top. The threshold starts at 128 KiB but rises (up to
32 MiB) each time a mapped block is freed, so after the first few layers every activation-sized tensor of a
long sequence comes from the heap. A checkpointed forward interleaves the small tensors it keeps (each layer's
input) with large transient ones, so the freed transients cannot be given back and resident memory grows with
everything ever allocated: on SmolLM2-135M with LoRA, a checkpointed 1k-token forward kept 72 MB of tensors but
raised resident memory by 880 MB; with the threshold fixed at 128 KiB, by 70 MB (docs/training-memory.md).

Setting the threshold with ``mallopt`` also turns its growth off. Elsewhere than glibc this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 << 10
"""glibc's own starting value, kept fixed: every tensor of a long sequence gets its own mapping, the small
bookkeeping allocations stay on the heap."""

_done = False


def release_large_frees() -> bool:
    """Fix glibc's mmap threshold at ``MMAP_THRESHOLD_BYTES`` for this process (once). True when applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1:
        log.warning("clawloop: could not set malloc's mmap threshold; long training steps may keep freed "
                    "memory resident")
        return False
    _done = True
    return True
