"""Publishing new policy weights to a vLLM server while it keeps serving.

Two ways, both bumping the engine's ``policy_version`` by one per publication:

* ``LoRAPublisher`` — the adapter is written to ``adapters_dir/<prefix>-v<N>`` and hot-loaded under that
  versioned name (``POST /v1/load_lora_adapter``; the server needs ``--enable-lora`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). New requests name the new adapter as their model, so each request runs on
  exactly one version from start to end and nothing waits. An older adapter is unloaded
  (``/v1/unload_lora_adapter``) and its folder removed once no request in flight uses it and nobody holds it
  (``VLLMEngine.hold``, for a stale sample that still needs it); ``keep_previous`` keeps the N newest older ones
  loaded anyway. Give the server ``--max-loras`` >= ``keep_previous + 2`` so the adapters in use fit at once.
* ``CheckpointPublisher`` (full fine-tuning) — the full state dict is written as a safetensors Hugging Face
  folder (``checkpoints_dir/<prefix>-v<N>``: weights plus the base folder's config and tokenizer files; a tied
  ``lm_head`` is left out as Hugging Face does; keys must match the base checkpoint, so a partial dict cannot load
  half a model). Then, with the engine draining (new requests wait, running ones finish), the server is paused
  (``/pause?mode=wait``), reloads the folder in place (``/collective_rpc`` -> ``reload_weights``, vLLM's
  in-place reload), drops its prefix cache (cached KV of the old weights must not be reused), records the
  version (``/update_weight_version``) and resumes. These endpoints exist only on a server started with
  ``VLLM_SERVER_DEV_MODE=1`` (``VLLMServerSettings(dev_mode=True)``). The new version is served, and recorded
  here, as soon as its reload succeeded (a failed ``/update_weight_version`` only leaves vLLM's own label stale
  and is logged). If the reload fails, the previous weights are reloaded, serving resumes and the error is
  raised; if that fails too, the server stays paused (no request is served on half-loaded weights) until a
  publication or restore succeeds or the server is restarted, and the error says so. vLLM 0.32 also has a
  streaming weight-transfer API (``/init_weight_transfer_engine`` + ``/update_weights`` over NCCL or CUDA IPC); it
  needs GPUs on both sides, so the disk reload is the path that works everywhere, CPU included.

Paths go to the server as written; when the server sees the folders under another mount, give ``server_dir`` (the
same folder as the server sees it). Publication must run in the process whose engine serves the requests (the
API process): only that engine knows which requests are in flight.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clawloop.weight_folder import copy_weight_folder, write_weight_folder
from clawloop.engines.base import EngineError
from clawloop.engines.vllm import VLLMEngine

log = logging.getLogger(__name__)

BASE_ADAPTER = "base"
"""The name of the zero adapter the base model's requests go to under per-user policies (never a user's: those are
``k_…`` key names)."""

USER_ADAPTERS_DIR = Path("published") / "users"
"""Where, under the run folder, ``UserAdapterPublisher`` writes every user's adapter versions (one folder per user)."""

_COPY_FROM_BASE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                   "tokenizer.model")


@dataclass
class LoRAWeights:
    """An adapter given as data: its PEFT ``adapter_config.json`` content and its tensors (PEFT key names)."""

    config: Mapping[str, Any]
    state_dict: Mapping[str, torch.Tensor]


