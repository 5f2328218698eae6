"""Checkpoints: everything needed to continue a run after it stops or crashes.

Layout under ``run_dir/checkpoints``::

    step_12/weights.safetensors   all weights (full fine-tuning) or the adapter only (LoRA)
    step_12/optimizer.pt          AdamW state
    step_12/state.json            step, policy version, optimizer updates, mode, when
    latest                        text file naming the newest complete checkpoint ("step_12")

Atomicity: a checkpoint is written by ``clawloop.weight_folder`` (a hidden temporary folder, flushed to disk,
then renamed into place); ``latest`` is replaced by rename only after that. A crash at any moment leaves
``latest`` naming a complete checkpoint (or no ``latest`` at all), never a half-written one.

The store is the other half of the state: resuming calls ``store.requeue_after_step(step)`` so samples consumed
by steps after the checkpoint (whose weights died with the process) become ready again and train exactly once.
Only the newest ``keep_last`` checkpoints are kept: each one holds a full optimizer state.

Damage: a file cut short afterwards (a full disk, a copy that did not finish) is found before anything is loaded
(``checkpoint_problem``, i.e. ``clawloop.weight_folder.folder_problem``, opens each file with its own reader
without reading the tensors). ``load_latest`` then falls back from the checkpoint ``latest`` names to the newest
older one that is intact, and logs which one it skipped and why; when none is intact it raises
``DamagedCheckpoints`` (resuming from the starting weights instead would be a silent fresh start).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawloop.atomic import write_text_atomically
from clawloop.weight_folder import READ_ERRORS, FolderLayout, folder_problem, read_weight_folder, save_in_layout

log = logging.getLogger(__name__)

LATEST = "latest"

LAYOUT = FolderLayout(tensors="weights.safetensors", record="state.json", required=("step", "policy_version"),
                      optimizer="optimizer.pt")
"""A checkpoint folder's files (written and checked by ``clawloop.weight_folder``)."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    policy_version: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    state: dict[str, Any]


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: str | Path, step: int, policy_version: int, weights: dict[str, torch.Tensor],
                    optimizer_state: dict[str, Any] | None, extra: dict[str, Any] | None = None,
                    keep_last: int = 2) -> Path:
    """Write checkpoint ``step_<step>`` atomically and point ``latest`` at it. Returns its folder."""
    root = checkpoints_dir(run_dir)
    name = f"step_{int(step)}"
    state = {"step": int(step), "policy_version": int(policy_version), "created_at": time.time(), **(extra or {})}
    final = save_in_layout(root / name, LAYOUT, weights, optimizer_state, state)
    # A failed write (disk full) leaves no stray file; ``latest`` still names the previous checkpoint.
    write_text_atomically(root / LATEST, name + "\n")
    _prune(root, keep_last, protect=name)
    return final


def _step_of(path: Path) -> int | None:
    return _step_of_name(path.name) if path.is_dir() else None


def _step_of_name(name: str) -> int | None:
    if not name.startswith("step_"):
        return None
    try:
        return int(name[len("step_"):])
    except ValueError:
        return None


