"""The vLLM servers a run uses, from its ``Config``: started and supervised here, or attached to.

Roles (docs/method.md, section 5), each its own server:

* **policy** (``engine = "vllm"``): serves the API's requests. ``policy_url`` attaches to a running server;
  otherwise one is started from ``vllm_policy`` with LoRA serving when ``lora`` (new adapters are hot-loaded by
  ``LoRAPublisher``) and dev mode when not (full weights are published by ``CheckpointPublisher`` through
  ``/pause`` + ``/collective_rpc`` reload).
* **teacher** (frozen base model): teacher scoring (``prompt_logprobs``), and the judge when neither ``judge_url``
  nor ``vllm_judge`` names another one (the original system's judge is the frozen base model too; with
  ``judge_backend = "auto"`` it is asked over HTTP, chat completions, so ``judge_extra_body`` applies). It is needed
  when ``engine = "vllm"`` and the method distils from the base model, or the judge falls to it. It never has
  LoRA enabled: prompt log-probs on a LoRA-enabled vLLM 0.32 CPU server crash its engine.
* **judge** (``vllm_judge``): a separate judge server, any model folder; judged over HTTP (chat completions).

Access: a managed server without an ``api_key`` in its section gets a random one, which every client here
sends (the engines and publishers, the judge through ``judge_api_key``, the readiness checks); the server asks for
it on every path but ``/health`` (``clawloop.engines.vllm_server``).

Starting: every managed server is launched first and then waited for, so their (minutes-long) start-ups
overlap. Logs go to ``RUN_DIR/logs/vllm-<role>.log``, the process id and the launch id to ``vllm-<role>.pid``
beside it, rewritten at every (re)start: a server left running by a run that was killed with -9 (nothing could
stop it) is stopped when the folder's next run starts, instead of holding its memory and port forever; only
processes carrying that launch id are touched. Supervision: ``FleetSupervisor`` (a server component the
composition root, ``clawloop.assemble``, runs whenever a fleet does, training on or off) checks the servers every
``interval_s``, restarts a dead managed one (``VLLMServer.ensure_running``, at most ``max_restarts`` times) and,
for the policy server, loads the current weights again (``publisher.restore()``), since a restarted vLLM comes
back with the base model only; an attached policy server that stops answering and comes back (restarted by
whoever runs it) gets its weights restored the same way. Stopping stops the managed servers and leaves attached
ones alone. A policy restore that fails is tried again every interval until it succeeds, and one role's failure
does not keep the others from being checked.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clawloop.config import Config
from clawloop.engines.base import EngineError
from clawloop.engines.model_files import resolve_model
from clawloop.engines.vllm_server import VLLMServer, VLLMServerSettings, end_launch

log = logging.getLogger("clawloop.fleet")

DEFAULT_SERVED_NAME = "base"


def needs_teacher_server(config: Config) -> bool:
    """Whether a run on vLLM needs the frozen base-model server (teacher scoring, or the judge falls to it)."""
    if config.engine != "vllm" or not config.train:  # serving only: nothing is judged or distilled
        return False
    distils_from_base = config.needs_hints and config.teacher == "base"
    judge_on_base = config.judge_backend in ("auto", "engine") and not config.judge_url and not config.vllm_judge
    return distils_from_base or judge_on_base


def role_section(config: Config, role: str) -> dict[str, Any]:
    """The config's ``vllm_<role>`` section: the settings of the server clawloop starts for ``role``."""
    return {"policy": config.vllm_policy, "teacher": config.vllm_teacher, "judge": config.vllm_judge}[role]


def server_settings(config: Config, role: str, model_dir: Path) -> VLLMServerSettings:
    """The settings of the ``role`` server clawloop starts: the config's section over role defaults."""
    section = dict(role_section(config, role))
    defaults: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": DEFAULT_SERVED_NAME,
        "dtype": config.dtype,
        "log_file": str(Path(config.run_dir) / "logs" / f"vllm-{role}.log"),
    }
    if role == "policy":
        defaults.update(enable_lora=bool(config.lora), max_lora_rank=max(16, config.lora_rank),
                        dev_mode=not config.lora)
    if config.num_threads and role != "judge":
        defaults["env"] = {"OMP_NUM_THREADS": str(config.num_threads)}
    settings = {**defaults, **section}
    # Dev mode lets any caller swap the served weights: no server of ours runs without a key.
    settings["api_key"] = settings.get("api_key") or secrets.token_urlsafe(32)
    return VLLMServerSettings.from_mapping(settings)


