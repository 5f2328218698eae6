"""The run folder: whether a process can start in it, and what it holds of earlier training.

Checked before any model is loaded, so that a folder that cannot be started stops start-up in seconds with a
``RunFolderError``: one paragraph for the person at the command line naming the file or folder at fault and what
to do about it.

* ``open_run_store``: the run's store (``RUN_DIR/store.sqlite``), opened for writing, and the run folder held by
  this process alone until the store is closed (``clawloop.store.run_lock``: two servers or trainers in one
  folder would both commit steps, write versions and recover each other's work in flight); a folder this process
  cannot write, a folder another process holds, or a store that does not read, is a ``RunFolderError``.
* ``prepare_training_state``: a folder that already holds training (checkpoints, or versions past the starting
  weights) is started only as asked:

  * ``resume``: from the newest intact checkpoint (``trainer.checkpoint.load_latest`` skips damaged ones and says
    which); a folder whose checkpoints are all damaged, or whose checkpoint's version folder is, stops start-up;
  * ``fresh``: ``checkpoints/`` and ``versions/`` (and under per-user policies ``users/``, every user's own, and
    the adapters published to vLLM) are moved to ``archive/<date-time>/`` (nothing is deleted) and training starts
    again from the starting weights; the store's record stays and numbers go on;
  * neither: refused, since the run would silently serve the starting weights, unless a rollback is pending
    (``clawloop rollback RUN_DIR --to N``), which serves version N.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from clawloop.store import STORE_FILENAME, Store
from clawloop.store.run_lock import RunInUse, hold_run
from clawloop.trainer import checkpoint as ckpt
from clawloop.engines.vllm_publish import USER_ADAPTERS_DIR
from clawloop.trainer import versions as history
from clawloop.trainer.per_user import USERS_FOLDER, known_users, user_dir
from clawloop.trainer.rollback import ROLLBACK_META

log = logging.getLogger("clawloop.run_folder")


class RunFolderError(RuntimeError):
    """The run folder cannot be started as it is. The message is one paragraph for the person at the command
    line: the file or folder at fault and what to do about it."""


def store_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STORE_FILENAME


def ensure_writable(folder: Path) -> None:
    """Create ``folder`` if needed and write a scratch file in it; a folder this process cannot write to is a
    ``RunFolderError`` (found by trying: permission bits do not tell, e.g. under root or a read-only mount)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise RunFolderError(
            f"clawloop cannot write to {folder} ({exc.strerror or exc}). A run keeps its store, checkpoints and "
            f"versions in its folder and writes there from the start. Make it writable (e.g. chmod -R u+w "
            f"{folder}, or remount its disk read-write), or give another folder with --run-dir.") from None


def open_run_store(run_dir: str | Path) -> Store:
    """The run's store, opened for writing, with the run folder held until it is closed (``hold_run``);
    see ``RunFolderError`` for what stops it."""
    folder = Path(run_dir)
    ensure_writable(folder)
    try:
        held = hold_run(folder)
    except PermissionError as exc:  # a run.lock another user (root?) left, which this one cannot open
        raise RunFolderError(
            f"clawloop cannot open {exc.filename} ({exc.strerror}), the lock of the process that serves or trains "
            f"in {folder}. It was left by another user: give this user access to it (or remove it while nothing "
            "runs there), or give another folder with --run-dir.") from None
    except RunInUse as exc:
        who = str(exc)
        raise RunFolderError(
            f"{who[:1].upper()}{who[1:]}. Two processes in one run would both commit steps and write versions, and "
            "each would take the other's work in flight for work cut short by a crash. Stop it first, or give another "
            "folder with --run-dir (a running run can still be watched with clawloop dashboard RUN_DIR and rolled "
            "back with clawloop rollback --url).") from None
    try:
        store = _open_store(store_path(folder))
    except BaseException:
        held.release()
        raise
    store.release_on_close(held.release)
    return store


def _open_store(path: Path) -> Store:
    try:
        if path.exists():
            with open(path, "ab"):  # a store file that cannot be written (the folder could be)
                pass
        return Store(path)
    except PermissionError as exc:
        raise RunFolderError(
            f"clawloop cannot write the run's store {path} ({exc.strerror}). Make it writable (e.g. chmod u+w "
            f"{path}), or give another folder with --run-dir.") from None
    except sqlite3.OperationalError as exc:  # locked, or its -wal / -shm file not writable: not damage
        raise RunFolderError(
            f"The run's store {path} could not be opened: SQLite says \"{exc}\". Another program may hold it "
            f"locked (an open sqlite3 shell, a backup in progress), or its -wal or -shm file beside it may not be "
            "writable by this user. Close that program or fix the files' permissions, then start again.") from None
    except sqlite3.DatabaseError as exc:
        raise RunFolderError(
            f"The run's store {path} cannot be read: SQLite says \"{exc}\". It is the record of every turn, "
            "sample and step of the run, and was probably cut short (a full disk, a copy that did not finish). "
            f"Restore it from a backup (with its -wal file, if there is one), or start a new run in another "
            "folder with --run-dir; this folder's checkpoints and versions cannot be resumed without it.") from None


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
    users: list[str] = field(default_factory=list)
    """Users whose own policy (per-user policies, ``RUN_DIR/users/<owner>``) holds checkpoints or versions."""

    @property
    def exists(self) -> bool:
        return bool(self.checkpoints or self.versions or self.users)

    def describe(self) -> str:
        parts = []
        if self.users:
            parts.append(f"the own policies of {len(self.users)} user(s) in {USERS_FOLDER}/")
        if self.checkpoints:
            parts.append(f"{len(self.checkpoints)} checkpoint(s) (newest {self.checkpoints[0]})")
        if self.versions:
            parts.append(f"{len(self.versions)} accepted version(s) (newest v{self.versions[0]})")
        return " and ".join(parts)