def _prune(root: Path, keep_last: int, protect: str) -> None:
    if keep_last < 1:
        return
    found = sorted((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None)
    # Only intact checkpoints count towards ``keep_last``: after a resume that skipped a damaged one, keeping it
    # in place of an older intact one would leave fewer checkpoints to fall back to.
    intact = [path for _, path in found if path.name == protect or checkpoint_problem(path) is None]
    keep = {path.name for path in intact[-keep_last:]} | {protect}
    for _, path in found:
        if path.name not in keep:
            if path not in intact:
                log.warning("checkpoint %s is damaged (%s) and is removed", path, checkpoint_problem(path))
            shutil.rmtree(path, ignore_errors=True)
    # Leftovers of a crash in the middle of a write.
    for path in root.iterdir():
        if path.name.startswith((".tmp-", ".old-", f".{LATEST}-")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:  # an unfinished ``latest`` pointer
                path.unlink(missing_ok=True)


def remove_checkpoints_from(run_dir: str | Path, step: int) -> list[str]:
    """Delete every checkpoint of step ``step`` or later (weights that trained on something that must go), and
    the ``latest`` pointer when it names one of them, so that a resume starts from the newest one left (or from
    the starting weights). Returns the removed folders' names; removing what is already gone is no error."""
    root = checkpoints_dir(run_dir)
    removed = [path.name for found, path in _step_folders(run_dir) if found >= int(step)]
    pointer = root / LATEST
    if pointer.is_file() and pointer.read_text().strip() in removed:
        pointer.unlink()
    for name in removed:
        shutil.rmtree(root / name, ignore_errors=True)
    return sorted(removed, key=lambda name: _step_of_name(name) or 0)


def latest_checkpoint_path(run_dir: str | Path) -> Path | None:
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise RuntimeError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


# ---- damage ------------------------------------------------------------------------------------------------
def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint folder ``path`` cannot be resumed from: the file and what is wrong with it (None: intact)."""
    return folder_problem(path, LAYOUT)


@dataclass(frozen=True)
class Skipped:
    """A checkpoint passed over on resume, and why."""

    path: Path
    problem: str


class DamagedCheckpoints(RuntimeError):
    """Checkpoints exist but none of them can be resumed from."""

    def __init__(self, root: Path, skipped: list[Skipped]):
        self.root = root
        self.skipped = skipped
        listed = "; ".join(f"{s.path.name}: {s.problem}" for s in skipped)
        super().__init__(f"no checkpoint in {root} can be resumed from ({listed})")


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every ``step_<N>`` folder under the run's checkpoints, newest first, intact or not."""
    return [path for _, path in _step_folders(run_dir)]


def _step_folders(run_dir: str | Path) -> list[tuple[int, Path]]:
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None), reverse=True)


def resume_candidates(run_dir: str | Path) -> list[Path]:
    """The checkpoints to resume from, in the order to try them: the one ``latest`` names, then the older ones,
    newest first. Without a readable pointer every ``step_<N>`` folder, newest first (a crash between a first
    checkpoint's folder and its pointer leaves such a folder complete)."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else ""
    named_step = _step_of_name(named)
    folders = _step_folders(run_dir)
    if named_step is None:
        return [path for _, path in folders]
    return [root / named] + [path for step, path in folders if step < named_step]


def newest_intact_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[Skipped]]:
    """The checkpoint a resume uses (None: there is none to use) and the damaged ones passed over before it."""
    skipped: list[Skipped] = []
    for path in resume_candidates(run_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append(Skipped(path, problem))
    return None, skipped


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    read = read_weight_folder(Path(path), LAYOUT, map_location)
    return Checkpoint(path=read.path, step=int(read.record["step"]), policy_version=int(read.record["policy_version"]),
                      weights=read.weights, optimizer=read.optimizer, state=read.record)


def load_latest(run_dir: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint | None:
    """The newest intact checkpoint, loaded (None when the run has none). A damaged one is skipped with a warning
    naming it and the one used instead; ``DamagedCheckpoints`` when checkpoints exist but none is intact."""
    skipped: list[Skipped] = []
    for path in resume_candidates(run_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            try:
                found = load_checkpoint(path, map_location)
            except READ_ERRORS as exc:  # damage the readers' quick look could not see
                problem = f"its files do not load ({type(exc).__name__}: {exc})"
            else:
                _report_fallback(skipped, found.path)
                return found
        log.warning("checkpoint %s is damaged and is skipped: %s", path, problem)
        skipped.append(Skipped(path, problem))
    if skipped:
        raise DamagedCheckpoints(checkpoints_dir(run_dir), skipped)
    return None


def _report_fallback(skipped: list[Skipped], used: Path) -> None:
    if skipped:
        log.warning("resuming from checkpoint %s, the newest intact one (skipped: %s)", used.name,
                    ", ".join(s.path.name for s in skipped))
