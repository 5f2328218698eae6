"""The run directory on a full filesystem: clear errors, no orphaned turn, no corrupted store, and recovery without
a restart once space returns.

Where the test may mount a small tmpfs (root on Linux) the disk is really filled with a filler file; otherwise
``OSError(ENOSPC)`` / SQLite's "database or disk is full" are injected at the store's and the checkpoint's writes.
The test id says which: ``[tmpfs]`` or ``[injected]``.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import torch

from clawloop.config import Config
from clawloop.store import Store, TurnState
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.core import Trainer
from clawloop.trainer.publish import LocalVersion
from tests.trainer.trainer_helpers import add_sample


def _can_mount_tmpfs() -> bool:
    probe = Path(f"/tmp/clawloop-mount-probe-{uuid.uuid4().hex[:8]}")
    probe.mkdir()
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    except OSError:
        return False
    finally:
        probe.rmdir()


# CLAWLOOP_FULL_DISK_MODE=injected forces the injected faults where tmpfs would work.
MODE = os.environ.get("CLAWLOOP_FULL_DISK_MODE") or ("tmpfs" if _can_mount_tmpfs() else "injected")


class FullDisk:
    """A folder whose filesystem can be filled (``fill``) and freed (``free``), really or by injection."""

    def __init__(self, root: Path, mode: str, monkeypatch):
        self.root = root
        self.mode = mode
        self.full = False
        self.monkeypatch = monkeypatch
        self.stores: list[Store] = []

    def fill(self) -> None:
        self.full = True
        if self.mode == "tmpfs":
            with open(self.root / "filler", "wb", buffering=0) as f:  # unbuffered: close() has nothing to flush
                try:
                    while True:
                        f.write(b"\0" * (1 << 16))
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC

    def free(self) -> None:
        self.full = False
        if self.mode == "tmpfs":
            (self.root / "filler").unlink()

    def watch_store(self, store: Store) -> None:
        """Injected mode: the store's writes fail as SQLite fails on a full disk."""
        if self.mode != "injected":
            return
        disk, real = self, store._db  # fault injection reaches into the store's connection on purpose

        class Connection:
            def __getattr__(self, name):
                return getattr(real, name)

            def execute(self, sql, *args):
                if disk.full and sql.lstrip().split()[0].upper() in ("INSERT", "UPDATE", "DELETE"):
                    raise sqlite3.OperationalError("database or disk is full")
                return real.execute(sql, *args)

        store._db = Connection()

    def watch_checkpoints(self) -> None:
        if self.mode != "injected":
            return
        real = ckpt.save_file

        def save_file(*args, **kwargs):
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)

        self.monkeypatch.setattr(ckpt, "save_file", save_file)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    root = tmp_path / "disk"
    root.mkdir()
    if MODE == "tmpfs":
        # Room for the checkpoints and the kept versions of a few steps of the tiny model; fill() takes the rest.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320m", "tmpfs", str(root)], check=True)
    try:
        yield FullDisk(root, MODE, monkeypatch)
    finally:
        if MODE == "tmpfs":
            subprocess.run(["umount", "-l", str(root)], check=False)


def _integrity(db_file: Path) -> str:
    con = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        return con.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        con.close()


GEN = {"model": "clawloop", "max_tokens": 3, "temperature": 0.0}


def _chat(c: httpx.Client, sid: str, *texts: str) -> httpx.Response:
    messages = []
    for i, text in enumerate(texts):
        if i:
            messages.append({"role": "assistant", "content": f"answer {i}"})
        messages.append({"role": "user", "content": text})
    return c.post("/v1/chat/completions", json={**GEN, "messages": messages}, headers={"X-Session-Id": sid})


