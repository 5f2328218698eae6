"""``clawloop openclaw``: clawloop brought up for OpenClaw in one command, and ``clawloop openclaw-end``.

``clawloop openclaw`` serves (and trains) like ``clawloop serve``; once the server answers it writes, into one
folder of OpenClaw's own (``RUN_DIR/openclaw`` unless ``--openclaw-dir`` says otherwise; ``~/.openclaw`` is never
touched unless named):

* ``openclaw.json``: the config ``clawloop openclaw-config`` would write, from the served model's limits. A file
  there that clawloop did not write (or that was edited since) is never replaced: start-up stops and says so.
* ``clawloop-api-key`` and ``clawloop-admin-key`` (mode 0600): the server's user and admin keys, generated on the
  first start unless given (``--api-key`` / ``CLAWLOOP_API_KEY``, ``--admin-key`` / ``CLAWLOOP_ADMIN_KEY``) and
  reused afterwards. With a user key set the dashboard needs the admin key, so there always is one.
* ``bin/openclaw``: OpenClaw for this server. It sets ``OPENCLAW_STATE_DIR`` and ``OPENCLAW_CONFIG_PATH`` to the
  folder and exports the user key as ``CLAWLOOP_API_KEY`` (the config refers to it) for OpenClaw only: without it
  every turn fails with a 401 that OpenClaw reports as an expired provider token; exported into the user's shell
  it would be inherited by ``clawloop dashboard``, which then refuses to open. It runs ``--openclaw-bin`` if
  given, else the pinned OpenClaw of ``integrations/openclaw`` when installed, else ``openclaw`` from PATH.

and prints what to run next. A run folder that holds earlier training is resumed (``--fresh`` starts over).

Stock OpenClaw never ends a session (``openclaw agent --local`` has no last turn), so a conversation's last answer
would wait for the idle timeout. ``clawloop openclaw-end SESSION`` ends it now: OpenClaw writes its session id into
the first message of every conversation (``Runtime: … | sessionId=<id> | …``), which names the clawloop sessions
it became in the run's store; each is ended through ``POST /v1/sessions/{id}/end``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shlex
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from clawloop.atomic import write_text_atomically
from clawloop.config import Config
from clawloop.openclaw_config import OpenClawConfigError, build_config, limits_from_server, plugin_dir
from clawloop.openclaw_format import runtime_session_id
from clawloop.store import STORE_FILENAME, Store

PINNED_OPENCLAW = Path(__file__).resolve().parent.parent / "integrations" / "openclaw" / "openclaw"
"""The repository's wrapper around the pinned Node + OpenClaw (absent in an installed package)."""
EXAMPLE_SESSION = "my-chat"
EXAMPLE_MESSAGE = "What is the capital of France?"
SESSION_SCAN = 200
"""Most recent clawloop sessions ``clawloop openclaw-end`` looks through for an OpenClaw session id."""


class OpenClawSetupError(RuntimeError):
    """Something stops ``clawloop openclaw`` or ``clawloop openclaw-end``; the message says what to do."""


@dataclass(frozen=True)
class OpenClawFolder:
    """OpenClaw's state folder for one clawloop run, and what clawloop writes into it."""

    path: Path

    @classmethod
    def for_run(cls, run_dir: str | Path, chosen: str = "") -> "OpenClawFolder":
        return cls(Path(chosen).expanduser() if chosen else Path(run_dir) / "openclaw")

    @property
    def config(self) -> Path:
        return self.path / "openclaw.json"

    @property
    def config_digest(self) -> Path:
        """SHA-256 of the config as clawloop last wrote it: a file that no longer matches was edited by someone."""
        return self.path / ".clawloop-config.sha256"

    @property
    def api_key(self) -> Path:
        return self.path / "clawloop-api-key"

    @property
    def admin_key(self) -> Path:
        return self.path / "clawloop-admin-key"

    @property
    def launcher(self) -> Path:
        return self.path / "bin" / "openclaw"


# ---- keys -----------------------------------------------------------------------------------------------------
def read_secret(path: Path) -> str:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return ""


def write_secret(path: Path, value: str) -> None:
    """Readable by the owner only, from the first byte on."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.chmod(path, 0o600)  # an older file keeps its mode through O_TRUNC


def settle_keys(config: Config, folder: OpenClawFolder) -> Config:
    """The config with a user and an admin key: given ones win, then the folder's, else new ones. Both are kept
    in the folder, so a restart serves with the same keys and OpenClaw's launcher reads the user key there."""
    api_key = config.api_key or read_secret(folder.api_key) or secrets.token_urlsafe(24)
    admin_key = config.admin_key or read_secret(folder.admin_key) or secrets.token_urlsafe(24)
    for path, value in ((folder.api_key, api_key), (folder.admin_key, admin_key)):
        if read_secret(path) != value:
            write_secret(path, value)
    return config.replace(api_key=api_key, admin_key=admin_key)


