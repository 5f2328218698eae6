"""The version history: accepted versions' weights on disk, so they can be served again.

Layout under ``run_dir/versions``::

    v7/weights.safetensors   the trainable state: the adapter (LoRA) or all weights (full fine-tuning)
    v7/optimizer.pt          AdamW state at that version (LoRA, and only while the version is one of the two
                             a rollback most likely returns to: see retention)
    v7/version.json          version, step, time, mode and the gate's evidence

Each folder is written atomically, and checked for damage, by ``clawloop.weight_folder``. The store's
``versions`` table is the index (status accepted / rolled_back / uncommitted / archived / retired, and the
evidence); the folders hold the weights. Version 0 is the starting weights.

Retention, applied each time a version is saved (``prune_versions``): the newest ``keep`` versions are kept
(``keep_lora_versions`` or ``keep_full_versions``), and so are, whatever their age, the version being served
while the new one is saved (after the new one is published it is the version a rollback returns to) and, with
LoRA, version 0 (the starting weights: an adapter of a few megabytes). The optimizer state (twice the adapter)
stays only with the new version and the served one: a rollback to either continues with its exact optimizer
state, a rollback to an older one with a fresh optimizer, as for full fine-tuning, whose versions never hold
one (it is twice the model). Checkpoints hold the optimizer state a resume needs.

A damaged folder (a file cut short by a full disk or an unfinished copy) is reported by ``load_version`` as
``DamagedVersion``, naming the version and the file, before anything is loaded.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawloop.atomic import write_text_atomically
from clawloop.config import Config
from clawloop.weight_folder import READ_ERRORS, FolderLayout, folder_problem, read_weight_folder, save_in_layout

WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"
META = "version.json"
LAYOUT = FolderLayout(tensors=WEIGHTS, record=META, required=("version",), optimizer=OPTIMIZER)
"""A version folder's files (written and checked by ``clawloop.weight_folder``)."""


@dataclass
class StoredVersion:
    version: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    meta: dict[str, Any]


class DamagedVersion(RuntimeError):
    """A kept version whose files cannot be read; nothing was loaded."""

    def __init__(self, version: int, problem: str):
        self.version = int(version)
        self.problem = problem
        super().__init__(f"version {version} is damaged: {problem}")


def versions_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "versions"


def version_dir(run_dir: str | Path, version: int) -> Path:
    return versions_dir(run_dir) / f"v{int(version)}"


def has_version(run_dir: str | Path, version: int) -> bool:
    return (version_dir(run_dir, version) / META).is_file()


def versions_to_keep(config: Config, lora: bool) -> int:
    """How many of the newest versions retention keeps for this kind of run."""
    return int(config.keep_lora_versions if lora else config.keep_full_versions)


def save_version(run_dir: str | Path, version: int, step: int, weights: dict[str, torch.Tensor],
                 optimizer_state: dict[str, Any] | None, *, lora: bool, evidence: dict[str, Any] | None = None,
                 keep: int = 3, serving: int | None = None) -> Path:
    """Write version ``version`` and apply retention (see the module docstring); returns its folder. ``serving``:
    the version served while this one is saved (kept, with its optimizer state)."""
    meta = {"version": int(version), "step": int(step), "created_at": time.time(), "lora": bool(lora),
            "has_optimizer": optimizer_state is not None and lora, "evidence": evidence or {}}

    path = save_in_layout(version_dir(run_dir, version), LAYOUT, weights, optimizer_state if lora else None, meta,
                          record_indent=1)
    prune_versions(run_dir, keep, newest=int(version), serving=serving, lora=lora)
    return path


def prune_versions(run_dir: str | Path, keep: int, *, newest: int, serving: int | None, lora: bool) -> None:
    """Retention (see the module docstring) after version ``newest`` was saved while ``serving`` was served."""
    found = sorted((v, p) for p in versions_dir(run_dir).iterdir() if (v := _version_of(p)) is not None)
    with_optimizer = {newest} | ({serving} if serving is not None else set())
    kept = {v for v, _ in found[-max(1, keep):]} | with_optimizer | ({0} if lora else set())
    for version, path in found:
        if version not in kept:
            shutil.rmtree(path, ignore_errors=True)
        elif version not in with_optimizer:
            drop_optimizer(path)


def remove_version(run_dir: str | Path, version: int) -> bool:
    """Delete version ``version``'s folder (its weights go for good). True when there was one."""
    path = version_dir(run_dir, version)
    found = path.exists()
    shutil.rmtree(path, ignore_errors=True)
    return found


def drop_optimizer(path: Path) -> None:
    """Remove a version's optimizer state and say so in its ``version.json`` (the weights stay)."""
    optimizer = path / OPTIMIZER
    if not optimizer.exists():
        return
    meta_path = path / META
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):  # a damaged record stays as it is; load_version reports it
        meta = None
    if isinstance(meta, dict):
        meta["has_optimizer"] = False
        write_text_atomically(meta_path, json.dumps(meta, indent=1, default=str) + "\n")
    optimizer.unlink(missing_ok=True)


def version_problem(run_dir: str | Path, version: int) -> str | None:
    """Why kept version ``version`` cannot be loaded: the file and what is wrong (None: intact or not kept)."""
    path = version_dir(run_dir, version)
    if not path.is_dir():
        return None
    return folder_problem(path, LAYOUT)


def load_version(run_dir: str | Path, version: int, map_location: str | torch.device = "cpu") -> StoredVersion:
    """Version ``version``'s weights, optimizer state (when kept) and record. ``FileNotFoundError`` when it is not
    kept, ``DamagedVersion`` when its files do not read (then nothing is loaded)."""
    path = version_dir(run_dir, version)
    if not (path / META).is_file():
        kept = ", ".join(f"v{v}" for v in list_versions(run_dir)) or "none"
        raise FileNotFoundError(f"version {version} is not in {versions_dir(run_dir)} (kept: {kept})")
    problem = version_problem(run_dir, version)
    if problem is not None:
        raise DamagedVersion(version, problem)
    try:
        read = read_weight_folder(path, LAYOUT, map_location)
    except READ_ERRORS as exc:  # damage the readers' quick look could not see
        raise DamagedVersion(version, f"its files do not load ({type(exc).__name__}: {exc})") from exc
    return StoredVersion(version=int(version), weights=read.weights, optimizer=read.optimizer, meta=read.record)


def list_versions(run_dir: str | Path) -> list[int]:
    root = versions_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(v for p in root.iterdir() if (v := _version_of(p)) is not None and (p / META).is_file())


def _version_of(path: Path) -> int | None:
    if not path.is_dir() or not path.name.startswith("v"):
        return None
    try:
        return int(path.name[1:])
    except ValueError:
        return None