def training_state(store: Store, run_dir: Path) -> TrainingState:
    checkpoints = [p.name for p in ckpt.list_checkpoints(run_dir)]
    versions = sorted((v for v in history.list_versions(run_dir) if v > 0), reverse=True)
    pending = store.get_meta(ROLLBACK_META) or ""
    users = [owner for owner in known_users(run_dir)
             if ckpt.list_checkpoints(user_dir(run_dir, owner))
             or any(v > 0 for v in history.list_versions(user_dir(run_dir, owner)))]
    return TrainingState(checkpoints, versions, int(pending) if pending else None, users)


@dataclass(frozen=True)
class TrainedWith:
    """What this start trains with, for a resume to compare with what its checkpoint was written with: the model
    folder (``engines.model_files.resolve_model``) and whether it trains a LoRA adapter."""

    model_dir: Path
    lora: bool


def prepare_training_state(store: Store, run_dir: str | Path, *, resume: bool, fresh: bool,
                           trained_with: TrainedWith | None = None) -> None:
    """Check (and with ``fresh``, set aside) what ``run_dir`` holds of earlier training before the trainer starts;
    ``RunFolderError`` names what stops it (module docstring). ``trained_with``: a resume whose checkpoint was
    written for another model or another ``lora`` setting is refused here, before any model loads."""
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
        check_resumable(run_dir, trained_with)
    elif state.exists and state.pending_rollback is None:
        raise RunFolderError(
            f"{run_dir} holds an earlier run's training: {state.describe()}. Started as it is, this run would "
            "serve and train from the starting weights and leave that training unused. Restart with --resume to "
            "continue from the newest checkpoint, or with --fresh to start over from the starting weights "
            f"(checkpoints/ and versions/ are then moved to {run_dir / 'archive'}/<date-time>/, nothing is "
            "deleted, and the store's record is kept). For an unrelated run, give another folder with --run-dir.")


def check_resumable(run_dir: Path, trained_with: TrainedWith | None = None) -> None:
    """A resume needs an intact checkpoint (when there are any), written for the same model and ``lora`` setting
    when ``trained_with`` says them, and the version folder it serves: the shared policy's, and every user's own
    (per-user policies)."""
    for folder in [run_dir, *(user_dir(run_dir, owner) for owner in known_users(run_dir))]:
        check_resumable_folder(folder, trained_with)


def _model_config(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None


def check_written_with(checkpoint: Path, trained_with: TrainedWith) -> None:
    """A checkpoint holds weights of one model, trained one way: loaded into another model (even one of the same
    shapes) or as the other kind (full weights against an adapter) it would serve nonsense or fail late. The model
    is compared by its ``config.json``: a folder moved or copied since is the same model; a recorded folder that
    is gone cannot be compared and passes."""
    state = json.loads((checkpoint / "state.json").read_text())
    if "lora" in state and bool(state["lora"]) != trained_with.lora:
        raise RunFolderError(
            f"Checkpoint {checkpoint} was written with lora={str(bool(state['lora'])).lower()}, and this start has "
            f"lora={str(trained_with.lora).lower()}. Start with the setting the run was trained with, or over from "
            "the starting weights with --fresh.")
    recorded = Path(state["model_dir"]) if state.get("model_dir") else None
    if recorded is None or recorded.resolve() == trained_with.model_dir.resolve():
        return
    before, now = _model_config(recorded), _model_config(trained_with.model_dir)
    if before is not None and now is not None and before != now:
        raise RunFolderError(
            f"Checkpoint {checkpoint} was trained on the model in {recorded}, and this start loads another one, "
            f"{trained_with.model_dir} (their config.json differ). Start with the run's model (--model "
            f"{recorded}), or over from the starting weights with --fresh, or give another folder with --run-dir.")


def check_resumable_folder(run_dir: Path, trained_with: TrainedWith | None = None) -> None:
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
    if trained_with is not None:
        check_written_with(found, trained_with)
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
    folders = [f for f in (ckpt.checkpoints_dir(run_dir), history.versions_dir(run_dir), run_dir / USERS_FOLDER,
                           run_dir / USER_ADAPTERS_DIR) if f.exists()]
    archive = run_dir / "archive" / time.strftime("%Y%m%d-%H%M%S")
    while archive.exists():  # two fresh starts within a second
        archive = archive.with_name(archive.name + "-1")
    archive.mkdir(parents=True)
    for folder in folders:
        target = archive / folder.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(folder, target)
    store.archive_versions({"archive": str(archive), "moved": [str(f.relative_to(run_dir)) for f in folders]})
    log.warning("--fresh: %s of %s moved to %s (%s); training starts again from the starting weights, the "
                "store's record is kept and step and version numbers go on", " and ".join(f.name for f in folders),
                run_dir, archive, state.describe())
    return archive
