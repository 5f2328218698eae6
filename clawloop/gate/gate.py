"""The publication decision: may this candidate version be served?

The trainer calls ``PublicationGate.check(candidate, reference)`` in its own thread, on its own model, after an
optimizer step; the serving engine keeps serving the last accepted version meanwhile, so no request waits.

A check:

1. builds the probe set: the shipped general prompts (``clawloop.gate.probes``) plus the run's most recent
   distinct real prompts (``recent_prompts`` from the store). A prompt of up to ``MAX_PROMPT_TOKENS`` is probed as
   it was served; a longer one (an agent's, with its system prompt, tools and history) as its closing exchanges
   (``closing_exchanges``: what the user wrote in the last messages, at most ``RECENT_TAIL_TOKENS``), which is
   what the guard judges the answer against; a probe equal to an earlier one is asked once;
2. generates the candidate's greedy answer to each probe (``probe_tokens`` at most; probes of similar length are
   batched together, ``length_buckets``);
3. runs the degeneracy guard on every answer: the text rules everywhere (empty, symbol soup, loops, low
   diversity) and, where the question is known (the shipped probes, and a recent prompt whose last user message
   ends in a wh-question, ``question_of``),
   the question rules too (the answer must mention the question's topic and must not merely echo it: "A tree
   is a tree is a tree." and "The answer is:" are early signs of collapse that the text rules miss). A probe
   counts against the candidate only when the reference answers it soundly: the reference's verdict on a probe
   is computed the first time the probe appears and kept. ``guard_pass`` = candidate-sound / reference-sound;
   the candidate fails when more of the counted probes regress than ``tolerated_regressions`` allows (the
   share ``1 - min_guard_pass`` of them, rounded down, and at least one unless ``min_guard_pass`` is 1; one
   more for a candidate whose KL, step 4, is below ``NEAR_IDENTICAL_KL``);
4. measures KL(candidate || reference) at every position of the candidate's answers (full vocabulary, nats per
   token, mean over all answer tokens); the candidate fails when it is above ``max_kl``. The reference is the
   starting weights (LoRA: the adapter switched off; full fine-tuning: the frozen copy kept for ``kl_coef > 0``);
   a full fine-tuning run without that copy measures against the last accepted weights instead.

The result carries its evidence (every probe's answer, verdict, reasons and KL) for the store and the version
history. Why these checks and thresholds: docs/publication-gate.md.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ContextManager

import torch

from clawloop.gate.guard import check as guard_check
from clawloop.gate.probes import PROBES
from clawloop.judge.envelopes import strip_messages
from clawloop.renderers.chat import ChatRenderer

MAX_PROMPT_TOKENS = 1024
"""Recent prompts up to this long are probed as they were served. Longer ones are probed in a bounded form
(``RECENT_TAIL_TOKENS``): an agent's multi-thousand-token prompt would make each check cost as much as a training
step, and leaving such prompts out made every probe of an OpenClaw run a shipped one."""

RECENT_TAIL_TOKENS = 256
"""Most tokens of a long recent prompt's bounded form: its last user message and as many exchanges before it as
fit. In recorded OpenClaw conversations (tests/data/openclaw) the user's messages are 6-20 tokens once their
envelopes are removed and the bounded forms 36-74 tokens, in the shipped probes' length group (~40 tokens), so
they add little to a check; a longer message (a text to summarise) keeps its beginning and end."""


@dataclass
class ProbeOutcome:
    source: str
    """``shipped`` or ``recent:<turn id>``."""
    prompt: str
    answer: str
    ok: bool
    reasons: list[str]
    reference_ok: bool
    kl: float
    tokens: int


@dataclass
class GateResult:
    accepted: bool
    reasons: list[str]
    guard_pass: float
    kl: float
    kl_to: str
    seconds: float
    thresholds: dict[str, float]
    probes: list[ProbeOutcome] = field(default_factory=list)
    counted: int = 0
    """Probes the reference answers soundly."""
    regressions: int = 0
    """Counted probes the candidate does not answer soundly."""

    def summary(self) -> str:
        verdict = "accepted" if self.accepted else "rejected (" + "; ".join(self.reasons) + ")"
        return (f"{verdict}: guard {self.guard_pass:.2f} ({self.regressions} of {self.counted} regressed), "
                f"KL {self.kl:.2f} nats/token, {self.seconds:.1f}s")

    def evidence(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "reasons": list(self.reasons), "guard_pass": self.guard_pass,
                "counted": self.counted, "regressions": self.regressions,
                "kl": self.kl, "kl_to": self.kl_to, "seconds": round(self.seconds, 3),
                "thresholds": dict(self.thresholds), "probes": [asdict(p) for p in self.probes]}


@dataclass(frozen=True)
class Decision:
    """The gate's verdict on a candidate's probe outcomes and KL (``decide``)."""

    accepted: bool
    reasons: list[str]
    guard_pass: float
    counted: int
    regressions: int
    tolerated: int


NEAR_IDENTICAL_KL = 1e-3
"""A candidate whose mean KL to the reference is below this (nats/token) is near-identical to it: it has learnt
nothing measurable yet, and a probe it fails is a borderline answer of the reference that tipped over (greedy
decoding flips at a near-tie), not a regression. Random perturbations of SmolLM2-135M at KL 6e-5-8e-4 flipped
0-2 of its 17 sound shipped probes (docs/publication-gate.md); healthy training steps measure 0.01 and more."""


def tolerated_regressions(counted: int, min_guard_pass: float, *, near_identical: bool = False) -> int:
    """How many of ``counted`` probes may regress: the share ``1 - min_guard_pass`` of them rounded down, and at
    least one; one more for a ``near_identical`` candidate (``NEAR_IDENTICAL_KL``). At 0.95: one of 17 (the share
    alone allows none there: one flaky probe rejected a near-identical candidate of an OpenClaw run) and of
    20-39, two of 40; near-identical, two, two and three. ``min_guard_pass = 1`` asks every probe to pass."""
    if min_guard_pass >= 1.0:
        return 0
    share = math.floor((1.0 - min_guard_pass) * counted + 1e-9)  # 0.05 * 20 is 1.0000000000000009, 0.1 * 10 0.999…
    return max(share, 1) + (1 if near_identical else 0)


def decide(outcomes: Sequence[ProbeOutcome], kl: float, *, min_guard_pass: float, max_kl: float) -> Decision:
    """Accept or reject on the probe outcomes and the mean KL: rejected when more counted probes regress than
    ``tolerated_regressions`` allows, or when the KL is above ``max_kl`` (or not a number)."""
    counted = [o for o in outcomes if o.reference_ok]
    regressed = [o for o in counted if not o.ok]
    guard_pass = (len(counted) - len(regressed)) / len(counted) if counted else 1.0
    tolerated = tolerated_regressions(len(counted), min_guard_pass, near_identical=kl < NEAR_IDENTICAL_KL)
    reasons = []
    if len(regressed) > tolerated:
        failed = sorted({r for o in regressed for r in o.reasons})
        reasons.append(f"guard pass {guard_pass:.3f} < {min_guard_pass:.3f}: {len(regressed)} of {len(counted)} "
                       f"counted probes regressed, {tolerated} tolerated ({', '.join(failed)})")
    if not kl <= max_kl:  # also rejects a NaN
        reasons.append(f"KL {kl:.2f} > {max_kl:.2f} nats/token")
    return Decision(accepted=not reasons, reasons=reasons, guard_pass=guard_pass, counted=len(counted),
                    regressions=len(regressed), tolerated=tolerated)


@dataclass
class _Probe:
    source: str
    prompt: str
    ids: list[int]
    question: str | None = None
    """The question, for the guard's question rules: a shipped prompt, or a recent prompt's closing wh-question
    (``question_of``); None when it has none (the text rules still apply)."""


class PublicationGate:
    """Checks candidates of one run (see the module docstring). Not thread-safe: the training thread owns it."""

    def __init__(self, tokenizer: Any, *, min_guard_pass: float = 0.9, max_kl: float = 4.0, probe_tokens: int = 32,
                 recent_prompts: Callable[[], Sequence[tuple[int, list[int], list[dict[str, Any]]]]] | None = None,
                 probes: Sequence[str] = PROBES):
        self.tokenizer = tokenizer
        self.min_guard_pass = float(min_guard_pass)
        self.max_kl = float(max_kl)
        self.probe_tokens = int(probe_tokens)
        self.recent_prompts = recent_prompts
        self.renderer = ChatRenderer(tokenizer)
        self.shipped = [_Probe("shipped", p, self._render(p), question=p) for p in probes]
        self._reference_ok: dict[str | bytes, bool] = {}
        """Reference verdict per probe key (``_key``); computed once each, so a question asked again in a new turn
        costs the reference no second answer."""

    def _render(self, prompt: str) -> list[int]:
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def probe_set(self) -> list[_Probe]:
        """The shipped probes, then each recent prompt's probe unless an earlier probe has the same ids: two
        sessions that ask the same question differ in OpenClaw's timestamps but not in their bounded forms, and
        one borderline answer must not count as two regressions."""
        probes = list(self.shipped)
        seen = {tuple(p.ids) for p in probes}
        for turn_id, ids, messages in (self.recent_prompts() if self.recent_prompts else ()):
            probe = self._recent_probe(turn_id, list(ids), messages)
            if probe is not None and tuple(probe.ids) not in seen:
                seen.add(tuple(probe.ids))
                probes.append(probe)
        return probes

    def _recent_probe(self, turn_id: int, ids: list[int], messages: Sequence[dict[str, Any]]) -> _Probe | None:
        """A recent prompt as a probe: as it was served when it is at most ``MAX_PROMPT_TOKENS`` long, else its
        bounded form (``bounded_ids``); None when it has no bounded form (it ends in a tool result, say)."""
        if not ids:
            return None
        if len(ids) > MAX_PROMPT_TOKENS:
            ids = self.bounded_ids(messages)
            if not ids:
                return None
        return _Probe(f"recent:{turn_id}", last_user_text(messages) or self._prompt_tail(ids), ids,
                      question=question_of(messages))

    def bounded_ids(self, messages: Sequence[dict[str, Any]], budget: int = RECENT_TAIL_TOKENS) -> list[int]:
        """A long prompt's bounded form, rendered like a shipped probe: its ``closing_exchanges`` from the last
        user message back, as many whole messages as fit in ``budget`` tokens; a last user message that alone is
        longer keeps its beginning and its end. Empty when the prompt has no closing user message."""
        tail = closing_exchanges(messages)
        if not tail:
            return []
        best = self._render_messages(tail[-1:])
        if len(best) > budget:
            return self._message_ends(tail[-1]["content"], budget)
        for start in range(len(tail) - 2, -1, -1):
            if tail[start]["role"] != "user":
                continue  # an exchange starts with the user's message
            ids = self._render_messages(tail[start:])
            if len(ids) > budget:
                break
            best = ids
        return best

    def _render_messages(self, messages: list[dict[str, Any]]) -> list[int]:
        """Users' messages rendered by the serving renderer: what they wrote stays text, never a special token."""
        return self.renderer.render(messages).ids

    def _message_ends(self, text: str, budget: int) -> list[int]:
        """``text`` as the only user message, rendered within ``budget`` tokens: its beginning and its end (where
        an instruction and a question are: "Summarize the following text: …", "… What does it mean?") with the
        middle cut. Empty if even the template's own tokens do not fit."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        keep = budget - len(self._render_messages([{"role": "user", "content": ""}]))
        while keep > 0:
            head, tail = ids[:keep // 2], ids[len(ids) - (keep - keep // 2):]
            cut = (self.tokenizer.decode(head, skip_special_tokens=True).rstrip() + "\n…\n"
                   + self.tokenizer.decode(tail, skip_special_tokens=True).lstrip())
            rendered = self._render_messages([{"role": "user", "content": cut}])
            if len(rendered) <= budget:
                return rendered
            keep -= len(rendered) - budget  # the cut mark, and decoding and encoding again, cost tokens too
        return []

    def _prompt_tail(self, ids: list[int]) -> str:
        """A short readable form of a recent prompt for the evidence (its last 200 characters)."""
        text = self.tokenizer.decode(ids[-80:], skip_special_tokens=True)
        return text[-200:]

    # ---- the check ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def check(self, candidate: torch.nn.Module, reference: Callable[[], ContextManager[torch.nn.Module]],
              kl_to: str = "reference") -> GateResult:
        """Decide on ``candidate`` (the training model as it is now). ``reference()`` enters a context in which
        it yields the model to compare with (``kl_to`` names it in the evidence). Only the fixed starting weights
        (``kl_to="reference"``) have their verdicts kept between checks; the last accepted version changes."""
        t0 = time.monotonic()
        if kl_to != "reference":
            self._reference_ok.clear()
        probes = self.probe_set()
        prompts = [p.ids for p in probes]
        answers, cand_lp = greedy_answers(candidate, prompts, self.probe_tokens, self._eos_ids())
        missing = [p for p in probes if _key(p) not in self._reference_ok]
        with reference() as ref:
            if missing:
                ref_answers, _ = greedy_answers(ref, [p.ids for p in missing], self.probe_tokens, self._eos_ids())
                for p, ans in zip(missing, ref_answers):
                    self._reference_ok[_key(p)] = guard_check(self._text(ans), question=p.question).ok
            ref_lp = answer_logprobs(ref, prompts, answers)
        outcomes: list[ProbeOutcome] = []
        kl_sum, kl_tokens = 0.0, 0
        for p, ans, c_T_V, r_T_V in zip(probes, answers, cand_lp, ref_lp):
            kl_T = (c_T_V.exp() * (c_T_V - r_T_V)).sum(-1) if len(ans) else torch.zeros(0)
            kl_sum += float(kl_T.sum())
            kl_tokens += len(ans)
            verdict = guard_check(self._text(ans), question=p.question)
            outcomes.append(ProbeOutcome(source=p.source, prompt=p.prompt, answer=self._text(ans), ok=verdict.ok,
                                         reasons=list(verdict.reasons), reference_ok=self._reference_ok[_key(p)],
                                         kl=float(kl_T.mean()) if len(ans) else 0.0, tokens=len(ans)))
        kl = kl_sum / kl_tokens if kl_tokens else 0.0
        decision = decide(outcomes, kl, min_guard_pass=self.min_guard_pass, max_kl=self.max_kl)
        return GateResult(accepted=decision.accepted, reasons=decision.reasons, guard_pass=decision.guard_pass,
                          kl=kl, kl_to=kl_to, seconds=time.monotonic() - t0, probes=outcomes,
                          thresholds={"min_guard_pass": self.min_guard_pass, "max_kl": self.max_kl,
                                      "probe_tokens": float(self.probe_tokens),
                                      "near_identical_kl": NEAR_IDENTICAL_KL,
                                      "tolerated_regressions": float(decision.tolerated)},
                          counted=decision.counted, regressions=decision.regressions)

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _eos_ids(self) -> list[int]:
        ids = {self.tokenizer.eos_token_id}
        im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if isinstance(im_end, int) and im_end != self.tokenizer.unk_token_id:
            ids.add(im_end)
        return sorted(i for i in ids if i is not None)


WH_WORDS = frozenset("what why how where when who whom whose which".split())
_SENTENCE_END_RE = re.compile(r"(?<=[.!?:;])\s+|\n+")
"""Where a sentence ends: punctuation followed by white space ("Node.js" and "10:30" stay whole), or a new line."""
_CLOSERS = "\"'”’)]*_ \t"


def question_of(messages: Sequence[dict[str, Any]]) -> str | None:
    """The question a recent prompt asks, for the guard's question rules (on topic, not an echo): the last
    sentence of its last user message (``last_user_text``: client envelopes removed) when that sentence is a
    wh-question ("Thanks! What is an atom?" gives "What is an atom?"), else None. Thanks, farewells and requests
    about the answer itself ("Great, thanks for your help.", "Can you keep it that short?", "Shorter, please.")
    say nothing about what the answer should be about: checked against their words, "You're welcome." was off
    topic and a compliant short re-answer would be too, and such false alarms fell on the candidates that had
    learnt the preference. The price: a recent
    prompt that asks in another form ("Explain photosynthesis.", "Can you tell me what a fossil is?", "What is
    X? One word, please.") gets the text rules only; the shipped probes keep the question rules for every form."""
    text = last_user_text(messages)
    if text is None:
        return None
    sentences = [s.strip() for s in _SENTENCE_END_RE.split(text) if any(ch.isalpha() for ch in s)]
    last = sentences[-1].rstrip(_CLOSERS).rstrip("!") if sentences else ""
    first = re.match(r"[^\W\d_]+", last.lstrip("\"'“‘(*_").lower())
    if not last.endswith("?") or first is None or first.group() not in WH_WORDS:  # "What's" counts as "what"
        return None
    return last


def last_user_text(messages: Sequence[dict[str, Any]]) -> str | None:
    """What the user wrote in a prompt's last message, when that is a user message of plain text, else None (a
    tool result, an image). Client envelopes are removed first (``clawloop.judge.envelopes``, as for the judge):
    OpenClaw's timestamp before the question ("[Mon 2026-11-23 19:51 UTC] What is a frog?") hid it from
    ``question_of``, and its internal-context message, sent after the user's, is no message of the user's."""
    kept = strip_messages(messages)
    return plain_text(kept[-1]) if kept and kept[-1].get("role") == "user" else None


def plain_text(message: dict[str, Any]) -> str | None:
    """A message's content when it is plain text (a string, or text parts only), stripped; else None."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: only an all-text message counts
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            return None
        content = " ".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        return None
    return content.strip() or None


def closing_exchanges(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """The plain-text user and assistant messages that close a prompt, client envelopes removed, ending with its
    last user message: the system prompt, tool calls and results, and everything before them are left out. Empty
    when the prompt does not end with a user message of plain text (after a tool result the answer is judged by
    the text rules only, and its context is the tool's output, which a bounded form could not keep whole)."""
    kept = strip_messages(messages)
    tail: list[dict[str, str]] = []
    for message in reversed(kept):
        role, text = message.get("role"), plain_text(message)
        if role not in ("user", "assistant") or text is None or message.get("tool_calls"):
            break
        if not tail and role != "user":
            return []
        tail.append({"role": str(role), "content": text})
    tail.reverse()
    return tail


def _key(p: _Probe) -> str | bytes:
    """A shipped probe's text, or a digest of a recent prompt's token ids (small, whatever the prompt's length)."""
    if p.source == "shipped":
        return p.prompt
    return hashlib.blake2b(array("q", p.ids).tobytes(), digest_size=16).digest()


def length_buckets(lengths: Sequence[int], *, ratio: float = 2.0, slack: int = 32) -> list[list[int]]:
    """Indices of ``lengths`` grouped for batching: sorted by length, a new group starts where a length exceeds
    ``ratio`` × the group's shortest + ``slack``. One batch padded to its longest prompt would make twenty
    40-token probes pay for a 200-token recent prompt (measured on the CPU default: 46 s for one batch against 32 s
    for two); a batch per prompt would pay the per-token decoding overhead once per prompt."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= ratio * lengths[groups[-1][0]] + slack:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@torch.no_grad()
def greedy_answers(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, eos_ids: list[int], *,
                   batches: Callable[[Sequence[int]], list[list[int]]] = length_buckets,
                   ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of ``prompts`` (one left-padded batch with a KV cache per group of ``batches``, by
    default ``length_buckets``), each cut before its first end-of-turn token or after ``max_tokens``, and the
    model's log-softmax ``[T, V]`` at each answer position (read from the generation's own logits, so no second
    forward is needed)."""
    answers: list[list[int]] = [[] for _ in prompts]
    logprobs: list[torch.Tensor] = [torch.zeros(0) for _ in prompts]
    for group in batches([len(p) for p in prompts]):
        group_answers, group_logprobs = _greedy_batch(model, [prompts[i] for i in group], max_tokens, eos_ids)
        for i, a, lp in zip(group, group_answers, group_logprobs):
            answers[i], logprobs[i] = a, lp
    return answers, logprobs


def _greedy_batch(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                  eos_ids: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    pad = eos_ids[0] if eos_ids else 0
    ids_B_L = torch.full((len(prompts), width), pad, dtype=torch.long, device=device)
    mask_B_L = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        ids_B_L[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask_B_L[i, width - len(p):] = 1
    out = model.generate(input_ids=ids_B_L, attention_mask=mask_B_L, max_new_tokens=max_tokens, do_sample=False,
                         num_beams=1, use_cache=True, eos_token_id=eos_ids, pad_token_id=pad, temperature=None,
                         top_p=None, top_k=None, output_logits=True, return_dict_in_generate=True)
    logits_B_N_V = torch.stack(out.logits, dim=1)
    answers, logprobs = [], []
    for i, row in enumerate(out.sequences[:, width:].tolist()):
        cut = next((j for j, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
        logprobs.append(torch.log_softmax(logits_B_N_V[i, :cut].float(), dim=-1))
    return answers, logprobs


@torch.no_grad()
def answer_logprobs(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Log-softmax ``[T, V]`` at the positions that predict each answer token (a right-padded forward per
    ``length_buckets`` group)."""
    out: list[torch.Tensor] = [torch.zeros(0) for _ in prompts]
    for group in length_buckets([len(p) + len(a) for p, a in zip(prompts, answers)]):
        for i, lp in zip(group, _answer_logprobs_batch(model, [prompts[i] for i in group],
                                                       [answers[i] for i in group])):
            out[i] = lp
    return out


def _answer_logprobs_batch(model: torch.nn.Module, prompts: list[list[int]],
                           answers: list[list[int]]) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(x) for x in seqs)
    ids_B_L = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    mask_B_L = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, x in enumerate(seqs):
        ids_B_L[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        mask_B_L[i, :len(x)] = 1
    hidden_B_L_H = model.get_decoder()(input_ids=ids_B_L, attention_mask=mask_B_L, use_cache=False)[0]
    head = model.get_output_embeddings()
    out = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        logits_T_V = head(hidden_B_L_H[i, len(p) - 1:len(p) - 1 + len(a)])
        out.append(torch.log_softmax(logits_T_V.float(), dim=-1))
    return out
