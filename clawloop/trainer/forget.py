"""``clawloop forget RUN_DIR --user OWNER`` (or ``--key-file FILE``): delete one user's data from a stopped run,
weights included.

``OWNER`` is the name the store keeps for a per-user key (``k_…``, ``clawloop.api.auth.owner_of``; the
dashboard and the records export show it). With the run's server stopped:

1. **The store** (``Store.forget_owner``): the user's turns, votes, hints, samples and context samples are
   deleted, their prompts are cut from the gate's evidence, and the file and its log are rewritten so that none
   of their text is left. In the same transaction every version trained on one of their samples (every version
   of a step at or after the first such step, since each version carries all the steps before it) is marked
   ``retired``, and a journal of what is left to do outside the store is written (``FORGET_PENDING``).
2. **The run folder**, from the journal: the retired versions' folders (``versions/`` and ``weights/``) and every
   checkpoint of that first step or later are deleted, in ``archive/`` too, and the user's lines are taken out of
   the records export in ``RUN_DIR/export`` (the gate's evidence there scrubbed as in the store, and in every
   version folder left). Under per-user policies (``policy_scope = "per_user"``) the user's samples trained only
   the user's own adapter: every version of it is retired and the user's folder ``RUN_DIR/users/<owner>`` (the
   adapter's versions, checkpoints and metrics) is deleted; no other user's version or checkpoint is touched.
3. **The receipt**, ``RUN_DIR/receipts/forget-<time>-<owner>.json``: counts and ids (never text), the retired versions,
   the removed checkpoints, and where training goes on from. Then the journal is cleared.

The next ``clawloop serve --run-dir RUN_DIR --resume`` starts from the newest checkpoint left (or the starting
weights): it serves that checkpoint's version, never a retired one, and the samples of the other users that the
deleted steps had trained on are requeued by the resume and trained again, in the order they were made, into
weights that never saw the forgotten user's.

A forget cut short (kill -9) after the store's transaction is finished by the next ``clawloop forget`` on the run
or by the next start of the run (``finish_pending_forget``), before any weights are loaded; one cut short before
it changed nothing. A running server holds the store open for writing, and the command refuses
(``StoreInUse``) before deleting anything.
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from clawloop.atomic import write_text_atomically
from clawloop.store import ForgetResult, Store, StoreInUse, find_store
from clawloop.store.forget import probe_sources, scrub_quotes
from clawloop.store.history import put_meta, retire_owner_versions, retire_versions_from, shared_steps
from clawloop.engines.vllm_publish import USER_ADAPTERS_DIR
from clawloop.trainer.checkpoint import list_checkpoints, remove_checkpoints_from
from clawloop.trainer.per_user import OWNER_NAME, USERS_FOLDER
from clawloop.trainer.versions import META as VERSION_RECORD
from clawloop.trainer.versions import remove_version

FORGET_PENDING = "forget_pending"
"""Store meta key: the journal of a forget whose run-folder part has not finished."""

RETIRED = "retired"
"""Version status of a version trained on a forgotten user's samples."""

EXPORT_DIR = "export"
ARCHIVE_DIR = "archive"
"""Where ``--fresh`` moves a run's earlier checkpoints and versions (``clawloop.run_folder``)."""
RECEIPTS_DIR = "receipts"


def forget_user(store: Store, run_dir: str | Path, owner: str) -> dict[str, Any]:
    """Forget ``owner`` in ``store`` and ``run_dir`` (module docstring); returns the receipt."""
    run_dir = Path(run_dir)
    finish_pending_forget(store, run_dir)  # an earlier forget cut short goes first
    # The user's hints are quoted by the gate's evidence (the preference check names the hint it reads). They are
    # cut from the run folder's copies here, before the store forgets them, so that no journal need hold their
    # text; the store cuts its own copies in the deleting transaction.
    hints = store.owner_hints(owner)
    if hints:
        _scrub_version_records(run_dir, set(), hints)
        _scrub_export(run_dir / EXPORT_DIR, set(), hints)

    def journal(db: sqlite3.Connection, result: ForgetResult) -> None:
        shared = shared_steps(db, result.steps)
        first = min(shared) if shared else None
        retired = retire_versions_from(db, first, RETIRED) if first is not None else []
        retired = sorted(retired + retire_owner_versions(db, owner, RETIRED))
        entry = {"owner": owner, "forgotten_at": time.time(), "first_step": first, "retired_versions": retired,
                 "user_policy_removed": bool(_user_folders(run_dir, owner)),
                 **{k: v for k, v in result.as_dict().items() if k not in ("owner", "log_truncated")}}
        put_meta(db, FORGET_PENDING, json.dumps(entry))

    result = store.forget_owner(owner, within=journal)
    receipt = finish_pending_forget(store, run_dir, compact=False)
    assert receipt is not None
    receipt["log_truncated"] = result.log_truncated
    return receipt


