"""The learning loop's threads run below serving's CPU priority (``train_nice``), on Linux."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from clawloop.config import Config
from clawloop.priority import lower_thread_priority
from clawloop.runtime import build_runtime

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def thread_nices() -> dict[int, int]:
    """Every thread of this process by native id, with its nice value."""
    out = {}
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            out[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def test_a_lowered_thread_and_the_threads_it_starts_keep_the_lower_priority():
    seen = {}

    def child():
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def learner():
        lower_thread_priority(7)
        seen["self"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        a = torch.randn(256, 256)
        for _ in range(20):  # PyTorch's own parallel workers start here, from this thread
            a = torch.tanh(a @ a)
        t = threading.Thread(target=child)
        t.start()
        t.join()

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=learner)
    t.start()
    t.join()
    assert seen == {"self": max(before, 7), "child": max(before, 7)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # the caller's own is untouched


def test_the_embedded_trainer_and_the_base_engine_run_below_serving(tmp_path):
    """With training on, the training thread and the frozen base engine's worker (the teacher's) take the
    configured nice value; the serving engine's threads and the event loop keep the process's own."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    config = Config(model="tiny", device="cpu", num_threads=2, run_dir=str(tmp_path / "run"), port=0,
                    method="hybrid", train_nice=min(19, base + 6), metrics_backends=["jsonl"])
    before = set(thread_nices())
    interval = sys.getswitchinterval()
    with build_runtime(config, console=None):
        assert sys.getswitchinterval() < interval  # serving gets the interpreter lock back sooner while it trains
        deadline = time.time() + 30
        lowered = []
        while time.time() < deadline and len(lowered) < 2:
            lowered = [tid for tid, nice in thread_nices().items()
                       if tid not in before and nice == config.train_nice]
            time.sleep(0.2)
        others = [nice for tid, nice in thread_nices().items() if tid not in lowered]
    assert len(lowered) >= 2, thread_nices()  # the training thread and the base engine's worker
    assert base in others and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    assert sys.getswitchinterval() == interval  # the trainer stopped: the process has Python's own interval again
