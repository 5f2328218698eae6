"""The whole loop in one process: what ``clawloop serve`` runs when training is on.

``Server`` (API, policy engine, store, sessions, and the vLLM servers the config names) + the judge/teacher
``Pipeline`` (woken when a turn becomes judgeable) + the ``OnlineTrainer`` (woken when a sample is written; with
``trainer = "remote"`` trainer processes lease the samples over HTTP instead); pipeline and trainer run as server components
on the server's event loop, so they start after the sessions are restored and stop before the engine closes.
The admin version routes (``/v1/admin/rollback``, ``/v1/admin/versions``) reach the embedded trainer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from clawloop.api.admin_routes import mount_admin_routes
from clawloop.config import Config
from clawloop.pipeline import Pipeline, build_pipeline
from clawloop.serve import Server
from clawloop.trainer.loop import OnlineTrainer


@dataclass
class Runtime:
    server: Server
    pipeline: Pipeline
    trainer: OnlineTrainer | None

    def start(self) -> "Runtime":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> "Runtime":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def build_runtime(config: Config, *, resume: bool = False, log_level: str = "warning",
                  pipeline_poll_s: float = 2.0, trainer_poll_s: float = 1.0,
                  console: TextIO | None = sys.stderr, on_gate: Callable[[dict[str, Any]], None] | None = None,
                  **server_kwargs: Any) -> Runtime:
    """Assemble server + pipeline (+ trainer when ``config.train``); nothing runs until ``start()``/``run()``.
    ``on_gate`` is called with every publication-gate decision of the trainer."""
    server = Server(config, log_level=log_level, **server_kwargs)
    server.build()
    config = server.config  # with the URLs of the vLLM servers it started
    tokenizer = server.engine.tokenizer
    base_engine = None
    if server.fleet is not None and server.fleet.teacher is not None:
        base_engine = server.fleet.teacher_engine(config, tokenizer)
    pipeline = build_pipeline(config, server.store, policy_engine=server.engine, tokenizer=tokenizer,
                              base_engine=base_engine, poll_interval_s=pipeline_poll_s)
    if base_engine is not None:
        pipeline.owned_engines.append(base_engine)
    trainer = None
    if config.train and config.trainer == "embedded":
        trainer = OnlineTrainer(config, server.store, server.engine, teacher=pipeline.teacher, resume=resume,
                                poll_interval_s=trainer_poll_s, console=console, on_gate=on_gate)
        pipeline.on_sample = lambda sample: trainer.wake()
    mount_admin_routes(server.app, server.store, config, lambda: trainer)
    server.on_judgeable = lambda turn_id: pipeline.notify()
    server.components = [pipeline] + ([trainer] if trainer is not None else [])
    return Runtime(server=server, pipeline=pipeline, trainer=trainer)


def run(config: Config, *, resume: bool = False, log_level: str = "warning") -> None:
    """Blocking entry point of ``clawloop serve``: serve, judge and train until interrupted."""
    build_runtime(config, resume=resume, log_level=log_level).server.run()