def finish_pending_forget(store: Store, run_dir: str | Path, *, compact: bool = True) -> dict[str, Any] | None:
    """Do the run-folder part of a forget whose store part committed (its journal is in the store), write its
    receipt and clear the journal. Idempotent; None when nothing is pending. ``compact``: rewrite the store file
    and its log first (a forget cut short may have committed its deletes but not compacted yet)."""
    run_dir = Path(run_dir)
    raw = store.get_meta(FORGET_PENDING)
    if not raw:
        return None
    entry = json.loads(raw)
    if compact:
        store.forget_owner(entry["owner"])  # nothing left to delete: it only compacts
    retired = [int(v) for v in entry["retired_versions"]]
    removed_versions = [v for v in retired if remove_version(run_dir, v)]
    for version in retired:
        folder = run_dir / "weights" / f"v{version}"
        if folder.exists():
            shutil.rmtree(folder, ignore_errors=True)
            removed_versions.append(version)
    first = entry["first_step"]
    checkpoints = remove_checkpoints_from(run_dir, int(first)) if first is not None else []
    # A run restarted with --fresh moved its earlier checkpoints and versions to archive/<time>/, same layout
    # and numbers: what there trained on the user's samples goes too.
    for archived in sorted(p for p in (run_dir / ARCHIVE_DIR).glob("*") if p.is_dir()):
        removed_versions += [v for v in retired if remove_version(archived, v)]
        if first is not None:
            checkpoints += [f"{ARCHIVE_DIR}/{archived.name}/{name}"
                            for name in remove_checkpoints_from(archived, int(first))]
    # Per-user policies: the user's adapter versions, checkpoints and metrics, and the adapters published to vLLM.
    for own_folder in _user_folders(run_dir, entry["owner"]):
        shutil.rmtree(own_folder)
    export_lines = _scrub_export(run_dir / EXPORT_DIR, set(entry["turn_ids"]))
    version_records = _scrub_version_records(run_dir, set(entry["turn_ids"]))
    left = list_checkpoints(run_dir)  # newest first
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(entry["forgotten_at"]))
    receipt = {
        "receipt": "clawloop forget",
        **entry,
        "forgotten_at_utc": stamp,
        "version_folders_removed": sorted(set(removed_versions)),
        "checkpoints_removed": checkpoints,
        "export_lines_removed": export_lines,
        "version_records_scrubbed": version_records,
        "user_policy_removed": bool(entry.get("user_policy_removed")),
        "training_resumes_from": left[0].name if left else "the starting weights",
        "note": "ids and counts only; " + (
            "the next start with --resume serves the version of the checkpoint it resumes from and trains the "
            "other users' samples of the retired steps again" if first is not None else
            "no step of the shared policy trained on the user's samples, so it is unchanged"
            + ("; the user's own policy was removed and their key is served the base model"
               if entry.get("user_policy_removed") else "")),
    }
    path = run_dir / RECEIPTS_DIR / f"forget-{stamp}-{re.sub(r'[^A-Za-z0-9_.-]', '_', entry['owner'])}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(receipt, indent=2) + "\n")
    receipt["receipt_path"] = str(path)
    store.set_meta(FORGET_PENDING, "")
    return receipt


def _user_folders(run_dir: Path, owner: str) -> list[Path]:
    """``owner``'s own policy folders under per-user policies, those the run has: their trainer's
    (``RUN_DIR/users/<owner>``, ``trainer.per_user``) and their adapters published to vLLM
    (``engines.vllm_publish.USER_ADAPTERS_DIR``), in ``archive/`` too."""
    if not OWNER_NAME.match(owner):
        return []
    roots = [run_dir, *sorted(p for p in (run_dir / ARCHIVE_DIR).glob("*") if p.is_dir())]
    return [folder for root in roots for folder in (root / USERS_FOLDER / owner, root / USER_ADAPTERS_DIR / owner)
            if folder.is_dir()]


def _scrub_version_records(run_dir: Path, turn_ids: set[int], hints: set[str] | None = None) -> int:
    """Cut the forgotten turns' prompts (and ``hints``) out of the gate evidence kept in every version folder left
    (the shared policy's, every user's, the archived ones); each record rewritten atomically. Returns how many
    changed."""
    if not turn_ids and not hints:
        return 0
    sources = probe_sources(turn_ids)
    changed = 0
    for path in sorted(run_dir.glob(f"**/versions/*/{VERSION_RECORD}")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # a damaged record is left for the version checks to report
            continue
        if scrub_quotes(record, sources, hints or ()):
            write_text_atomically(path, json.dumps(record, indent=1, default=str) + "\n")
            changed += 1
    return changed


def _scrub_export(folder: Path, turn_ids: set[int], hints: set[str] | None = None) -> dict[str, int]:
    """Take the forgotten turns' lines out of a records export (``clawloop records export``) and their prompts
    (and ``hints``) out of its gate evidence; each file rewritten atomically. Returns lines removed or changed
    per file."""
    if not folder.is_dir() or not (turn_ids or hints):
        return {}
    sources = probe_sources(turn_ids)
    changed: dict[str, int] = {}
    for path in sorted(folder.glob("*.jsonl")):
        kept, count = [], 0
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            turn = record.get("id") if path.name == "turns.jsonl" else record.get("turn_id")
            if path.name in ("turns.jsonl", "samples.jsonl") and turn in turn_ids:
                count += 1
                continue
            if scrub_quotes(record, sources, hints or ()):
                count += 1
                line = json.dumps(record, ensure_ascii=False, default=str)
            kept.append(line)
        if count:
            write_text_atomically(path, "".join(f"{line}\n" for line in kept))
            changed[path.name] = count
    return changed


def forget_command(run_dir: str | Path, owner: str) -> int:
    run_dir = Path(run_dir)
    try:
        path = find_store(run_dir)
    except FileNotFoundError as exc:
        print(f"clawloop forget: {exc}", file=sys.stderr)
        return 2
    if not owner:
        print("clawloop forget: --user names the user to forget (the k_… name their key has in the run's records)",
              file=sys.stderr)
        return 2
    store = Store(path)
    try:
        receipt = forget_user(store, run_dir, owner)
    except StoreInUse as exc:
        print(f"clawloop forget: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if not receipt["turn_ids"]:
        print(f"clawloop forget: the run holds nothing of {owner!r} (receipt written all the same)", file=sys.stderr)
    if not receipt["log_truncated"]:
        print("clawloop forget: a reader (a dashboard?) held the store's log open, so its old pages may still be in "
              f"{path.name}-wal; run the same command again once it has stopped", file=sys.stderr)
    print(json.dumps(receipt))
    return 0
