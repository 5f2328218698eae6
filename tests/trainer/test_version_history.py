"""The version history stays true through a crash, and stays bounded.

* A process killed between publishing a version and committing its step leaves that version ``uncommitted`` after
  the restart: never listed as accepted, never rolled back to (route and command), and no step is claimed by two
  accepted versions after the resumed trainer trains that step again.
* LoRA versions are bounded by ``keep_lora_versions``; the optimizer state stays only with the newest version and
  the one served while it was saved; retention never removes the served version, the version a rollback returns
  to, or version 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from clawloop.api.admin_routes import mount_admin_routes
from clawloop.api.errors import install_error_handlers
from clawloop.cli import main as cli_main
from clawloop.store import Store
from clawloop.trainer import versions as history
from clawloop.trainer.core import Trainer
from clawloop.trainer.publish import LocalVersion

from trainer_helpers import add_sample, train_steps

ADMIN_KEY = "history-admin-key-5b1e"


class Killed(BaseException):
    """kill -9 at this point: nothing after it runs (not an Exception, so no handler on the way catches it)."""


def _die(*args, **kwargs):
    raise Killed


def _accepted_steps(store: Store) -> list[tuple[int, int]]:
    return [(v["version"], v["step"]) for v in store.versions() if v["status"] == "accepted"]


class TrainerOnly:
    """What the admin route reads from the online trainer: its core, and a rollback that this test must never
    reach (the refusal comes first)."""

    policies = None  # one shared policy

    def __init__(self, core: Trainer):
        self.core = core

    async def rollback(self, version: int, owner: str | None = None):
        raise AssertionError(f"the route let a rollback to version {version} through")

    def gate_status(self):
        return {}

    def serving_versions(self):
        return self.core.policy_version


def test_a_kill_between_publication_and_commit_leaves_no_false_history(make_config, base_model, tiny_tokenizer):
    config = make_config(method="rl", lora=True, checkpoint_every=1, admin_key=ADMIN_KEY)
    run_dir = Path(config.run_dir)
    db = run_dir / "store.sqlite"
    store = Store(db)
    for i in range(6):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)

    first = Trainer(config, store, LocalVersion(), console=None)
    first.run_batch(*store.lease_samples(2))  # step 1, version 1, checkpoint step_1
    store.commit_step = _die  # the process dies after version 2 is kept, recorded and published
    with pytest.raises(Killed):
        first.run_batch(*store.lease_samples(2))
    assert first.engine.policy_version == 2 and history.has_version(run_dir, 2)
    assert [s["step"] for s in store.steps()] == [1]  # step 2 never committed
    del first
    store.close()

    store = Store(db)
    store.recover()  # what every start does first
    second = Trainer(config, store, LocalVersion(), console=None)
    second.resume()
    assert second.policy_version == 1
    second.run_batch(*store.lease_samples(2))  # step 2 again, with the same samples

    statuses = {v["version"]: v["status"] for v in store.versions()}
    assert statuses[2] == "uncommitted"
    accepted = _accepted_steps(store)
    assert accepted == [(1, 1), (3, 2)]
    steps = [step for _, step in accepted]
    assert len(steps) == len(set(steps))  # no step claimed by two accepted versions
    assert set(steps) <= {s["step"] for s in store.steps()}  # and every accepted version's step committed
    (event,) = store.events("uncommitted")
    assert event["detail"]["versions"] == [2] and event["detail"]["last_committed_step"] == 1

    # Not offered for rollback: the admin route and the command both refuse it, and name it.
    app = FastAPI()
    install_error_handlers(app)
    mount_admin_routes(app, store, config, lambda: TrainerOnly(second))
    with TestClient(app) as client:
        refused = client.post("/v1/admin/rollback", json={"version": 2},
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        listed = client.get("/v1/admin/versions", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["code"] == "version_uncommitted" and "Version 2" in error["message"]
    assert [(v["version"], v["status"]) for v in listed["versions"]] == [(1, "accepted"), (2, "uncommitted"),
                                                                         (3, "accepted")]
    assert cli_main(["rollback", str(run_dir), "--to", "2"]) == 2
    assert store.get_meta("rollback_to") in (None, "")

    # A second repair changes nothing (the first one's store is what a later start opens).
    store.close()
    again = Store(db)
    again.recover()
    assert _accepted_steps(again) == [(1, 1), (3, 2)] and len(again.events("uncommitted")) == 1
    again.close()


def test_a_store_with_two_accepted_versions_for_one_step_is_repaired(tmp_path):
    """A store written before the repair existed: the crash's version and the retrained one both say accepted."""
    store = Store(tmp_path / "store.sqlite")
    lease, _ = store.lease_samples(1)
    store.commit_step(lease, 1, 1, {}, [])
    store.record_version(1, 1, "accepted", {})
    store.record_version(2, 2, "accepted", {})  # published; step 2 never committed
    store.commit_step(lease, 2, 3, {}, [])  # the resumed trainer's step 2
    store.record_version(3, 2, "accepted", {})
    store.close()
    store = Store(tmp_path / "store.sqlite")
    store.recover()
    assert [(v["version"], v["status"]) for v in store.versions()] == [(1, "accepted"), (2, "uncommitted"),
                                                                       (3, "accepted")]


