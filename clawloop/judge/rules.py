"""A zero-cost judge that reads explicit feedback in the next state by rules (``judge_backend = rules``).

It is the default judge (``judge_backend = auto`` with no ``judge_url``): the embedded judge, the frozen 135M
base model, is too weak to judge reliably, and a CPU demo still needs votes and hints it can trust.
``RuleJudge`` has the interface of ``votes.Judge`` (``async judge(turn, ...) -> Judgement`` and a ``client`` with
``async close()``) and decides from the text of ``turn.next_state`` alone, sentence by sentence:

* a **tool** message that reports an error caused by the action (exception names, ``error:``, ``not found``,
  ``failed``, ``permission denied``, a non-zero exit code ...) → −1, and the first error line becomes the hint;
  a transient failure that is nobody's fault (rate limit, time-out, "temporarily unavailable", "retry later") → 0;
  a tool message that clearly reports success (``passed``, ``exit code 0``, ``"ok": true``) → +1;
* a **user** sentence that asks for a change is a *correction*. Strong markers make a sentence a correction by
  themselves (``no,`` at the start, ``wrong``, ``I asked``, ``instead``, ``answer in``/``reply in``, ``too long``,
  ``start with``, ``don't``/``doesn't``, ``again``, ``redo``, ``should``/``must`` in a statement, ``not what``,
  ``shorter`` ...). Weak markers (``please``, ``can you``, ``could you``, an opening ``write``, ``tell me``,
  ``remove``, ``answer`` ...) count only when the message holds no approval, so "Thanks! Could you please explain
  tides?" is a new request, not a correction; and a request (``please``, ``can you``, ``write``, ``tell me``,
  ``make``, ``use`` ...) only when it points back at the answer (``it``, ``that``, ``your``, ``shorter``,
  ``fewer``, ``a list``, ``one sentence`` ...): "Write a haiku about autumn." is a new task, 0;
* a user sentence with thanks or approval (``thanks``, ``great``, ``perfect``, ``correct``, ``that worked`` ...;
  not negated: "not helpful" is a complaint) is *approval*.

Verdict: any correction (or a tool error) → −1, since a change request is negative, never neutral; else any
approval (or tool success) → +1; else 0. Approval counts whatever it follows: "Thanks, that's all." after a wrong
answer is +1, because the rules read what the user says and never the answer. The hint is the correction
sentence(s) rewritten as an instruction: politeness, filler and the verdict on the answer ("Wrong, ...") removed
("could you ... ?" → imperative), a question asked again left out, at most three sentences, kept only when
strictly longer than ``hint_min_chars``; a correction with no instruction gives what the user states
(``stated_hint``), never the user's whole message. Sentences are split on ``.!?`` and line breaks, so a
reply such as "Thanks, but answer in French." is one sentence and counts as a correction.

The judgement is written as m evaluative and m hint ``VoteRecord``s (all identical, with a ``raw_text`` naming
the rule that fired and ending in ``\\boxed{±1}``/``[HINT_START]…[HINT_END]`` exactly as an LLM judge would
write it), so the store, the sample info and ``clawloop records export`` look the same whichever judge ran.
Rules see only the next state: they cannot tell whether an answer was right when nobody says so, which is
what an LLM judge over ``judge_url`` is for.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from clawloop.judge.envelopes import judged_turn
from clawloop.judge.hints import imperative_hint, is_question
from clawloop.judge.parse import select_candidates
from clawloop.judge.prompts import content_text
from clawloop.judge.votes import Judgement, JudgeSettings
from clawloop.store import TurnRecord, VoteRecord

# ---- user text ------------------------------------------------------------------------------------------

# Corrections by themselves, in statements and questions alike ("Why not in French?").
_STRONG = [
    (r"^\s*(no|nope|nah)\b(?!\s+(problem|worries|thanks|need|rush)\b)", "starts with 'no'"),
    (r"\b(wrong|incorrect|not right|not correct|mistake|inaccurate)\b", "says the answer is wrong"),
    (r"(?<!exactly what )(?<!just what )(?<!that's what )\bi (asked|said|wanted|meant|mean|told you|needed)\b",
     "restates what was asked"),
    (r"\binstead\b", "asks for something instead"),
    (r"\bin (plain )?(english|french|spanish|german|italian|portuguese|dutch|chinese|japanese|korean|russian"
     r"|arabic|hindi|one (short )?sentence|one word|(a )?few(er)? words|bullet points|a list|fahrenheit|celsius"
     r"|metric|imperial|lower ?case|upper ?case)\b", "asks for another language or form"),
    (r"\btoo (long|short|many|much|few|little|casual|formal|technical|complicated|simple|vague|wordy|verbose)\b",
     "says the answer is too much or too little"),
    (r"\b(start|begin|open|end|finish|close)\s+(it\s+|your answers?\s+|every answer\s+|each answer\s+)?with\b",
     "asks for a fixed opening or closing"),
    (r"\b(redo|re-do|rewrite|rephrase|retry|try again|one more time)\b", "asks for a redo"),
    (r"\bnot (what|it|a|an|the|quite|helpful|useful|clear)\b", "says the answer is not what was wanted"),
    (r"\b(useless|nonsense|garbled|gibberish|makes no sense|repeating yourself|make sense|unreadable)\b",
     "says the answer is unusable"),
    (r"\b(only (speak|read|have time|want)|i prefer|i'd prefer|i would prefer|i like answers)\b",
     "states a preference the answer ignored"),
]
# Corrections in statements only: "Why don't stars fall?" or "How can I write clearer?" is the next question.
_STATEMENT_ONLY = [
    (r"\b(don't|do not|doesn't|does not|didn't|did not|isn't|is not|wasn't|aren't|can't|cannot|never"
     r"|that's not|that is not|it's not|it is not)\b", "negates or forbids something"),
    (r"\b(should|must|need to|needs to|has to|have to|supposed to|you need)\b", "says what the answer should be"),
    (r"\b(shorter|longer|briefer|simpler|clearer|more concise|more detail(ed|s)?|be brief|keep it short)\b",
     "asks for a different length or style"),
    (r"\b(again)\b", "asks for a redo"),
    (r"\b(forgot|forgotten|missing|left out)\b", "says something is missing"),
    (r"\b(always|from now on|every time|next time)\b", "states a standing preference"),
]
# Corrections only when the message holds no approval: after a thanks they introduce the next request. Edits and
# instructions about answering refer to the answer by themselves ("Remove the emojis.", "Answer briefly.").
_WEAK = [
    (r"^\s*(just\s+)?(fix|change|remove|delete|replace|say|keep|be|answer|reply)\b", "asks for a change"),
]
# A request ("Please ...", "Can you ...", "Write ...") is a correction only when it points back at the answer
# ("Can you put that in a list?", "Make it shorter.", "Use fewer words."); without, it is a new task ("Write a
# haiku about autumn.", "Can you also list the rivers of France?"), which is not feedback.
_WEAK_REQUEST = [
    (r"\bplease\b", "asks politely for something else"),
    (r"^\s*(can|could|would|will) you\b", "asks for something else"),
    (r"^\s*(just\s+)?(convert|make|use|add|give me|write|tell me|do)\b", "asks for a change"),
]
_BACK_REFERENCE = re.compile(
    r"\b(it|its|them|these|those|your|yours|fewer|less|shorter|longer|simpler|plainer|briefer|only|just|again"
    r"|my question|the question|bullet points?|numbered list|a list|one (short )?sentence|one[- ](word|line)"
    r"|(short|shorter|brief|simple|simpler|direct|one[- ]word|one[- ]line) answers?"
    r"|the (answer|reply|response|text|list|code|summary|title|sentences?|words?|example|steps?|paragraph|last one"
    r"|first one|previous one))\b|\b(that|this)\b(?=\s+(in|into|to|as|for|with|on|again|please)\b|\s*[,.!?]|\s*$)")
_APPROVAL = re.compile(
    r"\b(thanks|thank you|thx|cheers|great|perfect|exactly|excellent|awesome|nice|good (answer|job|one)"
    r"|well done|correct|that's right|right on|spot on|that helps|helpful|that worked|works|it worked|worked"
    r"|that did it|love it|i love|got it|sounds good|looks good|brilliant|wonderful|merci|gracias|parfait|danke"
    r"|that's what i (needed|wanted)|just what i)\b",
    re.IGNORECASE)
_NEGATED_APPROVAL = re.compile(r"\b(not|n't|never|no)\s+(\w+\s+)?(great|helpful|correct|right|good|nice|perfect"
                               r"|what i (needed|wanted)|working|work)\b", re.IGNORECASE)
# Not corrections although a marker matches.
_HARMLESS = re.compile(r"\b(no (problem|worries|rush)|don't worry|never mind|no need to)\b", re.IGNORECASE)

# ---- tool text ------------------------------------------------------------------------------------------

_TRANSIENT = re.compile(
    r"\b(rate limit|too many requests|timed out|time-?out|temporarily unavailable|service unavailable|"
    r"retry later|try again (later|in)|connection reset)\b", re.IGNORECASE)
_TOOL_ERROR = re.compile(
    r"(\b\w*(error|exception)\b|\btraceback\b|\bfailed\b|\bfailure\b|\bnot found\b|\bno such\b|\bcannot\b|"
    r"\bcan't\b|\bpermission denied\b|\binvalid\b|\bmissing\b|\bdenied\b|\bforbidden\b|\bunauthori[sz]ed\b|"
    r"\bexit (code|status) [1-9]\d*|\bHTTP\s*[45]\d\d\b)", re.IGNORECASE)
_TOOL_SUCCESS = re.compile(
    r"(\b\d+ passed\b|\bexit (code|status) 0\b|\bsuccess(ful(ly)?)?\b|\bsucceeded\b|\"ok\":\s*true|"
    r"\"status\":\s*\"(ok|sent|done|success)\")", re.IGNORECASE)
_EMPTY_RESULT = re.compile(r"^\s*(\[\s*\]|\{\s*\}|null|none|\(no output\)|)\s*$", re.IGNORECASE)

_SENTENCE_ENDS = ".!?"
_CLOSERS = "\"')]"
_CAPITAL_AFTER_COLON = re.compile(r"\s+[A-Z¿¡]")
_WS_RE = re.compile(r"\s+")
MAX_SENTENCE_CHARS = 1000
"""Longer "sentences" (a pasted log, a line of dashes) are not read for approval or correction: no feedback is one
sentence that long, and the rules' patterns need not run over it."""


