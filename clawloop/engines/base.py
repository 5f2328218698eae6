"""The engine interface: token ids in, token ids (or log-probs) out.

An engine has two jobs and knows nothing about sessions, judges or losses:

* ``generate``: prompt token ids + sampling settings -> generated token ids, the log-prob of each generated
  token under the *sampling* distribution (temperature/top-p applied), the finish reason and the policy version
  that produced them. ``generate_stream`` yields the same tokens one at a time.
* ``score``: prompt ids + a fixed response -> per-position log-probs of the response tokens and the top-k
  ids/log-probs per response position, all from ``log_softmax(logits / temperature)`` over the full vocabulary.
  Optionally also the log-probs at caller-chosen ids per position (``at_ids_T_K``), which is how the teacher is
  evaluated on the student's top-k set.

Weight publication (``Publisher.publish``) swaps in new weights and bumps ``policy_version``; a request already
running finishes on the weights it started with, and no request is rejected because of a swap.

The embedded HF engine (``clawloop.engines.hf``) and HTTP-backed engines (vLLM) implement this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from clawloop.temperature import GREEDY_BELOW


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the decoded text contains one; the stop string is not returned in
    ``text``, while ``token_ids`` run up to and including the token that completed it."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the tokenizer's EOS always does); the stop token is kept in ids."""
    seed: int | None = None
    """Seeds this request's own random generator: same seed, prompt and settings -> same tokens."""
    top_logprobs: int = 0
    """How many alternatives (id, log-prob) to report per generated token; 0 = none."""
    adapter: str | None = None
    """On an engine with adapter slots: the published LoRA adapter (by name) that writes this completion, at its
    newest version when the request starts; ``Generation.policy_version`` is then that adapter's version. None:
    the served model itself."""


def check_sampling(params: SamplingParams) -> None:
    """Reject sampling settings no backend can honour (raised as EngineError, which the API turns into a 400)."""
    if params.max_tokens < 1:
        raise EngineError("max_tokens must be >= 1")
    if params.temperature < 0:
        raise EngineError("temperature must be >= 0")
    if 0 < params.temperature < GREEDY_BELOW:
        raise EngineError(f"temperature must be 0 (greedy) or >= {GREEDY_BELOW:g}; "
                          "pass it through clawloop.temperature.effective_temperature")
    if not 0 < params.top_p <= 1:
        raise EngineError("top_p must be in (0, 1]")
    if params.top_logprobs < 0:
        raise EngineError("top_logprobs must be >= 0")


@dataclass
class Generation:
    """One finished completion, exactly as sampled."""

    token_ids: list[int]
    """The generated ids, in order, including a final EOS/stop token when one ended generation (after a stop
    string: through the token that completed it, so decoding them can show more than ``text``)."""
    logprobs: list[float]
    """log pi(token | prefix) under the sampling distribution (after temperature and top-p), one per token;
    at temperature 0 (greedy) the plain log-softmax."""
    finish_reason: str
    """"stop" (EOS, stop token or stop string) or "length"."""
    policy_version: int
    prompt_tokens: int
    text: str = ""
    """The decoded completion with the stop string / EOS removed (what the client sees)."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """Per generated token the ``top_logprobs`` best (id, log-prob) under the sampling distribution (tokens the
    distribution cannot produce, e.g. outside the top-p nucleus, are left out, so a list can be shorter)."""


@dataclass
class TokenEvent:
    """One streamed token."""

    token_id: int
    logprob: float
    text_delta: str
    """New text made visible by this token (may be empty while a multi-byte char or a stop string is pending).
    The deltas of a stream concatenate exactly to the final ``Generation.text``."""
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class ScoreResult:
    """Log-probs of a fixed response under a prompt, temperature-scaled."""

    logprobs_T: torch.Tensor
    """[T] float32: log pi(response[t] | prompt, response[:t])."""
    topk_ids_T_K: torch.Tensor
    """[T, K] int64: the K most likely ids at each response position."""
    topk_logprobs_T_K: torch.Tensor
    """[T, K] float32: their log-probs."""
    at_ids_logprobs_T_K: torch.Tensor | None = None
    """[T, K'] float32: log-probs at the caller's ``at_ids_T_K`` (None when not asked)."""
    policy_version: int = 0


@dataclass
class ScoreRequest:
    prompt_ids: list[int]
    """Non-empty: position P-1+t (P = len(prompt_ids)) predicts response_ids[t]."""
    response_ids: list[int]
    top_k: int = 4
    temperature: float = 1.0
    """Log-probs are ``log_softmax(logits / temperature)``; a temperature <= 0 scores at 1."""
    at_ids_T_K: torch.Tensor | None = None
    """[T, K'] int64 ids whose log-probs to gather at each response position (None: not asked)."""
    extra: dict[str, Any] = field(default_factory=dict)


class EngineError(RuntimeError):
    """The engine could not do what was asked (bad input, backend down, timeout)."""


class PromptTooLongError(EngineError):
    """The prompt (plus requested tokens) does not fit the model's context."""


@runtime_checkable
class Engine(Protocol):
    """What every backend provides. All methods are safe to call concurrently from one event loop."""

    @property
    def policy_version(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | Generation]:
        """Yield a ``TokenEvent`` per token as it is sampled, then exactly one final ``Generation`` (the same
        object ``generate`` would have returned)."""
        ...

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]: ...

    async def close(self) -> None: ...


@runtime_checkable
class Publisher(Protocol):
    """An engine that accepts new policy weights from the trainer (the embedded engine; a vLLM client with
    weight updates). Judge endpoints are frozen and need not implement it. Its ``takes_adapters`` attribute says
    whether a LoRA run hands it the adapter itself (vLLM hot-loading) or merged weights
    (``clawloop.trainer.publish.publish_weights`` reads it)."""

    takes_adapters: bool

    async def publish(self, weights: Any, timeout_s: float | None = None) -> int:
        """Swap in ``weights`` (a full state dict of the served architecture, LoRA already merged, or a callable
        that edits the model in place); return the new ``policy_version`` once new requests use them."""
        ...
