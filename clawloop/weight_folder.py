"""Weight folders: the one writer and the one reader of every folder of weights clawloop puts on disk.

Four kinds of folder hold weights, each in its own layout because each has its own reader:

* checkpoints (``RUN_DIR/checkpoints/step_<N>``): ``weights.safetensors``, ``optimizer.pt``, ``state.json``;
* versions (``RUN_DIR/versions/v<N>``): ``weights.safetensors``, ``optimizer.pt``, ``version.json``;
* folders published by another process (``RUN_DIR/weights/v<N>``): a Hugging Face ``model.safetensors`` or a PEFT
  adapter (``adapter_model.safetensors`` + ``adapter_config.json``), read by the API;
* folders a vLLM server loads (a PEFT adapter, or a Hugging Face folder with the base model's config and tokenizer
  files), read by vLLM.

The layouts stay as they are (run folders written before keep loading, and vLLM and PEFT read the last two), but
all of them are written here, by ``write_weight_folder``, the same way:

* atomically (``clawloop.atomic.write_folder_atomically``: a hidden temporary folder, every file flushed, one
  rename), so a reader sees the whole folder or none of it;
* the tensors prepared once the same way: detached, on the CPU, contiguous, and a tensor sharing storage with
  one written before it (tied embeddings, views) cloned, since safetensors refuses to write shared storage;
* the manifest last: the folder's JSON record (``state.json``, ``version.json``, a PEFT ``adapter_config.json``)
  is written after the tensors and the optimizer state, so a folder whose record reads holds every file the
  record describes.

A ``FolderLayout`` names a layout's files; ``folder_problem`` says why a folder of that layout cannot be loaded
(a file missing, cut short or corrupt, a record without its fields), opening each file with its own reader
without reading the tensors, and ``read_weight_folder`` loads one.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from clawloop.atomic import write_folder_atomically

log = logging.getLogger(__name__)

READ_ERRORS = (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError)
"""What reading a damaged weights or optimizer file raises (each reader has its own)."""


@dataclass(frozen=True)
class FolderLayout:
    """The files of one kind of weight folder."""

    tensors: str
    """The safetensors file of the weights."""
    record: str
    """The JSON record (the manifest), written last."""
    required: tuple[str, ...] = ()
    """Integer fields the record must hold for the folder to be loadable."""
    optimizer: str | None = None
    """The optimizer state (``torch.save``), optional in every folder; None: the layout never has one."""


@dataclass
class WeightFolder:
    """A loaded weight folder."""

    path: Path
    record: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


# ---- writing -----------------------------------------------------------------------------------------------
def unshared_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors ready for safetensors: detached, on the CPU, contiguous; one that shares storage with a tensor
    before it (tied weights) is cloned, as safetensors refuses to write shared storage twice."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        v = v.detach().to("cpu").contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def write_weight_folder(final: Path, tensors: Mapping[str, torch.Tensor] | None = None, *,
                        tensors_file: str = "", metadata: dict[str, str] | None = None,
                        optimizer_state: dict[str, Any] | None = None, optimizer_file: str = "",
                        record: Mapping[str, Any] | None = None, record_file: str = "",
                        record_indent: int = 2, copies: Iterable[Path] = (),
                        write: Callable[[Path], None] | None = None, mode: int | None = None) -> Path:
    """Write folder ``final`` atomically (see the module docstring) and return it.

    ``tensors`` go to ``tensors_file`` (with safetensors ``metadata``), ``optimizer_state`` to ``optimizer_file``,
    each file of ``copies`` is copied in under its own name, ``write(tmp)`` adds files written by another library
    (a PEFT config or model), and ``record`` goes, last, to ``record_file`` as JSON. ``mode``: the finished
    folder's permission bits, for a folder another process (a model server) reads."""

    def fill(tmp: Path) -> None:
        if tensors is not None:
            save_file(unshared_tensors(tensors), str(tmp / tensors_file), metadata=metadata)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / optimizer_file)
        for source in copies:
            shutil.copy2(source, tmp / source.name)
        if write is not None:
            write(tmp)
        if record is not None:
            (tmp / record_file).write_text(json.dumps(dict(record), indent=record_indent, default=str) + "\n")

    return write_folder_atomically(final, fill, mode=mode)


