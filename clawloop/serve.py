"""``clawloop serve``: Config -> engine + store + sessions + the HTTP app -> uvicorn.

``Server`` composes the pieces and runs uvicorn either in-process on a background thread (``start()`` /
``stop()``, used by tests and by drivers that talk to the API over HTTP) or in the foreground (``run()``).

Extension points for the rest of the run (left empty by serving itself):

* ``on_judgeable(turn_id)`` — called when a stored turn gets its next state (sync or async; it must not block:
  put the id on a queue, or return a coroutine, which is scheduled, never awaited on the request path);
* ``components`` — background parts (the judge pipeline, the trainer) with ``async start()`` and
  ``async stop()``; they are started after the sessions are restored and stopped, in reverse order, before the
  engine closes. Each may read ``server.engine``, ``server.store`` and ``server.sessions``.

Start-up order: open the store (``RUN_DIR/store.sqlite``) and run ``store.recover()`` (both only when no store
is given; a run folder that cannot be written or a store that does not read stops start-up with a
``RunFolderError``, a paragraph naming the file and what to do), start or attach to the vLLM servers the config
names (``clawloop.engines.fleet``; ``server.config`` then holds their URLs) and build the engine (unless one is
given), connect to a remote engine, rebuild the live sessions from the turns still awaiting
their next state (so a restart loses no pairing), start the idle sweeper and the components, then accept
requests. Shutdown leaves awaiting turns as they are for the next start. The engine and store are closed, and the vLLM
servers it started stopped, at shutdown only when the server created them.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sqlite3
import tempfile
import threading
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from clawloop.api.app import ChatService, create_app
from clawloop.api.framing import OpenAIShapedFraming
from clawloop.api.metrics import ServingMetrics
from clawloop.api.trainer_routes import mount_trainer_routes
from clawloop.api.sessions import JudgeableHook, SessionManager
from clawloop.config import Config
from clawloop.store import STORE_FILENAME, Store

log = logging.getLogger("clawloop.serve")


class Component(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class RunFolderError(RuntimeError):
    """The run folder cannot be started as it is. The message is one paragraph for the person at the command
    line: the file or folder at fault and what to do about it."""


def store_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STORE_FILENAME


def ensure_writable(folder: Path) -> None:
    """Create ``folder`` if needed and write a scratch file in it; a folder this process cannot write to is a
    ``RunFolderError`` (found by trying: permission bits do not tell, e.g. under root or a read-only mount)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise RunFolderError(
            f"clawloop cannot write to {folder} ({exc.strerror or exc}). A run keeps its store, checkpoints and "
            f"versions in its folder and writes there from the start. Make it writable (e.g. chmod -R u+w "
            f"{folder}, or remount its disk read-write), or give another folder with --run-dir.") from None


def open_run_store(run_dir: str | Path) -> Store:
    """The run's store, opened for writing; see ``RunFolderError`` for what stops it."""
    folder = Path(run_dir)
    ensure_writable(folder)
    path = store_path(folder)
    try:
        if path.exists():
            with open(path, "ab"):  # a store file that cannot be written (the folder could be)
                pass
        return Store(path)
    except PermissionError as exc:
        raise RunFolderError(
            f"clawloop cannot write the run's store {path} ({exc.strerror}). Make it writable (e.g. chmod u+w "
            f"{path}), or give another folder with --run-dir.") from None
    except sqlite3.DatabaseError as exc:
        raise RunFolderError(
            f"The run's store {path} cannot be read: SQLite says \"{exc}\". It is the record of every turn, "
            "sample and step of the run, and was probably cut short (a full disk, a copy that did not finish). "
            f"Restore it from a backup (with its -wal file, if there is one), or start a new run in another "
            "folder with --run-dir; this folder's checkpoints and versions cannot be resumed without it.") from None


def build_engine(config: Config, fleet: Any = None) -> Any:
    """The policy engine: a ``VLLMEngine`` on the fleet's policy server (``engine = "vllm"``), else the embedded
    HF engine for ``config.model`` (imported lazily: loading torch models is slow)."""
    if config.engine == "vllm":
        from clawloop.engines.model_files import load_tokenizer, resolve_model

        if fleet is None or fleet.policy is None:
            raise ValueError("engine='vllm' needs the run's vLLM fleet (clawloop.engines.fleet.Fleet)")
        return fleet.policy_engine(config, load_tokenizer(resolve_model(config.model)))
    from clawloop.engines.hf import HFEngine

    return HFEngine(config.model, device=config.device, dtype=config.dtype, max_batch_size=config.max_batch_size,
                    num_threads=config.num_threads, model_name=config.served_model_name)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Server:
    """One serving process: engine, store, sessions and the API (see the module docstring)."""

    def __init__(self, config: Config, *, engine: Any = None, store: Store | None = None, tokenizer: Any = None,
                 on_judgeable: JudgeableHook | None = None, components: Sequence[Component] = (),
                 log_level: str = "warning"):
        self.config = config
        self._own_engine = engine is None
        self._own_store = store is None
        self.engine = engine
        self.store = store
        self.tokenizer = tokenizer
        self.on_judgeable = on_judgeable
        self.components: list[Component] = list(components)
        self.log_level = log_level
        self.sessions: SessionManager | None = None
        self.service: ChatService | None = None
        self.app: Any = None
        self._uvicorn: Any = None
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        self.port: int = config.port
        self.fleet: Any = None
        """The vLLM servers of this run (``clawloop.engines.fleet.Fleet``), started by ``build``."""

    # ---- assembly -------------------------------------------------------------------------------------
    def build(self) -> Any:
        """Create store, engine, sessions and the app (idempotent). Returns the FastAPI app."""
        if self.app is not None:
            return self.app
        self.open_store()
        if self.engine is None:
            self._start_fleet()
            self.engine = build_engine(self.config, self.fleet)
        self.sessions = SessionManager(self.store, max_sessions=self.config.max_sessions,
                                       idle_timeout_s=self.config.session_idle_timeout_s,
                                       on_judgeable=self._judgeable)
        self.service = ChatService(self.config, self.engine, self.store, self.sessions, tokenizer=self.tokenizer,
                                   metrics=ServingMetrics())
        self.app = create_app(self.service, lifespan=self._lifespan)
        mount_trainer_routes(self.app, self.store, self.engine, self.config)  # remote trainers lease batches here
        return self.app

    def open_store(self) -> Store:
        """Open the run's store and recover interrupted work, unless a store was given (idempotent). Raises
        ``RunFolderError`` before anything heavy is built (see ``open_run_store``)."""
        if self.store is None:
            self.store = open_run_store(self.config.run_dir)
            # Only a store this server opened: a given store may have live leases of a trainer in this process.
            recovered = self.store.recover()
            if any(recovered.values()):
                log.warning("recovered interrupted work: %s", recovered)
        return self.store

    def close_store(self) -> None:
        """Close the store if this server opened it (at shutdown, or when start-up stops early)."""
        if self._own_store and self.store is not None:
            self.store.close()
            self.store = None

    def _start_fleet(self) -> None:
        """Start (or attach to) the vLLM servers the config names; ``self.config`` then holds their URLs."""
        from clawloop.engines.fleet import Fleet, FleetSupervisor

        fleet = Fleet.plan(self.config)
        if not fleet.servers:
            return
        self.fleet = fleet.start()
        self.config = fleet.resolve(self.config)
        self.components.insert(0, FleetSupervisor(fleet))

    def stop_fleet(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
            self.fleet = None

    def _judgeable(self, turn_id: int) -> Any:
        # Looked up on every call so the hook can be attached after the server was built.
        if self.on_judgeable is not None:
            return self.on_judgeable(turn_id)
        return None

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        assert self.sessions is not None
        connect = getattr(self.engine, "connect", None)
        if connect is not None:  # a remote engine: check it serves the model, learn its context length
            await connect()
        restored = await self.sessions.restore()
        if restored:
            log.warning("rebuilt %d live sessions from turns awaiting their next state", restored)
        self.sessions.start()
        started: list[Component] = []
        try:
            for component in self.components:
                await component.start()
                started.append(component)
            yield
        finally:
            for component in reversed(started):
                try:
                    await component.stop()
                except Exception:
                    log.exception("stopping %r failed", component)
            await self.sessions.stop()
            if self._own_engine and self.engine is not None:
                await self.engine.close()

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
        while not self._uvicorn.started:
            if not self._thread.is_alive() or self._startup_error is not None:
                raise RuntimeError(f"the API failed to start on {self.base_url}: {self._startup_error!r}")
            if waited > timeout_s:
                raise TimeoutError(f"the API did not start within {timeout_s} s")
            threading.Event().wait(0.02)
            waited += 0.02
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self.close_store()
        self.stop_fleet()

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
            self.close_store()
            self.stop_fleet()


def run(config: Config, **kwargs: Any) -> None:
    """Blocking entry point of ``clawloop serve``."""
    Server(config, **kwargs).run()

