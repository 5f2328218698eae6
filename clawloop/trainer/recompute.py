"""Activation checkpointing of the decoder layers: keep each layer's input, recompute the rest in the backward.

Without it, a training forward keeps every intermediate of every decoder layer for the backward — on
SmolLM2-135M about 1.6 MB per token, so 13 GB for an 8k-token sample. With it, only each layer's input hidden
state stays (hidden size × 4 bytes per token and layer, ~70 KB per token on SmolLM2-135M) and one layer's
intermediates exist at a time while its backward runs, at the cost of running each layer's forward twice.
See docs/training-memory.md for the measurements.

Choices:

* Our own wrapper rather than transformers' ``gradient_checkpointing_enable``: that one only acts in training
  mode, and the trainer keeps the model in eval mode (no dropout, so ρ = 1 at the first PPO epoch). The
  wrapper is a temporary per-instance ``forward`` on each decoder layer, removed on exit: parameter names,
  state dicts and the module tree never change, so checkpoints, publication and LoRA are unaffected.
* ``torch.utils.checkpoint`` with ``use_reentrant=False``: it works with keyword arguments, needs no input that
  requires grad (LoRA freezes the embeddings), and the recomputed forward runs the very same kernels on the
  same inputs, so losses and gradients are unchanged.
* ``auto`` turns it on only for micro-batches with more than ``AUTO_MIN_TOKENS`` padded tokens: on short
  prompts the activations are small and the recompute would only cost time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import checkpoint

AUTO_MIN_TOKENS = 2048
"""``gradient_checkpointing = auto`` recomputes activations for micro-batches with more padded tokens than this
(about 3 GB of activations kept on SmolLM2-135M without it)."""

MODES = ("auto", "on", "off")


def wants_checkpointing(mode: str, padded_tokens: int) -> bool:
    """Whether a micro-batch of ``padded_tokens`` (samples × longest sample) should recompute activations."""
    if mode not in MODES:
        raise ValueError(f"gradient_checkpointing={mode!r} is not one of: {', '.join(MODES)}")
    if mode == "auto":
        return padded_tokens > AUTO_MIN_TOKENS
    return mode == "on"


def _checkpointed_forward(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


@contextlib.contextmanager
def checkpointed_layers(decoder: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside the block, every layer of ``decoder.layers`` keeps only its inputs for the backward.

    The backward of anything computed inside may run after the block ends: the checkpoint remembers which
    function to recompute."""
    layers = list(getattr(decoder, "layers", None) or []) if enabled else []
    if enabled and not layers:
        raise ValueError(f"{type(decoder).__name__} has no .layers to checkpoint")
    patched = []
    try:
        for layer in layers:
            if "forward" in vars(layer):
                raise RuntimeError("decoder layer already has its forward replaced (nested checkpointing?)")
            layer.forward = functools.partial(_checkpointed_forward, layer.forward)
            patched.append(layer)
        yield
    finally:
        for layer in patched:
            del layer.forward
