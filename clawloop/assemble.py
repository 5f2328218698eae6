"""The composition root: every part of one clawloop process, built in reading order by ``assemble``.

Each part gets what it needs through its constructor, hooks included; no part's attributes or lists are set from
outside after it was built. A hook that points forward (the sessions wake the pipeline, which is built after
them) is a closure over the later part, so a wake-up before that part exists is simply not delivered: nothing is
running then, and the pipeline and trainer poll the store anyway.

Order, and why:

0. **run folder**: the store (``RUN_DIR/store.sqlite``) is opened and recovered, and with an embedded trainer the
   folder's earlier training is checked (``clawloop.run_folder``). First, because a folder that cannot be
   started must stop start-up in seconds, before any model or vLLM server loads. A given store is used as it is
   (it may hold live leases of a trainer in this process).
1. **fleet**: the vLLM servers the config names, started or attached (``clawloop.fleet``); the config then
   holds their URLs. With learning on, a ``judge_url`` is checked here (``judge.endpoint_check``): a wrong key or
   path stops start-up, a slow or absent judge only warns.
2. **engines**: the policy engine (given, the fleet's policy server, or the embedded HF engine) and, with learning
   on, the frozen base engine when the embedded judge or the ``teacher = "base"`` teacher needs it (the fleet's
   teacher server, else loaded in-process).
3. **sessions**: ``on_judgeable`` wakes the pipeline and then calls the caller's hook, if any.
4. **judge**, 5. **teacher** (methods with an OPD branch; asked by the trainer, in-process or over the teacher
   route), 6. **pipeline** (votes and hints only; ``on_sample`` wakes the trainer), 7. **trainer** (``config.train``
   with ``trainer = "embedded"``; a remote trainer leases over HTTP instead).
8. **routes**: the chat API (``api.app.create_app``), the trainer routes, the forget route
   (``api.forget_routes``), and with learning on the teacher and admin routes. 9. **dashboard**: its routes are
   mounted onto the app here, so the API layer never imports it.

Components (``async start()`` / ``async stop()``), started in this order after the sessions are restored and
stopped in reverse before the engines close: the ``FleetSupervisor`` whenever a fleet runs (training on or off),
the pipeline, the trainer, then the caller's own. ``Assembly.lifespan`` runs them around serving;
``Assembly.close`` closes the store and stops the vLLM servers, each only when this assembly opened or started it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO, runtime_checkable

from fastapi import FastAPI

from clawloop.api.admin_routes import mount_admin_routes
from clawloop.api.app import ChatService, create_app
from clawloop.api.auth import check_keys_file
from clawloop.api.forget_routes import mount_forget_route
from clawloop.api.metrics import ServingMetrics
from clawloop.api.sessions import JudgeableHook, SessionManager
from clawloop.api.teacher_routes import mount_teacher_routes
from clawloop.api.trainer_routes import mount_trainer_routes
from clawloop.config import Config
from clawloop.dashboard.routes import install_for_service
from clawloop.fleet import Fleet, FleetSupervisor
from clawloop.judge.describe import judge_backend
from clawloop.judge.endpoint_check import check_judge_endpoint
from clawloop.judge.factory import build_judge, load_base_engine
from clawloop.judge.votes import Judge
from clawloop.pipeline import Pipeline
from clawloop.renderers import chat_render_fn
from clawloop.run_folder import TrainedWith, open_run_store, prepare_training_state
from clawloop.store import Store
from clawloop.teacher import Teacher
from clawloop.trainer.forget import finish_pending_forget
from clawloop.trainer.loop import OnlineTrainer

log = logging.getLogger("clawloop.assemble")


class Component(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@runtime_checkable
class ConnectableEngine(Protocol):
    """A remote engine, checked before serving: it serves the model; its context length is learned; the log-probs
    it reports are those of the distribution it samples from."""

    async def connect(self) -> Any: ...

    async def check_logprobs_mode(self) -> None: ...


@dataclass(frozen=True)
class Learning:
    """How the learning half (judge, teacher, pipeline, trainer) runs; ``assemble(learning=None)`` only serves."""

    resume: bool = False
    """Continue the run folder's training from its newest intact checkpoint (``clawloop.run_folder``)."""
    fresh: bool = False
    """Set the folder's earlier training aside (``archive/``) and start from the starting weights."""
    pipeline_poll_s: float = 2.0
    """How often the pipeline looks for judgeable turns when no wake-up came."""
    trainer_poll_s: float = 1.0
    """How often the embedded trainer looks for ready samples when no wake-up came."""
    console: TextIO | None = sys.stderr
    """Where the trainer prints its step lines (None: nowhere)."""
    on_gate: Callable[[dict[str, Any]], None] | None = None
    """Called with every publication-gate decision of the trainer."""


