"""The whole loop in one process: what ``clawloop serve`` runs when training is on.

``Server`` (API, policy engine, store, sessions, and the vLLM servers the config names) + the judge/teacher
``Pipeline`` (woken when a turn becomes judgeable) + the ``OnlineTrainer`` (woken when a sample is written; with
``trainer = "remote"`` trainer processes lease the samples over HTTP instead); pipeline and trainer run as server components
on the server's event loop, so they start after the sessions are restored and stop before the engine closes.
The admin version routes (``/v1/admin/rollback``, ``/v1/admin/versions``) reach the embedded trainer.

A run folder that already holds training (checkpoints, or versions past the starting weights) is started only
as asked (``prepare_training_state``), before any model is loaded:

* ``resume``: from the newest intact checkpoint (``trainer.checkpoint.load_latest`` skips damaged ones and says
  which); a folder whose checkpoints are all damaged, or whose checkpoint's version folder is, stops start-up
  with a paragraph naming the file and what to do;
* ``fresh``: ``checkpoints/`` and ``versions/`` are moved to ``archive/<date-time>/`` (nothing is deleted) and
  training starts again from the starting weights; the store's record stays and numbers go on;
* neither: refused (``RunFolderError``), since the run would silently serve the starting weights — unless a
  rollback is pending (``clawloop rollback RUN_DIR --to N``), which serves version N.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from clawloop.api.admin_routes import mount_admin_routes
from clawloop.config import Config
from clawloop.pipeline import Pipeline, build_pipeline
from clawloop.serve import RunFolderError, Server, ensure_writable
from clawloop.store import Store
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer import versions as history
from clawloop.trainer.loop import OnlineTrainer
from clawloop.trainer.rollback import ROLLBACK_META

log = logging.getLogger("clawloop.runtime")


@dataclass
class Runtime:
    server: Server
    pipeline: Pipeline
    trainer: OnlineTrainer | None

    def start(self) -> "Runtime":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build_runtime(config: Config, *, resume: bool = False, fresh: bool = False, log_level: str = "warning",
                  pipeline_poll_s: float = 2.0, trainer_poll_s: float = 1.0,
                  console: TextIO | None = sys.stderr, on_gate: Callable[[dict[str, Any]], None] | None = None,
                  **server_kwargs: Any) -> Runtime:
    """Assemble server + pipeline (+ trainer when ``config.train``); nothing runs until ``start()``/``run()``.
    ``on_gate`` is called with every publication-gate decision of the trainer. ``resume`` / ``fresh``: how a
    folder that holds training is started (module docstring); ``RunFolderError`` when it cannot be."""
    server = Server(config, log_level=log_level, **server_kwargs)
    if config.train and config.trainer == "embedded":
        store = server.open_store()
        try:
            prepare_training_state(store, config.run_dir, resume=resume, fresh=fresh)
        except RunFolderError:
            server.close_store()
            raise
    server.build()
    config = server.config  # with the URLs of the vLLM servers it started
    tokenizer = server.engine.tokenizer
    base_engine = None
    if server.fleet is not None and server.fleet.teacher is not None:
        base_engine = server.fleet.teacher_engine(config, tokenizer)
    pipeline = build_pipeline(config, server.store, policy_engine=server.engine, tokenizer=tokenizer,
                              base_engine=base_engine, poll_interval_s=pipeline_poll_s)
    if base_engine is not None:
        pipeline.owned_engines.append(base_engine)
    trainer = None
    if config.train and config.trainer == "embedded":
        trainer = OnlineTrainer(config, server.store, server.engine, teacher=pipeline.teacher, resume=resume,
                                poll_interval_s=trainer_poll_s, console=console, on_gate=on_gate)
        pipeline.on_sample = lambda sample: trainer.wake()
    mount_admin_routes(server.app, server.store, config, lambda: trainer)
    server.on_judgeable = lambda turn_id: pipeline.notify()
    server.components = [pipeline] + ([trainer] if trainer is not None else [])
    return Runtime(server=server, pipeline=pipeline, trainer=trainer)


def run(config: Config, *, resume: bool = False, fresh: bool = False, log_level: str = "warning") -> None:
    """Blocking entry point of ``clawloop serve``: serve, judge and train until interrupted."""
    build_runtime(config, resume=resume, fresh=fresh, log_level=log_level).server.run()


# ---- a run folder that already holds training ------------------------------------------------------------
@dataclass(frozen=True)
class TrainingState:
    """What a run folder holds of earlier training."""

    checkpoints: list[str]
    """Checkpoint folders, newest first."""
    versions: list[int]
    """Kept version folders past version 0 (the starting weights), newest first."""
    pending_rollback: int | None
    """The version ``clawloop rollback RUN_DIR --to N`` asked the next start to serve."""

    @property
    def exists(self) -> bool:
        return bool(self.checkpoints or self.versions)

    def describe(self) -> str:
        parts = []
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint(s) (newest {self.checkpoints[0]})")
        if self.versions:
            parts.append(f"{len(self.versions)} accepted version(s) (newest v{self.versions[0]})")
        return " and ".join(parts)


def training_state(store: Store, run_dir: Path) -> TrainingState:
    checkpoints = [p.name for p in ckpt.list_checkpoints(run_dir)]
    versions = sorted((v for v in history.list_versions(run_dir) if v > 0), reverse=True)
    pending = store.get_meta(ROLLBACK_META) or ""
    return TrainingState(checkpoints, versions, int(pending) if pending else None)


def prepare_training_state(store: Store, run_dir: str | Path, *, resume: bool, fresh: bool) -> None:
    """Check (and with ``fresh``, set aside) what ``run_dir`` holds of earlier training before the trainer starts;
    ``RunFolderError`` names what stops it (module docstring)."""
    run_dir = Path(run_dir)
    if resume and fresh:
        raise RunFolderError(f"--resume continues the run in {run_dir} and --fresh starts it over: give one.")
    for folder in (ckpt.checkpoints_dir(run_dir), history.versions_dir(run_dir)):
        if folder.exists():
            ensure_writable(folder)
    state = training_state(store, run_dir)
    if fresh:
        if state.exists:
            archive_training_state(store, run_dir, state)
        if state.pending_rollback is not None:  # its version went to the archive with the others
            store.set_meta(ROLLBACK_META, "")
        return
    if state.pending_rollback is not None:
        check_rollback_target(store, run_dir, state.pending_rollback)
    if resume:
        check_resumable(run_dir)
    elif state.exists and state.pending_rollback is None:
        raise RunFolderError(
            f"{run_dir} holds an earlier run's training: {state.describe()}. Started as it is, this run would "
            "serve and train from the starting weights and leave that training unused. Restart with --resume to "
            "continue from the newest checkpoint, or with --fresh to start over from the starting weights "
            f"(checkpoints/ and versions/ are then moved to {run_dir / 'archive'}/<date-time>/, nothing is "
            "deleted, and the store's record is kept). For an unrelated run, give another folder with --run-dir.")


def check_resumable(run_dir: Path) -> None:
    """A resume needs an intact checkpoint (when there are any) and the version folder it serves."""
    found, skipped = ckpt.newest_intact_checkpoint(run_dir)
    root = ckpt.checkpoints_dir(run_dir)
    if found is None and skipped:
        listed = "; ".join(f"{s.path.name}: {s.problem}" for s in skipped)
        raise RunFolderError(
            f"No checkpoint in {root} can be resumed from ({listed}). Restore one from a backup, or start over "
            f"from the starting weights with --fresh (checkpoints/ and versions/ are moved to "
            f"{run_dir / 'archive'}/<date-time>/). To train every recorded sample again into the starting "
            f"weights instead, move {root} elsewhere and restart with --resume.")
    if found is None:
        return
    version = int(json.loads((found / "state.json").read_text())["policy_version"])
    problem = history.version_problem(run_dir, version)
    if problem is not None:
        raise RunFolderError(
            f"Checkpoint {found.name} in {root} serves version {version}, but "
            f"{history.version_dir(run_dir, version)} is damaged ({problem}). Restore that folder from a backup, "
            "or start over from the starting weights with --fresh.")


def check_rollback_target(store: Store, run_dir: Path, version: int) -> None:
    """The version a pending rollback serves at start must be kept, intact and committed."""
    if not history.has_version(run_dir, version):
        reason = f"{history.version_dir(run_dir, version)} is not kept"
    elif (problem := history.version_problem(run_dir, version)) is not None:
        reason = f"{history.version_dir(run_dir, version)} is damaged ({problem})"
    elif store.version_status(version) == "uncommitted":
        reason = "it never committed (a crash came before its step did)"
    else:
        return
    raise RunFolderError(
        f"A rollback to version {version} is pending for {run_dir} (clawloop rollback --to {version}), but {reason}. "
        f"Choose another version with clawloop rollback {run_dir} --to N, or start over from the starting weights "
        "with --fresh.")


def archive_training_state(store: Store, run_dir: Path, state: TrainingState) -> Path:
    """``fresh``: move ``checkpoints/`` and ``versions/`` to a new ``archive/<date-time>/`` folder (renames in the
    run folder: nothing is copied or deleted) and mark the store's accepted versions archived. Returns the
    archive."""
    folders = [f for f in (ckpt.checkpoints_dir(run_dir), history.versions_dir(run_dir)) if f.exists()]
    archive = run_dir / "archive" / time.strftime("%Y%m%d-%H%M%S")
    while archive.exists():  # two fresh starts within a second
        archive = archive.with_name(archive.name + "-1")
    archive.mkdir(parents=True)
    for folder in folders:
        os.replace(folder, archive / folder.name)
    store.archive_versions({"archive": str(archive), "moved": [f.name for f in folders]})
    log.warning("--fresh: %s of %s moved to %s (%s); training starts again from the starting weights, the "
                "store's record is kept and step and version numbers go on", " and ".join(f.name for f in folders),
                run_dir, archive, state.describe())
    return archive
