"""The version history: every accepted version's weights on disk, so any of them can be served again.

Layout under ``run_dir/versions``::

    v7/weights.safetensors   the trainable state: the adapter (LoRA) or all weights (full fine-tuning)
    v7/optimizer.pt          AdamW state at that version (LoRA only: full fine-tuning's is twice the model)
    v7/version.json          version, step, time, mode and the gate's evidence

Each folder is written atomically (``clawloop.atomic.write_folder_atomically``). LoRA adapters are small and all kept;
full fine-tuning keeps the newest ``keep_full`` versions (plus version 0, the starting weights, only while it is
among them). The store's ``versions`` table is the index (status accepted / rolled_back and the evidence); the
folders hold the weights. Version 0 is the starting weights.
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

from clawloop.atomic import write_folder_atomically


@dataclass
class StoredVersion:
    version: int
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    meta: dict[str, Any]


def versions_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "versions"


def version_dir(run_dir: str | Path, version: int) -> Path:
    return versions_dir(run_dir) / f"v{int(version)}"


def has_version(run_dir: str | Path, version: int) -> bool:
    return (version_dir(run_dir, version) / "version.json").is_file()


def save_version(run_dir: str | Path, version: int, step: int, weights: dict[str, torch.Tensor],
                 optimizer_state: dict[str, Any] | None, *, lora: bool, evidence: dict[str, Any] | None = None,
                 keep_full: int = 3) -> Path:
    """Write version ``version`` (see the module docstring); returns its folder."""
    meta = {"version": int(version), "step": int(step), "created_at": time.time(), "lora": bool(lora),
            "has_optimizer": optimizer_state is not None and lora, "evidence": evidence or {}}

    def write(tmp: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / "weights.safetensors"))
        if optimizer_state is not None and lora:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "version.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")

    path = write_folder_atomically(version_dir(run_dir, version), write)
    if not lora:
        _prune_full(versions_dir(run_dir), keep_full, protect=path.name)
    return path


def load_version(run_dir: str | Path, version: int, map_location: str | torch.device = "cpu") -> StoredVersion:
    path = version_dir(run_dir, version)
    if not (path / "version.json").is_file():
        kept = ", ".join(f"v{v}" for v in list_versions(run_dir)) or "none"
        raise FileNotFoundError(f"version {version} is not in {versions_dir(run_dir)} (kept: {kept})")
    meta = json.loads((path / "version.json").read_text())
    weights = load_file(str(path / "weights.safetensors"), device=str(map_location))
    opt = path / "optimizer.pt"
    optimizer = torch.load(opt, map_location=map_location, weights_only=True) if opt.exists() else None
    return StoredVersion(version=int(version), weights=weights, optimizer=optimizer, meta=meta)


def list_versions(run_dir: str | Path) -> list[int]:
    root = versions_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(v for p in root.iterdir() if (v := _version_of(p)) is not None and (p / "version.json").is_file())


def _version_of(path: Path) -> int | None:
    if not path.is_dir() or not path.name.startswith("v"):
        return None
    try:
        return int(path.name[1:])
    except ValueError:
        return None


def _prune_full(root: Path, keep: int, protect: str) -> None:
    found = sorted((v, p) for p in root.iterdir() if (v := _version_of(p)) is not None)
    for _, path in found[:-max(1, keep)]:
        if path.name != protect:
            shutil.rmtree(path, ignore_errors=True)