@pytest.mark.parametrize("mode", [MODE])
def test_serving_on_a_full_disk(make_server, disk, mode):
    run_dir = disk.root / "run"
    srv = make_server(run_dir=run_dir)
    disk.watch_store(srv.store)
    long_text = "tell me about lighthouses and the sea " * 60  # each stored turn grows the database
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        r1 = _chat(c, "s1", long_text)
        r2 = _chat(c, "s2", long_text)
        assert r1.status_code == r2.status_code == 200
        t1, t2 = r1.json()["clawloop"]["turn_id"], r2.json()["clawloop"]["turn_id"]

        disk.fill()
        # Continuing s1 must pair t1 first: the write fails, the request says so, and t1 stays pending.
        r = _chat(c, "s1", long_text, "and the next one")
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "storage_unavailable" and "disk" in r.json()["error"]["message"]
        assert srv.store.get_turn(t1).state == TurnState.AWAITING_NEXT
        assert srv.sessions.pending_turn_id("s1") == t1
        # Ending s2 fails the same way and leaves it live (it must not come back after a restart either).
        r = c.post("/v1/sessions/s2/end")
        assert r.status_code == 503 and srv.sessions.pending_turn_id("s2") == t2
        # A new conversation cannot be stored, so it is not answered.
        r = _chat(c, "s3", long_text)
        assert r.status_code == 503
        # Reads keep working, on the same connection.
        assert c.get("/healthz").status_code == 200
        assert c.get("/v1/status").json()["turns_by_state"] == {"awaiting_next": 2}
        assert _integrity(run_dir / "store.sqlite") == "ok"

        disk.free()  # space returns: no restart needed
        r = _chat(c, "s1", long_text, "and the next one")
        assert r.status_code == 200, r.text
        assert r.json()["clawloop"]["paired_turn_id"] == t1
        assert srv.store.get_turn(t1).state == TurnState.JUDGEABLE
        r = c.post("/v1/sessions/s2/end")
        assert r.status_code == 200 and r.json()["dropped_turn_id"] == t2
        assert _chat(c, "s3", long_text).status_code == 200
    assert _integrity(run_dir / "store.sqlite") == "ok"
    srv.stop()

    srv = make_server(run_dir=run_dir)  # a restart brings back s1 and s3, not the ended s2
    assert srv.sessions.get("s2") is None
    assert srv.sessions.get("s1") is not None and srv.sessions.get("s3") is not None
    assert srv.store.get_turn(t2).state == TurnState.DROPPED


@pytest.mark.parametrize("mode", [MODE])
def test_a_failed_checkpoint_write_leaves_the_step_standing(disk, mode, tiny_model_path, tiny_tokenizer, tmp_path):
    from clawloop.engines.model_files import load_model

    torch.set_num_threads(2)
    disk.watch_checkpoints()
    # Only the checkpoints folder is on the full disk (the run's version history and metrics are not).
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(disk.root, target_is_directory=True)
    config = Config.from_dict(dict(model=str(tiny_model_path), device="cpu", run_dir=str(run_dir),
                                   rollout_batch_size=2, micro_batch_size=2, checkpoint_every=1, lr=1e-3,
                                   metrics_backends=["jsonl"]))
    store = Store(tmp_path / "store.sqlite")  # the store lives elsewhere: only checkpoints hit the full disk
    model = load_model(tiny_model_path, device="cpu")
    for i in range(6):
        add_sample(store, model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, LocalVersion(), console=None)
    assert trainer.run_batch(*store.lease_samples(2)) is not None
    assert ckpt.latest_checkpoint_path(config.run_dir).name == "step_1"

    disk.fill()
    lease_id, samples = store.lease_samples(2)
    metrics = trainer.run_batch(lease_id, samples)  # no exception: the step itself succeeded
    assert metrics is not None and metrics["step"] == 2 and trainer.step == 2
    assert [s["step"] for s in store.steps()] == [1, 2]
    assert all(store.get_turn(s.turn_id).state == TurnState.CONSUMED for s in samples)
    assert trainer.checkpoint_error is not None  # e.g. OSError ENOSPC, or torch.save's RuntimeError
    root = ckpt.checkpoints_dir(config.run_dir)
    assert ckpt.latest_checkpoint_path(config.run_dir).name == "step_1"  # still a complete checkpoint
    assert not [p for p in os.listdir(root) if p.startswith((".tmp-", ".latest-"))]

    disk.free()
    assert trainer.run_batch(*store.lease_samples(2))["step"] == 3
    assert trainer.checkpoint_error is None
    assert ckpt.latest_checkpoint_path(config.run_dir).name == "step_3"
    assert ckpt.load_latest(config.run_dir).step == 3
    store.close()
