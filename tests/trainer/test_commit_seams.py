"""A commit that fails for any reason but a lost lease is tried again and never gives the batch back: the update is
already in the weights, so a released batch would be trained twice. The store lives on a real, small tmpfs that
is filled up at the moment of the commit (SQLite answers "database or disk is full"), in process and behind the
API's trainer routes (503, which the remote store tries again), and space comes back while the trainer waits."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from clawloop.config import Config
from clawloop.retry import Backoff
from clawloop.store import Store
from tests.trainer.trainer_helpers import add_sample

ADMIN_KEY = "seams-admin-key-41c2"


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs (needs root; skipped where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(disk: Path) -> Path:
    filler = disk / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    return filler


class FullAtCommit(Store):
    """A store whose disk fills up just before its first commit (the failure is SQLite's own)."""

    def __init__(self, path: Path, disk: Path):
        super().__init__(path)
        self.disk = disk
        self.filler: Path | None = None
        self.commit_failures = 0

    def commit_step(self, *args: Any, **kwargs: Any) -> None:
        if self.filler is None:
            self.filler = _fill(self.disk)
        try:
            super().commit_step(*args, **kwargs)
        except Exception:
            self.commit_failures += 1
            raise


def _free_space_after(store: FullAtCommit, failures: int, before_freeing=None) -> threading.Thread:
    def run() -> None:
        deadline = time.time() + 120
        while store.commit_failures < failures and time.time() < deadline:
            time.sleep(0.05)
        if before_freeing is not None:
            before_freeing()
        if store.filler is not None:
            os.remove(store.filler)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _trained_once(store: Store, turn_ids: list[int]) -> None:
    steps = store.steps()
    trained = [t for s in steps for t in s["turn_ids"]]
    assert sorted(trained) == sorted(turn_ids) and len(set(trained)) == len(trained)
    assert store.count_samples() == {"consumed": len(turn_ids)}


def test_an_embedded_commit_on_a_full_disk_is_retried_and_trains_nothing_twice(make_config, base_model,
                                                                              tiny_tokenizer, small_disk, tmp_path):
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion

    store = FullAtCommit(small_disk / "store.sqlite", small_disk)
    for i in range(4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    config = make_config(method="rl", gate=False, rollout_batch_size=2, checkpoint_every=100)
    trainer = Trainer(config, store, LocalVersion(), run_dir=tmp_path / "run", console=None,
                      store_backoff=Backoff(2, 0.05))
    freer = _free_space_after(store, failures=3)
    first = trainer.run_batch(*store.lease_samples(2, min_n=2))
    freer.join(5)
    assert first is not None and first["step"] == 1
    assert store.commit_failures >= 3 and trainer.store_retries >= 3  # the disk really was full at the commit
    assert store.count_samples() == {"consumed": 2, "ready": 2}  # nothing went back to ready meanwhile
    second = trainer.run_batch(*store.lease_samples(2, min_n=2))  # space is back: the next step goes as usual
    assert second is not None and second["step"] == 2
    _trained_once(store, [s.turn_id for s in store.samples()])
    assert [s["step"] for s in store.steps()] == [1, 2]
    trainer.close()
    store.close()


def _serve(app: Any) -> tuple[Any, threading.Thread, str]:
    import uvicorn

    from clawloop.serve import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


def test_a_remote_commit_on_a_full_disk_is_a_503_retried_and_trains_nothing_twice(make_config, base_model,
                                                                                 tiny_tokenizer, small_disk,
                                                                                 tmp_path):
    from fastapi import FastAPI

    from clawloop.api.errors import install_error_handlers
    from clawloop.api.trainer_routes import mount_trainer_routes
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion
    from clawloop.trainer.remote import RemoteStore

    store = FullAtCommit(small_disk / "store.sqlite", small_disk)
    for i in range(4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    app = FastAPI()
    install_error_handlers(app)
    mount_trainer_routes(app, store, LocalVersion(), Config.from_dict(dict(host="127.0.0.1", admin_key=ADMIN_KEY)))
    server, thread, url = _serve(app)
    remote = RemoteStore(url, ADMIN_KEY, retries=1, backoff_s=0.05)
    seen: dict[str, Any] = {}

    def while_full() -> None:  # what any trainer route answers while the disk is full
        r = httpx.post(f"{url}/v1/trainer/events", json={"kind": "probe", "detail": {}},
                       headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
        seen["status"], seen["body"] = r.status_code, r.json()

    try:
        config = make_config(method="rl", gate=False, rollout_batch_size=2, checkpoint_every=100)
        trainer = Trainer(config, remote, LocalVersion(), run_dir=tmp_path / "run", console=None,
                          store_backoff=Backoff(1, 0.05))
        freer = _free_space_after(store, failures=4, before_freeing=while_full)
        first = trainer.run_batch(*remote.lease_samples(2, min_n=2))
        freer.join(5)
        assert first is not None and first["step"] == 1
        assert store.commit_failures >= 4
        assert seen["status"] == 503 and seen["body"]["error"]["code"] == "store_unavailable"
        assert seen["body"]["error"]["type"] == "server_error"
        assert store.count_samples() == {"consumed": 2, "ready": 2}
        second = trainer.run_batch(*remote.lease_samples(2, min_n=2))
        assert second is not None and second["step"] == 2
        _trained_once(store, [s.turn_id for s in store.samples()])
        # The version history went through the routes too: one accepted version per step, numbered by the store.
        assert [(v["version"], v["step"], v["status"]) for v in store.versions()] == [(1, 1, "accepted"),
                                                                                     (2, 2, "accepted")]
        # Only a lost lease is a 409: a commit under a lease that holds nothing is refused as such.
        with pytest.raises(Exception) as lost:
            remote.commit_step("no-such-lease", 3, 2, {}, [store.samples()[0].turn_id])
        assert type(lost.value).__name__ == "LeaseLost"
        trainer.close()
    finally:
        remote.close()
        server.should_exit = True
        thread.join(10)
        store.close()