# ---- the config file, never clobbered ---------------------------------------------------------------------------
def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_config_replaceable(folder: OpenClawFolder) -> None:
    """Refuse a folder whose openclaw.json clawloop did not write, or that was changed since it did."""
    if not folder.config.exists():
        return
    current = digest(folder.config.read_text(encoding="utf-8", errors="replace"))
    if current != read_secret(folder.config_digest):
        raise OpenClawSetupError(
            f"{folder.config} exists and was not written by clawloop (or was edited since), so it is left as it is. "
            f"Give another folder with --openclaw-dir, or move that file away and start again.")


def write_openclaw_config(folder: OpenClawFolder, config: dict[str, Any]) -> None:
    check_config_replaceable(folder)  # again: the file may have appeared while the model loaded
    text = json.dumps(config, indent=2) + "\n"
    write_text_atomically(folder.config, text)
    write_text_atomically(folder.config_digest, digest(text) + "\n")


# ---- the launcher ----------------------------------------------------------------------------------------------
def openclaw_command(chosen: str = "") -> str:
    """How the launcher starts OpenClaw: as chosen, else the repository's pinned one when installed, else
    ``openclaw`` on PATH."""
    if chosen:
        return shlex.quote(str(Path(chosen).expanduser().resolve()) if os.sep in chosen else chosen)
    node_modules = PINNED_OPENCLAW.parent / "node_modules"
    if PINNED_OPENCLAW.is_file() and (node_modules / "openclaw" / "openclaw.mjs").is_file():
        return shlex.quote(str(PINNED_OPENCLAW))
    return "openclaw"


def launcher_text(folder: OpenClawFolder, server_url: str, openclaw: str = "") -> str:
    state = folder.path.resolve()
    q = shlex.quote
    return (
        "#!/bin/sh\n"
        f"# OpenClaw for the clawloop server at {server_url}, written by `clawloop openclaw`. Its config and state\n"
        f"# are in {state} (not ~/.openclaw); the server's user key is exported to OpenClaw only.\n"
        f"OPENCLAW_STATE_DIR={q(str(state))}\n"
        f"OPENCLAW_CONFIG_PATH={q(str(state / folder.config.name))}\n"
        f"CLAWLOOP_API_KEY=$(cat {q(str(state / folder.api_key.name))}) || exit 1\n"
        "export OPENCLAW_STATE_DIR OPENCLAW_CONFIG_PATH CLAWLOOP_API_KEY\n"
        f'exec {openclaw_command(openclaw)} "$@"\n')


def write_launcher(folder: OpenClawFolder, server_url: str, openclaw: str = "") -> None:
    write_text_atomically(folder.launcher, launcher_text(folder, server_url, openclaw))
    folder.launcher.chmod(0o755)


# ---- bringing it up ---------------------------------------------------------------------------------------------
def local_url(config: Config) -> str:
    """The server's address as seen from this machine."""
    host = config.host if config.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return f"http://{host}:{config.port}"


def holds_training(run_dir: Path) -> bool:
    """Whether the run folder holds earlier training (then ``clawloop openclaw`` resumes it)."""
    from clawloop.run_folder import training_state

    path = run_dir / STORE_FILENAME
    if not path.exists():
        return False
    store = Store(path, readonly=True)
    try:
        return training_state(store, run_dir).exists
    finally:
        store.close()


def wait_until_serving(url: str, stop: threading.Event, poll_s: float = 0.5) -> bool:
    """Poll ``/healthz`` until it answers (True) or ``stop`` is set (False). Loading a model can take minutes."""
    while not stop.is_set():
        try:
            if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(poll_s)
    return False


