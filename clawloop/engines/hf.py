"""The embedded engine: a Hugging Face causal LM served with continuous batching on one worker thread.

Design choices (what a reader needs to trust the numbers it returns):

* **One worker thread owns the model.** The asyncio side only validates requests and puts them in an inbox;
  results travel back through ``loop.call_soon_threadsafe`` into a per-request ``asyncio.Queue``. Every
  model call runs under ``torch.inference_mode``.
* **Continuous batching with a shared, left-padded KV cache.** At each decode-step boundary the waiting
  requests (up to ``max_batch_size`` running in all) are prefilled together in one left-padded forward
  (a lone request without padding), sample their first token, and their KV caches are left-padded to the
  running batch's width and concatenated into its ``DynamicCache``. Every decode step is one
  forward over all running sequences with an explicit 2D attention mask and per-sequence ``position_ids``
  (each sequence keeps its true positions whatever padding precedes it). Finished sequences leave the batch
  at once (``batch_select_indices``) and padding columns no sequence needs any more are trimmed. Results are
  therefore the same, up to float rounding, as running each request alone.
* **Sampling** (``clawloop.engines.sampling``): greedy at temperature 0, else temperature then top-p with
  a per-request ``torch.Generator`` (seeded when ``seed`` is given). The log-prob returned for each token is
  read from the very distribution it was drawn from; at temperature 0 it is the plain log-softmax.
* **Ending.** EOS ids (the tokenizer's plus the generation config's) and ``stop_token_ids`` end a sequence
  and are kept as the last id (not in the text). A stop string ends it when the decoded text contains it:
  the text is cut before the stop string, while ``token_ids``/``logprobs`` run up to *and including* the
  token that completed it (so ``decode(token_ids)`` may extend past ``text`` by the stop string and what
  followed it inside that last token). ``max_tokens`` ends with ``"length"``.
* **Streaming** holds back text that could be the start of a stop string and never splits a UTF-8
  character (``clawloop.engines.detok``); the deltas always concatenate to the final ``Generation.text``.
* **Weight publication.** ``swap_mode="double_buffer"`` (default): the new weights are loaded into a copy
  of the model outside the worker; at the next step boundary new requests start on the copy while
  sequences already running keep decoding on the old model object (a second batch, one extra forward per
  step) until they finish and the old copy is freed. Peak memory is two models. ``swap_mode="drain"``
  loads the weights in place: new requests wait (never rejected) until the running ones finish, bounded by
  their ``max_tokens``. Either way every request runs on one set of weights from start to end and
  ``policy_version`` goes up by one. ``publish`` takes a full state dict of the served architecture (LoRA
  adapters are merged by the trainer before publishing) or a callable that edits the model in place.
* **Adapter slots** (``adapter_slots > 0``, ``clawloop.engines.multi_lora``): the base model stays fixed and
  LoRA adapters are published by name (``publish_adapter``), each publication a new version of that name loaded
  into a slot of its own at a step boundary. A request names its adapter (``SamplingParams.adapter``) and runs on
  that adapter's newest version from start to end: requests of different adapters decode in one batch, each row
  with its own adapter's delta, nothing merged. The newest version's tensors are kept, so an adapter that more
  recently used ones pushed out of the bounded slots is loaded again when a request names it; ``remove_adapter``
  unpublishes a name (a forgotten user's). Publishing a version evicts the name's older versions that no
  running sequence uses; otherwise a slot is reused (least recently used first) only when no running sequence
  uses it. Full-weight publication is refused on such an engine; scoring runs on the base.
* **Scoring** runs on the worker between decode steps, in chunks of at most ``score_batch_tokens`` tokens
  (right-padded), taking the final hidden states and applying the output layer only at response positions,
  ``score_chunk_rows`` rows at a time, so the full ``[T, V]`` logits of a long prompt never exist.
  Position ``P - 1 + t`` predicts ``response[t]``. Temperature <= 0 scores at temperature 1.
* Supported models: decoder-only HF causal LMs with standard attention KV caches (Llama, Qwen2/3,
  Mistral, SmolLM, ...). Recurrent/hybrid cache models are refused at construction.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import inspect
import logging
import os
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from clawloop.engines import model_files
from clawloop.engines.base import (
    EngineError,
    check_sampling,
    Generation,
    PromptTooLongError,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
)
from clawloop.engines.detok import IncrementalDetokenizer, StopStrings
from clawloop.engines.head import logit_softcap, soft_capped
from clawloop.engines.multi_lora import LORA_TARGETS, MultiLoRA
from clawloop.engines.sampling import choose_tokens, sampling_logprobs, top_alternatives
from clawloop.memory import trim_heap
from clawloop.priority import lower_thread_priority

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _cache_kwarg_of(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The forward's KV-cache argument. transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name
    warns on every call and goes in 5.40); earlier 5.x releases know only ``past_key_values``."""
    return {_cache_kwarg_of(type(model)): cache, "use_cache": True}


def trim_padding(cache: Any, mask_B_L: torch.Tensor) -> torch.Tensor:
    """Drop the leading KV-cache columns that are padding for every row (dead weight in every decoding step) and
    return the mask without them."""
    first = int(mask_B_L.any(dim=0).nonzero()[0])
    if first > 0:
        for layer in cache.layers:
            layer.keys = layer.keys[:, :, first:, :]
            layer.values = layer.values[:, :, first:, :]
        mask_B_L = mask_B_L[:, first:]
    return mask_B_L