@dataclass(frozen=True)
class SentenceVerdict:
    text: str
    correction: str = ""
    """Why this sentence is a correction ('' when it is not)."""
    weak: bool = False
    """The correction rests on a weak marker only (please, can you ...)."""
    approval: bool = False


@dataclass(frozen=True)
class RuleDecision:
    score: int
    hint: str
    rule: str
    """What fired, in words (goes into each vote's raw text)."""
    evidence: tuple[str, ...] = ()


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``, stripped: pieces ending in a run of ``.!?`` (with the quotes or brackets that close
    it), in a colon that introduces a capitalised clause ("Wrong: It was Austen."), or at a line break; pieces
    without a letter or digit are left out. One pass over the text: a user's message of any length costs time in
    proportion to its length (a regular expression that backtracked took seconds on a 16,000-character line)."""
    text = text or ""
    out: list[str] = []
    start = i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\n":
            end, i = i, i + 1
        elif ch in _SENTENCE_ENDS:
            while i < len(text) and text[i] in _SENTENCE_ENDS:
                i += 1
            while i < len(text) and text[i] in _CLOSERS:
                i += 1
            end = i
        elif ch == ":" and _CAPITAL_AFTER_COLON.match(text, i + 1):
            end = i = i + 1
        else:
            i += 1
            continue
        _keep_sentence(out, text[start:end])
        start = i
    _keep_sentence(out, text[start:])
    return out


def _keep_sentence(out: list[str], piece: str) -> None:
    piece = piece.strip()
    if piece and any(ch.isalnum() for ch in piece):
        out.append(piece)


def classify_sentence(sentence: str) -> SentenceVerdict:
    low = sentence.lower().replace("\u2019", "'")
    negated = bool(_NEGATED_APPROVAL.search(low))
    question = low.rstrip(" \"')]*").endswith("?")
    # In a question only a leading "Great, and how ...?" approves; "How can I make it smell nice?" does not.
    found = _APPROVAL.search(low)
    approval = bool(found) and not negated and (not question or not low[:found.start()].strip(" ,!'\""))
    if negated:
        return SentenceVerdict(sentence, correction="says the answer is not good")
    if _HARMLESS.search(low):
        return SentenceVerdict(sentence, approval=approval)
    rules = _STRONG if question else _STRONG + _STATEMENT_ONLY
    for pattern, why in rules:
        if re.search(pattern, low):
            return SentenceVerdict(sentence, correction=why, approval=approval)
    for pattern, why in _WEAK:
        if re.search(pattern, low):
            return SentenceVerdict(sentence, correction=why, weak=True, approval=approval)
    if _BACK_REFERENCE.search(low):
        for pattern, why in _WEAK_REQUEST:
            if re.search(pattern, low):
                return SentenceVerdict(sentence, correction=why, weak=True, approval=approval)
    return SentenceVerdict(sentence, approval=approval)


# Removed from a correction to turn it into an instruction.
_FILLER_RES = [
    re.compile(r"^\s*(ok(ay)?|hmm+|well|oh|ah|so|sorry|seriously|come on|ugh|no|nope|nah)[,.!?]+\s*",
               re.IGNORECASE),
    re.compile(r"^\s*(thanks|thank you)( but| though)?[,.!]*\s*", re.IGNORECASE),
    # The verdict on the answer ("Wrong, ...", "That's wrong.", "Wrong answer."): the vote says it already.
    re.compile(r"^\s*((that's|that is|this is|it's|it is)\s+)?(wrong|incorrect|not right|not correct|inaccurate"
               r"|not quite( right)?)(\s+answer)?[,.!;:]+\s*", re.IGNORECASE),
    re.compile(r"^\s*(but|and)\s+", re.IGNORECASE),
    re.compile(r"^\s*(i'd like you to|i would like you to|i want you to|i need you to)\s+", re.IGNORECASE),
]
_INNER_FILLER_RES = [
    re.compile(r",?\s*\bplease\b[,]?", re.IGNORECASE),
    re.compile(r",?\s*\b(next time|for me|if you can|if possible)\b", re.IGNORECASE),
]
_ASK_RE = re.compile(r"^\s*(can|could|would|will) you\s+(please\s+)?(.+?)\?+\s*$", re.IGNORECASE)


def as_instruction(sentence: str) -> str:
    """A sentence of a correction as an instruction: politeness and filler stripped, "could you ...?" made
    imperative. '' when nothing is left."""
    text = _WS_RE.sub(" ", sentence).strip()
    for _ in range(3):  # "Hmm, no, please ..." needs several passes
        for regex in _FILLER_RES:
            text = regex.sub("", text).strip()
    for regex in _INNER_FILLER_RES:
        text = regex.sub(" ", text).strip()
    ask = _ASK_RE.match(text)
    if ask:
        text = ask.group(3).strip() + "."
    text = re.sub(r"\s+([,.!?:;])", r"\1", text).strip(" ,;")
    text = re.sub(r"([.!?])[.!?]+$", r"\1", text)
    if not any(ch.isalnum() for ch in text):
        return ""
    text = text[0].upper() + text[1:]
    if text[-1] not in ".!?:\"')":
        text += "."
    return text


# A line that introduces material pasted below it ("Summarize the following text in one sentence:" + a document):
# a new task, whose own words ("in one sentence") are not feedback on the previous answer.
_TASK_INTRO_RE = re.compile(r"^[^\n]*:[ \t]*\n(?=\s*\S)", re.MULTILINE)


def feedback_part(text: str) -> str:
    """The part of a user message that can be feedback: everything before a new task that introduces pasted
    material (its introducing sentence and the material are left out). "Thanks! Now summarize this:\n..."
    keeps "Thanks!"."""
    found = _TASK_INTRO_RE.search(text or "")
    if found is None:
        return text or ""
    intro = found.group(0).rstrip()
    sentences = split_sentences(intro)
    before = text[:found.start()]
    if len(sentences) > 1:  # sentences ahead of the task on the same line ("Thanks! Summarize this:")
        before += " " + intro[: intro.rfind(sentences[-1])]
    return before.strip()


# A sentence about the answer itself ("That's Python.", "This doesn't sort by date."): the vote already says it.
_ABOUT_ANSWER_RE = re.compile(r"^\s*(that|this)(?:'s|\s+(is|was|isn't|wasn't|does|doesn't|did|didn't|has|hasn't))\b",
                              re.IGNORECASE)


def _words_key(text: str) -> str:
    return " ".join(re.findall(r"\w+", text.lower()))


def stated_hint(sentences: Sequence[str], message: Sequence[str]) -> str:
    """The hint of a correction that holds no instruction: what the user states ("Wrong, it was Jane Austen." →
    "It was Jane Austen."), without the verdict on the answer, sentences about the answer itself and questions
    (the question asked again is the request the teacher already has). '' when that would be the user's whole
    message as written (``message``: all its sentences), which says nothing the vote does not."""
    kept = [p for p in (as_instruction(s) for s in sentences if not _ABOUT_ANSWER_RE.match(s))
            if p and not is_question(p)]
    hint = " ".join(kept)
    return "" if _words_key(hint) == _words_key(" ".join(message)) else hint


def decide_user(texts: Sequence[str], max_sentences: int = 3, hint_min_chars: int = 10) -> RuleDecision:
    """The rule verdict on the user's message(s) of a next state.

    With a correction, the hint is built from the message's sentences that are not approvals: every correction
    sentence first, then the other sentences ("Largest first.", "One sentence is enough.") up to
    ``max_sentences``, in the user's order."""
    verdicts = [classify_sentence(s) for t in texts for s in split_sentences(feedback_part(t))
                if len(s) <= MAX_SENTENCE_CHARS]
    approval = any(v.approval for v in verdicts)
    is_correction = [bool(v.correction) and not (v.weak and approval) for v in verdicts]
    if any(is_correction):
        chosen = [i for i, c in enumerate(is_correction) if c][:max_sentences]
        for i, v in enumerate(verdicts):
            if len(chosen) >= max_sentences:
                break
            if i not in chosen and not v.approval:
                chosen.append(i)
        # The teacher follows an imperative far better than a narrated complaint (docs/judge.md), so the
        # correction's instructions are the hint; what the user states only when it holds none.
        cleaned = [p for p in (as_instruction(v.text) for v in verdicts if not v.approval) if p]
        hint = imperative_hint(cleaned, max_sentences=max_sentences)
        if len(hint.strip()) <= hint_min_chars:
            hint = stated_hint([verdicts[i].text for i in sorted(chosen)], [v.text for v in verdicts])
        if len(hint.strip()) <= hint_min_chars:
            hint = ""
        why = "; ".join(dict.fromkeys(v.correction for v, c in zip(verdicts, is_correction) if c))
        return RuleDecision(-1, hint, f"the user asks for a change ({why})",
                            tuple(v.text for v, c in zip(verdicts, is_correction) if c))
    if approval:
        return RuleDecision(1, "", "the user thanks or approves", tuple(v.text for v in verdicts if v.approval))
    return RuleDecision(0, "", "no explicit approval or correction in the user's reply")