def shown_path(path: Path) -> str:
    """A path as the user types it: relative to the current folder when inside it."""
    resolved = path.resolve()
    try:
        return str(resolved.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(resolved)


def clawloop_command() -> str:
    """The ``clawloop`` executable of this interpreter's environment (e.g. .venv/bin/clawloop)."""
    beside = Path(sys.executable).parent / "clawloop"
    return shown_path(beside) if beside.exists() else "clawloop"


def end_command(config: Config, folder: OpenClawFolder, session: str) -> str:
    parts = [clawloop_command(), "openclaw-end", session]
    if folder != OpenClawFolder.for_run(config.run_dir):
        parts += ["--openclaw-dir", shown_path(folder.path)]
    if Path(config.run_dir) != Path(Config().run_dir):
        parts += ["--run-dir", shown_path(Path(config.run_dir))]
    return " ".join(shlex.quote(p) for p in parts)


def next_steps(config: Config, folder: OpenClawFolder, url: str, context: int) -> str:
    launcher = shown_path(folder.launcher)
    turn = f'{shlex.quote(launcher)} agent --local --session-id {EXAMPLE_SESSION} -m "{EXAMPLE_MESSAGE}"'
    return "\n".join([
        f"clawloop serves model {config.model!r} ({context}-token context) for OpenClaw at {url}/v1",
        f"  run folder (records, checkpoints, versions): {shown_path(Path(config.run_dir))}",
        f"  OpenClaw's config and state: {shown_path(folder.path)} (~/.openclaw is not used)",
        "",
        "Talk to OpenClaw, from another terminal in this folder (one --session-id per conversation):",
        f"  {turn}",
        "End a conversation, so that its last answer is closed now rather than after "
        f"{config.session_idle_timeout_s / 60:g} minutes idle:",
        f"  {end_command(config, folder, EXAMPLE_SESSION)}",
        f"Dashboard: {url}/dashboard/  (admin key: {config.admin_key}; also in {shown_path(folder.admin_key)})",
        "Stop with Ctrl-C; the same command starts it again and training goes on from where it stopped.",
        ""])


def configure_openclaw(config: Config, folder: OpenClawFolder, url: str, *, plugin: Path | None = None,
                       max_tokens: int = 512, full: bool = False, openclaw: str = "") -> str:
    """Once the server answers: write OpenClaw's config and launcher; the text that says what to run next."""
    limits = limits_from_server(url, config.api_key)
    write_openclaw_config(folder, build_config(limits, max_tokens=max_tokens, lean=not full, plugin=plugin))
    write_launcher(folder, url, openclaw)
    return next_steps(config, folder, url, limits.context)


def bring_up(config: Config, *, openclaw_dir: str = "", plugin: str = "", max_tokens: int = 512,
             full: bool = False, openclaw: str = "", resume: bool = False, fresh: bool = False,
             log_level: str = "warning") -> None:
    """Serve and train (blocking, like ``clawloop serve``); OpenClaw's folder is written once the server answers."""
    from clawloop.runtime import run

    if config.port == 0:
        raise OpenClawSetupError("clawloop openclaw needs a fixed --port: OpenClaw's config names it")
    if not config.train:
        raise OpenClawSetupError("clawloop openclaw trains while it serves; drop --no-train (or use clawloop serve "
                                 "with clawloop openclaw-config)")
    folder = OpenClawFolder.for_run(config.run_dir, openclaw_dir)
    check_config_replaceable(folder)
    plugin_path = plugin_dir(plugin) if plugin else None
    config = settle_keys(config, folder)
    if not fresh and not resume and holds_training(Path(config.run_dir)):
        resume = True
        print(f"clawloop openclaw: {config.run_dir} holds earlier training; going on from it (--fresh starts over)",
              file=sys.stderr, flush=True)
    url = local_url(config)
    stop = threading.Event()

    def when_serving() -> None:
        if not wait_until_serving(url, stop):
            return
        try:
            print(configure_openclaw(config, folder, url, plugin=plugin_path, max_tokens=max_tokens, full=full,
                                     openclaw=openclaw), flush=True)
        except (OpenClawConfigError, OpenClawSetupError) as exc:
            print(f"clawloop openclaw: {exc}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # the server shuts down as on Ctrl-C

    watcher = threading.Thread(target=when_serving, name="clawloop-openclaw-setup", daemon=True)
    watcher.start()
    try:
        run(config, resume=resume, fresh=fresh, log_level=log_level)
    finally:
        stop.set()


# ---- ending a conversation ---------------------------------------------------------------------------------------
def message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def openclaw_session_of(messages: list[dict[str, Any]]) -> str:
    """The OpenClaw session id in a conversation's first user message (its Runtime line), or ''."""
    first = next((m for m in messages if m.get("role") == "user"), None)
    return runtime_session_id(message_text(first)) if first else ""


def clawloop_sessions_of(store: Store, openclaw_session: str, scan: int = SESSION_SCAN) -> list[str]:
    """The clawloop sessions (newest first) whose conversation OpenClaw began under ``openclaw_session``."""
    found = []
    for summary in store.session_summaries(limit=scan):
        first = store.turns(session_id=summary["session_id"], limit=1)
        if first and openclaw_session_of(first[0].messages) == openclaw_session:
            found.append(summary["session_id"])
    return found


def end_openclaw_session(config: Config, folder: OpenClawFolder, openclaw_session: str) -> list[str]:
    """End the live clawloop sessions of an OpenClaw session; the ids of those ended (none: all already were)."""
    store_path = Path(config.run_dir) / STORE_FILENAME
    if not store_path.exists():
        raise OpenClawSetupError(f"{config.run_dir} holds no run ({STORE_FILENAME} missing); give --run-dir")
    store = Store(store_path, readonly=True)
    try:
        sessions = clawloop_sessions_of(store, openclaw_session)
    finally:
        store.close()
    if not sessions:
        raise OpenClawSetupError(f"no conversation of OpenClaw session {openclaw_session!r} in {config.run_dir}")
    try:
        base_url = json.loads(folder.config.read_text())["models"]["providers"]["clawloop"]["baseUrl"]
    except (OSError, ValueError, KeyError) as exc:
        raise OpenClawSetupError(f"cannot read the server's address from {folder.config}: {exc}") from None
    key = read_secret(folder.api_key) or config.api_key  # the key the server was started with
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    ended = []
    for session in sessions:
        try:
            r = httpx.post(f"{base_url.rstrip('/')}/sessions/{session}/end", headers=headers, timeout=60)
        except httpx.HTTPError as exc:
            raise OpenClawSetupError(f"cannot reach the server at {base_url}: {exc}") from None
        if r.status_code == 200:
            ended.append(session)
        elif r.status_code != 404:  # 404: that session had ended already
            raise OpenClawSetupError(f"{base_url} answered {r.status_code} ending {session}: {r.text[:200]}")
    return ended
