"""Handing the trained weights to the serving engine.

What the engine receives:

* full fine-tuning — the training model's own tensors (the engine copies them; training is paused while it
  does, so nothing changes under it);
* LoRA — for every adapted linear layer ``W + scaling · B @ A`` computed into a new tensor (peft's own delta),
  every other tensor as it is. The training model is never merged in place, so the adapter and the optimizer
  state stay exactly what they were;
* LoRA to an engine that hot-loads adapters (vLLM's ``LoRAPublisher``) — the PEFT model itself, so only the
  adapter is written and loaded.

A LoRA adapter folder written by another process (the ``torchrun`` trainer) is merged for engines that take
full weights by ``merge_adapter_folder``: the base weights are read from the model folder's safetensors files
and ``W + scaling · B @ A`` is computed for each adapted layer, the same delta peft computes, without building
the base model or a peft model (which took seconds per publication and a second model's memory). Adapter
features that change that formula (DoRA, per-module rank or alpha patterns, ``fan_in_fan_out``, extra trained
modules) fall back to peft's own merge.

``publish_weights`` returns the engine's new ``policy_version``. An engine that accepts an explicit version
(``version=`` keyword) is given one when resuming, so versions continue from the checkpoint.

The weight sinks of the trainer loop (``trainer.contracts.WeightSink``) are here: ``EngineSink`` (an engine in
this process; with ``LocalVersion`` nowhere) and ``FolderSink``: a trainer in another process (``torchrun``)
publishes by folder:
``RUN_DIR/weights/v<N>`` holds the full weights or the PEFT adapter, written to a temporary name and renamed
so the API never reads half of one, then reported to the API's ``/v1/trainer/weights`` route, which loads it
(``merge_adapter_folder`` for an adapter and an engine that takes full weights).
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch

from clawloop.engines.multi_lora import PEFT_PREFIX, plain_lora_scaling
from clawloop.trainer.contracts import PublishingEngine
from clawloop.trainer.model import TrainModels, merged_lora_weights
from clawloop.weight_folder import unshared_tensors, write_weight_folder

log = logging.getLogger(__name__)

KEEP_WEIGHTS_FOLDERS = 2


@torch.no_grad()
def merged_state_dict(models: TrainModels) -> dict[str, torch.Tensor]:
    """The weights to serve, keyed as the base architecture's ``state_dict``."""
    model = models.causal_lm
    if not models.lora:
        return {k: v.detach() for k, v in model.state_dict().items()}
    deltas = {f"{name}.weight": merged for name, _, merged in merged_lora_weights(models)}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = deltas.get(plain, value.detach())
    return out


def _direct_merge_scaling(adapter_config: dict[str, Any], adapter_keys: list[str]) -> float | None:
    """``plain_lora_scaling`` when the file holds nothing but LoRA pairs, else None."""
    if any(not (k.startswith(PEFT_PREFIX) and k.endswith((".lora_A.weight", ".lora_B.weight"))) for k in adapter_keys):
        return None
    return plain_lora_scaling(adapter_config)