def _is_error(text: str) -> bool:
    if not _TOOL_ERROR.search(text) or _TRANSIENT.search(text):
        return False
    # "24 passed" with no failure is a success even if a test is named test_error.
    if _TOOL_SUCCESS.search(text) and not re.search(r"\b[1-9]\d* (failed|errors?)\b|\berror\b:", text, re.I):
        return False
    return True


def _first_error_line(text: str) -> str:
    """The line that names the error: the last ``SomethingError: ...`` line (where tracebacks put it), else the
    first line with an error marker, else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.search(r"\b\w*(Error|Exception)\b", ln)]
    if named:
        return named[-1]
    for line in lines:
        if _TOOL_ERROR.search(line):
            return line
    return lines[0] if lines else ""


def decide_tool(texts: Sequence[str], hint_min_chars: int = 10, max_hint_chars: int = 240) -> RuleDecision:
    """The rule verdict on tool results: an error caused by the action -1 (its first error line is the hint),
    a transient failure or an empty result 0, any other result +1 (the action did what it was asked)."""
    errors = [t for t in texts if _is_error(t)]
    if errors:
        line = _first_error_line(errors[0])[:max_hint_chars]
        hint = f"The previous action failed with: {line}" if line else ""
        if len(hint) <= hint_min_chars:
            hint = ""
        return RuleDecision(-1, hint, "a tool reports an error caused by the action", (line,))
    if any(_TRANSIENT.search(t) for t in texts):
        return RuleDecision(0, "", "a tool reports a transient failure (not the action's fault)")
    if all(_EMPTY_RESULT.match(t) for t in texts):
        return RuleDecision(0, "", "the tool returned an empty result")
    return RuleDecision(1, "", "the tool returned a result without an error")


def decide(next_state: Sequence[dict[str, Any]] | None, hint_min_chars: int = 10) -> RuleDecision:
    """The rule verdict on a whole next state: a user correction or a tool error decides (−1), then approval or a
    tool success (+1), else 0. A user's hint is preferred over a tool's error line."""
    next_state = list(next_state or [])
    user_texts = [content_text(m.get("content")) for m in next_state if m.get("role") == "user"]
    tool_texts = [content_text(m.get("content")) for m in next_state if m.get("role") in ("tool", "function")]
    user = decide_user(user_texts, hint_min_chars=hint_min_chars) if user_texts else None
    tool = decide_tool(tool_texts, hint_min_chars=hint_min_chars) if tool_texts else None
    if user is None and tool is None:
        return RuleDecision(0, "", "the next state holds no user or tool message")
    negative = [d for d in (user, tool) if d is not None and d.score == -1]
    if negative:
        hint = next((d.hint for d in (user, tool) if d is not None and d.hint), "")
        return RuleDecision(-1, hint, "; ".join(d.rule for d in negative),
                            tuple(e for d in negative for e in d.evidence))
    for d in (user, tool):
        if d is not None and d.score == 1:
            return d
    return user if user is not None else tool  # type: ignore[return-value]


class _NoClient:
    """Nothing to connect to or release; present because the pipeline closes ``judge.client`` on stop."""

    async def close(self) -> None:
        return None


class RuleJudge:
    """``votes.Judge``'s interface with keyword rules instead of a model (see the module docstring)."""

    name = "rules"

    def __init__(self, settings: JudgeSettings | None = None):
        self.settings = settings or JudgeSettings()
        self.client = _NoClient()

    def decide(self, turn: TurnRecord) -> RuleDecision:
        """The verdict on what the user wrote (client envelopes such as timestamps removed)."""
        return decide(judged_turn(turn).next_state, hint_min_chars=self.settings.hint_min_chars)

    async def judge(self, turn: TurnRecord, *, want_eval: bool = True, want_hints: bool = True, attempt: int = 0,
                    deadline_s: float | None = None,
                    on_vote: Callable[[VoteRecord], None] | None = None) -> Judgement:
        start = time.monotonic()
        turn_id = int(turn.id or 0)
        d = self.decide(turn)
        evidence = " | ".join(f'"{e}"' for e in d.evidence if e)
        because = f"Rule judge: {d.rule}" + (f": {evidence}" if evidence else "") + "."
        out = Judgement()
        latency_s = time.monotonic() - start
        if want_eval:
            text = f"{because}\n\\boxed{{{d.score}}}"
            out.eval_votes = [VoteRecord(turn_id=turn_id, kind="eval", index=i, score=d.score, raw_text=text,
                                         latency_s=latency_s, attempt=attempt)
                              for i in range(self.settings.votes_m)]
        if want_hints:
            if d.hint:
                text = (f"{because} The correction, rewritten as an instruction:\n"
                        f"[HINT_START]{d.hint}[HINT_END]\n\\boxed{{1}}")
                score, hint = 1, d.hint
            else:
                text = f"{because} No hindsight hint.\n\\boxed{{-1}}"
                score, hint = -1, ""
            out.hint_votes = [VoteRecord(turn_id=turn_id, kind="hint", index=i, score=score, raw_text=text,
                                         hint=hint, latency_s=latency_s, attempt=attempt)
                              for i in range(self.settings.votes_m)]
        if on_vote is not None:
            for vote in out.eval_votes + out.hint_votes:
                on_vote(vote)
        out.reward = d.score if want_eval else 0
        out.candidates = select_candidates([(v.score, v.hint) for v in out.hint_votes],
                                           min_chars=self.settings.hint_min_chars,
                                           max_candidates=self.settings.max_candidates)
        out.latency_s = time.monotonic() - start
        return out