SWAP_MODES = ("double_buffer", "drain")
Weights = Mapping[str, torch.Tensor] | Callable[[torch.nn.Module], Any] | torch.nn.Module


# ------------------------------------------------------------------------------------------ work items


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool
    cancelled: bool = False


@dataclass(eq=False)
class _ScoreJob:
    requests: list[ScoreRequest]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    chunks: deque[list[int]]
    results: list[ScoreResult | None] = field(default_factory=list)


@dataclass(eq=False)
class _PublishJob:
    model: torch.nn.Module | None = None
    """double_buffer: the ready new model, swapped in at the next step boundary."""
    apply: Callable[[torch.nn.Module], None] | None = None
    """drain: applied in place by the worker once no sequence is running."""
    version: int | None = None
    """The version to publish as (None: current + 1)."""
    adapter: tuple[str, Mapping[str, torch.Tensor], float] | None = None
    """Adapter slots: (name, PEFT tensors, scaling) loaded as a new version of that name."""
    remove: str | None = None
    """Adapter slots: the name to unpublish (its versions leave their slots once no answer runs on them)."""
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class _Stop:
    pass


class _Seq:
    """One running completion: its ids, log-probs, text and how much of it the client has seen."""

    def __init__(self, req: _Request, tokenizer: Any, eos_ids: frozenset[int], version: int, device: torch.device,
                 slot: str | None = None):
        self.req = req
        self.params = req.params
        self.version = version
        self.slot = slot
        """The adapter slot (``name@version``) that writes this sequence; None: the model itself."""
        self.generator = torch.Generator(device=device)
        seed = self.params.seed if self.params.seed is not None else random.SystemRandom().randrange(2**62)
        self.generator.manual_seed(int(seed))
        self.end_ids = eos_ids | frozenset(self.params.stop_token_ids)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] | None = [] if self.params.top_logprobs > 0 else None
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopStrings(self.params.stop)
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None

    def append(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> TokenEvent:
        self.ids.append(token_id)
        self.logprobs.append(logprob)
        if self.top is not None:
            self.top.append(top or [])
        ended_by_token = token_id in self.end_ids
        if ended_by_token:
            delta = self.detok.flush()
        else:
            delta = self.detok.add(token_id)
            if len(self.ids) >= self.params.max_tokens:
                delta += self.detok.flush()
        old_len = len(self.text)
        self.text += delta
        cut = self.stops.find(self.text, old_len)
        if cut is not None:
            self.text = self.text[:cut]
            self.finish_reason = "stop"
        elif ended_by_token:
            self.finish_reason = "stop"
        elif len(self.ids) >= self.params.max_tokens:
            self.finish_reason = "length"
        visible_end = len(self.text) if self.finish_reason else len(self.text) - self.stops.holdback(self.text)
        visible_end = max(visible_end, self.emitted)
        text_delta = self.text[self.emitted : visible_end]
        self.emitted = visible_end
        return TokenEvent(token_id=token_id, logprob=logprob, text_delta=text_delta, top_logprobs=top)

    def result(self) -> Generation:
        return Generation(
            token_ids=list(self.ids),
            logprobs=list(self.logprobs),
            finish_reason=self.finish_reason or "length",
            policy_version=self.version,
            prompt_tokens=len(self.req.prompt_ids),
            text=self.text,
            top_logprobs=self.top,
        )


class _Batch:
    """Sequences decoding together on one model object (one policy version)."""

    def __init__(self, model: torch.nn.Module, version: int):
        self.model = model
        self.version = version
        self.seqs: list[_Seq] = []
        self.cache: Any = None
        self.mask_B_L: torch.Tensor | None = None  # 1 = real token, 0 = left padding
        self.pos_B: torch.Tensor | None = None  # position of the next input token of each sequence
        self.next_B: torch.Tensor | None = None  # next input token (the last sampled one)


# ---------------------------------------------------------------------------------------------- engine


class HFEngine:
    """The embedded engine (see the module docstring). Implements ``clawloop.engines.base.Engine``.

    ``model``: "default", "tiny", a local HF folder, or a loaded causal LM (then ``tokenizer`` is required, the
    model is used where it is and ``device``/``dtype`` are ignored; the engine owns it from then on: do not
    train it in place, publish copies of trained weights instead). ``device`` "auto" picks CUDA when present.
    ``max_context`` defaults to ``config.max_position_embeddings``. ``num_threads`` 0 = all cores (the torch
    setting is process-wide). ``eos_token_ids`` overrides the tokenizer's and generation config's EOS ids
    (an empty list disables EOS, as benchmarks want). ``score_batch_tokens`` bounds one scoring forward;
    ``score_chunk_rows`` bounds the rows of one ``[rows, V]`` log-softmax; ``prefill_batch_tokens`` bounds
    one prefill forward (rows x longest prompt) of requests admitted together.
    """

    takes_adapters = False
    """Publication capability: it takes merged weights (a LoRA run's adapter merged into the base)."""

    def __init__(
        self,
        model: str | Path | torch.nn.Module = "default",
        tokenizer: Any = None,
        *,
        device: str | torch.device | None = "auto",
        dtype: str | torch.dtype | None = "float32",
        max_batch_size: int = 16,
        max_context: int | None = None,
        num_threads: int = 0,
        swap_mode: str = "double_buffer",
        eos_token_ids: list[int] | tuple[int, ...] | None = None,
        score_batch_tokens: int = 4096,
        score_chunk_rows: int = 256,
        prefill_batch_tokens: int = 4096,
        initial_version: int = 0,
        model_name: str | None = None,
        worker_nice: int = 0,
        adapter_slots: int = 0,
        adapter_rank: int = 16,
        adapter_targets: tuple[str, ...] = LORA_TARGETS,
    ):
        if swap_mode not in SWAP_MODES:
            raise ValueError(f"swap_mode must be one of {SWAP_MODES}, not {swap_mode!r}")
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        torch.set_num_threads(num_threads if num_threads > 0 else (os.cpu_count() or 1))

        if isinstance(model, torch.nn.Module):
            if tokenizer is None:
                raise ValueError("a model object needs its tokenizer")
            self._model = model.eval()
            self.model_name = model_name or str(getattr(model.config, "name_or_path", "") or "model")
        else:
            model_dir = model_files.resolve_model(model)
            self._model = model_files.load_model(model_dir, dtype=dtype, device=device)
            tokenizer = tokenizer if tokenizer is not None else model_files.load_tokenizer(model_dir)
            self.model_name = model_name or model_dir.name
        self.tokenizer = tokenizer
        self.device = next(self._model.parameters()).device
        config = self._model.config
        self.vocab_size = int(self._model.get_input_embeddings().weight.shape[0])
        position_limit = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        limits = [x for x in (max_context, position_limit) if x]
        if not limits:
            raise ValueError("max_context is unknown: pass max_context=")
        self._max_context = min(limits)
        self.eos_token_ids = frozenset(eos_token_ids) if eos_token_ids is not None else self._default_eos_ids()
        self.max_batch_size = max_batch_size
        self.swap_mode = swap_mode
        self.score_batch_tokens = score_batch_tokens
        self.score_chunk_rows = score_chunk_rows
        self.prefill_batch_tokens = prefill_batch_tokens
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_token_ids))
        self._check_cache_support()
        self._adapters = MultiLoRA(self._model, adapter_targets, max_adapters=adapter_slots,
                                   max_rank=adapter_rank) if adapter_slots > 0 else None
        self._adapter_versions: dict[str, int] = {}
        """Newest published version per adapter name (written by the worker)."""
        self._unpublished_loaded = False
        """A slot still holds an unpublished adapter that a running answer uses (freed after it finishes)."""
        self._adapter_sources: dict[str, tuple[dict[str, torch.Tensor], float]] = {}
        """Each name's newest published adapter as it was handed over: an adapter evicted from its slot by more
        recently used ones is loaded again from here when a request asks for it."""

        self._version = initial_version
        self._latest_model = self._model  # what the next double-buffer publication copies
        self._publish_lock = threading.Lock()
        self._closed = False
        self._inbox: queue.Queue = queue.Queue()
        # Worker-only state.
        self._current = self._model
        self._waiting: deque[_Request] = deque()
        self._score_jobs: deque[_ScoreJob] = deque()
        self._publications: deque[_PublishJob] = deque()
        self._batches: list[_Batch] = []
        self._stopping = False
        self.stats: dict[str, float] = {
            "prefills": 0, "prefill_forwards": 0, "prefill_s": 0.0, "decode_steps": 0, "decode_rows": 0,
            "decode_forward_s": 0.0, "decode_total_s": 0.0, "generated_tokens": 0, "max_running": 0,
            "scored_tokens": 0,
        }
        """Counters since start (read-only outside the worker): ``decode_rows / decode_steps`` is the mean batch;
        ``decode_forward_s / decode_total_s`` the share of decode time spent in the model's forward."""
        self._worker_nice = int(worker_nice)
        """CPU priority of the worker thread below serving's (``clawloop.priority``): for an engine that only does
        the learning loop's work (the frozen base model judging and scoring)."""
        self._thread = threading.Thread(target=self._run, name="clawloop-hf-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------------- public surface

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def model(self) -> torch.nn.Module:
        """The model new requests run on (read-only use: the engine owns it)."""
        return self._latest_model

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        req = self._submit(prompt_ids, params, stream=False)
        try:
            item = await req.queue.get()
        finally:
            req.cancelled = True  # no effect once finished; frees the slot when the caller gave up
        if isinstance(item, BaseException):
            raise item
        return item

    async def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | Generation]:
        req = self._submit(prompt_ids, params, stream=True)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Generation):
                    return
        finally:
            req.cancelled = True

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        if self._closed:
            raise EngineError("engine is closed")
        for r in requests:
            self._validate_score(r)
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        job = _ScoreJob(
            requests=list(requests),
            loop=loop,
            future=loop.create_future(),
            chunks=deque(self._plan_score_chunks(requests)),
            results=[None] * len(requests),
        )
        self._inbox.put(job)
        return await job.future

    async def publish(self, weights: Weights, timeout_s: float | None = None, version: int | None = None) -> int:
        """Swap in new weights (see module docstring); returns the new ``policy_version``.

        ``version`` sets the version explicitly (a trainer resuming from a checkpoint continues its count);
        by default it is the current version plus one."""
        return await asyncio.to_thread(self.publish_sync, weights, timeout_s, version)

    def publish_sync(self, weights: Weights, timeout_s: float | None = None, version: int | None = None) -> int:
        """Blocking ``publish`` for trainer threads. Never call it on the event loop's thread."""
        if self._closed:
            raise EngineError("engine is closed")
        if self._adapters is not None:
            raise EngineError("an engine with adapter slots serves a fixed base model: publish adapters "
                              "(publish_adapter) instead of weights")
        if isinstance(weights, torch.nn.Module):
            weights = weights.state_dict()
        with self._publish_lock:
            if self.swap_mode == "double_buffer":
                new_model = copy.deepcopy(self._latest_model)
                with torch.no_grad():
                    _apply_weights(new_model, weights)
                job = _PublishJob(model=new_model.eval(), version=version)
            else:
                _check_state_dict(self._latest_model, weights)
                job = _PublishJob(apply=lambda m: _apply_weights(m, weights), version=version)
            self._inbox.put(job)
            version = self._wait_published(job, timeout_s)
            if job.model is not None:
                # The starting model too is only referenced by the batches still running on it from here on,
                # so it is freed with them: at rest one model, two while a publication copies.
                self._model = self._latest_model = job.model
        return version

    load_state_dict = publish_sync

    def publish_adapter_sync(self, name: str, adapter: Mapping[str, torch.Tensor], scaling: float, *,
                             version: int | None = None, timeout_s: float | None = None) -> int:
        """Publish ``adapter`` (PEFT tensors, ``base_model.model.<module>.lora_A.weight``; ``scaling`` =
        alpha / r) as a new version of adapter ``name``, loaded at the next step boundary; returns that version
        (``version``, or the name's last + 1, from 1). Requests already running keep the version they started
        on. Blocking: never call it on the event loop's thread."""
        if self._closed:
            raise EngineError("engine is closed")
        if self._adapters is None:
            raise EngineError("this engine has no adapter slots (adapter_slots=0)")
        if not name or "@" in name:
            raise EngineError(f"adapter name {name!r}: non-empty, without '@'")
        job = _PublishJob(adapter=(name, dict(adapter), float(scaling)), version=version)
        self._inbox.put(job)
        return self._wait_published(job, timeout_s)

    async def publish_adapter(self, name: str, adapter: Mapping[str, torch.Tensor], scaling: float, *,
                              version: int | None = None, timeout_s: float | None = None) -> int:
        """``publish_adapter_sync`` off the event loop."""
        return await asyncio.to_thread(functools.partial(self.publish_adapter_sync, name, adapter, scaling,
                                                         version=version, timeout_s=timeout_s))

    def adapter_version(self, name: str) -> int | None:
        """The newest published version of adapter ``name``; None if it was never published."""
        return self._adapter_versions.get(name)

    async def remove_adapter(self, name: str, timeout_s: float | None = None) -> int:
        """Unpublish adapter ``name`` (a forgotten user's): from the next step boundary no new request can name
        it; an answer already running on it finishes. Returns the version it had (0: none)."""
        if self._adapters is None:
            raise EngineError("this engine has no adapter slots (adapter_slots=0)")
        job = _PublishJob(remove=name)
        self._inbox.put(job)
        return await asyncio.to_thread(self._wait_published, job, timeout_s)

    def _wait_published(self, job: _PublishJob, timeout_s: float | None) -> int:
        waited = 0.0
        while True:
            try:
                return job.done.result(timeout=1.0)
            except concurrent.futures.TimeoutError:
                waited += 1.0
                if not self._thread.is_alive():
                    raise EngineError("engine is closed") from None
                if timeout_s is not None and waited >= timeout_s:
                    raise EngineError(f"weights were not swapped in within {timeout_s} s") from None

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    def close_sync(self, timeout_s: float = 30.0) -> None:
        if not self._closed:  # (a worker that died on an error has closed the engine itself)
            self._closed = True
            self._inbox.put(_Stop())
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._release()

    def _release(self) -> None:
        """Drop the weights once the worker is gone. Objects that outlive the engine may still point at it (web
        frameworks cache route handlers, which close over the services), so a closed engine must not keep a model
        or two double-buffered copies alive: a process that builds several servers would grow by gigabytes."""
        self._model = self._latest_model = self._current = None  # type: ignore[assignment]
        self._batches = []
        self._waiting.clear()
        self._score_jobs.clear()
        trim_heap()

    # ------------------------------------------------------------------------------------- validation

    def _default_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen_eos = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(int(i) for i in gen_eos)
        return frozenset(ids)

    def _check_cache_support(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        with torch.inference_mode():
            cache = DynamicCache()
            self._model(input_ids=torch.tensor([[self.pad_id]], device=self.device),
                        **cache_kwargs(self._model, cache))
        if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
            raise EngineError(f"{type(self._model).__name__} uses a cache this engine cannot batch")

    def _check_ids(self, ids: Any, what: str) -> None:
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise EngineError(f"{what} holds token ids outside [0, {self.vocab_size})")

    def _submit(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> _Request:
        if self._closed:
            raise EngineError("engine is closed")
        prompt_ids = [int(i) for i in prompt_ids]
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        self._check_ids(prompt_ids, "the prompt")
        check_sampling(params)
        if params.adapter is not None and params.adapter not in self._adapter_versions:
            raise EngineError(f"no adapter named {params.adapter!r} is published"
                              + ("" if self._adapters is not None else " (this engine has no adapter slots)"))
        if len(prompt_ids) + params.max_tokens > self._max_context:
            raise PromptTooLongError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"length of {self._max_context} tokens"
            )
        req = _Request(prompt_ids, params, asyncio.get_running_loop(), asyncio.Queue(), stream)
        self._inbox.put(req)
        return req

    def _validate_score(self, r: ScoreRequest) -> None:
        if not r.prompt_ids:
            raise EngineError("score needs a non-empty prompt")
        self._check_ids(list(r.prompt_ids), "the prompt")
        self._check_ids(list(r.response_ids), "the response")
        if len(r.prompt_ids) + len(r.response_ids) > self._max_context:
            raise PromptTooLongError(f"prompt + response exceed the context length of {self._max_context} tokens")
        if r.top_k < 0:
            raise EngineError("top_k must be >= 0")
        if r.at_ids_T_K is not None:
            at = r.at_ids_T_K
            if at.ndim != 2 or at.shape[0] != len(r.response_ids):
                raise EngineError(f"at_ids_T_K must be [T={len(r.response_ids)}, K], got {tuple(at.shape)}")
            if at.numel() and (int(at.min()) < 0 or int(at.max()) >= self.vocab_size):
                raise EngineError("at_ids_T_K holds ids outside the vocabulary")

    def _plan_score_chunks(self, requests: list[ScoreRequest]) -> list[list[int]]:
        """Group requests of similar length so that rows x longest stays within ``score_batch_tokens``."""
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids) + len(requests[i].response_ids))
        chunks: list[list[int]] = []
        for i in order:
            n = len(requests[i].prompt_ids) + len(requests[i].response_ids)
            if chunks and (len(chunks[-1]) + 1) * n <= self.score_batch_tokens:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        return chunks

    # ------------------------------------------------------------------------------------------ worker

    def _run(self) -> None:
        lower_thread_priority(self._worker_nice)
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._pull_inbox(block=not self._has_work())
                    if self._stopping:
                        break
                    self._apply_publications()
                    self._admit()
                    if self._score_jobs:
                        self._score_next_chunk()
                    for batch in list(self._batches):
                        if batch.seqs:
                            self._decode_step(batch)
                    self._batches = [b for b in self._batches if b.seqs]
                    if self._unpublished_loaded:
                        self._evict_unpublished()
        except BaseException:  # the loop itself broke: report it to everyone waiting
            log.exception("engine worker stopped by an unexpected error")
        finally:
            self._closed = True
            self._fail_everything(EngineError("engine is closed"))

    def _has_work(self) -> bool:
        if any(b.seqs for b in self._batches) or self._score_jobs:
            return True
        if self._publications:
            return True  # with nothing running, any publication can be applied now
        return bool(self._waiting)

    def _pull_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(block=block)
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Request):
                self._waiting.append(item)
            elif isinstance(item, _ScoreJob):
                self._score_jobs.append(item)
            elif isinstance(item, _PublishJob):
                self._publications.append(item)
            elif isinstance(item, _Stop):
                self._stopping = True
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _running(self) -> int:
        return sum(len(b.seqs) for b in self._batches)

    def _apply_publications(self) -> None:
        while self._publications:
            job = self._publications[0]
            if job.remove is not None:
                self._publications.popleft()
                job.done.set_result(self._remove_adapter(job.remove))
                continue
            if job.adapter is not None:
                self._publications.popleft()
                try:
                    job.done.set_result(self._load_adapter(job))
                except Exception as exc:  # noqa: BLE001 - handed to the publisher
                    job.done.set_exception(EngineError(f"publishing adapter {job.adapter[0]!r} failed: {exc}"))
                continue
            if job.model is not None:
                self._current = job.model
            else:
                if self._running():
                    return  # drain: wait for running sequences; admissions are paused meanwhile
                try:
                    job.apply(self._current)
                except Exception as exc:  # noqa: BLE001 - handed to the publisher
                    self._publications.popleft()
                    job.done.set_exception(EngineError(f"publishing weights failed: {exc}"))
                    continue
            self._version = self._version + 1 if job.version is None else int(job.version)
            self._publications.popleft()
            job.done.set_result(self._version)

    def _load_adapter(self, job: _PublishJob) -> int:
        """Load a published adapter into a slot as ``name@version``; older versions of the name that no running
        sequence uses are evicted, and no slot a running sequence uses is taken."""
        assert self._adapters is not None and job.adapter is not None
        name, tensors, scaling = job.adapter
        version = int(job.version) if job.version is not None else self._adapter_versions.get(name, 0) + 1
        in_use = self._slots_in_use()
        slot = f"{name}@{version}"
        self._adapters.load(slot, tensors, scaling, pinned=sorted(in_use))
        for old in self._adapters.loaded:
            if old != slot and old.rpartition("@")[0] == name and old not in in_use:
                self._adapters.evict(old)
        self._adapter_versions[name] = version
        self._adapter_sources[name] = (dict(tensors), float(scaling))
        return version

    def _remove_adapter(self, name: str) -> int:
        """Unpublish ``name``: new requests can no longer name it, its kept tensors go, and its slots not used by
        a running answer are freed (zeroed) now, the others after the step their last answer finishes in.
        Returns the version it had (0: none)."""
        assert self._adapters is not None
        version = self._adapter_versions.pop(name, 0)
        self._adapter_sources.pop(name, None)
        self._evict_unpublished()
        return version

    def _slots_in_use(self) -> set[str]:
        """The adapter slots (``name@version``) of running sequences."""
        return {seq.slot for batch in self._batches for seq in batch.seqs if seq.slot}

    def _evict_unpublished(self) -> None:
        """Free the slots of unpublished adapters that no running answer uses (at removal, and after each step
        until the last answer on one has finished)."""
        assert self._adapters is not None
        in_use = self._slots_in_use()
        stale = [slot for slot in self._adapters.loaded if slot.rpartition("@")[0] not in self._adapter_versions]
        for slot in stale:
            if slot not in in_use:
                self._adapters.evict(slot)
        self._unpublished_loaded = any(slot in in_use for slot in stale)

    def _reload_evicted(self, seqs: list[_Seq]) -> None:
        """Load again the newest adapters of ``seqs`` that more recently used ones evicted (a new sequence always
        starts on its name's newest version, whose tensors are kept), never taking a slot in use."""
        assert self._adapters is not None
        wanted = {seq.slot for seq in seqs if seq.slot}
        missing = sorted(wanted - set(self._adapters.loaded))
        if not missing:
            return
        in_use = self._slots_in_use() | wanted
        for slot in missing:
            tensors, scaling = self._adapter_sources[slot.rpartition("@")[0]]
            self._adapters.load(slot, tensors, scaling, pinned=sorted(in_use - {slot}))

    def _rows(self, seqs: list[_Seq]) -> Any:
        """The adapter context of a forward over ``seqs`` (a no-op without adapter slots)."""
        if self._adapters is None:
            return contextlib.nullcontext()
        return self._adapters.rows([seq.slot for seq in seqs])

    def _admit(self) -> None:
        if any(job.apply is not None for job in self._publications):
            return
        while self._waiting and self._running() < self.max_batch_size:
            group: list[_Request] = []
            width = 0
            while self._waiting and self._running() + len(group) < self.max_batch_size:
                req = self._waiting[0]
                if req.cancelled:
                    self._waiting.popleft()
                    continue
                new_width = max(width, len(req.prompt_ids))
                if group and (len(group) + 1) * new_width > self.prefill_batch_tokens:
                    break
                group.append(self._waiting.popleft())
                width = new_width
            if not group:
                return
            try:
                self._prefill_and_join(group)
            except Exception as exc:  # noqa: BLE001 - these requests fail, the engine goes on
                log.exception("prefill failed")
                for req in group:
                    self._deliver(req, EngineError(f"generation failed: {exc}"))

    def _current_batch(self) -> _Batch:
        for batch in self._batches:
            if batch.model is self._current and batch.version == self._version:
                return batch
        batch = _Batch(self._current, self._version)
        self._batches.append(batch)
        return batch

    def _prefill_and_join(self, group: list[_Request]) -> None:
        """Prefill the group's prompts in one left-padded forward, sample each first token, and merge the
        sequences that go on into the running batch."""
        from transformers import DynamicCache

        batch = self._current_batch()
        device = self.device
        seqs = []
        unpublished = [req for req in group if req.params.adapter is not None
                       and req.params.adapter not in self._adapter_versions]
        for req in unpublished:  # removed (a forgotten user's) after ``_submit`` checked it: this request fails alone
            self._deliver(req, EngineError(f"adapter {req.params.adapter!r} was unpublished"))
        group = [req for req in group if req not in unpublished]
        if not group:
            return
        for req in group:
            name = req.params.adapter
            if name is None:
                seqs.append(_Seq(req, self.tokenizer, self.eos_token_ids, batch.version, device))
            else:
                version = self._adapter_versions[name]
                seqs.append(_Seq(req, self.tokenizer, self.eos_token_ids, version, device, slot=f"{name}@{version}"))
        if self._adapters is not None:
            self._reload_evicted(seqs)
        lengths = [len(req.prompt_ids) for req in group]
        W = max(lengths)
        ids_N_W = torch.tensor([[self.pad_id] * (W - n) + req.prompt_ids for req, n in zip(group, lengths)],
                               device=device)
        mask_N_W = torch.tensor([[0] * (W - n) + [1] * n for n in lengths], dtype=torch.long, device=device)
        cache = DynamicCache()
        t0 = time.perf_counter()
        with self._rows(seqs):
            if len(group) == 1:  # no padding: the plain causal forward
                out = batch.model(input_ids=ids_N_W, logits_to_keep=1, **cache_kwargs(batch.model, cache))
            else:
                pos_N_W = (mask_N_W.cumsum(dim=1) - 1).clamp(min=0)
                out = batch.model(input_ids=ids_N_W, attention_mask=mask_N_W, position_ids=pos_N_W,
                                  logits_to_keep=1, **cache_kwargs(batch.model, cache))
        self.stats["prefills"] += len(group)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_s"] += time.perf_counter() - t0
        tokens = self._sample_and_append(seqs, out.logits[:, -1, :])
        keep = [i for i, seq in enumerate(seqs) if seq.finish_reason is None]
        if not keep:
            return
        if len(keep) < len(seqs):
            keep_N = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_N)
            mask_N_W = mask_N_W[keep_N]
        pos_N = torch.tensor([lengths[i] for i in keep], device=device)
        next_N = torch.tensor([tokens[i] for i in keep], device=device)
        if not batch.seqs:
            batch.cache, batch.mask_B_L, batch.pos_B, batch.next_B = cache, mask_N_W, pos_N, next_N
        else:
            L = batch.mask_B_L.shape[1]
            width = max(L, W)
            # Every joined tensor is built before any is assigned: an error part-way (out of memory in a
            # ``cat``) fails only the joining group, and leaves the running batch as it was.
            joined = [(torch.cat([_left_pad(old.keys, width - L), _left_pad(new.keys, width - W)], dim=0),
                       torch.cat([_left_pad(old.values, width - L), _left_pad(new.values, width - W)], dim=0))
                      for old, new in zip(batch.cache.layers, cache.layers)]
            mask_B_L = torch.cat([F.pad(batch.mask_B_L, (width - L, 0)), F.pad(mask_N_W, (width - W, 0))], dim=0)
            pos_B, next_B = torch.cat([batch.pos_B, pos_N]), torch.cat([batch.next_B, next_N])
            for old, (keys, values) in zip(batch.cache.layers, joined):
                old.keys, old.values = keys, values
            batch.mask_B_L, batch.pos_B, batch.next_B = mask_B_L, pos_B, next_B
        batch.seqs.extend(seqs[i] for i in keep)
        batch.mask_B_L = trim_padding(batch.cache, batch.mask_B_L)

    def _decode_step(self, batch: _Batch) -> None:
        try:
            t0 = time.perf_counter()
            mask_B_L = F.pad(batch.mask_B_L, (0, 1), value=1)
            with self._rows(batch.seqs):
                out = batch.model(
                    input_ids=batch.next_B[:, None],
                    attention_mask=mask_B_L,
                    position_ids=batch.pos_B[:, None],
                    **cache_kwargs(batch.model, batch.cache),
                )
            logits_B_V = out.logits[:, -1, :].float()
            t1 = time.perf_counter()
            batch.mask_B_L = mask_B_L
            batch.pos_B = batch.pos_B + 1
            self.stats["decode_steps"] += 1
            self.stats["decode_rows"] += len(batch.seqs)
            self.stats["max_running"] = max(self.stats["max_running"], self._running())
            tokens = self._sample_and_append(batch.seqs, logits_B_V)
            self.stats["decode_forward_s"] += t1 - t0
            self.stats["decode_total_s"] += time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - the batch fails, the engine goes on
            log.exception("decode step failed")
            for seq in batch.seqs:
                self._deliver(seq.req, EngineError(f"generation failed: {exc}"))
            batch.seqs = []
            return
        keep = [b for b, seq in enumerate(batch.seqs) if seq.finish_reason is None and not seq.req.cancelled]
        batch.next_B = torch.tensor(tokens, device=self.device)
        if len(keep) < len(batch.seqs):
            batch.seqs = [batch.seqs[b] for b in keep]
            if not keep:
                batch.cache = batch.mask_B_L = batch.pos_B = batch.next_B = None
                return
            keep_B = torch.tensor(keep, device=self.device)
            batch.cache.batch_select_indices(keep_B)
            batch.mask_B_L = batch.mask_B_L[keep_B]
            batch.pos_B = batch.pos_B[keep_B]
            batch.next_B = batch.next_B[keep_B]
            batch.mask_B_L = trim_padding(batch.cache, batch.mask_B_L)

    def _sample_and_append(self, seqs: list[_Seq], logits_B_V: torch.Tensor) -> list[int]:
        """Sample one token per sequence, record it, deliver events/results; returns the sampled ids."""
        logits_B_V = logits_B_V.float()
        temperatures = [s.params.temperature for s in seqs]
        if not any(temperatures) and not any(s.params.top_logprobs for s in seqs):
            # All greedy, no alternatives asked: argmax and one logsumexp, no [B, V] log-prob table.
            ids_B = logits_B_V.argmax(dim=-1)
            chosen_B = logits_B_V.gather(1, ids_B[:, None])[:, 0] - torch.logsumexp(logits_B_V, dim=-1)
            logprobs_B_V = None
        else:
            temperature_B = torch.tensor(temperatures, device=logits_B_V.device)
            top_p_B = torch.tensor([s.params.top_p for s in seqs], device=logits_B_V.device)
            logprobs_B_V = sampling_logprobs(logits_B_V, temperature_B, top_p_B)
            ids_B = choose_tokens(logits_B_V, logprobs_B_V, temperatures, [s.generator for s in seqs])
            chosen_B = logprobs_B_V.gather(1, ids_B[:, None])[:, 0]
        ids, chosen = ids_B.tolist(), chosen_B.tolist()
        self.stats["generated_tokens"] += len(ids)
        for b, seq in enumerate(seqs):
            top = top_alternatives(logprobs_B_V[b], seq.params.top_logprobs) if seq.params.top_logprobs else None
            event = seq.append(ids[b], chosen[b], top)
            if seq.req.stream:
                self._deliver(seq.req, event)
            if seq.finish_reason is not None:
                self._deliver(seq.req, seq.result())
        return ids

    def _deliver(self, req: _Request, item: Any) -> None:
        if req.cancelled:
            return
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone
            req.cancelled = True

    # ----------------------------------------------------------------------------------------- scoring

    def _score_next_chunk(self) -> None:
        job = self._score_jobs[0]
        if job.future.cancelled():
            self._score_jobs.popleft()
            return
        indices = job.chunks.popleft()
        try:
            for i, result in zip(indices, self._score_chunk([job.requests[i] for i in indices])):
                job.results[i] = result
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            log.exception("scoring failed")
            self._score_jobs.popleft()
            self._resolve(job, EngineError(f"scoring failed: {exc}"))
            return
        if not job.chunks:
            self._score_jobs.popleft()
            self._resolve(job, list(job.results))

    def _resolve(self, job: _ScoreJob, value: Any) -> None:
        def settle() -> None:
            if job.future.done():
                return
            if isinstance(value, BaseException):
                job.future.set_exception(value)
            else:
                job.future.set_result(value)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _score_chunk(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        model, version = self._current, self._version
        lengths = [len(r.prompt_ids) + len(r.response_ids) for r in requests]
        L = max(lengths)
        ids_B_L = torch.full((len(requests), L), self.pad_id, dtype=torch.long, device=self.device)
        mask_B_L = torch.zeros((len(requests), L), dtype=torch.long, device=self.device)
        for b, r in enumerate(requests):
            ids_B_L[b, : lengths[b]] = torch.tensor(list(r.prompt_ids) + list(r.response_ids))
            mask_B_L[b, : lengths[b]] = 1
        self.stats["scored_tokens"] += sum(lengths)
        hidden_B_L_H = model.get_decoder()(input_ids=ids_B_L, attention_mask=mask_B_L, use_cache=False)[0]
        return [self._score_rows(model, hidden_B_L_H[b], r, version) for b, r in enumerate(requests)]

    def _score_rows(
        self, model: torch.nn.Module, hidden_L_H: torch.Tensor, r: ScoreRequest, version: int
    ) -> ScoreResult:
        P, T, K = len(r.prompt_ids), len(r.response_ids), r.top_k
        temperature = r.temperature if r.temperature > 0 else 1.0
        lm_head = model.get_output_embeddings()
        softcap = logit_softcap(model)
        response_T = torch.tensor(list(r.response_ids), dtype=torch.long, device=self.device)
        at_T_K = r.at_ids_T_K.to(self.device) if r.at_ids_T_K is not None else None
        logprobs_T = torch.empty(T, dtype=torch.float32)
        topk_ids_T_K = torch.empty(T, K, dtype=torch.long)
        topk_logprobs_T_K = torch.empty(T, K, dtype=torch.float32)
        at_logprobs_T_K = torch.empty(tuple(at_T_K.shape), dtype=torch.float32) if at_T_K is not None else None
        for start in range(0, T, self.score_chunk_rows):
            end = min(T, start + self.score_chunk_rows)
            # Position P-1+t holds the prediction of response[t].
            logits_N_V = soft_capped(lm_head(hidden_L_H[P - 1 + start : P - 1 + end]).float(), softcap)
            logprobs_N_V = torch.log_softmax(logits_N_V / temperature, dim=-1)
            logprobs_T[start:end] = logprobs_N_V.gather(1, response_T[start:end, None])[:, 0].cpu()
            if K:
                values_N_K, ids_N_K = logprobs_N_V.topk(min(K, logprobs_N_V.shape[-1]), dim=-1)
                topk_ids_T_K[start:end] = ids_N_K.cpu()
                topk_logprobs_T_K[start:end] = values_N_K.cpu()
            if at_T_K is not None and at_T_K.shape[1]:
                at_logprobs_T_K[start:end] = logprobs_N_V.gather(1, at_T_K[start:end].long()).cpu()
        return ScoreResult(
            logprobs_T=logprobs_T,
            topk_ids_T_K=topk_ids_T_K,
            topk_logprobs_T_K=topk_logprobs_T_K,
            at_ids_logprobs_T_K=at_logprobs_T_K,
            policy_version=version,
        )

    # ---------------------------------------------------------------------------------------- shutdown

    def _fail_everything(self, exc: EngineError) -> None:
        for req in self._waiting:
            self._deliver(req, exc)
        self._waiting.clear()
        for batch in self._batches:
            for seq in batch.seqs:
                self._deliver(seq.req, exc)
        self._batches = []
        for job in self._score_jobs:
            self._resolve(job, exc)
        self._score_jobs.clear()
        for job in self._publications:
            job.done.set_exception(exc)
        self._publications.clear()
        while True:  # anything that arrived after the stop
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Request):
                self._deliver(item, exc)
            elif isinstance(item, _ScoreJob):
                self._resolve(item, exc)
            elif isinstance(item, _PublishJob):
                item.done.set_exception(exc)


