"""The output layer as a model's own forward applies it, for code that runs the decoder alone.

The trainer's runner, the gate's scoring and the engine's scoring run ``model.get_decoder()`` and apply the output
embedding themselves, to keep only the positions they need (or to cut the graph before the head). A model's
forward may do more after its output embedding: Gemma 2 and its kind soft-cap the logits,
``cap · tanh(logits / cap)`` (``config.final_logit_softcapping``). Skipping that would score the student, the
teacher and a gate candidate under another distribution than the one the served model samples from.
"""

from __future__ import annotations

import torch


def logit_softcap(model: torch.nn.Module) -> float | None:
    """The model's final logit soft-cap (``config.final_logit_softcapping``), or None where it has none."""
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return float(cap) if cap else None


def soft_capped(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``logits`` as the model's forward returns them: ``cap · tanh(logits / cap)``, unchanged for ``cap`` None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap
