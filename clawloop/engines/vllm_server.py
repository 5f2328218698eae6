"""Start, watch and stop a local vLLM OpenAI-compatible server, or attach to one started elsewhere.

Choices a reader needs to know:

* **Its own interpreter.** vLLM pins its own torch and lives in a separate virtualenv (``.venv-vllm``, made by
  ``scripts/setup_vllm_venv.sh``); ``find_vllm_python`` picks ``$CLAWLOOP_VLLM_PYTHON`` first, then
  ``<repo>/.venv-vllm/bin/python``. The server is started as ``python -m vllm.entrypoints.openai.api_server``
  (the ``vllm`` console script looks for a distribution literally named ``vllm``, which the CPU wheel is not).
* **Settings that keep clawloop's numbers right**, set on every server started here:
  ``--logprobs-mode processed_logprobs`` (generated-token log-probs come from the distribution actually sampled
  from: after temperature and top-p, like the embedded engine), ``--generation-config vllm`` (the model folder's
  generation defaults never change a request's sampling silently) and ``--max-logprobs`` (how many alternatives
  scoring may ask for per position). LoRA serving (``enable_lora``) turns on runtime adapter loading through
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``. ``dev_mode`` (``VLLM_SERVER_DEV_MODE=1``) exposes ``/pause``,
  ``/resume``, ``/collective_rpc`` and ``/reset_prefix_cache``, which checkpoint publication needs; never expose a
  dev-mode server beyond the trainer's network.
* **Access.** ``api_key`` reaches vLLM through ``VLLM_API_KEY`` (a command line is readable by every local user;
  a process's environment only by its owner) and never goes to a log; the log file is created 0600. vLLM checks
  its key on a few path prefixes only, so every server started here also loads a small guard module
  (``--middleware clawloop_vllm_guard.RequireKey``, written to a private temp folder put on its ``PYTHONPATH``)
  that asks for the key on every path but ``/health`` (dev-mode routes included) and marks each answer with a
  random id given to that launch only.
* **Its own port.** A port that something already holds is refused before launching (vLLM binds with
  ``SO_REUSEPORT``, so a second server of the same user would share the port with the first one), and readiness
  takes only answers that carry this launch's id: another process answering on the port stops the start with an
  error naming the port instead of being taken for the server started here.
* **Small by default**: ``--max-model-len 2048``, ``--max-num-seqs 16`` and, on CPU, a 1 GiB KV cache
  (``VLLM_CPU_KVCACHE_SPACE``). ``enforce_eager`` skips torch.compile: startup takes a couple of minutes instead
  of several on a small CPU (the first compiled start of a configuration is the slow one; vLLM caches the
  result under ``~/.cache/vllm``), at some cost in decode speed. ``block_size`` (32 suits CPU scoring servers:
  see ``clawloop.engines.vllm``) is left to vLLM unless set.
* **Lifecycle.** The process runs in its own session (process group) with stdout/stderr in a log file. ``start``
  waits for ``GET /health`` and the served model in ``GET /v1/models`` up to ``startup_timeout_s``, failing early
  (with the log's tail in the error) when the process exits. ``stop`` sends SIGTERM to the group, then SIGKILL after
  a grace period. ``ensure_running`` restarts a server that died (up to ``max_restarts``), after ending what is
  left of its launch (processes that carry its launch id). ``pid_file``, when set, is rewritten at every start
  with the process id and launch id. ``attach`` wraps a server started elsewhere: the same health wait, and
  ``stop`` leaves it alone.
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import httpx

from clawloop.engines.base import EngineError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIRNAME = ".venv-vllm"
_RUNNING: weakref.WeakSet[VLLMServer] = weakref.WeakSet()
LAUNCH_ENV = "CLAWLOOP_VLLM_LAUNCH"
"""Environment variable holding the random id of one launch: the guard marks answers with it, and the processes of
a launch are found by it (``launch_processes``)."""
LAUNCH_HEADER = "x-clawloop-launch"
GUARD_MODULE = "clawloop_vllm_guard"
_GUARD_SOURCE = '''"""Loaded into a vLLM server clawloop started (``--middleware clawloop_vllm_guard.RequireKey``).

vLLM checks its API key on a few path prefixes only, and dev mode adds routes (/pause, /collective_rpc, ...) that
swap the served weights: this asks for the key on every path but /health, and marks each answer with the launch id
clawloop gave this process, so that clawloop can tell its own server from another one on the same port."""

import hmac
import os

_KEYED = bool(os.environ.get("VLLM_API_KEY"))
_EXPECTED = ("Bearer " + os.environ.get("VLLM_API_KEY", "")).encode()
_LAUNCH = os.environ.get("CLAWLOOP_VLLM_LAUNCH", "").encode()
_OPEN_PATHS = {"/health"}
_REFUSAL = b'{"error": "Unauthorized"}'


class RequireKey:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if _KEYED and scope["path"] not in _OPEN_PATHS and not _has_key(scope):
            return await _refuse(scope, send)
        return await self.app(scope, receive, _marking(send))


def _has_key(scope):
    given = dict(scope.get("headers") or []).get(b"authorization", b"")
    return hmac.compare_digest(given, _EXPECTED)


def _marking(send):
    async def send_marked(message):
        if message["type"] == "http.response.start" and _LAUNCH:
            message = {**message, "headers": [*message.get("headers", []), (b"x-clawloop-launch", _LAUNCH)]}
        await send(message)

    return send_marked


async def _refuse(scope, send):
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(_REFUSAL)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": _REFUSAL})
'''
_guard_folder: tempfile.TemporaryDirectory | None = None
"""The private folder holding the guard module: made once per process, removed at exit."""


@atexit.register
def _stop_leftovers() -> None:
    """A server started here never outlives the interpreter that started it (it holds GBs of memory)."""
    for server in list(_RUNNING):
        server.stop(timeout_s=10)


def find_vllm_python() -> Path | None:
    """The interpreter of the vLLM virtualenv: ``$CLAWLOOP_VLLM_PYTHON``, else ``<repo>/.venv-vllm/bin/python``."""
    env = os.environ.get("CLAWLOOP_VLLM_PYTHON", "").strip()
    if env:
        path = Path(env).expanduser()
        return path if path.is_file() else None
    path = REPO_ROOT / VENV_DIRNAME / "bin" / "python"
    return path if path.is_file() else None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_taken(host: str, port: int) -> bool:
    """Whether a socket already listens on (or binds exclusively) ``host:port``. SO_REUSEADDR, as vLLM binds: the
    closed connections of a server that just died (TIME_WAIT) do not hold the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def guard_folder() -> Path:
    """The folder to put on a server's ``PYTHONPATH`` so that it can import the guard module."""
    global _guard_folder
    if _guard_folder is None:
        folder = tempfile.TemporaryDirectory(prefix="clawloop-vllm-guard-")  # 0700: nobody else can swap the guard
        (Path(folder.name) / f"{GUARD_MODULE}.py").write_text(_GUARD_SOURCE)
        _guard_folder = folder
    return Path(_guard_folder.name)


def launch_processes(launch_id: str) -> list[int]:
    """The processes of one launch: those whose environment carries its id (a server and the workers it started).
    A reused process id or another run's server never does; other users' processes cannot be read and are skipped."""
    marker = f"{LAUNCH_ENV}={launch_id}".encode()
    try:
        entries = [entry for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    except OSError:
        return []
    found = []
    for entry in entries:
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or another user's (PermissionError)
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def end_launch(launch_id: str, grace_s: float = 10.0) -> bool:
    """SIGTERM the processes of ``launch_id``, SIGKILL those left after ``grace_s``, and wait until they are gone
    (they hold memory and the port). True if any was found."""
    pids = launch_processes(launch_id)
    if not pids:
        return False
    if _signal(pids, signal.SIGTERM) and not _wait_ended(launch_id, grace_s):
        if _signal(launch_processes(launch_id), signal.SIGKILL) and not _wait_ended(launch_id, 10.0):
            log.error("vLLM processes %s of launch %s outlived SIGKILL", launch_processes(launch_id), launch_id)
    return True


def _signal(pids: list[int], sig: signal.Signals) -> bool:
    """Send ``sig`` to ``pids``; False when one may not be signalled (then there is nothing to wait for)."""
    allowed = True
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.warning("not allowed to signal vLLM process %d: it keeps running", pid)
            allowed = False
    return allowed


def _wait_ended(launch_id: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while launch_processes(launch_id):  # an ended process nobody reaped yet has no environment left to read
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


@dataclass(frozen=True)
class VLLMServerSettings:
    """How to start one vLLM server. Field names follow vLLM's flags where there is one."""

    model: str
    """A local Hugging Face model folder (clawloop never lets vLLM download)."""
    served_model_name: str = "base"
    python: str = ""
    """Interpreter with vLLM installed; empty = ``find_vllm_python()``."""
    host: str = "127.0.0.1"
    port: int = 0
    """0 = pick a free port at start."""
    dtype: str = "auto"
    max_model_len: int = 2048
    max_num_seqs: int = 16
    max_logprobs: int = 64
    logprobs_mode: str = "processed_logprobs"
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 2
    dev_mode: bool = False
    enforce_eager: bool = False
    block_size: int | None = None
    """KV cache block (tokens); None = vLLM's default (128 on CPU). Prefix caching reuses whole blocks only, so
    a scoring server's per-position requests profit from small blocks (32 on CPU)."""
    cpu_kv_cache_gb: int | None = 1
    """``VLLM_CPU_KVCACHE_SPACE`` (GiB) for the CPU build; None leaves vLLM's default. Ignored on GPU builds."""
    gpu_memory_utilization: float | None = None
    api_key: str = ""
    """When set the server requires ``Authorization: Bearer <api_key>`` on every path but ``/health``; it is passed
    in the environment (``VLLM_API_KEY``), never on the command line."""
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    log_file: str = ""
    """Where the server's output goes; empty = a new file in the temp folder."""
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0
    max_restarts: int = 3

    @classmethod
    def check_overrides(cls, values: Mapping[str, Any]) -> None:
        """Fail on keys that are not settings and on values of the wrong type (a config section, before use)."""
        if not isinstance(values, Mapping):
            raise ValueError(f"expected a table of vLLM server settings, got {values!r}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown vLLM server setting(s) {unknown}; known: {sorted(known)}")
        for name, value in values.items():
            expected = _SETTING_TYPES.get(name)
            if expected is not None and value is not None and (
                    not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected)):
                raise ValueError(f"vLLM server setting {name}={value!r} is not a {expected[0].__name__}")
        if "extra_args" in values and not all(isinstance(a, str) for a in values["extra_args"]):
            raise ValueError(f"extra_args must be a list of strings, got {values['extra_args']!r}")
        if any(a.split("=", 1)[0] == "--api-key" for a in values.get("extra_args", ())):
            # On the command line every local user could read it, and clawloop's clients would not send it.
            raise ValueError("give the server's key as api_key, not as --api-key in extra_args")
        if "env" in values and not all(isinstance(v, str) for v in dict(values["env"]).values()):
            raise ValueError(f"env values must be strings, got {values['env']!r}")
        port = values.get("port", 0)
        if not 0 <= port <= 65535:
            raise ValueError(f"port={port!r} must be in [0, 65535]")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> VLLMServerSettings:
        """Build from a config section (unknown keys are an error, so typos do not pass silently)."""
        cls.check_overrides(values)
        values = dict(values)
        if "extra_args" in values:
            values["extra_args"] = tuple(values["extra_args"])
        if "env" in values:
            values["env"] = dict(values["env"])
        return cls(**values)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self, python: str | Path) -> list[str]:
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-logprobs", str(self.max_logprobs),
            "--logprobs-mode", self.logprobs_mode,
            "--generation-config", "vllm",
        ]
        if self.enable_lora:
            argv += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank), "--max-loras", str(self.max_loras)]
        if self.enforce_eager:
            argv.append("--enforce-eager")
        if self.block_size is not None:
            argv += ["--block-size", str(self.block_size)]
        if self.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        argv += ["--middleware", f"{GUARD_MODULE}.RequireKey"]  # importable through guard_folder()
        return argv + list(self.extra_args)

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["HF_HUB_OFFLINE"] = "1"  # never download: the model is a local folder
        env["TRANSFORMERS_OFFLINE"] = "1"
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        env.setdefault("DO_NOT_TRACK", "1")
        if self.cpu_kv_cache_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(int(self.cpu_kv_cache_gb))
        if self.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        # The settings alone decide the key: one inherited from this process would lock its clients out.
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        # The main venv's variables must not leak into the other interpreter.
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)
        env.update(self.env)
        return env

    def model_vocab_size(self) -> int | None:
        """``vocab_size`` from the model folder's config.json (None when unreadable)."""
        try:
            config = json.loads((Path(self.model) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        value = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return int(value) if value else None


_SETTING_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str,), "served_model_name": (str,), "python": (str,), "host": (str,), "port": (int,),
    "dtype": (str,), "max_model_len": (int,), "max_num_seqs": (int,), "max_logprobs": (int,),
    "logprobs_mode": (str,), "enable_lora": (bool,), "max_lora_rank": (int,), "max_loras": (int,),
    "dev_mode": (bool,), "enforce_eager": (bool,), "block_size": (int,), "cpu_kv_cache_gb": (int,),
    "gpu_memory_utilization": (float, int), "api_key": (str,), "extra_args": (list, tuple), "env": (Mapping,),
    "log_file": (str,), "startup_timeout_s": (float, int), "stop_timeout_s": (float, int), "max_restarts": (int,),
}


class VLLMServer:
    """One vLLM server: a process started here, or an attached URL (see the module docstring)."""

    def __init__(self, settings: VLLMServerSettings | None = None, *, url: str = "", api_key: str = "",
                 served_model_name: str = "", startup_timeout_s: float = 300.0):
        if settings is None and not url:
            raise ValueError("give settings (start a server) or url (attach to one)")
        self.settings = settings
        self._url = url.rstrip("/")
        self._api_key = api_key or (settings.api_key if settings else "")
        self._served_name = served_model_name or (settings.served_model_name if settings else "")
        self._startup_timeout_s = settings.startup_timeout_s if settings else startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self.pid_file: Path | None = None
        """Where each start records the process id and launch id (None: nowhere), for ``clawloop.fleet``."""
        self.launch_id = ""
        """The random id of the current launch ('' before the first one)."""
        self.restarts = 0
        self.startup_s: float | None = None

    # ------------------------------------------------------------------------------------------ set-up

    @classmethod
    def attach(cls, url: str, *, api_key: str = "", served_model_name: str = "",
               startup_timeout_s: float = 60.0) -> VLLMServer:
        """Wrap a server started elsewhere (``stop`` will not touch it). Call ``start`` to wait for it. A server this
        process started (another part of it attaching by URL) is sent the key it was started with."""
        return cls(url=url, api_key=api_key or _key_of_running(url), served_model_name=served_model_name,
                   startup_timeout_s=startup_timeout_s)

    @property
    def managed(self) -> bool:
        return self.settings is not None

    @property
    def url(self) -> str:
        if self._url:
            return self._url
        raise EngineError("the vLLM server has not been started yet")

    @property
    def served_model_name(self) -> str:
        return self._served_name

    @property
    def api_key(self) -> str:
        """The key its clients send ('' for none)."""
        return self._api_key

    def start(self) -> VLLMServer:
        """Start the process (managed) and wait until it serves; an attached server is only waited for."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> VLLMServer:
        """Start the process without waiting (start several servers, then ``wait_ready`` each)."""
        if self.managed and (self.process is None or self.process.poll() is not None):
            self._spawn()
        return self

    def _spawn(self) -> None:
        settings = self.settings
        assert settings is not None
        python = Path(settings.python) if settings.python else find_vllm_python()
        if python is None or not Path(python).is_file():
            raise EngineError(
                "no vLLM interpreter: run scripts/setup_vllm_venv.sh (creates .venv-vllm) or set "
                "CLAWLOOP_VLLM_PYTHON to a python with vllm installed"
            )
        if not (Path(settings.model) / "config.json").is_file():
            raise EngineError(f"vLLM model {settings.model!r} is not a local model folder with config.json")
        if settings.port == 0:
            settings = replace(settings, port=free_port(settings.host))
            self.settings = settings
        self._url = settings.url
        if port_taken(settings.host, settings.port):
            raise EngineError(
                f"cannot start a vLLM server on port {settings.port} ({settings.host}): another process holds it "
                "(a server of another run?); stop it or give this server another port"
            )
        self.log_path = _log_path(settings)
        self.launch_id = secrets.token_hex(16)
        argv = settings.command(python)
        log.info("starting vLLM: %s (log %s)", " ".join(argv), self.log_path)
        with os.fdopen(_open_private(self.log_path), "ab") as out:
            out.write(f"\n=== clawloop: {' '.join(argv)}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self._launch_environment(settings), start_new_session=True,
            )
        _RUNNING.add(self)
        if self.pid_file is not None:
            self.pid_file.write_text(json.dumps({"pid": self.process.pid, "launch": self.launch_id}))

    def _launch_environment(self, settings: VLLMServerSettings) -> dict[str, str]:
        env = settings.environment()
        env[LAUNCH_ENV] = self.launch_id
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(guard_folder()), env.get("PYTHONPATH", "")) if p)
        return env

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until ``/health`` answers 200 and the served model is listed (by this launch, for a server started
        here); EngineError otherwise."""
        timeout_s = self._startup_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        last = "no answer yet"
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0), headers=headers) as client:
            while True:
                if self.process is not None and self.process.poll() is not None:
                    raise EngineError(
                        f"vLLM server {self.url} exited with code {self.process.returncode} while starting; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        models = client.get(f"{self.url}/v1/models")
                        self._refuse_a_stranger(models)
                        if models.status_code == 200:
                            names = [m.get("id") for m in models.json().get("data", [])]
                            if not self._served_name or self._served_name in names:
                                if not self._served_name and names:
                                    self._served_name = str(names[0])
                                self.startup_s = time.monotonic() - started
                                return
                            last = f"serves {names}, not {self._served_name!r}"
                        else:
                            last = f"/v1/models answered {models.status_code}"
                    else:
                        last = "/health not ready"
                except (httpx.HTTPError, ValueError) as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() >= deadline:
                    where = f"; log {self.log_path}:\n{self.log_tail()}" if self.log_path else ""
                    if self.managed:
                        self.stop()
                    raise EngineError(f"vLLM server {self.url} not ready after {timeout_s:.0f} s ({last}){where}")
                time.sleep(1.0)

    def _refuse_a_stranger(self, answer: httpx.Response) -> None:
        """Stop the start when another process answers on the port of the one started here: only this launch's
        guard marks its answers with its id (and knows the key), so anything else is not our server."""
        if not self.launch_id or answer.headers.get(LAUNCH_HEADER) == self.launch_id:
            return
        why = "refuses this server's key" if answer.status_code in (401, 403) else "is not the process started here"
        assert self.settings is not None
        self.stop()
        raise EngineError(
            f"another process answers on port {self.settings.port}: {self.url} {why}; stop it or give this server "
            "another port"
        )

    # ------------------------------------------------------------------------------------------ running

    def is_alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        if not self.managed:
            try:
                return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False
        return False

    def ensure_running(self) -> bool:
        """Restart a managed server that died (``max_restarts`` at most). Returns True when it was restarted."""
        if not self.managed or self.is_alive():
            return False
        assert self.settings is not None
        if self.restarts >= self.settings.max_restarts:
            raise EngineError(
                f"vLLM server {self.url} died and was already restarted {self.restarts} times; log "
                f"{self.log_path}:\n{self.log_tail()}"
            )
        log.warning("vLLM server %s died (code %s); restarting", self._url,
                    self.process.returncode if self.process else None)
        self.restarts += 1
        self.process = None
        if self.launch_id:  # workers it left behind hold memory, and may hold its listening socket
            end_launch(self.launch_id, grace_s=0.0)
        self.start()
        return True

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 20000))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float | None = None) -> None:
        """Terminate a managed server's process group (SIGTERM, then SIGKILL); an attached server is left alone."""
        process, self.process = self.process, None
        _RUNNING.discard(self)
        if process is None or process.poll() is not None:
            return
        grace = timeout_s if timeout_s is not None else (self.settings.stop_timeout_s if self.settings else 30.0)
        try:
            os.killpg(process.pid, signal.SIGTERM)  # the group is the server's own session
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(10)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -------------------------------------------------------------------------------------------- engine

    def engine(self, **overrides: Any) -> Any:
        """A ``VLLMEngine`` for this server, told what the settings already say (context, logprob limits...).

        For an attached server nothing is known: ``await engine.connect()`` learns the context length, and a
        LoRA-enabled one needs ``prompt_logprobs=False``, ``max_logprobs=`` its ``--max-logprobs``."""
        from clawloop.engines.vllm import VLLMEngine

        kwargs: dict[str, Any] = {"api_key": self._api_key}
        if self.settings is not None:
            s = self.settings
            kwargs.update(
                max_context=s.max_model_len,
                max_logprobs=s.max_logprobs,
                # Prompt log-probs on a LoRA-enabled CPU server crash its engine (vLLM 0.32 CPU LoRA logits path).
                prompt_logprobs=not s.enable_lora,
                vocab_size=s.model_vocab_size(),
            )
        kwargs.update(overrides)
        return VLLMEngine(self.url, self.served_model_name, **kwargs)


def _key_of_running(url: str) -> str:
    """The key of the server this process started at ``url`` ('' if it started none there)."""
    url = url.rstrip("/")
    return next((server.api_key for server in list(_RUNNING) if server._url == url), "")


def _log_path(settings: VLLMServerSettings) -> Path:
    if settings.log_file:
        path = Path(settings.log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    fd, name = tempfile.mkstemp(prefix=f"clawloop-vllm-{settings.port}-", suffix=".log")
    os.close(fd)
    return Path(name)


def _open_private(path: Path) -> int:
    """``path`` opened for appending, readable by its owner only (a server's log may show what it was sent)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)  # a log left by an older run may be world-readable
    return fd


def main(argv: list[str] | None = None) -> int:
    """``python -m clawloop.engines.vllm_server SETTINGS.json``: start a server and keep it up until interrupted."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m clawloop.engines.vllm_server SETTINGS.json", file=sys.stderr)
        return 2
    settings = VLLMServerSettings.from_mapping(json.loads(Path(args[0]).read_text()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop the server on SIGTERM too, not only Ctrl-C
    server = VLLMServer(settings).start()
    print(f"vLLM serving {server.served_model_name} at {server.url} (log {server.log_path})", flush=True)
    try:
        while True:
            time.sleep(5)
            server.ensure_running()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