@torch.no_grad()
def merge_adapter_folder(adapter_dir: str | Path, base_model_dir: str | Path) -> dict[str, torch.Tensor]:
    """A PEFT LoRA adapter folder merged into the base model's weights: a float32 state dict keyed as the base
    architecture's (see the module docstring)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    adapter_dir, base_model_dir = Path(adapter_dir), Path(base_model_dir)
    adapter_config = json.loads((adapter_dir / "adapter_config.json").read_text())
    adapter = load_file(str(adapter_dir / "adapter_model.safetensors"))
    scaling = _direct_merge_scaling(adapter_config, list(adapter))
    base_files = _weight_files(base_model_dir)
    if scaling is None or not base_files:
        return merge_adapter_with_peft(adapter_dir, base_model_dir)
    merged: dict[str, torch.Tensor] = {}
    for file in base_files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                merged[key] = tensor.to(torch.float32) if tensor.is_floating_point() else tensor
    for key, a_R_In in adapter.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
        b_Out_R = adapter[f"{PEFT_PREFIX}{module}.lora_B.weight"]
        weight = f"{module}.weight"
        if weight not in merged:
            raise KeyError(f"the adapter in {adapter_dir} adapts {module!r}, which {base_model_dir} does not have")
        merged[weight] = merged[weight] + (b_Out_R.to(torch.float32) @ a_R_In.to(torch.float32)) * scaling
    tied = json.loads((base_model_dir / "config.json").read_text()).get("tie_word_embeddings", False)
    if tied and "lm_head.weight" not in merged and "model.embed_tokens.weight" in merged:
        merged["lm_head.weight"] = merged["model.embed_tokens.weight"]  # stored once, as the model ties them
    return merged


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that hold the model: those its index names, else ``model.safetensors``; [] when
    neither is there (the folder is then left to peft and transformers to read)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def merge_adapter_with_peft(adapter_dir: Path, base_model_dir: Path) -> dict[str, torch.Tensor]:
    """peft's own merge (``merge_and_unload``) of an adapter folder into a freshly loaded base model."""
    from peft import PeftModel

    from clawloop.engines.model_files import load_model

    base = load_model(base_model_dir, dtype="float32", device="cpu")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def _accepts_version(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "version" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def takes_adapters(engine: PublishingEngine) -> bool:
    """Whether the engine publishes LoRA adapters as such (vLLM hot-loading) rather than merged weights: its
    ``takes_adapters`` capability, part of the ``PublishingEngine`` contract."""
    return bool(engine.takes_adapters)


def publish_weights(engine: PublishingEngine, models: TrainModels, version: int | None = None) -> int:
    """Publish from a worker thread (blocking). Returns the engine's policy version afterwards.

    A LoRA run publishing to an engine that hot-loads adapters (vLLM with ``LoRAPublisher``) sends the PEFT
    model itself (only the adapter is written); everything else gets the merged base-architecture state dict."""
    weights: Any = models.policy if models.lora and takes_adapters(engine) else merged_state_dict(models)
    publish = engine.publish_sync
    if version is not None and _accepts_version(publish):
        return int(publish(weights, version=version))
    return int(publish(weights))


class LocalVersion:
    """A stand-in engine for offline training: nothing serves, but versions still count publications."""

    takes_adapters = False
    max_context: int | None = None

    def __init__(self, version: int = 0):
        self._version = int(version)

    @property
    def policy_version(self) -> int:
        return self._version

    def publish_sync(self, weights: Any, version: int | None = None) -> int:
        self._version = int(version) if version is not None else self._version + 1
        return self._version


class EngineSink:
    """Weights go to an engine in this process (``LocalVersion``: nowhere, only the version counts). It serves the
    live training weights, not the ``weights`` snapshot it is handed (``serves_live_weights``): the trainer takes
    no step while a publication it owes has not gone through."""

    serves_live_weights = True

    def __init__(self, engine: PublishingEngine):
        self.engine = engine

    @property
    def policy_version(self) -> int:
        return int(self.engine.policy_version)

    @property
    def max_context(self) -> int | None:
        return self.engine.max_context

    def publish(self, models: TrainModels, weights: dict[str, torch.Tensor] | None, version: int) -> int:
        return publish_weights(self.engine, models, version=version)

    def served_version(self) -> int | None:
        return None


# ---- weights folders for another process (the torchrun trainer's rank 0) ------------------------------------
def write_weights_folder(models: TrainModels, weights: dict[str, torch.Tensor], folder: Path) -> tuple[Path, str]:
    """The full weights (``model.safetensors``) or, with LoRA, a PEFT adapter folder, written atomically. Returns
    the folder and the ``kind`` the API's ``/v1/trainer/weights`` takes for it."""
    if not models.lora:
        write_weight_folder(folder, weights, tensors_file="model.safetensors")
        return folder, "full"
    adapter = getattr(models.policy, "active_adapter", "default")
    if isinstance(adapter, (list, tuple)):
        adapter = adapter[0]
    peft_config = copy.deepcopy(models.policy.peft_config[adapter])
    peft_config.inference_mode = True  # as peft's save_pretrained writes it

    # The adapter's config is its manifest: written after the tensors, as PEFT's save_pretrained names it.
    write_weight_folder(folder, weights, tensors_file="adapter_model.safetensors", metadata={"format": "pt"},
                        write=lambda tmp: peft_config.save_pretrained(str(tmp)))
    return folder, "lora"


def prune_weights_folders(root: Path, keep: int) -> None:
    """Remove all but the newest ``keep`` ``v<N>`` folders under ``root``."""
    def number(p: Path) -> int | None:
        try:
            return int(p.name[1:]) if p.is_dir() and p.name.startswith("v") else None
        except ValueError:
            return None

    found = sorted((v, p) for p in root.iterdir() if (v := number(p)) is not None)
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


class WeightReport(Protocol):
    """The API's side of folder publication (``trainer.remote.RemoteStore``)."""

    def report_weights(self, path: str, version: int | None = None, kind: str = "full") -> int: ...

    def state(self) -> dict[str, Any]: ...


class FolderSink:
    """Publishing by folder: writes each version's folder, reports it to the API when there is one (``api``),
    and keeps the newest ``KEEP_WEIGHTS_FOLDERS``. A failed report raises; the loop calls ``publish`` again with
    the same version before the next step, and the folder already written is reported, not written again."""

    max_context: int | None = None

    def __init__(self, run_dir: Path, api: WeightReport | None, version: int = 0):
        self.api = api
        self.root = run_dir / "weights"
        self._version = int(version)
        self.written: tuple[Path, str, int] | None = None
        """The folder of the newest version written, its kind and its version."""

    @property
    def policy_version(self) -> int:
        return self._version

    def served_version(self) -> int | None:
        return int(self.api.state()["policy_version"]) if self.api is not None else None

    def publish(self, models: TrainModels, weights: dict[str, torch.Tensor] | None, version: int) -> int:
        if self.written is None or self.written[2] != version:
            if weights is None:
                raise RuntimeError("folder publication needs the gathered weights")
            folder, kind = write_weights_folder(models, weights, self.root / f"v{version}")
            self.written = (folder, kind, version)
        folder, kind, _ = self.written
        served = version if self.api is None else int(self.api.report_weights(str(folder), version, kind=kind))
        self._version = served
        self._prune()
        return served

    def _prune(self) -> None:
        try:
            prune_weights_folders(self.root, KEEP_WEIGHTS_FOLDERS)
        except OSError:
            log.exception("removing old weight folders failed")
