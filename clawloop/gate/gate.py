"""The publication decision: may this candidate version be served?

The trainer calls ``PublicationGate.check(candidate, reference)`` in its own thread, on its own model, after an
optimizer step; the serving engine keeps serving the last accepted version meanwhile, so no request waits.

A check:

1. builds the probe set: the shipped general prompts (``clawloop.gate.probes``), the shipped knowledge probes
   (``clawloop.gate.knowledge``), the run's corrected prompts (``fixed_prompts``: answers that got a hint or a -1
   vote and were trained into an accepted version) and its most recent distinct real prompts (``recent_prompts``;
   both from the store, spread across users and sessions). A prompt of up to ``MAX_PROMPT_TOKENS`` is probed as
   it was served; a longer one (an agent's, with its system prompt, tools and history) as its closing exchanges
   (``closing_exchanges``: what the user wrote in the last messages, at most ``RECENT_TAIL_TOKENS``), which is
   what the guard judges the answer against; a probe equal to an earlier one is asked once;
2. has the reference answer each probe once, the first time a check reaches it, and keeps its verdict (the
   starting weights' answers to the shipped and knowledge probes are also kept on disk from one run to the next,
   ``kept_answers``, ``clawloop.gate.kept_answers``);
3. finds the candidate's greedy answer to each probe (``probe_tokens`` at most, ``knowledge_tokens`` for the
   knowledge probes, which are answered first; probes of similar length batched together, ``length_buckets``,
   each row leaving the batch when its answer ends; on the CPU a LoRA candidate merged, as the embedded engine
   serves it, by the trainer's ``gate_candidate``); with ``knowledge_samples`` set, each knowledge probe instead
   gets that many answers sampled at the serving temperature, drawn with the same uniforms as the reference's
   (``sampling_uniforms``), since users are served sampled answers and a small model's greedy answer to a fact it
   states in half its answers flips at the slightest change;
4. runs the degeneracy guard on every answer: the text rules everywhere (empty, symbol soup, loops, low diversity)
   and, where the question is known (the shipped probes, and a recent prompt whose last user message ends in a
   wh-question, ``question_of``), the question rules too (the answer must mention the question's topic and must not
   merely echo it: "A tree is a tree is a tree." and "The answer is:" are early signs of collapse that the text
   rules miss). A knowledge probe's answer must also contain one of its right answers; sampled, the fact is
   forgotten when the candidate states it in at most a quarter as many answers as the reference
   (``forgot_sampled``), it counts where the reference stated it in at least half, and over all facts the
   candidate's answers may state them at most ``max_fact_drop`` less often than the reference's (against the fixed
   starting weights: the lower of their count under the same dice and their mean over ``reference_dice`` sets of
   dice, drawn once per run when a candidate first needs it, ``fact_share_bar``: one draw's luck is not a bar). A
   probe counts against the candidate when the reference or the last accepted version answered it soundly (the last
   accepted version's verdicts are recorded by the check that accepted it; before any, the reference's stand for
   them). ``guard_pass`` = candidate-sound / counted; the candidate fails when more of the counted probes regress
   than ``tolerated_regressions`` allows (the share ``1 - min_guard_pass`` of them, rounded down, and at least one
   unless ``min_guard_pass`` is 1; one more for a candidate whose KL, step 5, is below ``NEAR_IDENTICAL_KL``), when
   more known facts are forgotten than the same rule allows for their own count, or when it breaks a corrected
   prompt the last accepted version answered soundly (``decide``). The check stops as soon as the candidate can no
   longer pass (``certain_rejection``);
5. measures KL(candidate || reference) at every position of the candidate's greedy answers (full vocabulary, nats
   per token, mean over all their tokens; sampled knowledge answers are left out); the candidate fails when it is
   above ``max_kl``. The reference is the starting weights (LoRA: the adapter switched off; full fine-tuning: the
   frozen copy kept for ``kl_coef > 0``, the retain term or ``gate_fixed_reference``, on by default); a full
   fine-tuning run without that copy measures against the last accepted weights instead. Against the starting
   weights the forward reads only the answers, after the prompts' kept states (``prompt_states``,
   ``clawloop.gate.scoring``), as does the reading of step 6;
6. with a hint to read (``preference_hint``: the trainer's most frequent hint), an accepted version since the
   gate started and the starting weights as the reference (``kl_to="reference"``), reads the hint's implicit
   reward of the candidate's greedy guard answers and of the last accepted version's answers to the same probes
   under the reference (``clawloop.gate.preference``); the candidate fails when its mean per answer token is
   more than ``max_preference_drop`` nats/token lower: it unlearnt what the users taught.

The result carries its evidence (every probe's answer, verdict, reasons and KL) for the store and the version
history. Why these checks and thresholds: docs/publication-gate.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ContextManager

import torch

from clawloop.engines.model_files import end_token_ids, turn_end_token_id
from clawloop.gate.generation import length_buckets, probe_answers, sampling_uniforms
from clawloop.gate.guard import check as guard_check, last_user_text, plain_text, question_of
from clawloop.gate.kept_answers import KeptAnswers, request_key
from clawloop.gate.knowledge import KNOWLEDGE_TOKENS, KnowledgeProbe, knows, names_fact
from clawloop.gate.preference import PreferenceReading, implicit_rewards
from clawloop.gate.probes import PROBES
from clawloop.gate.scoring import PromptStates, answer_logprob_sums, answer_logprobs, summed_logprob
from clawloop.judge.envelopes import strip_messages
from clawloop.renderers.chat import ChatRenderer
from clawloop.teacher import inject_hint

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
    """``shipped``, ``knowledge``, ``fixed:<turn id>`` (a corrected prompt) or ``recent:<turn id>``."""
    prompt: str
    answer: str
    ok: bool
    reasons: list[str]
    reference_ok: bool
    kl: float
    tokens: int
    accepted_ok: bool | None = None
    """The last accepted version's verdict on this probe; None when no accepted version has answered it since the
    gate started (the reference's verdict then stands for it)."""
    accepted_answer: str | None = None
    """The last accepted version's answer, for the evidence."""
    samples: int = 0
    """A knowledge probe answered by sampling: how many answers each model gave (0: one greedy answer)."""
    right: int | None = None
    """Sampled knowledge probe: how many of the candidate's answers state the fact (``answer`` shows one that does
    not, if any)."""
    reference_right: int | None = None
    """Sampled knowledge probe: how many of the reference's answers, drawn with the same uniforms, state it."""
    reference_mean: float | None = None
    """Sampled knowledge probe: the mean of that count over the reference's dice sets (``reference_dice``; the
    check's own set among them); None where the reference drew with the check's dice only."""
    preference: float | None = None
    """The preference check's R of the candidate's answer, summed over its tokens and its end token where it ended
    before the cap (``clawloop.gate.preference``); None where not measured."""
    accepted_preference: float | None = None
    """The same R of the last accepted version's answer."""

    @property
    def counted(self) -> bool:
        """Whether the candidate's verdict counts: the reference or the last accepted version answered soundly (a
        sampled knowledge probe: the reference stated the fact in at least half of its answers; the last accepted
        version's count, itself a draw, does not raise the bar)."""
        if self.samples:
            return self.reference_ok
        return self.reference_ok or bool(self.accepted_ok)

    @property
    def regressed(self) -> bool:
        return self.counted and not self.ok


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
    """Guard probes (all but the knowledge probes) the reference or the last accepted version answers soundly."""
    regressions: int = 0
    """Counted guard probes the candidate does not answer soundly."""
    knowledge_counted: int = 0
    """Knowledge probes the reference (or, greedy, the last accepted version) answers rightly; sampled: the
    reference states their fact in at least half of its answers."""
    forgotten: int = 0
    """Counted knowledge probes whose fact the candidate's answer lacks (or that it answers unsoundly); sampled:
    whose fact it states in at most a quarter as many answers as the reference."""
    facts_right: int = 0
    """Sampled knowledge probes: the candidate's answers that state their fact, over every probe asked."""
    facts_reference_right: int = 0
    """The same count for the reference's answers."""
    facts_reference_bar: float = 0.0
    """What ``facts_right`` was held to, before ``max_fact_drop``: the lower of ``facts_reference_right`` and the
    reference's mean count over its dice sets (``fact_share_bar``)."""
    broken_fixes: int = 0
    """Corrected prompts the last accepted version answered soundly and the candidate does not."""
    unanswered: int = 0
    """Probes the check did not ask the candidate: it stopped once the candidate could no longer pass, or the
    probe could not count (neither the reference nor the last accepted version answered it soundly)."""
    kl_measured: bool = True
    """False when the check stopped after the knowledge probes (a candidate rejected for its facts), before the
    guard's probes: ``kl`` and ``guard_pass`` then measure nothing."""
    preference: PreferenceReading | None = None
    """The preference check's measurement; None when it did not run (off, no hint or no accepted version yet, or
    the check stopped early)."""
    seconds_by_part: dict[str, float] = field(default_factory=dict)
    """Where ``seconds`` went, for the parts the check ran: ``reference_answers`` (the starting weights answering
    probes they had not answered before), ``reference_dice`` (their sampled knowledge answers under more sets of
    dice, once per run, ``PublicationGate.reference_dice``), ``knowledge`` and ``guard`` (the candidate's answers
    to the knowledge probes and to the others, a LoRA adapter's merge included), ``kl`` (the reference's forward
    over the candidate's greedy answers) and ``preference`` (the preference check's reading)."""

    def summary(self) -> str:
        verdict = "accepted" if self.accepted else "rejected (" + "; ".join(self.reasons) + ")"
        mean = (f", {self.facts_reference_bar:.1f} on average"
                if self.facts_reference_bar < self.facts_reference_right else "")
        delivered = (f" (stated in {self.facts_right} sampled answers, the reference's {self.facts_reference_right}"
                     f"{mean})" if self.facts_reference_right else "")
        facts = f"{self.forgotten} of {self.knowledge_counted} facts forgotten{delivered}"
        if not self.kl_measured:
            return f"{verdict}: {facts}; stopped before the guard's probes and the KL, {self.seconds:.1f}s"
        pref = self.preference
        preference = ("" if pref is None else
                      f", the hint's reward {pref.accepted_mean:.3f} → {pref.candidate_mean:.3f} nats/token "
                      f"({pref.probes} probes)")
        return (f"{verdict}: guard {self.guard_pass:.2f} ({self.regressions} of {self.counted} regressed), "
                f"{facts}, KL {self.kl:.2f} nats/token{preference}, {self.seconds:.1f}s")

    def evidence(self) -> dict[str, Any]:
        return {"accepted": self.accepted, "reasons": list(self.reasons), "guard_pass": self.guard_pass,
                "counted": self.counted, "regressions": self.regressions,
                "knowledge_counted": self.knowledge_counted, "forgotten": self.forgotten,
                "facts_right": self.facts_right, "facts_reference_right": self.facts_reference_right,
                "facts_reference_bar": self.facts_reference_bar, "broken_fixes": self.broken_fixes,
                "unanswered": self.unanswered, "kl_measured": self.kl_measured,
                "kl": self.kl, "kl_to": self.kl_to, "seconds": round(self.seconds, 3),
                "seconds_by_part": {k: round(v, 3) for k, v in self.seconds_by_part.items()},
                "preference": None if self.preference is None else self.preference.as_dict(),
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
    knowledge_counted: int = 0
    forgotten: int = 0
    tolerated_forgotten: int = 0
    broken_fixes: int = 0
    facts_right: int = 0
    facts_reference_right: int = 0
    facts_reference_bar: float = 0.0


MAX_FACT_DROP = 0.1
"""Largest share by which the sampled answers stating their fact may fall below the reference's (``decide``)."""


def forgot_sampled(right: int, reference_right: int) -> bool:
    """A sampled knowledge probe's fact is forgotten when the candidate states it in at most a quarter as many of
    its answers as the reference did with the same uniforms (8 of 8 → 2 or fewer; 4 of 8 → 1 or fewer): a drop that
    large is rare by chance where the reference states the fact in at least half of its answers (the probe counts
    only then), while a candidate steered off the fact states it in none."""
    return right <= reference_right // 4


def fact_share_bar(sampled: Sequence[ProbeOutcome]) -> tuple[int, int, float]:
    """``(candidate's right answers, reference's right answers, the bar)`` over sampled knowledge probes: the bar
    the candidate's count is held to (before ``max_fact_drop``) is the lower of the reference's count under the
    check's own dice and its mean count over its dice sets (``reference_mean``). Under the check's dice a candidate
    that barely moved draws the reference's very answers, so it must not fall below that count; a candidate that
    moved enough to draw other answers is held to what the reference states on average, not to the luck of one
    draw (on SmolLM2-135M the check's own dice gave the reference 99 right answers of 136 where nine other sets
    gave 83-94, which made a 10 % allowance a 1 % one for every candidate that had moved)."""
    right = sum(int(o.right or 0) for o in sampled)
    reference = sum(int(o.reference_right or 0) for o in sampled)
    mean = sum(o.reference_right if o.reference_mean is None else o.reference_mean for o in sampled)
    return right, reference, min(float(reference), float(mean))


def too_few_facts(sampled: Sequence[ProbeOutcome], max_fact_drop: float) -> bool:
    """The share rule: the candidate's sampled answers state their facts more than ``max_fact_drop`` less often
    than ``fact_share_bar``."""
    right, _, bar = fact_share_bar(sampled)
    return right < (1.0 - max_fact_drop) * bar - 1e-9


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


def decide(outcomes: Sequence[ProbeOutcome], kl: float, *, min_guard_pass: float, max_kl: float,
           max_fact_drop: float = MAX_FACT_DROP, kl_measured: bool = True,
           preference: PreferenceReading | None = None, max_preference_drop: float = math.inf) -> Decision:
    """Accept or reject on the probe outcomes and the mean KL. Rejected when

    * more counted guard probes regress than ``tolerated_regressions`` allows: a probe counts when the reference or
      the last accepted version answered it soundly (``ProbeOutcome.counted``), so a drift that breaks a probe the
      reference already failed is seen, and the reference-based count is the special case of a gate with no
      accepted version yet;
    * more counted knowledge probes are forgotten than the same rule allows for their own number (a separate count,
      so adding facts does not loosen the guard's allowance);
    * over the sampled knowledge probes asked, the candidate's answers state their facts more than ``max_fact_drop``
      less often than the reference's (``fact_share_bar``; each fact a little less known is as much a loss as one
      fact gone);
    * a corrected prompt that the last accepted version answered soundly is not answered soundly any more (an
      earlier fix broken; none tolerated, except by a near-identical candidate, whose failures are near-ties);
    * the KL is above ``max_kl`` (or not a number);
    * the hint's implicit reward per token of the candidate's answers (``preference``,
      ``clawloop.gate.preference``) is more than ``max_preference_drop`` nats/token below that of the last accepted
      version's answers: it unlearnt the preference.

    ``kl_measured`` is False when the check stopped after its knowledge probes, before the guard's, or when every
    greedy answer ended at once (no token to measure): a candidate is near-identical only by a KL measured on
    those answers."""
    near_identical = kl_measured and kl < NEAR_IDENTICAL_KL
    guard = [o for o in outcomes if o.source != "knowledge" and o.counted]
    regressed = [o for o in guard if not o.ok]
    guard_pass = (len(guard) - len(regressed)) / len(guard) if guard else 1.0
    tolerated = tolerated_regressions(len(guard), min_guard_pass, near_identical=near_identical)
    facts = [o for o in outcomes if o.source == "knowledge" and o.counted]
    forgotten = [o for o in facts if not o.ok]
    tolerated_facts = tolerated_regressions(len(facts), min_guard_pass, near_identical=near_identical)
    broken = [o for o in guard if o.source.startswith("fixed:") and o.accepted_ok and not o.ok]
    sampled = [o for o in outcomes if o.source == "knowledge" and o.samples and o.reference_right]
    facts_right, facts_reference_right, facts_bar = fact_share_bar(sampled)
    reasons = []
    if len(regressed) > tolerated:
        failed = sorted({r for o in regressed for r in o.reasons})
        reasons.append(f"guard pass {guard_pass:.3f} < {min_guard_pass:.3f}: {len(regressed)} of {len(guard)} "
                       f"counted probes regressed, {tolerated} tolerated ({', '.join(failed)})")
    if len(forgotten) > tolerated_facts:
        reasons.append(f"{len(forgotten)} of {len(facts)} known facts forgotten, {tolerated_facts} tolerated ("
                       + "; ".join(o.prompt for o in forgotten) + ")")
    if too_few_facts(sampled, max_fact_drop):
        mean = f" ({facts_bar:.1f} on average)" if facts_bar < facts_reference_right else ""
        reasons.append(f"facts stated in {facts_right} of the sampled answers, the reference's in "
                       f"{facts_reference_right}{mean}: more than {max_fact_drop:.0%} fewer")
    if broken and not near_identical:
        reasons.append(f"{len(broken)} earlier fix(es) broken (" + "; ".join(o.prompt for o in broken) + ")")
    if not kl <= max_kl:  # also rejects a NaN
        reasons.append(f"KL {kl:.2f} > {max_kl:.2f} nats/token")
    if preference is not None and not preference.drop <= max_preference_drop:
        reasons.append(f"the hint's reward of the answers fell {preference.drop:.3f} nats/token "
                       f"({preference.accepted_mean:.3f} → {preference.candidate_mean:.3f} over {preference.probes} "
                       f"probes), more than {max_preference_drop:.3f}")
    return Decision(accepted=not reasons, reasons=reasons, guard_pass=guard_pass, counted=len(guard),
                    regressions=len(regressed), tolerated=tolerated, knowledge_counted=len(facts),
                    forgotten=len(forgotten), tolerated_forgotten=tolerated_facts, broken_fixes=len(broken),
                    facts_right=facts_right, facts_reference_right=facts_reference_right,
                    facts_reference_bar=facts_bar)


def certain_rejection(outcomes: Sequence[ProbeOutcome], pending_guard: int, pending_facts: int, *,
                      min_guard_pass: float, max_fact_drop: float = MAX_FACT_DROP) -> bool:
    """True when the candidate must be rejected whatever the probes not answered yet and its KL turn out to be:
    its regressions (or forgotten facts) so far exceed what ``decide`` would tolerate even if every pending probe
    counted and the candidate were near-identical, or, with every knowledge probe answered, its sampled answers
    state their facts too much less often than the reference's (a rule no KL and no guard probe can change). A
    check stops there (``PublicationGate.check``)."""
    guard = [o for o in outcomes if o.source != "knowledge" and o.counted]
    facts = [o for o in outcomes if o.source == "knowledge" and o.counted]
    most_tolerated = tolerated_regressions(len(guard) + pending_guard, min_guard_pass, near_identical=True)
    most_forgotten = tolerated_regressions(len(facts) + pending_facts, min_guard_pass, near_identical=True)
    sampled = [o for o in outcomes if o.source == "knowledge" and o.samples and o.reference_right]
    fewer_facts = pending_facts == 0 and too_few_facts(sampled, max_fact_drop)
    return (sum(not o.ok for o in guard) > most_tolerated
            or sum(not o.ok for o in facts) > most_forgotten or fewer_facts)


@dataclass
class _Probe:
    source: str
    prompt: str
    ids: list[int]
    question: str | None = None
    """The question, for the guard's question rules: a shipped prompt, or a recent prompt's closing wh-question
    (``question_of``); None when it has none (the text rules still apply)."""
    answers: tuple[str, ...] = ()
    """A knowledge probe's right answers (``clawloop.gate.knowledge``); empty for the others."""
    messages: list[dict[str, Any]] | None = None
    """The messages ``ids`` render, for the preference check's hinted prompt; None where ``ids`` are a cut text
    (a long message's ends) or a knowledge probe."""


SHIPPED_SOURCES = ("shipped", "knowledge")
"""Probes whose text ships with clawloop (the run's own prompts come from users' conversations)."""

PromptSource = Callable[[], Sequence[tuple[int, list[int], list[dict[str, Any]]]]]
"""Gives ``(turn id, prompt ids, request messages)`` of the run's prompts (``Store.recent_prompts``)."""


class PublicationGate:
    """Checks candidates of one run (see the module docstring). Not thread-safe: the training thread owns it.

    The trainer passes every setting from its ``Config`` (``gate_min_guard_pass``, ``gate_probe_tokens``, ...); the
    keyword defaults below are small values for a gate built directly, as the tests do, not the served defaults."""

    def __init__(self, tokenizer: Any, *, min_guard_pass: float = 0.9, max_kl: float = 4.0, probe_tokens: int = 32,
                 recent_prompts: PromptSource | None = None, probes: Sequence[str] = PROBES,
                 knowledge: Sequence[KnowledgeProbe] = (), knowledge_tokens: int = KNOWLEDGE_TOKENS,
                 fixed_prompts: PromptSource | None = None, knowledge_samples: int = 0,
                 knowledge_temperature: float = 0.6, max_fact_drop: float = MAX_FACT_DROP,
                 preference_hint: Callable[[], str | None] | None = None, max_preference_drop: float = 0.1,
                 hint_system: str | None = None, prompt_states: PromptStates | None = None,
                 reference_dice: int = 1, kept_answers: KeptAnswers | None = None, accepted_verdicts: bool = True):
        self.tokenizer = tokenizer
        self.accepted_verdicts = bool(accepted_verdicts)
        """Keep the last accepted version's verdicts (a probe it answered soundly counts even where the reference
        failed it; a corrected prompt it answered soundly may not break). False keeps none, so the reference's
        verdicts alone count: the gate without that check, for measuring what it adds."""
        self.min_guard_pass = float(min_guard_pass)
        self.max_kl = float(max_kl)
        self.probe_tokens = int(probe_tokens)
        self.knowledge_tokens = min(int(knowledge_tokens), self.probe_tokens)
        if knowledge_samples < 0 or (knowledge_samples > 0 and not knowledge_temperature > 0):
            raise ValueError("knowledge_samples must be >= 0, and sampling needs knowledge_temperature > 0 "
                             f"(got {knowledge_samples}, {knowledge_temperature})")
        self.knowledge_samples = int(knowledge_samples)
        """Answers sampled per knowledge probe (at ``knowledge_temperature``, the serving default: what users get);
        0 asks one greedy answer, counted like a guard probe."""
        self.knowledge_temperature = float(knowledge_temperature)
        if reference_dice < 1:
            raise ValueError(f"reference_dice must be >= 1 (got {reference_dice})")
        self.reference_dice = int(reference_dice)
        """Sets of dice the fixed reference's sampled knowledge answers are drawn with (the check's own first), once
        per run: the share rule's bar is the lower of its count under the check's dice and its mean over these
        (``fact_share_bar``). 1 = the check's own only."""
        self.max_fact_drop = float(max_fact_drop)
        if not max_preference_drop >= 0:
            raise ValueError(f"max_preference_drop must be >= 0 (got {max_preference_drop})")
        self.preference_hint = preference_hint
        """Gives the hint the preference check reads (``clawloop.gate.preference``), or None while there is none;
        the check is off when this is None."""
        self.max_preference_drop = float(max_preference_drop)
        self.hint_system = hint_system
        """Where the preference check writes the hint besides the last user message, as the teacher does
        (``clawloop.teacher.inject_hint``'s ``system``)."""
        self.recent_prompts = recent_prompts
        self.fixed_prompts = fixed_prompts
        self.prompt_states = prompt_states
        """The starting weights' kept prompt states (``clawloop.gate.scoring``), used by the KL and preference
        forwards when the reference is those weights (``kl_to="reference"``); None scores every prompt afresh."""
        self.kept_answers = kept_answers
        """The starting weights' answers to the shipped and knowledge probes kept on disk between runs
        (``clawloop.gate.kept_answers``), read and added to when the reference is those weights; None asks the
        reference in every run."""
        self.renderer = ChatRenderer(tokenizer)
        self.shipped = [_Probe("shipped", p, self._render(p), question=p, messages=[{"role": "user", "content": p}])
                        for p in probes]
        self.knowledge = [_Probe("knowledge", k.question, self._render(k.question), question=k.question,
                                 answers=tuple(k.answers)) for k in knowledge]
        self._reference_ok: dict[str | bytes, bool] = {}
        """Reference verdict per probe key (``_key``); computed once each, so a question asked again in a new turn
        costs the reference no second answer."""
        self._reference_right: dict[str | bytes, int] = {}
        """Sampled knowledge probes: how many of the reference's answers state the fact."""
        self._reference_mean: dict[str | bytes, float] = {}
        """Sampled knowledge probes: the mean of that count over ``reference_dice`` sets (the fixed reference's
        only)."""
        self._reference_draws: dict[str | bytes, list[int]] = {}
        """Sampled knowledge probes: the count under each dice set drawn so far, set 0 first, until the mean."""
        self._accepted: dict[str | bytes, tuple[bool, str, list[int]]] = {}
        """The last accepted version's verdict and answer per probe key, recorded by the check that accepted it;
        empty at start and after ``forget_accepted`` (the reference's verdicts then stand for it)."""
        self._accepted_reward: dict[str | bytes, tuple[str, float]] = {}
        """The preference check's R of the last accepted version's answer per probe key, with the hint it was read
        under (recorded by the check that accepted it, so a check scores only the candidate's answers)."""

    def forget_accepted(self) -> None:
        """The served version changed outside the gate (a rollback): its verdicts are unknown, so the reference's
        stand for them until a candidate is accepted again."""
        self._accepted.clear()
        self._accepted_reward.clear()

    def _render(self, prompt: str) -> list[int]:
        out = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def probe_set(self) -> list[_Probe]:
        """The shipped probes, the knowledge probes, the run's corrected prompts (``fixed:``), then its recent
        prompts, each run prompt unless an earlier probe has the same ids: two sessions that ask the same question
        differ in OpenClaw's timestamps but not in their bounded forms, and one borderline answer must not count as
        two regressions."""
        probes = list(self.shipped) + list(self.knowledge)
        seen = {tuple(p.ids) for p in probes}
        for kind, source in (("fixed", self.fixed_prompts), ("recent", self.recent_prompts)):
            for turn_id, ids, messages in (source() if source else ()):
                probe = self._recent_probe(turn_id, list(ids), messages, kind=kind)
                if probe is not None and tuple(probe.ids) not in seen:
                    seen.add(tuple(probe.ids))
                    probes.append(probe)
        return probes

    def _recent_probe(self, turn_id: int, ids: list[int], messages: Sequence[dict[str, Any]], *,
                      kind: str = "recent") -> _Probe | None:
        """A recent prompt as a probe: as it was served when it is at most ``MAX_PROMPT_TOKENS`` long, else its
        bounded form (``bounded_ids``); None when it has no bounded form (it ends in a tool result, say)."""
        if not ids:
            return None
        shown: list[dict[str, Any]] | None = list(messages)
        if len(ids) > MAX_PROMPT_TOKENS:
            ids, shown = self.bounded_form(messages)
            if not ids:
                return None
        return _Probe(f"{kind}:{turn_id}", last_user_text(messages) or self._prompt_tail(ids), ids,
                      question=question_of(messages), messages=shown)

    def bounded_ids(self, messages: Sequence[dict[str, Any]], budget: int = RECENT_TAIL_TOKENS) -> list[int]:
        """A long prompt's bounded form, rendered like a shipped probe: its ``closing_exchanges`` from the last
        user message back, as many whole messages as fit in ``budget`` tokens; a last user message that alone is
        longer keeps its beginning and its end. Empty when the prompt has no closing user message."""
        return self.bounded_form(messages, budget)[0]

    def bounded_form(self, messages: Sequence[dict[str, Any]],
                     budget: int = RECENT_TAIL_TOKENS) -> tuple[list[int], list[dict[str, Any]] | None]:
        """``bounded_ids`` and the messages they render (None where a long last message was cut to its ends)."""
        tail = closing_exchanges(messages)
        if not tail:
            return [], None
        best, kept = self._render_messages(tail[-1:]), tail[-1:]
        if len(best) > budget:
            return self._message_ends(tail[-1]["content"], budget), None
        for start in range(len(tail) - 2, -1, -1):
            if tail[start]["role"] != "user":
                continue  # an exchange starts with the user's message
            ids = self._render_messages(tail[start:])
            if len(ids) > budget:
                break
            best, kept = ids, tail[start:]
        return best, list(kept)

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
    def _verdict(self, p: _Probe, ids: list[int]) -> tuple[bool, list[str]]:
        """The guard's verdict on an answer (question rules where the question is known). A knowledge probe's
        answer must hold one of its right answers (``forgot`` otherwise) and pass the text rules only: the fact is
        what it checks, so "The answer is 3." to the sides of a triangle is right, though the question rules would
        call it off topic; and it may be all digits ("10 + 10 = 20." is a sound answer to a sum, though the text
        rules call it ``empty`` and ``non_letters``)."""
        text = self._text(ids)
        verdict = guard_check(text, question=None if p.answers else p.question)
        reasons = [r for r in verdict.reasons if not (p.answers and r in ("empty", "non_letters"))]
        if p.answers and not knows(text, p.answers):
            reasons.append("forgot")
        return not reasons, reasons

    def _sound_count(self, p: _Probe, answers: list[list[int]]) -> int:
        """How many of a probe's answers pass its verdict (a sampled knowledge probe: state the fact)."""
        return sum(self._verdict(p, ans)[0] for ans in answers)

    def _accepted_ok(self, p: _Probe) -> bool | None:
        known = self._accepted.get(_key(p))
        return None if known is None else known[0]

    def _sampled(self, p: _Probe) -> bool:
        return p.source == "knowledge" and self.knowledge_samples > 0

    def _worth_asking(self, p: _Probe) -> bool:
        """A knowledge probe is asked only when its verdict can count: the reference or the last accepted version
        knew the fact (sampled: the reference stated it at least once, so it also counts in the share of answers
        stating facts). Every other probe is asked (its answer also feeds the KL and the evidence)."""
        if p.source != "knowledge":
            return True
        if self._sampled(p):
            return self._reference_right[_key(p)] > 0
        return self._reference_ok[_key(p)] or bool(self._accepted_ok(p))

    def _ask(self, model: torch.nn.Module, probes: list[_Probe], eos: list[int],
             dice_set: int = 0) -> list[tuple[list[list[int]], torch.Tensor | None]]:
        """Each probe's answers: one greedy answer with its log-softmax rows, or for a sampled knowledge probe
        ``knowledge_samples`` answers drawn with the probe's own uniforms (``sampling_uniforms``), and None. The
        check always draws with dice set 0; ``fact_counts`` may ask with others."""
        prompts: list[list[int]] = []
        caps: list[int] = []
        dice: list[torch.Tensor | None] = []
        done: list[Callable[[list[int]], bool] | None] = []
        for p in probes:
            sampled = self._sampled(p)
            for i in range(self.knowledge_samples if sampled else 1):
                prompts.append(p.ids)
                caps.append(self._cap(p))
                draw = dice_set * self.knowledge_samples + i
                dice.append(sampling_uniforms(p.prompt, draw, self._cap(p)) if sampled else None)
                done.append(self._names_fact(p.answers) if sampled else None)
        answers, logprobs = probe_answers(model, prompts, caps, eos, uniforms=dice,
                                           temperature=self.knowledge_temperature, done=done)
        out, row = [], 0
        for p in probes:
            n = self.knowledge_samples if self._sampled(p) else 1
            out.append((answers[row:row + n], None if self._sampled(p) else logprobs[row]))
            row += n
        return out

    @torch.no_grad()
    def fact_counts(self, model: torch.nn.Module, dice_set: int = 0) -> list[tuple[str, int, int]]:
        """``(question, answers stating the fact, answers)`` for each knowledge probe, its ``knowledge_samples``
        answers sampled by ``model`` as the check samples them, but with the ``dice_set``-th set of uniforms (the
        check's own is set 0). What the check's sampled fact count would have been under other dice: how much of a
        verdict is the model and how much the draw (``benchmarks/support_pull.py --dice``)."""
        if not self.knowledge_samples:
            raise ValueError("fact_counts needs knowledge_samples > 0")
        counts = []
        for p, (answers, _) in zip(self.knowledge, self._ask(model, self.knowledge, self._eos_ids(), dice_set)):
            counts.append((p.prompt, self._sound_count(p, answers), len(answers)))
        return counts

    @torch.no_grad()
    def check(self, candidate: torch.nn.Module | Callable[[], ContextManager[torch.nn.Module]],
              reference: Callable[[], ContextManager[torch.nn.Module]], kl_to: str = "reference") -> GateResult:
        """Decide on ``candidate``: a model, or a function entering a context in which it yields the model (the
        trainer's merged view of its LoRA model, ``trainer.model.gate_candidate``). ``reference()`` enters a
        context in which it yields the model to compare with (``kl_to`` names it in the evidence); the two
        contexts are never entered at once. Only the fixed starting weights (``kl_to="reference"``) have their
        verdicts kept between checks; the last accepted version changes.

        The cost is bounded five ways: a knowledge probe that cannot count (neither the reference nor the last
        accepted version knew the fact; sampled, the reference never stated it) is not asked; the knowledge probes,
        whose facts come in a first sentence, are answered in ``knowledge_tokens``, each prompt prefilled once for
        all its sampled answers; a sampled knowledge answer ends once it has named its fact (``names_fact``:
        whether it names it cannot change, only the text rules then see less of it); the knowledge probes are
        answered first (by the reference too, where it has not yet answered a probe); and the check stops as soon
        as what it has seen rejects the candidate whatever the rest would show (``certain_rejection``). None but
        the third can change a rule's verdict (with greedy knowledge answers, the probes not asked also leave the
        KL's mean, which they would enter)."""
        t0 = time.monotonic()
        enter_candidate = ((lambda: contextlib.nullcontext(candidate)) if isinstance(candidate, torch.nn.Module)
                           else candidate)
        if kl_to != "reference":
            self._reference_ok.clear()
            self._reference_right.clear()
            self._reference_mean.clear()
            self._reference_draws.clear()
        states = self.prompt_states if kl_to == "reference" else None  # kept states are the fixed weights' only
        probe_set = self.probe_set()
        eos = self._eos_ids()
        # Two parts, the knowledge probes first: their answers are short, and most rejections in simulated runs
        # were for facts, which once every knowledge probe is answered no other probe can change
        # (``certain_rejection``); such a check then skips the guard's long answers, and the reference's answers to
        # the run's new prompts too.
        parts = [[p for p in probe_set if p.source == "knowledge"], [p for p in probe_set if p.source != "knowledge"]]
        answered: list[tuple[_Probe, list[int], torch.Tensor | None]] = []
        outcomes: list[ProbeOutcome] = []
        unasked, stopped, kl_measured = 0, False, True
        # The share of facts is decided once the knowledge part is over, when the reference may need more dice.
        more_dice = kl_to == "reference" and self.reference_dice > 1
        parts_s: dict[str, float] = {}
        for k, part in enumerate(parts):
            missing = [p for p in part if _key(p) not in self._reference_ok]
            if missing:  # the reference answers each probe once, the first time a check reaches it
                self._answer_by_reference(reference, missing, eos, parts_s, keep=kl_to == "reference")
            asked = [p for p in part if self._worth_asking(p)]
            unasked += len(part) - len(asked)
            batches = [[asked[i] for i in idx] for idx in length_buckets([len(p.ids) for p in asked])]
            if not batches:
                continue
            with _timed(parts_s, "guard" if k else "knowledge"), enter_candidate() as model:
                for n, batch in enumerate(batches):
                    for p, (answers, lp) in zip(batch, self._ask(model, batch, eos)):
                        outcome, ans = (self._sampled_outcome(p, answers) if lp is None
                                        else (self._outcome(p, answers[0]), answers[0]))
                        answered.append((p, ans, lp))
                        outcomes.append(outcome)
                    pending = [p for rest in batches[n + 1:] for p in rest] + [p for later in parts[k + 1:]
                                                                                for p in later]
                    if pending and certain_rejection(outcomes, sum(p.source != "knowledge" for p in pending),
                                                     sum(p.source == "knowledge" for p in pending),
                                                     min_guard_pass=self.min_guard_pass,
                                                     # with more dice to come the share waits for the bar
                                                     max_fact_drop=1.0 if more_dice and k == 0
                                                     else self.max_fact_drop):
                        unasked += len(pending)
                        stopped = True
                        break
            if k == 0 and more_dice:  # also after a stop for forgotten facts, so the evidence's bar is the real one
                self._fill_reference_means(answered, outcomes, reference, eos, parts_s)
                pending = [p for later in parts[1:] for p in later]
                if not stopped and pending and certain_rejection(outcomes, len(pending), 0,
                                                                 min_guard_pass=self.min_guard_pass,
                                                                 max_fact_drop=self.max_fact_drop):
                    unasked += len(pending)
                    stopped = True
            if stopped:
                kl_measured = k > 0  # stopped after the knowledge probes: no guard pass and no KL measured
                break
        order = {id(p): i for i, p in enumerate(probe_set)}  # the evidence lists probes in the probe set's order
        pairs = sorted(zip(answered, outcomes), key=lambda pair: order[id(pair[0][0])])
        answered, outcomes = [a for a, _ in pairs], [o for _, o in pairs]
        greedy = [(p, a) for p, a, lp in answered if lp is not None]
        scored = iter(())
        if greedy:
            # Read with their end token where they ended: the KL takes the answer's rows, the preference check
            # (step 6) the end token's row as well.
            with _timed(parts_s, "kl"), reference() as ref:
                scored = iter(answer_logprobs(ref, [p.ids for p, _ in greedy],
                                              [self._with_end(p, a) for p, a in greedy], states=states))
        ref_lp = [next(scored) if lp is not None else None for _, _, lp in answered]
        kl_sum, kl_tokens = 0.0, 0
        for outcome, (_, ans, c_T_V), r_T_V in zip(outcomes, answered, ref_lp):
            if c_T_V is None:  # sampled answers: the KL is measured on the greedy ones
                continue
            kl_T = (c_T_V.exp() * (c_T_V - r_T_V[:len(ans)])).sum(-1) if len(ans) else torch.zeros(0)
            kl_sum += float(kl_T.sum())
            kl_tokens += len(ans)
            outcome.kl = float(kl_T.mean()) if len(ans) else 0.0
        kl = kl_sum / kl_tokens if kl_tokens else 0.0
        # Greedy answers that all ended at once measured nothing: such a candidate is not near-identical.
        kl_measured = kl_measured and kl_tokens > 0
        decision = decide(outcomes, kl, min_guard_pass=self.min_guard_pass, max_kl=self.max_kl,
                          max_fact_drop=self.max_fact_drop, kl_measured=kl_measured)
        preference, rewards = None, {}
        if kl_to != "reference":
            # Without the starting weights there is no fixed reader: rewards read by one accepted version and
            # compared with the next one's readings would measure the readers, not the answers.
            self._accepted_reward.clear()
        elif decision.accepted:  # a candidate rejected already needs no reading (nor its rewards kept)
            with _timed(parts_s, "preference") if self.preference_hint is not None else contextlib.nullcontext():
                preference, rewards = self._preference(answered, outcomes, ref_lp, reference, states)
            if preference is not None:
                decision = decide(outcomes, kl, min_guard_pass=self.min_guard_pass, max_kl=self.max_kl,
                                  max_fact_drop=self.max_fact_drop, kl_measured=kl_measured, preference=preference,
                                  max_preference_drop=self.max_preference_drop)
        if decision.accepted:
            # The new last accepted version's verdicts replace the old ones; a fact it was not asked (neither an
            # accepted version nor the reference knew it) keeps its earlier verdict.
            unasked_keys = {_key(p) for p in probe_set} - {_key(p) for p, _, _ in answered}
            # (A sampled knowledge probe's entry is kept for the evidence only: its facts count against the
            # reference alone, ``ProbeOutcome.counted``.)
            if self.accepted_verdicts:
                self._accepted = {**{k: v for k, v in self._accepted.items() if k in unasked_keys},
                                  **{_key(p): (o.ok, o.answer, list(a)) for (p, a, _), o in zip(answered, outcomes)}}
            self._accepted_reward = rewards
        return GateResult(accepted=decision.accepted, reasons=decision.reasons, guard_pass=decision.guard_pass,
                          kl=kl, kl_to=kl_to, seconds=time.monotonic() - t0, probes=outcomes,
                          thresholds={"min_guard_pass": self.min_guard_pass, "max_kl": self.max_kl,
                                      "probe_tokens": float(self.probe_tokens),
                                      "knowledge_tokens": float(self.knowledge_tokens),
                                      "knowledge_samples": float(self.knowledge_samples),
                                      "knowledge_temperature": self.knowledge_temperature,
                                      "max_fact_drop": self.max_fact_drop,
                                      "near_identical_kl": NEAR_IDENTICAL_KL,
                                      "tolerated_regressions": float(decision.tolerated),
                                      "tolerated_forgotten": float(decision.tolerated_forgotten),
                                      "max_preference_drop": self.max_preference_drop},
                          counted=decision.counted, regressions=decision.regressions,
                          knowledge_counted=decision.knowledge_counted, forgotten=decision.forgotten,
                          facts_right=decision.facts_right, facts_reference_right=decision.facts_reference_right,
                          facts_reference_bar=decision.facts_reference_bar,
                          broken_fixes=decision.broken_fixes, unanswered=unasked, kl_measured=kl_measured,
                          preference=preference, seconds_by_part=parts_s)

    def _preference(self, answered: list[tuple[_Probe, list[int], torch.Tensor | None]],
                    outcomes: list[ProbeOutcome], ref_lp: list[torch.Tensor | None],
                    reference: Callable[[], ContextManager[torch.nn.Module]], states: PromptStates | None
                    ) -> tuple[PreferenceReading | None, dict[str | bytes, tuple[str, float]]]:
        """The preference check (``clawloop.gate.preference``): the hint's R of the candidate's greedy guard
        answers, by probe key, and the reading over those the last accepted version also answered (None when
        there is no hint, no accepted version since the gate started, or no such probe), each outcome given both
        answers' R. The unhinted half of the candidate's R comes from the KL's reference forward (``ref_lp``)
        wherever the probe's ids are its messages' rendering; the accepted answers' R are those recorded when
        their version was accepted, read again only where the hint changed since, and an answer equal to the
        accepted version's has its R. So a check costs one reference forward over the hinted prompts of the
        answers that changed. A probe whose R is not finite is left out (it must not decide, nor be kept)."""
        hint = self.preference_hint() if self.preference_hint is not None else None
        if not hint:
            return None, {}
        rows, plain_sums, plain, hinted = [], [], [], []
        for (p, ans, lp), o, r_T_V in zip(answered, outcomes, ref_lp):
            if lp is None or p.source == "knowledge" or p.messages is None:
                continue
            pair = self._hinted_pair(p.messages, hint)
            if pair is None:
                continue
            read = self._with_end(p, ans)
            rows.append((p, read, o))
            plain.append(pair[0])
            hinted.append(pair[1])
            reuse = r_T_V is not None and pair[0] == p.ids
            plain_sums.append(summed_logprob(r_T_V, read) if reuse else None)
        if not rows:
            return None, {}
        compared = [i for i, (p, _, _) in enumerate(rows) if _key(p) in self._accepted]
        stale = [i for i in compared if self._accepted_reward.get(_key(rows[i][0]), ("", 0.0))[0] != hint]
        theirs = {i: self._accepted_reward[_key(rows[i][0])][1] for i in compared if i not in stale}
        # An answer equal to the accepted version's has its R (once that is known).
        same = [i for i in compared if rows[i][1] == self._accepted_scored(rows[i][0])]
        todo = [i for i in range(len(rows)) if i not in same]
        unplain = [i for i in todo if plain_sums[i] is None]
        if stale or todo:
            with reference() as ref:
                if stale:
                    read = implicit_rewards(ref, [plain[i] for i in stale], [hinted[i] for i in stale],
                                            [self._accepted_scored(rows[i][0]) for i in stale], states=states)
                    theirs.update(zip(stale, read))
                    # The accepted version's rewards under this hint, whatever becomes of the candidate.
                    self._accepted_reward.update({_key(rows[i][0]): (hint, r) for i, r in zip(stale, read)})
                for i, v in zip(unplain, answer_logprob_sums(ref, [plain[i] for i in unplain],
                                                             [rows[i][1] for i in unplain], states=states)
                                if unplain else []):
                    plain_sums[i] = v
                hinted_sums = answer_logprob_sums(ref, [hinted[i] for i in todo], [rows[i][1] for i in todo],
                                                  states=states) if todo else []
        else:
            hinted_sums = []
        mine = {i: theirs[i] for i in same}
        mine.update({i: h - float(plain_sums[i]) for i, h in zip(todo, hinted_sums)})
        kept = [i for i in range(len(rows)) if math.isfinite(mine[i])]
        compared = [i for i in compared if i in kept and math.isfinite(theirs[i])]
        for i in kept:
            rows[i][2].preference = mine[i]
        for i in compared:
            rows[i][2].accepted_preference = theirs[i]
        rewards = {_key(rows[i][0]): (hint, mine[i]) for i in kept}
        if not compared:
            return None, rewards
        return PreferenceReading.of(hint, [theirs[i] for i in compared], [mine[i] for i in compared],
                                    [len(self._accepted_scored(rows[i][0])) for i in compared],
                                    [len(rows[i][1]) for i in compared]), rewards

    def _with_end(self, p: _Probe, ans: list[int]) -> list[int]:
        """A greedy answer as the preference check reads it: with the end of turn (``turn_end_token_id``) where it
        ended before its cap (a greedy answer stops short of its cap only at an end token). Where an answer ends
        says as much about a preference for length or for a closing as its words do, and an answer read without it
        would be scored as if it could go on."""
        return list(ans) + [turn_end_token_id(self.tokenizer)] if len(ans) < self._cap(p) else list(ans)

    def _accepted_scored(self, p: _Probe) -> list[int]:
        """The last accepted version's answer to ``p`` as the preference check reads it (``_with_end``)."""
        return self._with_end(p, self._accepted[_key(p)][2])

    def _hinted_pair(self, messages: list[dict[str, Any]], hint: str) -> tuple[list[int], list[int]] | None:
        """A probe's messages rendered without and with the hint; None when the renderer refuses them (content it
        cannot render as text): that probe is left out of the preference check, never the cause of a rejection."""
        try:
            hinted = inject_hint(messages, hint, system=self.hint_system)
            return self._render_messages(messages), self._render_messages(hinted)
        except (ValueError, TypeError, KeyError):
            return None

    def _outcome(self, p: _Probe, ans: list[int]) -> ProbeOutcome:
        """A greedy answer's outcome, with the reference's and the last accepted version's verdicts."""
        ok, reasons = self._verdict(p, ans)
        known = self._accepted.get(_key(p))
        return ProbeOutcome(source=p.source, prompt=p.prompt, answer=self._text(ans), ok=ok, reasons=reasons,
                            reference_ok=self._reference_ok[_key(p)], kl=0.0, tokens=len(ans),
                            accepted_ok=None if known is None else known[0],
                            accepted_answer=None if known is None else known[1])

    def _names_fact(self, answers: tuple[str, ...]) -> Callable[[list[int]], bool]:
        """Whether a sampled answer so far names the fact for good (``names_fact``: "= 12." but not "= 12", which
        could become "= 120"): it ends there, since an answer running on to the cap costs the check up to 24
        decoding steps for each of its rows. The text rules then judge the answer as far as it went."""
        return lambda ids: names_fact(self._text(ids), answers)

    def _sampled_outcome(self, p: _Probe, answers: list[list[int]]) -> tuple[ProbeOutcome, list[int]]:
        """A sampled knowledge probe's outcome (``forgot_sampled``), shown by its first answer that lacks the fact
        (else its first answer), which is also returned."""
        verdicts = [self._verdict(p, ans) for ans in answers]
        right = sum(ok for ok, _ in verdicts)
        reference_right = self._reference_right[_key(p)]
        shown = next((i for i, (ok, _) in enumerate(verdicts) if not ok), 0)
        ok = not forgot_sampled(right, reference_right)
        return ProbeOutcome(source=p.source, prompt=p.prompt, answer=self._text(answers[shown]), ok=ok,
                            reasons=[] if ok else sorted(set(verdicts[shown][1]) | {"forgot"}),
                            reference_ok=self._reference_ok[_key(p)], kl=0.0, tokens=len(answers[shown]),
                            samples=len(answers), right=right, reference_right=reference_right,
                            reference_mean=self._reference_mean.get(_key(p))), answers[shown]

    def _fill_reference_means(self, answered: list[tuple[_Probe, list[int], torch.Tensor | None]],
                              outcomes: list[ProbeOutcome], reference: Callable[[], ContextManager[torch.nn.Module]],
                              eos: list[int], seconds: dict[str, float]) -> None:
        """Gives the sampled knowledge outcomes the reference's mean count over ``reference_dice`` sets of dice
        (``fact_share_bar``). The fixed reference draws the other sets once per run (``reference_dice`` in
        ``seconds``; 7 sets of 136 answers took about 50 s on 2 CPU threads), and only once a candidate's share of
        facts falls more than ``max_fact_drop`` below what the check's own dice gave the reference: the mean can
        only lower the bar, so until then it could change no verdict."""
        sampled = [(p, o) for (p, _, _), o in zip(answered, outcomes) if o.samples and o.reference_right]
        lacking = [p for p, _ in sampled if _key(p) not in self._reference_mean]
        if lacking and too_few_facts([o for _, o in sampled], self.max_fact_drop):
            self._draw_reference_dice(reference, lacking, eos, seconds)
        for p, o in sampled:
            o.reference_mean = self._reference_mean.get(_key(p))

    def _answer_by_reference(self, reference: Callable[[], ContextManager[torch.nn.Module]], probes: list[_Probe],
                             eos: list[int], seconds: dict[str, float] | None = None, *, keep: bool = True) -> None:
        """The reference's verdict on each probe (sampled: how many of its answers state the fact). ``keep``: the
        reference is the fixed starting weights, whose answers may come from and go to ``kept_answers``."""
        for p, answers in zip(probes, self._reference_asked(reference, probes, eos, 0, seconds, "reference_answers",
                                                             keep=keep)):
            right = self._sound_count(p, answers)
            self._reference_right[_key(p)] = right
            self._reference_ok[_key(p)] = 2 * right >= len(answers)

    def _draw_reference_dice(self, reference: Callable[[], ContextManager[torch.nn.Module]], probes: list[_Probe],
                             eos: list[int], seconds: dict[str, float] | None = None,
                             max_sets: int | None = None) -> None:
        """Draws the reference's answers to sampled knowledge ``probes`` with their next dice sets (every set left,
        or ``max_sets`` of them), each probe's mean count recorded once it has ``reference_dice`` counts."""
        for _ in range(self.reference_dice if max_sets is None else max_sets):
            todo = [p for p in probes if _key(p) not in self._reference_mean]
            if not todo:
                return
            draws = [self._reference_draws.setdefault(_key(p), [self._reference_right[_key(p)]]) for p in todo]
            d = min(len(drawn) for drawn in draws)
            batch = [(p, drawn) for p, drawn in zip(todo, draws) if len(drawn) == d]
            asked = self._reference_asked(reference, [p for p, _ in batch], eos, d, seconds, "reference_dice")
            for (p, drawn), answers in zip(batch, asked):
                drawn.append(self._sound_count(p, answers))
                if len(drawn) >= self.reference_dice:
                    self._reference_mean[_key(p)] = sum(drawn) / len(drawn)

    def _reference_asked(self, reference: Callable[[], ContextManager[torch.nn.Module]], probes: list[_Probe],
                         eos: list[int], dice_set: int, seconds: dict[str, float] | None, part: str, *,
                         keep: bool = True) -> list[list[list[int]]]:
        """The reference's answers to ``probes`` under ``dice_set``: a shipped or knowledge probe's from
        ``kept_answers`` where it holds them, the others asked (the reference entered only then, its time added to
        ``seconds[part]``) and, for shipped text, kept."""
        kept = self.kept_answers if keep else None
        keys = [self._kept_key(p, eos, dice_set) if kept is not None and p.source in SHIPPED_SOURCES else None
                for p in probes]
        found = [kept.get(k) if kept is not None and k is not None else None for k in keys]
        missing = [i for i, answers in enumerate(found) if answers is None]
        if missing:
            with _timed(seconds if seconds is not None else {}, part), reference() as ref:
                asked = self._ask(ref, [probes[i] for i in missing], eos, dice_set)
            for i, (answers, _) in zip(missing, asked):
                found[i] = answers
            if kept is not None:
                kept.put({k: found[i] for i in missing if (k := keys[i]) is not None})
        return [answers or [] for answers in found]

    def _kept_key(self, p: _Probe, eos: list[int], dice_set: int) -> str:
        sampled = self._sampled(p)
        return request_key(p.prompt, p.ids, cap=self._cap(p), eos_ids=eos,
                           samples=self.knowledge_samples if sampled else 0,
                           temperature=self.knowledge_temperature, dice_set=dice_set,
                           facts=p.answers if sampled else ())

    @torch.no_grad()
    def prepare(self, reference: Callable[[], ContextManager[torch.nn.Module]]) -> bool:
        """Does one piece of the fixed reference's own work ahead of the checks that need it, and returns whether
        any is left: its answers to the knowledge probes, then to the shipped probes, then its other dice sets of
        the sampled knowledge probes, one set a call. For a trainer with nothing to train (``Trainer.prepare``):
        every check would do the same work on the way to a new version, the first check most of it (on the CPU
        default, the reference's first answers took 42 s of a 112 s check, its other dice 106 s of another, with
        a simulated user talking). Only for the fixed starting weights (``kl_to="reference"``), whose verdicts
        are kept. No verdict changes: a check would ask the reference the same probes with the same dice, and a
        mean known before a check needs it lowers the bar only for candidates that the check's own draw passes
        anyway (``fact_share_bar``)."""
        eos = self._eos_ids()
        for part in (self.knowledge, self.shipped):
            missing = [p for p in part if _key(p) not in self._reference_ok]
            if missing:
                self._answer_by_reference(reference, missing, eos)
                return True
        dice = [p for p in self.knowledge if self._sampled(p) and self._reference_right[_key(p)] > 0
                and _key(p) not in self._reference_mean] if self.reference_dice > 1 else []
        if dice:
            self._draw_reference_dice(reference, dice, eos, max_sets=1)
        return any(_key(p) not in self._reference_mean for p in dice)

    def _cap(self, p: _Probe) -> int:
        """Most tokens of a probe's answer: ``knowledge_tokens`` for a knowledge probe, else ``probe_tokens``."""
        return self.knowledge_tokens if p.source == "knowledge" else self.probe_tokens

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _eos_ids(self) -> list[int]:
        return end_token_ids(self.tokenizer)


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


@contextlib.contextmanager
def _timed(seconds: dict[str, float], part: str) -> Iterator[None]:
    """Adds the block's wall time to ``seconds[part]``."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        seconds[part] = seconds.get(part, 0.0) + time.monotonic() - t0


def _key(p: _Probe) -> str | bytes:
    """A shipped probe's text, or a digest of a recent prompt's token ids (small, whatever the prompt's length)."""
    if p.source == "shipped":
        return p.prompt
    return hashlib.blake2b(array("q", p.ids).tobytes(), digest_size=16).digest()