def save_in_layout(final: Path, layout: FolderLayout, weights: Mapping[str, torch.Tensor],
                   optimizer_state: dict[str, Any] | None, record: Mapping[str, Any], *,
                   record_indent: int = 2) -> Path:
    """Write a folder of ``layout`` (the optimizer state only when given and the layout has a place for it)."""
    if optimizer_state is not None and layout.optimizer is None:
        raise ValueError(f"a folder with {layout.record} holds no optimizer state")
    return write_weight_folder(final, weights, tensors_file=layout.tensors, optimizer_state=optimizer_state,
                               optimizer_file=layout.optimizer or "", record=record, record_file=layout.record,
                               record_indent=record_indent)


def copy_weight_folder(source: Path, final: Path, *, mode: int | None = None) -> Path:
    """Copy a whole folder (e.g. an adapter another process wrote) to ``final`` atomically."""
    return write_folder_atomically(final, lambda tmp: shutil.copytree(source, tmp, dirs_exist_ok=True), mode=mode)


# ---- damage ------------------------------------------------------------------------------------------------
def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (None when it is). Only the header is read: the file is
    mapped, and the header must account for every byte of it, so a file cut short is found at once."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        with safe_open(str(path), framework="pt") as opened:
            opened.keys()
    except READ_ERRORS as exc:
        return _unreadable(path, exc)
    return None


def torch_file_problem(path: Path, *, optional: bool = False) -> str | None:
    """Why ``path`` is not a whole ``torch.save`` file (None when it is, or when it is ``optional`` and absent).
    Loaded memory-mapped: the archive's directory and the pickle are read, the tensors' bytes are not."""
    if not path.is_file():
        return None if optional else f"{path.name} is missing"
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except READ_ERRORS as exc:
        return _unreadable(path, exc)
    return None


def json_problem(path: Path, required: tuple[str, ...]) -> str | None:
    """Why ``path`` is not a JSON object holding the integer fields ``required`` (None when it is)."""
    if not path.is_file():
        return f"{path.name} is missing"
    try:
        values = json.loads(path.read_text())
        for key in required:
            int(values[key])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.debug("%s does not read: %s: %s", path, type(exc).__name__, exc)
        return f"{path.name} is not a readable record (damaged JSON or missing fields)"
    return None


def _unreadable(path: Path, exc: BaseException) -> str:
    """The problem as said to a person; the reader's own words go to the debug log."""
    log.debug("%s does not read: %s: %s", path, type(exc).__name__, exc)
    return f"{path.name} is cut short or corrupt"


def folder_problem(path: Path, layout: FolderLayout) -> str | None:
    """Why folder ``path`` of ``layout`` cannot be loaded: the file and what is wrong with it (None: intact).
    The record first, then the weights, then the optimizer state when there is one."""
    if not path.is_dir():
        return "the folder is missing"
    return (json_problem(path / layout.record, layout.required)
            or safetensors_problem(path / layout.tensors)
            or (None if layout.optimizer is None else torch_file_problem(path / layout.optimizer, optional=True)))


# ---- reading -----------------------------------------------------------------------------------------------
def read_weight_folder(path: Path, layout: FolderLayout, map_location: str | torch.device = "cpu") -> WeightFolder:
    """Load a folder of ``layout``: its record, weights and optimizer state (None when it holds none). Raises what
    the readers raise (``READ_ERRORS``) on a damaged file; check ``folder_problem`` first to name it."""
    record = json.loads((path / layout.record).read_text())
    weights = load_file(str(path / layout.tensors), device=str(map_location))
    opt = None if layout.optimizer is None else path / layout.optimizer
    optimizer = torch.load(opt, map_location=map_location, weights_only=True) if opt and opt.exists() else None
    return WeightFolder(path=path, record=record, weights=weights, optimizer=optimizer)
