"""The process's allocator settings: during a training step every large tensor gets its own mapping (unmapped when
freed, so the step's memory stays bounded); outside the steps, and while anything decodes inside one, such
tensors come from the heap, whose freed chunks the next decoding step reuses instead of faulting in fresh pages.

Each test runs in a fresh Python process: whether glibc maps an allocation also depends on the free heap space
that whatever ran before left behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")

MAPPED = textwrap.dedent('''
    import ctypes, ctypes.util, sys, threading
    import torch
    from clawloop.memory import decoding_allocations, training_allocations

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        print("no mallinfo2"); sys.exit(0)
    libc.mallinfo2.restype = MallInfo2

    def mapped():
        """Whether an 8 MiB tensor gets a mapping of its own (the step's threshold is 128 KiB, the other 32 MiB)."""
        before = libc.mallinfo2().hblks
        t = torch.empty(1 << 21)
        t.fill_(1.0)
        result = libc.mallinfo2().hblks > before
        del t
        return result
''')


def _run(body: str) -> str:
    done = subprocess.run([sys.executable, "-c", MAPPED + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "no mallinfo2":
        pytest.skip("glibc before 2.33 has no mallinfo2 to count mapped blocks with")
    return done.stdout.strip()


def test_a_training_step_maps_large_tensors_and_decoding_takes_them_from_the_heap():
    out = _run('''
        seen = []
        with training_allocations():
            pass
        seen.append(mapped())          # outside the steps: from the heap
        with training_allocations():
            seen.append(mapped())      # a step's transient tensors are unmapped when freed
            with decoding_allocations():   # the retain term's targets, built inside a step
                seen.append(mapped())
            try:
                with decoding_allocations():
                    raise RuntimeError("a failed build")
            except RuntimeError:
                pass
            seen.append(mapped())      # the step's threshold is back, after a failure too
        seen.append(mapped())
        print(seen)
    ''')
    assert out == "[False, True, False, True, False]"


def test_overlapping_blocks_on_two_threads_the_newest_decides_until_it_ends():
    out = _run('''
        entered, leave = threading.Event(), threading.Event()

        def step():
            with training_allocations():
                entered.set()
                leave.wait(30)

        seen = []
        thread = threading.Thread(target=step)
        thread.start()
        entered.wait(30)
        seen.append(mapped())          # the other thread's step runs
        with decoding_allocations():
            seen.append(mapped())
        seen.append(mapped())          # that step still runs
        leave.set()
        thread.join(30)
        seen.append(mapped())
        print(seen)
    ''')
    assert out == "[True, False, True, False]"


def test_the_block_that_ends_is_the_one_taken_away_when_equal_modes_nest():
    """training → decoding → training: the inner step ending leaves the decoding block deciding, not the outer
    step (an equal entry of the same mode)."""
    out = _run('''
        seen = []
        with training_allocations():
            with decoding_allocations():
                with training_allocations():
                    seen.append(mapped())
                seen.append(mapped())  # back inside the decoding block
            seen.append(mapped())      # back inside the outer step
        print(seen)
    ''')
    assert out == "[True, False, True]"
