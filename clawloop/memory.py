"""Process memory: keeping what PyTorch frees on CPU from staying with the process, without slowing decoding.

PyTorch on CPU allocates activations, gradients and KV caches through the C allocator (glibc's malloc on Linux).
Two of its habits keep freed memory resident, and this module holds the switches:

* ``training_allocations`` (around every training step, ``clawloop.trainer.step.train_step``) fixes glibc's mmap
  threshold low for the step. glibc serves an allocation above that threshold with its own mapping, returned to
  the system on free, and one below it from the heap, which only shrinks from the top. The threshold starts at
  128 KiB but rises (up to 32 MiB) each time a mapped block is freed, so after the first few layers every
  activation-sized tensor of a long sequence comes from the heap. A checkpointed forward interleaves the small
  tensors it keeps (each layer's input) with large transient ones, so the freed transients cannot be given back
  and resident memory grows with everything ever allocated: on SmolLM2-135M with LoRA, a checkpointed 1k-token
  forward kept 72 MB of tensors but raised resident memory by 880 MB; with the threshold fixed at 128 KiB, by
  70 MB (docs/training-memory.md).
* Outside the steps the threshold is high (``DECODING_THRESHOLD_BYTES``; ``decoding_allocations`` raises it
  inside a step too, for the retain term's targets). Decoding needs it: a KV cache grows by one token a step by
  copying every layer's keys and values into new tensors, and given a fresh mapping each step those tensors cost
  a page fault per 4 KiB. Greedy answers to 30 probes of 64 tokens on SmolLM2-135M took 14.5 s with the
  threshold fixed at 128 KiB (4.8 million page faults) and 9.5 s with it high (0.6 million); the trainer's
  process fixed it low for good until the publication gate's checks and the embedded engine's answers were
  measured paying that. The serving engine in the trainer's process (the embedded one) decodes beside the
  trainer's thread: while a step runs, its answers pay the low threshold too.
* ``trim_heap`` (after each training step, and when an engine lets go of its weights; also when the last switch
  ends) asks glibc to return the free pages of its heaps (``malloc_trim``). glibc keeps what is freed in its heaps
  (one per thread that allocated) for reuse, and with the many differently sized tensors of a training step
  those heaps fragment: a 135M-parameter run with ~2 GB of live tensors was seen holding 6-9 GB after a few
  steps, and the freed gigabytes of a stopped server stayed with the process.

All are best effort and do nothing elsewhere than glibc (macOS, musl).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import sys
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD_BYTES = 128 << 10
"""The threshold during a training step: glibc's own starting value, kept fixed, so every tensor of a long
sequence gets its own mapping and the small bookkeeping allocations stay on the heap."""
TRIM_THRESHOLD_BYTES = 128 << 10
"""glibc's default top-of-heap trim threshold, kept during a step."""
DECODING_THRESHOLD_BYTES = 32 << 20
"""The threshold outside training steps: glibc's own ceiling on 64-bit, above a decoder's per-layer KV-cache
tensors, so they come from the heap and its freed chunks are reused step after step. The trim threshold is then
twice as much, as glibc's own adjustment makes it, so a freed chunk at the top of the heap is not handed back and
asked for again every decoding step."""

TRAINING = (MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES)
DECODING = (DECODING_THRESHOLD_BYTES, 2 * DECODING_THRESHOLD_BYTES)

_lock = threading.Lock()
_open: list[list[tuple[int, int]]] = []
"""The blocks open now, oldest first (one list per block, so each is removed by identity): the newest decides."""


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


def _set_thresholds(mode: tuple[int, int]) -> None:
    libc = _libc()
    try:
        mallopt = None if libc is None else libc.mallopt
    except AttributeError:  # not glibc
        return
    if mallopt is None:
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for param, nbytes in zip((M_MMAP_THRESHOLD, M_TRIM_THRESHOLD), mode):
        if mallopt(param, nbytes) != 1:
            log.debug("mallopt(%d, %d) failed", param, nbytes)


@contextlib.contextmanager
def _thresholds(mode: tuple[int, int]) -> Iterator[None]:
    """``mode``'s thresholds while the block runs. Blocks nest, and overlap across threads: the newest open block
    decides; once the last ends the thresholds are ``DECODING``'s (fixed: glibc's own growth stays off). The heaps'
    free pages are returned (``trim_heap``) whenever ``TRAINING`` begins or comes back, and when the last block
    ends."""
    if not sys.platform.startswith("linux"):
        yield
        return
    entry = [mode]
    with _lock:
        _open.append(entry)
        _set_thresholds(mode)
    if mode == TRAINING:
        trim_heap()  # the heap's free space is given back, so a step's large tensors are mapped, not put there
    try:
        yield
    finally:
        with _lock:
            # By identity: ``list.remove`` compares by value, and an outer block of the same mode is an equal list.
            del _open[next(i for i, e in enumerate(_open) if e is entry)]
            now = _open[-1][0] if _open else DECODING
            _set_thresholds(now)
        if now == TRAINING or not _open:
            trim_heap()


def training_allocations() -> contextlib.AbstractContextManager[None]:
    """Around a training step's forwards and backwards: every tensor above 128 KiB gets its own mapping (see the
    module docstring)."""
    return _thresholds(TRAINING)


def decoding_allocations() -> contextlib.AbstractContextManager[None]:
    """Around decoding that may run inside a training step (the retain term's targets): large tensors come from the
    heap again until the block ends (see the module docstring)."""
    return _thresholds(DECODING)
