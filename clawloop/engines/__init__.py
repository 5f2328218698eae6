"""Engines: token ids in, token ids / log-probs out (see ``clawloop.engines.base``).

``HFEngine`` (embedded, HF transformers) and ``VLLMEngine`` (a vLLM OpenAI-compatible server) are imported
lazily so that importing the interface stays cheap.
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
    "VLLMEngine",
]


def __getattr__(name: str):
    if name == "HFEngine":
        from clawloop.engines.hf import HFEngine

        return HFEngine
    if name == "VLLMEngine":
        from clawloop.engines.vllm import VLLMEngine

        return VLLMEngine
    raise AttributeError(f"module 'clawloop.engines' has no attribute {name!r}")