@dataclass
class Fleet:
    """The policy / teacher / judge servers of one run (``None`` = that role is not on vLLM)."""

    policy: VLLMServer | None = None
    teacher: VLLMServer | None = None
    judge: VLLMServer | None = None
    publisher: Any = None
    """The policy engine's publisher (``LoRAPublisher`` / ``CheckpointPublisher``, or ``UserAdapterPublisher`` for
    per-user policies), restored after a restart."""
    _started: list[VLLMServer] = field(default_factory=list)

    @classmethod
    def plan(cls, config: Config) -> Fleet:
        """Decide which servers the run needs; nothing is started (model folders are resolved lazily)."""
        fleet = cls()
        if config.engine == "vllm":
            fleet.policy = _server(config, "policy", config.policy_url, config.policy_model, config.policy_api_key)
            if needs_teacher_server(config):
                fleet.teacher = _server(config, "teacher", config.teacher_url, config.teacher_model,
                                        config.teacher_api_key)
        if config.vllm_judge and config.train:
            fleet.judge = _server(config, "judge", "", "")
        return fleet

    @property
    def servers(self) -> dict[str, VLLMServer]:
        return {role: s for role, s in (("policy", self.policy), ("teacher", self.teacher), ("judge", self.judge))
                if s is not None}

    def start(self) -> Fleet:
        """Launch every managed server, then wait for all of them (start-ups overlap)."""
        try:
            for role, server in self.servers.items():
                if server.managed:
                    server.pid_file = _pid_file(server)  # rewritten at every start, restarts included
                    stop_leftover(server.pid_file)
                    log.warning("starting the vLLM %s server (log %s)", role, server.settings.log_file)
                server.launch()
                self._started.append(server)
            for server in self.servers.values():
                server.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in reversed(self._started):
            server.stop()
            if server.managed:
                _pid_file(server).unlink(missing_ok=True)
        self._started.clear()

    def resolve(self, config: Config) -> Config:
        """``config`` with the URLs and model names of the started servers filled in."""
        changes: dict[str, Any] = {}
        if self.policy is not None:
            changes.update(policy_url=self.policy.url, policy_model=self.policy.served_model_name, vllm_policy={})
        if self.teacher is not None:
            changes.update(teacher_url=self.teacher.url, teacher_model=self.teacher.served_model_name,
                           vllm_teacher={})
            if config.judge_backend == "auto" and not config.judge_url and not config.vllm_judge:
                # The judge falls to the frozen model: over HTTP (chat completions), like any judge endpoint.
                changes.update(judge_url=self.teacher.url + "/v1", judge_model=self.teacher.served_model_name,
                               judge_api_key=self.teacher.api_key or config.judge_api_key)
        if self.judge is not None:
            changes.update(judge_url=self.judge.url + "/v1", judge_model=self.judge.served_model_name, vllm_judge={},
                           judge_api_key=self.judge.api_key or config.judge_api_key)
        return config.replace(**changes) if changes else config

    # ---- engines ------------------------------------------------------------------------------------------
    def policy_engine(self, config: Config, tokenizer: Any) -> Any:
        """The ``VLLMEngine`` serving the policy, with the publisher new weights go through."""
        from clawloop.engines.vllm_publish import USER_ADAPTERS_DIR, CheckpointPublisher, LoRAPublisher, \
            UserAdapterPublisher

        assert self.policy is not None
        engine = _engine(self.policy, config, tokenizer, lora=config.lora)
        run_dir = Path(config.run_dir)
        if config.policy_scope == "per_user":  # every user's adapter under their own name; the base stays fixed
            self.publisher = UserAdapterPublisher(engine, run_dir / USER_ADAPTERS_DIR)
            return engine
        if config.lora:
            self.publisher = LoRAPublisher(engine, run_dir / "published" / "adapters",
                                           name_prefix=config.served_model_name)
        else:
            self.publisher = CheckpointPublisher(engine, run_dir / "published" / "checkpoints",
                                                 resolve_model(config.model), name_prefix=config.served_model_name)
        engine.publisher = self.publisher
        return engine

    def teacher_engine(self, config: Config, tokenizer: Any) -> Any:
        assert self.teacher is not None
        return _engine(self.teacher, config, tokenizer, lora=False)