@dataclass
class Assembly:
    """The parts of one process, as ``assemble`` built them."""

    config: Config
    """The settings, with the URLs of the vLLM servers this process started filled in."""
    store: Store
    engine: Any
    sessions: SessionManager
    service: ChatService
    app: FastAPI
    fleet: Fleet | None = None
    """The vLLM servers of this run (None: none)."""
    judge: Judge | None = None
    teacher: Teacher | None = None
    pipeline: Pipeline | None = None
    trainer: OnlineTrainer | None = None
    components: list[Component] = field(default_factory=list)
    owned_engines: list[Any] = field(default_factory=list)
    """Engines built here, closed after the components stopped."""
    owns_store: bool = False

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Any) -> AsyncIterator[None]:
        """Around serving: connect a remote engine, rebuild the live sessions, run the components."""
        if isinstance(self.engine, ConnectableEngine):
            await self.engine.connect()
            # A server attached by URL may run with vLLM's default raw log-probs: every answer sampled at T != 1
            # would be stored, and trained on, with log-probs of another distribution than it was drawn from.
            # One the fleet started itself was given --logprobs-mode processed_logprobs.
            policy = self.fleet.policy if self.fleet is not None else None
            if policy is None or not policy.managed:
                await self.engine.check_logprobs_mode()
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
            for engine in reversed(self.owned_engines):
                try:
                    await engine.close()
                except Exception:
                    log.exception("closing %r failed", engine)

    def close(self) -> None:
        """After serving: close the store and stop the vLLM servers, each only if this assembly opened it."""
        if self.owns_store:
            self.store.close()
        if self.fleet is not None:
            self.fleet.stop()


def assemble(config: Config, *, learning: Learning | None = None, engine: Any = None, store: Store | None = None,
             tokenizer: Any = None, on_judgeable: JudgeableHook | None = None,
             components: Sequence[Component] = (), supervise_interval_s: float = 10.0) -> Assembly:
    """Build every part of one process (module docstring); nothing runs until ``Assembly.lifespan``.

    ``engine`` / ``store``: use these instead of building them (they are then not closed here). ``tokenizer``:
    the chat renderer's tokenizer when it is not the engine's. ``on_judgeable``: called when a stored turn gets
    its next state, after the pipeline was woken. ``components``: started after the built ones.
    ``RunFolderError`` / ``judge.endpoint_check.JudgeEndpointError`` stop start-up; what was opened or started
    by then is closed again."""
    trains_here = learning is not None and config.train and config.trainer == "embedded"
    owns_store = store is None
    fleet: Fleet | None = None
    owned: list[Any] = []
    try:
        # 0. run folder (and the users' keys: both stop start-up before any model loads)
        check_keys_file(config)
        if store is None:
            store = open_run_store(config.run_dir)
            recovered = store.recover()
            if any(recovered.values()):
                log.warning("recovered interrupted work: %s", recovered)
            finished = finish_pending_forget(store, config.run_dir)  # before any weights of the run are loaded
            if finished is not None:
                log.warning("finished forgetting %s, cut short earlier (receipt %s)", finished["owner"],
                            finished["receipt_path"])
        if trains_here:
            assert learning is not None
            from clawloop.engines.model_files import resolve_model

            prepare_training_state(store, config.run_dir, resume=learning.resume, fresh=learning.fresh,
                                   trained_with=TrainedWith(resolve_model(config.model), config.lora))

        # 1. fleet
        if engine is None:
            planned = Fleet.plan(config)
            if planned.servers:
                fleet = planned.start()
                config = fleet.resolve(config)
        if learning is not None and judge_backend(config) == "http":
            check_judge_endpoint(config)

        # 2. engines
        if engine is None:
            engine = build_engine(config, fleet)
            owned.append(engine)
        base_engine = None
        if learning is not None and needs_base_engine(config):
            if fleet is not None and fleet.teacher is not None:
                base_engine = fleet.teacher_engine(config, engine.tokenizer)
            else:
                base_engine = load_base_engine(config)
            owned.append(base_engine)

        # 3. sessions (the pipeline and the trainer are built below: the hooks reach them when they exist)
        pipeline: Pipeline | None = None
        trainer: OnlineTrainer | None = None

        def judgeable(turn_id: int) -> Any:
            if pipeline is not None:
                pipeline.notify(turn_id)
            return on_judgeable(turn_id) if on_judgeable is not None else None

        sessions = SessionManager(store, max_sessions=config.max_sessions,
                                  idle_timeout_s=config.session_idle_timeout_s, on_judgeable=judgeable)

        # 4.-7. judge, teacher, pipeline, trainer
        judge, teacher = None, None
        if learning is not None:
            render = chat_render_fn(engine.tokenizer)
            judge = build_judge(config, base_engine=base_engine, render=render)
            teacher = build_teacher(config, render, policy_engine=engine, base_engine=base_engine,
                                    tokenizer=engine.tokenizer)
            pipeline = Pipeline(store, config, judge=judge, poll_interval_s=learning.pipeline_poll_s, teacher=teacher,
                                on_sample=lambda sample: trainer.wake() if trainer is not None else None)
            if trains_here:
                trainer = OnlineTrainer(config, store, engine, teacher=teacher, resume=learning.resume,
                                        poll_interval_s=learning.trainer_poll_s, console=learning.console,
                                        on_gate=learning.on_gate)

        # 8. routes
        service = ChatService(config, engine, store, sessions, tokenizer=tokenizer, metrics=ServingMetrics())
        parts: Assembly | None = None

        def lifespan(app: Any) -> Any:  # the app is built before the record of the parts that runs it
            assert parts is not None
            return parts.lifespan(app)

        app = create_app(service, lifespan=lifespan)
        mount_trainer_routes(app, store, engine, config)  # remote trainers lease batches here
        if learning is not None:
            mount_teacher_routes(app, lambda: teacher, config)  # a torchrun trainer asks the teacher here
            mount_admin_routes(app, store, config, lambda: trainer)
        mount_forget_route(app, store, config, sessions, engine, lambda: trainer)

        # 9. dashboard
        install_for_service(app, service)

        running: list[Component] = []
        if fleet is not None:  # training on or off: a dead managed server is restarted either way
            running.append(FleetSupervisor(fleet, interval_s=supervise_interval_s))
        running += [c for c in (pipeline, trainer) if c is not None]
        running += list(components)
        parts = Assembly(config=config, store=store, engine=engine, sessions=sessions, service=service, app=app,
                         fleet=fleet, judge=judge, teacher=teacher, pipeline=pipeline, trainer=trainer,
                         components=running, owned_engines=owned, owns_store=owns_store)
        return parts
    except BaseException:
        if owns_store and store is not None:
            store.close()
        if fleet is not None:
            fleet.stop()
        raise


