"""The judge a configuration selects, built one way for serving, ``clawloop judge check`` and benchmarks.

``build_judge`` returns what ``judge_backend`` names: the keyword rules (no model), an OpenAI-compatible endpoint
(``judge_url``), or the frozen base model in-process. ``load_base_engine`` loads that frozen model; the embedded
judge and the ``teacher = "base"`` teacher share one, so the caller loads it once and passes it in.

``configured_turn_deadline_s`` is how long judging one turn may take. It lives here, with the judge, because a
judge check must give each case exactly the time the pipeline gives a turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from clawloop.config import Config
from clawloop.judge.client import EngineJudgeClient, HTTPJudgeClient, JudgeClient
from clawloop.judge.describe import judge_backend
from clawloop.judge.rules import RuleJudge
from clawloop.judge.votes import Judge, JudgeSettings
from clawloop.retry import Backoff


def default_turn_deadline_s(config: Config, backoff_s: float = 0.5) -> float:
    """Long enough for a vote to use all its retries, plus the teacher; never infinite."""
    retries = int(config.judge_retries)
    backoff = Backoff(retries, backoff_s, jitter=True)  # as the HTTP judge client retries
    return float(config.judge_timeout_s) * (retries + 1) + backoff.max_wait_s() + 60.0


def configured_turn_deadline_s(config: Config) -> float:
    """``judge_turn_deadline_s`` when set, else ``default_turn_deadline_s``."""
    configured = float(config.judge_turn_deadline_s or 0.0)
    return configured if configured > 0 else default_turn_deadline_s(config)


def load_base_engine(config: Config) -> Any:
    """A frozen engine for the base model: the embedded judge and the ``teacher = "base"`` teacher share it.
    Imported lazily: loading torch models is slow and the rule judge needs none."""
    from clawloop.engines.hf import HFEngine

    return HFEngine(config.model, device=config.device, dtype=config.dtype, max_batch_size=config.max_batch_size,
                    num_threads=config.num_threads, model_name=f"{config.served_model_name}-base",
                    worker_nice=config.train_nice)  # it works for the learning loop only, never for a user


def build_judge(config: Config, *, base_engine: Any = None, render: Callable[..., list[int]] | None = None,
                backoff_s: float = 0.5) -> Judge:
    """The judge ``judge_backend`` asks for: keyword rules, an HTTP endpoint, or the frozen base engine (which
    needs ``base_engine`` and the chat renderer ``render``)."""
    settings = JudgeSettings.from_config(config)
    backend = judge_backend(config)
    if backend == "rules":
        return RuleJudge(settings)  # type: ignore[return-value] - same interface as Judge
    client: JudgeClient
    if backend == "http":
        client = HTTPJudgeClient(config.judge_url, config.judge_model, config.judge_api_key,
                                 timeout_s=config.judge_timeout_s, retries=config.judge_retries,
                                 backoff_s=backoff_s, concurrency=config.judge_concurrency,
                                 extra_body=config.judge_extra_body, structured=config.judge_structured_output)
    else:
        if base_engine is None or render is None:
            raise ValueError("the embedded judge needs the frozen base engine and the chat renderer")
        client = EngineJudgeClient(base_engine, lambda messages: render(messages, None),
                                   timeout_s=config.judge_timeout_s,
                                   concurrency=max(config.judge_concurrency, 2 * config.prm_m))
    return Judge(client, settings)
