"""The whole loop in one process: what ``clawloop serve`` runs when training is on.

``build_runtime`` is ``serve.Server`` with ``learning`` (``clawloop.assemble.Learning``): the composition root then
adds the judge, the teacher, the ``Pipeline`` (woken when a turn becomes judgeable) and the ``OnlineTrainer``
(woken when a sample is written; with ``trainer = "remote"`` trainer processes lease the samples over HTTP
instead), and the admin version routes (``/v1/admin/rollback``, ``/v1/admin/versions``) that reach the trainer.
Pipeline and trainer run as components on the server's event loop, so they start after the sessions are restored
and stop before the engines close; the vLLM servers' supervisor runs beside them whenever a fleet does.

A run folder that already holds training is started only as asked (``resume`` / ``fresh``), before any model is
loaded: ``clawloop.run_folder.prepare_training_state`` says how.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

from clawloop.assemble import Learning
from clawloop.config import Config
from clawloop.pipeline import Pipeline
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


def build_runtime(config: Config, *, resume: bool = False, fresh: bool = False, log_level: str = "warning",
                  pipeline_poll_s: float = 2.0, trainer_poll_s: float = 1.0,
                  console: TextIO | None = sys.stderr, on_gate: Callable[[dict[str, Any]], None] | None = None,
                  **server_kwargs: Any) -> Runtime:
    """Assemble server + pipeline (+ trainer when ``config.train`` with ``trainer = "embedded"``); nothing runs
    until ``start()``/``run()``. ``on_gate`` is called with every publication-gate decision of the trainer.
    ``resume`` / ``fresh``: how a folder that holds training is started; ``RunFolderError`` when it cannot be, and
    ``JudgeEndpointError`` when ``judge_url`` refuses the key or has no such path. ``server_kwargs`` go to
    ``Server``."""
    learning = Learning(resume=resume, fresh=fresh, pipeline_poll_s=pipeline_poll_s, trainer_poll_s=trainer_poll_s,
                        console=console, on_gate=on_gate)
    server = Server(config, learning=learning, log_level=log_level, **server_kwargs)
    server.build()
    assert server.parts is not None and server.parts.pipeline is not None
    return Runtime(server=server, pipeline=server.parts.pipeline, trainer=server.parts.trainer)


def run(config: Config, *, resume: bool = False, fresh: bool = False, log_level: str = "warning") -> None:
    """Blocking entry point of ``clawloop serve``: serve, judge and train until interrupted."""
    build_runtime(config, resume=resume, fresh=fresh, log_level=log_level).server.run()