def build_engine(config: Config, fleet: Fleet | None = None) -> Any:
    """The policy engine: a ``VLLMEngine`` on the fleet's policy server (``engine = "vllm"``), else the embedded
    HF engine for ``config.model`` (imported lazily: loading torch models is slow)."""
    if config.engine == "vllm":
        from clawloop.engines.model_files import load_tokenizer, resolve_model

        if fleet is None or fleet.policy is None:
            raise ValueError("engine='vllm' needs the run's vLLM fleet (clawloop.fleet.Fleet)")
        return fleet.policy_engine(config, load_tokenizer(resolve_model(config.model)))
    from clawloop.engines.hf import HFEngine

    per_user = config.policy_scope == "per_user"  # the base model stays fixed; users' adapters get slots
    return HFEngine(config.model, device=config.device, dtype=config.dtype, max_batch_size=config.max_batch_size,
                    num_threads=config.num_threads, model_name=config.served_model_name,
                    adapter_slots=config.user_adapter_slots if per_user else 0, adapter_rank=config.lora_rank,
                    adapter_targets=tuple(config.lora_target_modules))


def needs_base_engine(config: Config) -> bool:
    """Whether the frozen base model runs here: the embedded judge, or a ``teacher = "base"`` teacher."""
    return judge_backend(config) == "engine" or (config.needs_hints and config.teacher == "base")


def build_teacher(config: Config, render: Callable[..., list[int]], *, policy_engine: Any,
                  base_engine: Any = None, tokenizer: Any = None) -> Teacher | None:
    """The teacher of a method with an OPD branch (None otherwise): the frozen base model, or the policy itself.
    ``tokenizer`` gives the ids that end an answer, which a mixed ``opd_target`` reads, and the text of a mixed
    context answer."""
    if not config.needs_hints:
        return None
    return Teacher(base_engine if config.teacher == "base" else policy_engine, render, config, tokenizer=tokenizer)


@contextlib.contextmanager
def offline_teacher(config: Config) -> Iterator[Teacher | None]:
    """The teacher for training without a server (``clawloop train``): the frozen base model loaded in this
    process, closed on exit. None when the method has no OPD branch, or with ``teacher = "policy"``, whose
    teacher is the served policy and so does not exist offline (OPD branches then train only where scores were
    recorded at the old policy's very top-k ids, which a warning says)."""
    if not config.needs_hints:
        yield None
        return
    if config.teacher != "base":
        log.warning("training offline with teacher=%r: no policy serves here, so no teacher is asked; OPD branches "
                    "train only on scores recorded at the same top-k ids", config.teacher)
        yield None
        return
    engine = load_base_engine(config)
    try:
        yield build_teacher(config, chat_render_fn(engine.tokenizer), policy_engine=None, base_engine=engine,
                            tokenizer=engine.tokenizer)
    finally:
        engine.close_sync()


def build_pipeline(config: Config, store: Store, *, tokenizer: Any, base_engine: Any = None,
                   **kwargs: Any) -> Pipeline:
    """A pipeline on its own (a worker process, a benchmark): the judge and ``Pipeline`` as ``assemble`` builds
    them. The embedded judge's ``base_engine`` is loaded here when needed and not given, and then closed by the
    pipeline's ``stop()``; ``kwargs`` go to ``Pipeline``."""
    owned = []
    if judge_backend(config) == "engine" and base_engine is None:
        base_engine = load_base_engine(config)
        owned.append(base_engine)
    judge = build_judge(config, base_engine=base_engine, render=chat_render_fn(tokenizer))
    pipeline = Pipeline(store, config, judge=judge, **kwargs)
    pipeline.owned_engines.extend(owned)  # the pipeline's documented list of engines it closes on stop()
    return pipeline