# --------------------------------------------------------------------------------------------- helpers


def _left_pad(x_B_H_L_D: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(x_B_H_L_D, (0, 0, n, 0)) if n > 0 else x_B_H_L_D


def _check_state_dict(model: torch.nn.Module, state_dict: Any) -> None:
    """Refuse a state dict that would load partly: unknown keys, missing (untied) keys, wrong shapes."""
    if not isinstance(state_dict, Mapping):
        return  # a callable edits the model itself
    own = model.state_dict()
    unexpected = [k for k in state_dict if k not in own]
    loaded_ptrs = {own[k].data_ptr() for k in state_dict if k in own}
    missing = [k for k in own if k not in state_dict and own[k].data_ptr() not in loaded_ptrs]
    wrong = [k for k in state_dict if k in own and tuple(state_dict[k].shape) != tuple(own[k].shape)]
    if unexpected or missing or wrong:
        hint = " (merge LoRA adapters into the base weights before publishing)" if any(
            "lora_" in k or k.startswith("base_model.") for k in unexpected
        ) else ""
        raise EngineError(
            f"state dict does not match the served model{hint}: unexpected {unexpected[:5]}, "
            f"missing {missing[:5]}, wrong shape {wrong[:5]}"
        )


def _apply_weights(model: torch.nn.Module, weights: Any) -> None:
    if isinstance(weights, Mapping):
        _check_state_dict(model, weights)
        model.load_state_dict(dict(weights), strict=False)
    elif callable(weights):
        weights(model)
    else:
        raise EngineError(f"cannot publish a {type(weights).__name__}: give a state dict or a callable")
