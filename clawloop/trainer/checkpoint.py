"""Checkpoints: everything needed to continue a run after it stops or crashes.

Layout under ``run_dir/checkpoints``::

    step_12/weights.safetensors   all weights (full fine-tuning) or the adapter only (LoRA)
    step_12/optimizer.pt          AdamW state
    step_12/state.json            step, policy version, optimizer updates, mode, when
    latest                        text file naming the newest complete checkpoint ("step_12")

Atomicity: a checkpoint is written into a hidden temporary folder, flushed to disk, then renamed into place;
``latest`` is replaced by rename only after that. A crash at any moment leaves ``latest`` naming a complete
checkpoint (or no ``latest`` at all), never a half-written one.

The store is the other half of the state: resuming calls ``store.requeue_after_step(step)`` so samples consumed
by steps after the checkpoint (whose weights died with the process) become ready again and train exactly once.
Only the newest ``keep_last`` checkpoints are kept: each one holds a full optimizer state.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from clawloop.atomic import write_folder_atomically, write_text_atomically

LATEST = "latest"


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

    def write(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "weights.safetensors"))
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        state = {"step": int(step), "policy_version": int(policy_version), "created_at": time.time(),
                 **(extra or {})}
        (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")

    final = write_folder_atomically(root / name, write)
    # A failed write (disk full) leaves no stray file; ``latest`` still names the previous checkpoint.
    write_text_atomically(root / LATEST, name + "\n")
    _prune(root, keep_last, protect=name)
    return final


def _step_of(path: Path) -> int | None:
    if not path.is_dir() or not path.name.startswith("step_"):
        return None
    try:
        return int(path.name[len("step_"):])
    except ValueError:
        return None


def _prune(root: Path, keep_last: int, protect: str) -> None:
    if keep_last < 1:
        return
    found = sorted((s, p) for p in root.iterdir() if (s := _step_of(p)) is not None)
    for _, path in found[:-keep_last]:
        if path.name != protect:
            shutil.rmtree(path, ignore_errors=True)
    # Leftovers of a crash in the middle of a write.
    for path in root.iterdir():
        if path.name.startswith((".tmp-", ".old-", f".{LATEST}-")):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:  # an unfinished ``latest`` pointer
                path.unlink(missing_ok=True)


def latest_checkpoint_path(run_dir: str | Path) -> Path | None:
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "state.json").is_file():
        raise RuntimeError(f"{pointer} names {path.name}, which is not a complete checkpoint")
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint:
    path = Path(path)
    state = json.loads((path / "state.json").read_text())
    weights = load_file(str(path / "weights.safetensors"), device=str(map_location))
    opt_path = path / "optimizer.pt"
    optimizer = torch.load(opt_path, map_location=map_location, weights_only=True) if opt_path.exists() else None
    return Checkpoint(path=path, step=int(state["step"]), policy_version=int(state["policy_version"]),
                      weights=weights, optimizer=optimizer, state=state)


def load_latest(run_dir: str | Path, map_location: str | torch.device = "cpu") -> Checkpoint | None:
    path = latest_checkpoint_path(run_dir)
    return None if path is None else load_checkpoint(path, map_location)