def _folders(run_dir) -> dict[int, set[str]]:
    return {v: {p.name for p in history.version_dir(run_dir, v).iterdir()} for v in history.list_versions(run_dir)}


def test_lora_versions_are_bounded_and_keep_what_serving_and_rollback_need(make_config, base_model,
                                                                          tiny_tokenizer):
    config = make_config(method="rl", lora=True, keep_lora_versions=2)
    run_dir = Path(config.run_dir)
    store = Store(run_dir / "store.sqlite")
    for i in range(12):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, LocalVersion(), console=None)
    for _ in range(4):  # versions 1..4, one per step (gate off)
        trainer.run_batch(*store.lease_samples(2))
    assert trainer.policy_version == 4
    # v4 is the newest, v3 was served while v4 was saved (a rollback from v4 returns to it), v0 always stays.
    folders = _folders(run_dir)
    assert sorted(folders) == [0, 3, 4]
    assert [v for v, files in sorted(folders.items()) if "optimizer.pt" in files] == [3, 4]
    assert history.load_version(run_dir, 0).meta["has_optimizer"] is False

    # Rolling back to v3 restores its exact optimizer state; the next version keeps v3 (served) whatever its age.
    assert trainer.rollback(3)["optimizer"] == "restored"
    trainer.run_batch(*store.lease_samples(2))  # version 5, saved while v3 was served
    folders = _folders(run_dir)
    assert sorted(folders) == [0, 3, 4, 5]
    assert [v for v, files in sorted(folders.items()) if "optimizer.pt" in files] == [3, 5]
    trainer.run_batch(*store.lease_samples(2))  # version 6, saved while v5 was served
    assert sorted(_folders(run_dir)) == [0, 5, 6]
    # An older version is served again with a fresh optimizer, as the answer says; a pruned one is not kept.
    assert trainer.rollback(0)["optimizer"] == "reset (not kept with this version)"
    with pytest.raises(FileNotFoundError):
        trainer.rollback(3)
    assert trainer.policy_version == 0


def test_full_versions_never_prune_the_served_one(make_config, base_model, tiny_tokenizer):
    config = make_config(method="rl", keep_full_versions=1)
    run_dir = Path(config.run_dir)
    store = Store(run_dir / "store.sqlite")
    trainer = train_steps(config, store, base_model, tiny_tokenizer)
    assert sorted(_folders(run_dir)) == [1, 2]  # v2 newest, v1 served while it was saved
    trainer.rollback(1)
    trainer.run_batch(*store.lease_samples(2))  # v3, saved while v1 was served
    assert sorted(_folders(run_dir)) == [1, 3]
    assert all("optimizer.pt" not in files for files in _folders(run_dir).values())
    assert trainer.rollback(1)["version"] == 1
