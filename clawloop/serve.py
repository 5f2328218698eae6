"""``clawloop serve``: one process of the loop on uvicorn, in-process on a background thread or in the foreground.

``Server`` hosts what ``clawloop.assemble.assemble`` builds (the composition root: run folder, vLLM fleet,
engines, store, sessions, and with ``learning`` the judge, teacher, pipeline and trainer, then the routes and the
dashboard) and runs it on uvicorn: ``start()`` / ``stop()`` on a background thread (tests, drivers that talk to the
API over HTTP), or ``run()`` in the foreground. ``Server(config)`` alone only serves; ``clawloop.runtime`` gives it
``learning``. Nothing is built until ``build()`` (called by ``start()`` and ``run()``).

Hooks for the rest of the run, passed to the constructor:

* ``on_judgeable(turn_id)``: called when a stored turn gets its next state (sync or async; it must not block: put
  the id on a queue, or return a coroutine, which is scheduled, never awaited on the request path). It is read on
  every call, so it may also be set on the server after it was built;
* ``components``: background parts with ``async start()`` and ``async stop()``, started after the built ones.

Start-up order and shutdown are the assembly's (``clawloop.assemble``). Shutdown leaves awaiting turns as they are
for the next start; the engine and store are closed, and the vLLM servers it started stopped, only when the
server created them.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Sequence
from typing import Any

from clawloop.api.app import ChatService
from clawloop.api.framing import OpenAIShapedFraming
from clawloop.api.sessions import JudgeableHook, SessionManager
from clawloop.assemble import Assembly, Component, Learning, assemble
from clawloop.config import Config
from clawloop.fleet import Fleet
from clawloop.store import Store

log = logging.getLogger("clawloop.serve")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Server:
    """One serving process: what ``assemble`` builds, on uvicorn (see the module docstring)."""

    def __init__(self, config: Config, *, learning: Learning | None = None, engine: Any = None,
                 store: Store | None = None, tokenizer: Any = None, on_judgeable: JudgeableHook | None = None,
                 components: Sequence[Component] = (), supervise_interval_s: float = 10.0,
                 log_level: str = "warning"):
        self.config = config
        """The settings; once built, with the URLs of the vLLM servers it started."""
        self.learning = learning
        self.on_judgeable = on_judgeable
        self.log_level = log_level
        self.port: int = config.port
        self.parts: Assembly | None = None
        """Everything ``build()`` assembled (None before)."""
        self._given_engine = engine
        self._given_store = store
        self._tokenizer = tokenizer
        self._components = list(components)
        self._supervise_interval_s = supervise_interval_s
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        self._closed = False

    # ---- assembly -------------------------------------------------------------------------------------
    def build(self) -> Any:
        """Assemble every part (idempotent). Returns the FastAPI app."""
        if self.parts is None:
            self.parts = assemble(self.config, learning=self.learning, engine=self._given_engine,
                                  store=self._given_store, tokenizer=self._tokenizer, on_judgeable=self._judgeable,
                                  components=self._components, supervise_interval_s=self._supervise_interval_s)
            self.config = self.parts.config
        return self.parts.app

    @property
    def engine(self) -> Any:
        return self.parts.engine if self.parts is not None else self._given_engine

    @property
    def store(self) -> Store | None:
        return self.parts.store if self.parts is not None else self._given_store

    @property
    def sessions(self) -> SessionManager | None:
        return self.parts.sessions if self.parts is not None else None

    @property
    def service(self) -> ChatService | None:
        return self.parts.service if self.parts is not None else None

    @property
    def app(self) -> Any:
        return self.parts.app if self.parts is not None else None

    @property
    def fleet(self) -> Fleet | None:
        """The vLLM servers of this run (``clawloop.fleet.Fleet``), started by ``build``."""
        return self.parts.fleet if self.parts is not None else None

    @property
    def components(self) -> list[Component]:
        """What runs beside serving, in start order (empty before ``build``)."""
        return list(self.parts.components) if self.parts is not None else []

    def _judgeable(self, turn_id: int) -> Any:
        # Read on every call, so a hook set after the server was built is used.
        if self.on_judgeable is not None:
            return self.on_judgeable(turn_id)
        return None

    def close(self) -> None:
        """Close what the assembly opened (the store, the vLLM servers); once, after serving."""
        if self.parts is not None and not self._closed:
            self._closed = True
            self.parts.close()

    def _uvicorn_server(self) -> Any:
        import uvicorn

        app = self.build()
        uv_config = uvicorn.Config(app, host=self.config.host, port=self.port, log_level=self.log_level,
                                   lifespan="on", timeout_graceful_shutdown=5, access_log=False,
                                   http=OpenAIShapedFraming)
        return uvicorn.Server(uv_config)

    # ---- in-process -------------------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> "Server":
        """Serve on a background thread; returns once the API accepts connections (port 0 = pick a free one)."""
        if self.port == 0:
            self.port = free_port(self.config.host)
        self._uvicorn = self._uvicorn_server()

        def target() -> None:
            try:
                self._uvicorn.run()
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                self._startup_error = exc

        self._thread = threading.Thread(target=target, name="clawloop-api", daemon=True)
        self._thread.start()
        waited = 0.0
        try:
            while not self._uvicorn.started:
                if not self._thread.is_alive() or self._startup_error is not None:
                    raise RuntimeError(f"the API failed to start on {self.base_url}: {self._startup_error!r}")
                if waited > timeout_s:
                    raise TimeoutError(f"the API did not start within {timeout_s} s")
                threading.Event().wait(0.02)
                waited += 0.02
        except BaseException:
            self.stop()  # the store, the vLLM servers and a thread still starting must not outlive a failed start
            raise
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- foreground ----------------------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until interrupted (Ctrl-C / SIGTERM)."""
        server = self._uvicorn_server()
        log.warning("clawloop serving %s on %s (run dir %s)", self.config.served_model_name, self.base_url,
                    self.config.run_dir)
        try:
            server.run()
        finally:
            self.close()


def stop_on_termination() -> None:
    """SIGTERM (a service manager, ``docker stop``) and SIGHUP (a closed terminal) stop ``clawloop serve`` as
    Ctrl-C does: a ``KeyboardInterrupt`` in the main thread, so the process leaves through its ``finally`` blocks
    and closes what it opened, the vLLM servers above all (they run in sessions of their own and would outlive a
    process the signal killed). While serving, uvicorn answers SIGTERM with a graceful shutdown and then raises it
    again under the handler it found, this one; before that (minutes of model loading), this handler is the one
    that answers. A signal whose action is not the default (SIGHUP under ``nohup``) is left alone. Main thread
    only."""
    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def hang_up(signum: int, frame: Any) -> None:
        signal.raise_signal(signal.SIGTERM)  # uvicorn's handler while it serves, else ``stop``

    # Only where the signal still has its default action: ``nohup`` (SIGHUP ignored) and a parent's own handling
    # stay as they were.
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, stop)
    if signal.getsignal(signal.SIGHUP) == signal.SIG_DFL:
        signal.signal(signal.SIGHUP, hang_up)


def run(config: Config, **kwargs: Any) -> None:
    """Blocking entry point of ``clawloop serve``."""
    Server(config, **kwargs).run()

