"""Engines: token ids in, token ids / log-probs out (see ``clawloop.engines.base``).

``HFEngine`` (embedded, HF transformers) is imported lazily so that importing the interface stays cheap.
"""

from clawloop.engines.base import (
    Engine,
    EngineError,
    Generation,
    PromptTooLongError,
    Publisher,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
)

__all__ = [
    "Engine",
    "EngineError",
    "Generation",
    "HFEngine",
    "PromptTooLongError",
    "Publisher",
    "SamplingParams",
    "ScoreRequest",
    "ScoreResult",
    "TokenEvent",
]


def __getattr__(name: str):
    if name == "HFEngine":
        from clawloop.engines.hf import HFEngine

        return HFEngine
    raise AttributeError(f"module 'clawloop.engines' has no attribute {name!r}")
