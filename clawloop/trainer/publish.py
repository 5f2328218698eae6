"""Handing the trained weights to the serving engine.

What the engine receives:

* full fine-tuning — the training model's own tensors (the engine copies them; training is paused while it
  does, so nothing changes under it);
* LoRA — for every adapted linear layer ``W + scaling · B @ A`` computed into a new tensor (peft's own delta),
  every other tensor as it is. The training model is never merged in place, so the adapter and the optimizer
  state stay exactly what they were;
* LoRA to an engine that hot-loads adapters (vLLM's ``LoRAPublisher``) — the PEFT model itself, so only the
  adapter is written and loaded.

``publish_weights`` returns the engine's new ``policy_version``. An engine that accepts an explicit version
(``version=`` keyword) is given one when resuming, so versions continue from the checkpoint.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from clawloop.trainer.model import TrainModels


@torch.no_grad()
def merged_state_dict(models: TrainModels) -> dict[str, torch.Tensor]:
    """The weights to serve, keyed as the base architecture's ``state_dict``."""
    model = models.causal_lm
    if not models.lora:
        return {k: v.detach() for k, v in model.state_dict().items()}
    from peft.tuners.lora import LoraLayer

    adapter = getattr(models.policy, "active_adapter", "default")
    if isinstance(adapter, (list, tuple)):
        adapter = adapter[0]
    deltas: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            base = module.get_base_layer()
            deltas[f"{name}.weight"] = base.weight.detach() + module.get_delta_weight(adapter).to(base.weight.dtype)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = deltas.get(plain, value.detach())
    return out


def _accepts_version(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "version" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def takes_adapters(engine: Any) -> bool:
    """Whether the engine publishes LoRA adapters as such (vLLM hot-loading) rather than merged weights: its
    ``takes_adapters`` capability (an engine that does not declare it takes merged weights)."""
    return bool(getattr(engine, "takes_adapters", False))


def publish_weights(engine: Any, models: TrainModels, version: int | None = None) -> int:
    """Publish from a worker thread (blocking). Returns the engine's policy version afterwards.

    A LoRA run publishing to an engine that hot-loads adapters (vLLM with ``LoRAPublisher``) sends the PEFT
    model itself (only the adapter is written); everything else gets the merged base-architecture state dict."""
    weights: Any = models.policy if models.lora and takes_adapters(engine) else merged_state_dict(models)
    publish = getattr(engine, "publish_sync", None)
    if publish is None:
        raise TypeError(f"{type(engine).__name__} has no publish_sync(weights) method")
    if version is not None and _accepts_version(publish):
        return int(publish(weights, version=version))
    return int(publish(weights))


class LocalVersion:
    """A stand-in engine for offline training: nothing serves, but versions still count publications."""

    takes_adapters = False

    def __init__(self, version: int = 0):
        self._version = int(version)

    @property
    def policy_version(self) -> int:
        return self._version

    def publish_sync(self, weights: Any, version: int | None = None) -> int:
        self._version = int(version) if version is not None else self._version + 1
        return self._version