class _Publisher:
    def __init__(self, engine: VLLMEngine, root: str | Path, name_prefix: str, server_dir: str | Path | None, *,
                 attach: bool = True):
        self.engine = engine
        self.root = Path(root)
        self.name_prefix = name_prefix
        self.server_dir = Path(server_dir) if server_dir else None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        if attach:  # the engine's own policy goes through it (a user's adapter publisher is not attached)
            engine.publisher = self

    def _name(self, version: int) -> str:
        return f"{self.name_prefix}-v{version}"

    def _server_path(self, folder: Path) -> str:
        if self.server_dir is None:
            return str(folder.resolve())
        return str(self.server_dir / folder.relative_to(self.root))

    def _serial(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        return await self.engine.request(method, path, body, retry=False, expect_json=False)


class LoRAPublisher(_Publisher):
    """Hot-load LoRA adapters under versioned names (see the module docstring)."""

    takes_adapters = True
    """A LoRA run hands it the adapter itself (a PEFT model or folder), not merged weights."""

    def __init__(self, engine: VLLMEngine, adapters_dir: str | Path, *, name_prefix: str = "policy",
                 keep_previous: int = 0, server_dir: str | Path | None = None, delete_retired: bool = True,
                 adapter: str | None = None):
        """``adapter``: publish versions of that adapter name (``engine.set_adapter_route``; per-user policies)
        instead of the engine's policy."""
        super().__init__(engine, adapters_dir, name_prefix, server_dir, attach=adapter is None)
        self.adapter = adapter
        self.keep_previous = max(0, keep_previous)
        self.delete_retired = delete_retired
        self.loaded: list[tuple[int, str]] = []
        """(version, adapter name) loaded by this publisher and not yet retired, oldest first."""
        self.unloaded: list[str] = []
        self._retiring: dict[str, asyncio.Task] = {}

    async def publish(self, adapter: Any, *, version: int | None = None) -> int:
        """Load ``adapter`` (a PEFT folder, a PEFT model, or ``LoRAWeights``) as the new policy; its version."""
        async with self._serial():
            if version is None:
                current = self.engine.policy_version if self.adapter is None else self.engine.adapter_version(
                    self.adapter)
                version = (current or 0) + 1
            version = int(version)
            name = self._name(version)
            retiring = self._retiring.get(name)
            if retiring is not None:  # a rollback to a version being unloaded: let that finish, then load it again
                await retiring
            if any(n == name for _, n in self.loaded):
                # Still loaded (a rollback to the version being served, or to one kept loaded): a version number
                # names one set of weights, so it is served as it is; vLLM would refuse to load the name twice.
                self.loaded = [(v, n) for v, n in self.loaded if n != name]
            else:
                folder = await asyncio.to_thread(self._materialise, adapter, self.root / name)
                body = {"lora_name": name, "lora_path": self._server_path(folder)}
                try:
                    try:
                        await self._call("POST", "/v1/load_lora_adapter", body)
                    except EngineError as exc:
                        if "already been loaded" not in str(exc):
                            raise
                        # An adapter of this name from an earlier process on the same server (a restart, another
                        # run attached to it) may hold other weights: this version's folder replaces it.
                        await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
                        await self._call("POST", "/v1/load_lora_adapter", body)
                except EngineError as exc:
                    raise EngineError(f"loading LoRA adapter {name} from {folder} failed: {exc}") from exc
            if self.adapter is None:
                self.engine.set_policy(version, name)
            else:
                self.engine.set_adapter_route(self.adapter, version, name)
            self.loaded.append((version, name))
            for _, old in self.loaded[: -1 - self.keep_previous]:
                if old in self._retiring:
                    continue
                if self.engine.in_use(old):  # unload once the last request on it finishes
                    self._retiring[old] = asyncio.ensure_future(self._retire(old))
                else:
                    await self._retire(old)
            return version

    def _materialise(self, adapter: Any, folder: Path) -> Path:
        if isinstance(adapter, (str, Path)):
            source = Path(adapter)
            if not (source / "adapter_config.json").is_file():
                raise EngineError(f"{source} is not a PEFT adapter folder (no adapter_config.json)")
            return copy_weight_folder(source, folder, mode=0o755)
        if isinstance(adapter, LoRAWeights):
            return write_weight_folder(folder, adapter.state_dict, tensors_file="adapter_model.safetensors",
                                       metadata={"format": "pt"}, record=adapter.config,
                                       record_file="adapter_config.json", mode=0o755)
        if hasattr(adapter, "save_pretrained") and hasattr(adapter, "peft_config"):
            return write_weight_folder(folder, write=lambda tmp: adapter.save_pretrained(str(tmp)), mode=0o755)
        raise EngineError(
            f"cannot publish a {type(adapter).__name__} as a LoRA adapter: give a PEFT folder, a PEFT model or "
            "LoRAWeights"
        )

    async def retire(self, name: str) -> None:
        """Unload version ``name`` once no request runs on it (``_retire``), waiting for it."""
        await self._retire(name)

    async def _retire(self, name: str) -> None:
        try:
            await self.engine.when_idle(name)
            try:
                await self._call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
            except EngineError as exc:
                if "404" not in str(exc):  # already gone is fine
                    raise
            self.loaded = [(v, n) for v, n in self.loaded if n != name]
            self.unloaded.append(name)
            if self.delete_retired:
                await asyncio.to_thread(shutil.rmtree, self.root / name, True)
        except Exception:  # noqa: BLE001 - a failed unload must not break serving; it is logged
            log.exception("unloading LoRA adapter %s failed", name)
        finally:
            self._retiring.pop(name, None)

    async def restore(self) -> None:
        """Load the adapters this publisher keeps again, e.g. after ``VLLMServer.ensure_running`` restarted the
        server (a restart forgets runtime-loaded adapters)."""
        async with self._serial():
            for _, name in self.loaded:
                try:
                    body = {"lora_name": name, "lora_path": self._server_path(self.root / name)}
                    await self._call("POST", "/v1/load_lora_adapter", body)
                except EngineError as exc:
                    if "already been loaded" not in str(exc):
                        raise

    async def wait_retired(self) -> None:
        """Wait until every adapter scheduled for unloading is unloaded (tests, shutdown)."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring.values()), return_exceptions=True)

    async def aclose(self) -> None:
        for task in list(self._retiring.values()):
            task.cancel()
        self._retiring.clear()


class UserAdapterPublisher:
    """Per-user policies on one vLLM server: every user's adapter versions are hot-loaded under their own names,
    ``<user>-v<N>`` (a ``LoRAPublisher`` per user, in ``adapters_dir/<user>/``), and each user's requests go to
    their newest version (``engine.set_adapter_route``). A user's older version is unloaded once no request uses
    it. How many adapters are resident at once is vLLM's own bound: ``--max-loras`` per batch and its CPU cache of
    adapters, which it fills and evicts by recency, loading an evicted one again from its folder (kept on disk
    while the version is served) when a request names it."""

    takes_adapters = True

    def __init__(self, engine: VLLMEngine, adapters_dir: str | Path, *, server_dir: str | Path | None = None):
        self.engine = engine
        self.root = Path(adapters_dir)
        self.server_dir = Path(server_dir) if server_dir else None
        self.publishers: dict[str, LoRAPublisher] = {}
        self.base_adapter: str | None = None
        """The all-zero adapter the base model's requests go to once any user's adapter is loaded (see
        ``_serve_base_through_an_adapter``)."""
        engine.adapter_publisher = self

    def _publisher(self, name: str) -> LoRAPublisher:
        publisher = self.publishers.get(name)
        if publisher is None:
            if not name or "/" in name or name.startswith("."):
                raise EngineError(f"adapter name {name!r} cannot name a folder")
            publisher = LoRAPublisher(self.engine, self.root / name, name_prefix=name, adapter=name,
                                      server_dir=self.server_dir / name if self.server_dir else None)
            self.publishers[name] = publisher
        return publisher

    async def publish(self, name: str, adapter: Mapping[str, torch.Tensor], scaling: float, *,
                      version: int | None = None) -> int:
        """Load ``adapter`` (PEFT tensors; ``scaling`` = alpha / r) as a new version of ``name``; its version."""
        if name == BASE_ADAPTER:
            raise EngineError(f"{BASE_ADAPTER!r} names the base model's own adapter")
        config = adapter_config(adapter, scaling)
        if self.base_adapter is None:
            await self._serve_base_through_an_adapter(config, adapter)
        weights = LoRAWeights(config=config, state_dict=dict(adapter))
        return await self._publisher(name).publish(weights, version=version)

    async def _serve_base_through_an_adapter(self, config: Mapping[str, Any],
                                             like: Mapping[str, torch.Tensor]) -> None:
        """Route the base model's requests to an adapter of zeros before the first user's adapter loads. vLLM 0.32's
        CPU LoRA kernels give a request without an adapter wrong log-probs when it shares a batch with adapter
        requests (measured: 0.3-0.9 nats off the base model, while the adapter rows are exact, and exact when
        alone); with every row on an adapter each row is exact, and a zero adapter adds nothing."""
        zeros = {k: torch.zeros_like(v) for k, v in like.items()}
        publisher = LoRAPublisher(self.engine, self.root / BASE_ADAPTER, name_prefix=BASE_ADAPTER, adapter=BASE_ADAPTER,
                                  server_dir=self.server_dir / BASE_ADAPTER if self.server_dir else None)
        await publisher.publish(LoRAWeights(config=config, state_dict=zeros), version=0)
        self.engine.remove_adapter_route(BASE_ADAPTER)  # no request names it: the base route goes to it
        self.engine.set_policy(self.engine.policy_version, publisher.loaded[-1][1])
        self.publishers[BASE_ADAPTER] = publisher
        self.base_adapter = publisher.loaded[-1][1]

    async def remove(self, name: str) -> int:
        """Unpublish ``name`` (a forgotten user): its route goes now; each of its versions is unloaded once no
        request runs on it, then its folder is deleted. Returns the version it had (0: none)."""
        publisher = self.publishers.pop(name, None)
        if publisher is None:
            route = self.engine.remove_adapter_route(name)
            return 0 if route is None else route.version
        async with publisher._serial():  # after a publication in flight, which would set the route again
            route = self.engine.remove_adapter_route(name)
        for _, loaded in list(publisher.loaded):
            await publisher.retire(loaded)
        await asyncio.to_thread(shutil.rmtree, publisher.root, True)
        return 0 if route is None else route.version

    async def restore(self) -> None:
        """Load every user's served adapters again (after a server restart)."""
        for publisher in self.publishers.values():
            await publisher.restore()

    async def aclose(self) -> None:
        for publisher in self.publishers.values():
            await publisher.aclose()


def adapter_config(adapter: Mapping[str, torch.Tensor], scaling: float) -> dict[str, Any]:
    """The PEFT ``adapter_config.json`` of a plain LoRA adapter given as tensors: its rank, its target modules and
    ``lora_alpha = scaling · r``."""
    a_keys = [k for k in adapter if k.endswith(".lora_A.weight")]
    if not a_keys:
        raise EngineError("the adapter holds no LoRA pairs (no '.lora_A.weight' tensors)")
    ranks = {int(adapter[k].shape[0]) for k in a_keys}
    if len(ranks) != 1:
        raise EngineError(f"the adapter's layers have different ranks {sorted(ranks)}: plain LoRA has one")
    r = ranks.pop()
    targets = sorted({k[:-len(".lora_A.weight")].rsplit(".", 1)[-1] for k in a_keys})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": float(scaling) * r,
            "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "modules_to_save": None}


class CheckpointPublisher(_Publisher):
    """Full fine-tuning: write a checkpoint folder and reload it in place (see the module docstring)."""

    takes_adapters = False
    """It takes whole weights (a LoRA run's merged into the base)."""

    def __init__(self, engine: VLLMEngine, checkpoints_dir: str | Path, base_model_dir: str | Path, *,
                 name_prefix: str = "policy", keep: int = 2, server_dir: str | Path | None = None):
        super().__init__(engine, checkpoints_dir, name_prefix, server_dir)
        self.base_model_dir = Path(base_model_dir)
        self.keep = max(1, keep)
        self.current: Path = self.base_model_dir
        """The folder the server's weights came from."""
        self.written: list[Path] = []
        self._base_keys: set[str] | None = None
        self._tied = bool(json.loads((self.base_model_dir / "config.json").read_text()).get("tie_word_embeddings"))

    async def publish(self, weights: Any, *, version: int | None = None) -> int:
        """Publish a full state dict (or module, or an HF checkpoint folder); returns the new version."""
        async with self._serial():
            version = self.engine.policy_version + 1 if version is None else int(version)
            if isinstance(weights, (str, Path)):
                folder = Path(weights)
                if not (folder / "config.json").is_file():
                    raise EngineError(f"{folder} is not a Hugging Face checkpoint folder")
            else:
                folder = await asyncio.to_thread(self._write, weights, self.root / self._name(version))
                self.written.append(folder)
            async with self.engine.draining():
                await self._reload(folder, version)
            await asyncio.to_thread(self._prune)
            return version

    async def restore(self) -> None:
        """Reload the current weights, e.g. after a restarted server came back up with the base model."""
        async with self._serial():
            if self.current != self.base_model_dir:
                async with self.engine.draining():
                    await self._reload(self.current, self.engine.policy_version)

    async def _reload(self, folder: Path, version: int) -> None:
        """Pause, load ``folder`` as ``version`` and resume; a failure is rolled back (``_roll_back``)."""
        try:
            await self._call("POST", "/pause?mode=wait")
        except EngineError as exc:
            hint = " (start the server with VLLM_SERVER_DEV_MODE=1: VLLMServerSettings(dev_mode=True))" \
                if "404" in str(exc) else ""
            raise EngineError(f"cannot pause {self.engine.base_url} for a weight reload{hint}: {exc}") from exc
        try:
            await self._reload_from(folder)
        except EngineError as exc:
            await self._roll_back(folder, exc)
        # The server holds the new weights from here on: what is served and what is recorded must agree.
        self.current = folder
        self.engine.set_policy(version, self.engine.base_model)
        try:
            await self._call("POST", "/update_weight_version", {"new_version": str(version)})
        except EngineError as exc:
            log.warning("%s serves weight version %d but did not record it: %s", self.engine.base_url, version, exc)
        finally:
            await self._call("POST", "/resume")

    async def _roll_back(self, folder: Path, error: EngineError) -> None:
        """After loading ``folder`` failed: reload the previous weights, resume and raise. When that fails too, the
        server is left paused: neither set of weights is whole, and resuming would serve a half-loaded model."""
        failure = f"reloading weights from {folder} failed: {error}"
        try:
            await self._reload_from(self.current)
        except EngineError as again:
            log.error("%s is left paused: %s; reloading the previous weights failed too", self.engine.base_url,
                      failure)
            raise EngineError(
                f"{failure}; reloading the previous weights ({self.current}) failed too: {again}; the server stays "
                "paused (no request is served on half-loaded weights) until a publication or restore succeeds or "
                "it is restarted"
            ) from error
        await self._call("POST", "/resume")
        raise EngineError(f"{failure}; the previous weights ({self.current}) were reloaded") from error

    async def _reload_from(self, folder: Path) -> None:
        await self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": self._server_path(folder)}})
        # Cached KV blocks were computed by the old weights.
        await self._call("POST", "/reset_prefix_cache")

    def _server_path(self, folder: Path) -> str:
        if folder == self.base_model_dir or self.server_dir is None or not folder.is_relative_to(self.root):
            return str(folder.resolve())
        return super()._server_path(folder)

    def base_keys(self) -> set[str]:
        if self._base_keys is None:
            from safetensors import safe_open

            keys: set[str] = set()
            for path in sorted(self.base_model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    keys.update(f.keys())
            if not keys:
                raise EngineError(f"{self.base_model_dir} holds no safetensors weights to compare against")
            self._base_keys = keys
        return self._base_keys

    def _write(self, weights: Any, folder: Path) -> Path:
        if isinstance(weights, torch.nn.Module):
            if hasattr(weights, "peft_config"):
                raise EngineError("a PEFT model goes to LoRAPublisher (or merge_and_unload() it first)")
            weights = weights.state_dict()
        if not isinstance(weights, Mapping):
            raise EngineError(f"cannot publish a {type(weights).__name__}: give a state dict, a module or a folder")
        state = dict(weights)
        if self._tied:
            state.pop("lm_head.weight", None)
        base = self.base_keys()
        unexpected = sorted(set(state) - base)
        missing = sorted(base - set(state))
        if unexpected or missing:
            raise EngineError(
                f"state dict does not match the served checkpoint: unexpected {unexpected[:5]}, missing {missing[:5]}"
            )

        copies = [self.base_model_dir / name for name in _COPY_FROM_BASE if (self.base_model_dir / name).is_file()]
        return write_weight_folder(folder, state, tensors_file="model.safetensors", metadata={"format": "pt"},
                                   copies=copies, mode=0o755)

    def _prune(self) -> None:
        """Keep the newest ``keep`` written folders (the one being served is always among them)."""
        while len(self.written) > self.keep:
            old = self.written.pop(0)
            if old != self.current:
                shutil.rmtree(old, ignore_errors=True)