def _pid_file(server: VLLMServer) -> Path:
    assert server.settings is not None
    return Path(server.settings.log_file).with_suffix(".pid")


def stop_leftover(pid_file: Path, grace_s: float = 10.0) -> bool:
    """Stop the vLLM server an earlier run of this folder started and could not stop (it was killed with -9):
    it holds memory and its port. Only processes that carry the launch id the pid file records are touched (not
    whatever now has the recorded process id, nor another run's server). True if any was found."""
    try:
        launch_id = str(json.loads(pid_file.read_text())["launch"])
    except (OSError, ValueError, TypeError, KeyError):  # none, or written by an older version: nothing to match
        return False
    found = bool(launch_id) and end_launch(launch_id, grace_s)
    if found:
        log.warning("stopped the vLLM server left running by an earlier run (%s)", pid_file)
    return found


def _server(config: Config, role: str, url: str, model: str, api_key: str = "") -> VLLMServer:
    if url:
        return VLLMServer.attach(url, api_key=api_key, served_model_name=model or DEFAULT_SERVED_NAME)
    model_dir = Path(role_section(config, role).get("model") or resolve_model(config.model))
    return VLLMServer(server_settings(config, role, model_dir))


def _engine(server: VLLMServer, config: Config, tokenizer: Any, *, lora: bool) -> Any:
    overrides: dict[str, Any] = {"tokenizer": tokenizer}
    if not server.managed:
        # Nothing is known about an attached server but what the config says: the model folder sizes the id
        # checks, and a LoRA server is scored by probing, never with prompt log-probs (see VLLMServer.engine).
        vocab = VLLMServerSettings(model=str(resolve_model(config.model))).model_vocab_size()
        overrides.update(vocab_size=vocab, prompt_logprobs=not lora)
    return server.engine(**overrides)


class FleetSupervisor:
    """Server component: restart dead managed servers and restore the published weights on the policy one."""

    def __init__(self, fleet: Fleet, interval_s: float = 10.0):
        self.fleet = fleet
        self.interval_s = interval_s
        self.restarted: list[str] = []
        self._down: set[str] = set()
        self._restore_due = False
        """The policy server came back with the base weights and the current ones are not loaded yet."""
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="clawloop-fleet-supervisor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def check_once(self) -> list[str]:
        """Restart what died and load the policy's weights again where due; returns the roles restarted (or,
        attached, seen coming back). Every role is checked even when another one fails; the failures are raised
        together afterwards (EngineError). A failed restore stays due and is tried again at the next check."""
        restarted: list[str] = []
        failures: dict[str, str] = {}
        for role, server in self.fleet.servers.items():
            try:
                back = await self._came_back(role, server)
            except Exception as exc:  # noqa: BLE001 - reported below, once the other roles were checked
                failures[role] = str(exc)
                continue
            if back:
                restarted.append(role)
                log.warning("the vLLM %s server was restarted", role)
                if role == "policy":  # it came back with the base weights
                    self._restore_due = True
        self.restarted.extend(restarted)
        if self._restore_due and "policy" not in failures:
            try:
                await self._restore()
            except Exception as exc:  # noqa: BLE001 - still due: tried again at the next check
                failures["policy"] = f"loading the current weights again failed: {exc}"
        if failures:
            raise EngineError("; ".join(f"vLLM {role} server: {failure}" for role, failure in failures.items()))
        return restarted

    async def _came_back(self, role: str, server: VLLMServer) -> bool:
        if server.managed:
            return await asyncio.to_thread(server.ensure_running)
        # Restarted by someone else: it comes back with the base weights, so watch for down -> up.
        alive = await asyncio.to_thread(server.is_alive)
        back = alive and role in self._down
        if alive:
            self._down.discard(role)
        else:
            if role not in self._down:
                log.warning("the vLLM %s server at %s does not answer", role, server.url)
            self._down.add(role)
        return back

    async def _restore(self) -> None:
        if self.fleet.publisher is not None:
            await self.fleet.publisher.restore()
        self._restore_due = False

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - a server beyond its restarts, a failed restore: say so every interval
                log.exception("vLLM server supervision failed")
