"""Corrections rewritten as instructions: the rule judge's hint wording.

The teacher reads a hint appended to the user's message as an instruction (``[user's hint / instruction]``). A
narrated complaint ("You forgot the "In short," at the start.") is a poor instruction: the teacher has to infer
what to do, and a small model mostly does not. The same preference written as an imperative ("Begin every answer
with "In short,".") is followed far more often (see docs/judge.md for the measurement). ``imperative_hint``
therefore turns the sentences of a correction into instructions:

1. sentences that state a *kind* of preference are written in one canonical imperative form: a fixed opening or
   closing ("start with "X"", "you forgot "X" at the start", "I like answers that open with "X"" → ``Begin every
   answer with "X".``), a language ("in French, please", "I only speak French" → ``Answer in French.``), a length
   ("too long", "one short sentence is enough" → ``Answer in one short sentence.``, "answer in one word" →
   ``Answer in one word.``), a format (bullet points, a list) or an unanswered question ("that doesn't answer my
   question" → ``Answer the question: ...``);
2. other sentences that are already imperative ("Fix it.", "Use sudo for that file.") are kept, without a question
   asked again after them ("Use Fahrenheit: what is 100 degrees Celsius?" → ``Use Fahrenheit.``), and a few
   statements of what the answer must be ("It must be 5-7-5.") are made imperative ("Make it 5-7-5.");
3. complaints and narration ("That's too long.", "Again in English...") are dropped once an instruction exists.

One instruction per kind is kept (the most specific: "one short sentence" beats "shorter"), in the user's order.
When no sentence yields an instruction (e.g. "Wrong, it was Jane Austen."), the caller keeps what the user states
(``rules.stated_hint``: "It was Jane Austen.").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_QUOTE_RE = re.compile(r"\"([^\"]{1,80})\"|\u201c([^\u201d]{1,80})\u201d|'([^']{1,40}[^'\w\s][^']{0,40})'")
_LANGS = ("english", "french", "spanish", "german", "italian", "portuguese", "dutch", "chinese", "japanese",
          "korean", "russian", "arabic", "hindi", "polish", "swedish", "turkish", "greek")
_LANG = "(" + "|".join(_LANGS) + ")"
_LANG_ASK_RES = [
    re.compile(r"\b(reply|answer|write|respond|say|speak|talk|translate|explain|tell|give)\b[^.!?]*?\b(in|into)\s+"
               + _LANG + r"\b"),
    re.compile(r"^(always\s+|only\s+|just\s+)?(in|into)\s+" + _LANG + r"\b"),
    re.compile(r"\bi\s+(only\s+)?(speak|read|understand)\s+(only\s+)?" + _LANG + r"\b"),
    re.compile(r"\b" + _LANG + r"\s+only\b"),
]
_OPEN_RE = re.compile(r"\b(begin|start|open)(s|ing)?\b(?!\s+(over|again))")
_CLOSE_RE = re.compile(r"\b(end|finish|close|sign off)(s|ing)?\b")
_MISSING_RE = re.compile(r"\b(forgot|forgotten|forget|missing|left out|leave out|where is|where's|without)\b")
_AT_START_RE = re.compile(r"\b(at the (start|beginning|top)|first|begin|start|open)\b")
# A sentence count asked for ("in one short sentence", "one sentence is enough", "One sentence, please.") and
# not merely mentioned ("Two sentences contradict each other.").
_COUNT = r"(?P<n>one|a single|1|two|2|three|3)\s+(?P<short>short\s+|brief\s+)?sentences?\b"
_LIMIT = (r"(\s+(of|with|in|under)\s+(at most|no more than|fewer than|less than|under|max(imum)?)\s+"
          r"(?P<words>\d+)\s+words)?")
_SENTENCE_COUNT_RES = [
    re.compile(r"(?:\b(?:in|to|into|for|just|only|give me|with|use|write|keep it to|at most|max(?:imum)?"
               r"|limit(?: it)? to)\s+|[:,;]\s*)" + _COUNT + _LIMIT),
    re.compile(_COUNT + r"\s+(is|are|will be|would be)\s+(enough|plenty|fine|sufficient)"),
    re.compile(r"^\s*(just\s+|only\s+)?" + _COUNT + _LIMIT + r"(,?\s*(only|max(imum)?|please))?\s*[.!]*\s*$"),
]
# A word count asked for ("in one word", "with a single word", "one-word answer", "Just one word."), not mentioned.
_WORDS = r"(?P<n>one|a single|single|1|two|2|three|3|a few)"
_WORD_COUNT_RES = [
    re.compile(r"\b(?:in|with|using|use|give me|just|only)\s+(?:just\s+|only\s+)?" + _WORDS + r"\s+words?\b"),
    re.compile(r"\b" + _WORDS + r"[- ]word\s+(?:answer|reply|response)s?\b"),
    re.compile(r"^\s*(?:just\s+|only\s+)?" + _WORDS + r"\s+words?(?:,?\s*(?:only|please))?\s*[.!]*\s*$"),
]
_WORD_LIMIT_RE = re.compile(r"\b(at most|no more than|fewer than|less than|under|max(imum)?)\s+(\d+)\s+words\b")
_TOO_LONG_RE = re.compile(r"\btoo (long|wordy|verbose|many words|much text)\b")
_SHORTER_RE = re.compile(r"\b(shorter|be (brief|concise)|briefer|more concise|keep it (short|brief)|that short"
                         r"|fewer words)\b")
_FORMATS = r"(?P<format>bullet(ed)?\s+points|bullets|(numbered|bulleted)\s+list|list|table|markdown|json|code block)"
_FORMAT_RE = re.compile(r"\b(as|in|with|use)\s+(a\s+)?" + _FORMATS + r"\b")
# A format asked for by its name alone ("A numbered list, please.", "Numbered list please!").
_FORMAT_NOUN_RE = re.compile(r"^\s*(just\s+|only\s+)?(a\s+)?" + _FORMATS + r"(,?\s*(only|please))?\s*[.!]*\s*$")
_WITH_ARTICLE = ("numbered list", "bulleted list", "list", "table", "code block")
"""Formats the instruction names with "a" ("Answer with a numbered list."); the others take "in" ("Answer in
bullet points.", "Answer in json.")."""
_UNANSWERED_RE = re.compile(r"\b(didn't|did not|doesn't|does not|don't|do not|never)\s+answer"
                            r"(ed)?\s+(what i asked|my question|the question)\b|\banswer my question\b")
_MUST_BE_RE = re.compile(r"^(it|that|this|the answer|your answer|the reply|the code)\s+(must|should|has to|needs to)"
                         r"\s+be\s+(.+?)[.!]?$", re.IGNORECASE)
_YOU_SHOULD_RE = re.compile(r"^you\s+(should|must|have to|need to|ought to)\s+(.+?)[.!]?$", re.IGNORECASE)
_YOU_NEED_RE = re.compile(r"^you\s+need\s+(?!to\b)(.+?)[.!]?$", re.IGNORECASE)
# Instructions that say nothing on their own ("Do that.", "Try again."): kept only when nothing better exists.
_VAGUE_RE = re.compile(r"^(just\s+)?(do|fix|try|redo|change|answer)\s+(that|it|this|again|properly|better)"
                       r"(\s+(again|properly|now))?[.!]$", re.IGNORECASE)
_REPEAT_RE = re.compile(r"\brepeating yourself\b")
_QUESTION_WORDS = (r"(what|who|whom|whose|when|where|why|how|which|is|are|was|were|do|does|did|can|could|should"
                   r"|will|would|has|have)")
# ": what is 100 degrees Celsius?" ending an instruction (also made a statement by "could you ...?" → "... .").
_REASKED_RE = re.compile(r":\s*(?:[^:]*\?|" + _QUESTION_WORDS + r"\b[^:]*)$", re.IGNORECASE)

# Base-form verbs that open an instruction ("Fix it.", "Use bullets."); words that may precede them.
_VERBS = frozenset("""
answer reply respond write say use give keep be make start begin open end finish close stop fix add remove include
explain tell show list put sort translate try do don't never avoid speak check read run call follow return print
format spell skip mention focus cite provide describe summarize summarise stick talk switch change replace convert
delete drop rewrite rephrase redo shorten simplify split merge name count calculate compute define compare lead
""".split())
_PRE_VERB = frozenset({"always", "just", "only", "please", "now", "also", "then", "simply"})


@dataclass(frozen=True)
class Instruction:
    text: str
    kind: str
    """What the instruction is about (``opening``, ``language``, ``length`` ... or ``other``); one per kind."""
    specificity: int = 0
    """Higher wins among instructions of the same kind."""
    consumes_next: bool = False
    """The instruction carries the next sentence (the question after "Answer my question:")."""
    complaint: bool = False
    """Read from a complaint alone ("That's too long." gives "Answer briefly."): dropped when the message asks
    for something itself ("Too much text. A numbered list, please." asks for a list, not for brevity)."""


def quoted(text: str) -> list[str]:
    """Phrases in double (or curly) quotes, in order."""
    return [next(g for g in m.groups() if g is not None) for m in _QUOTE_RE.finditer(text)]


def _standing(low: str) -> bool:
    return bool(re.search(r"\b(always|every time|from now on|every answer|all (your )?answers)\b", low))


def _finish(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip(" ,;")
    if not text:
        return ""
    text = text[0].upper() + text[1:]
    if text[-1] not in ".!?:":
        text += "."
    return text


def is_question(sentence: str) -> bool:
    """Whether a sentence asks something (ends with a question mark, after closing quotes or brackets)."""
    return sentence.strip().rstrip("\"')]*").endswith("?")


def is_imperative(sentence: str) -> bool:
    """Whether a sentence opens with a base-form verb, optionally after "always", "just" ..."""
    words = re.findall(r"[a-z']+", sentence.lower().replace("\u2019", "'"))
    while words and words[0] in _PRE_VERB:
        words = words[1:]
    return bool(words) and (words[0] in _VERBS or (words[0] == "do" and len(words) > 1 and words[1] == "not"))


def format_instruction(what: str) -> str:
    """The instruction for a named format: "Answer with a numbered list.", "Answer in bullet points."."""
    what = " ".join(what.split())
    if what.startswith("bullet") and not what.endswith("list"):
        return "Answer in bullet points."
    return f"Answer with a {what}." if what in _WITH_ARTICLE else f"Answer in {what}."


def rewrite(sentence: str, message_quotes: Sequence[str] = (), message_low: str = "",
            next_sentence: str = "") -> Instruction | None:
    """``sentence`` (already stripped of politeness) as an instruction, or None when it only narrates.

    ``message_quotes`` are the quoted phrases of the whole message (so "Always begin with it." can refer to an
    earlier sentence's "In short,"); ``message_low`` is the whole message in lower case; ``next_sentence`` is
    the sentence after this one (the question an unanswered-question complaint repeats)."""
    low = sentence.lower().replace("\u2019", "'")
    own = quoted(sentence)
    phrase = own[-1] if own else (message_quotes[-1] if message_quotes else "")
    refers = bool(own) or bool(re.search(r"\bwith (it|that|this)\b", low))
    if phrase and refers and _OPEN_RE.search(low) and re.search(r"\bwith\b", low):
        return Instruction(f'Begin every answer with "{phrase}".', "opening", 2)
    if phrase and refers and _CLOSE_RE.search(low) and re.search(r"\bwith\b", low):
        return Instruction(f'End every answer with "{phrase}".', "closing", 2)
    if own and _MISSING_RE.search(low):
        if _AT_START_RE.search(low) or _OPEN_RE.search(message_low):
            return Instruction(f'Begin every answer with "{own[-1]}".', "opening", 1)
        return Instruction(f'Include "{own[-1]}".', "include", 1)
    for regex in _LANG_ASK_RES:
        found = regex.search(low)
        if found:
            lang = next(g for g in reversed(found.groups()) if g in _LANGS)
            if lang != "english" or "english" not in re.sub(r"\bin english\b", "", message_low):
                prefix = "Always answer" if _standing(low) else "Answer"
                return Instruction(f"{prefix} in {lang.capitalize()}.", "language", 2)
    count = next((m for m in (r.search(low) for r in _SENTENCE_COUNT_RES) if m), None)
    if count:
        number = {"a single": "one", "1": "one", "2": "two", "3": "three"}.get(count["n"], count["n"])
        short = "short " if (count["short"] or "").strip() in ("short", "brief") else ""
        noun = "sentence" if number == "one" else "sentences"
        words = count.groupdict().get("words")
        limit = f" of at most {words} words" if words else ""
        return Instruction(f"Answer in {number} {short}{noun}{limit}.", "length", 3)
    words = next((m for m in (r.search(low) for r in _WORD_COUNT_RES) if m), None)
    if words:
        number = {"a single": "one", "single": "one", "1": "one", "2": "two", "3": "three"}.get(words["n"],
                                                                                              words["n"])
        return Instruction(f"Answer in {number} {'word' if number == 'one' else 'words'}.", "length", 3)
    limit = _WORD_LIMIT_RE.search(low)
    if limit:
        return Instruction(f"Answer in at most {limit.group(3)} words.", "length", 2)
    asked_shorter = _SHORTER_RE.search(low) is not None
    if asked_shorter or _TOO_LONG_RE.search(low):
        return Instruction("Answer briefly.", "length", 1, complaint=not asked_shorter)
    fmt = _FORMAT_RE.search(low) or _FORMAT_NOUN_RE.match(low)
    if fmt:
        return Instruction(format_instruction(fmt["format"]), "format", 2)
    if _UNANSWERED_RE.search(low):
        question = next_sentence.strip() if next_sentence.strip().endswith("?") else ""
        return Instruction(f"Answer the question: {question}" if question else "Answer the question asked.",
                           "unanswered", 2, consumes_next=bool(question))
    if _REPEAT_RE.search(low):
        return Instruction("Do not repeat yourself.", "repeat", 1)
    must = _MUST_BE_RE.match(sentence.strip())
    if must:
        return Instruction(_finish(f"Make it {must.group(3)}"), "other")
    should = _YOU_SHOULD_RE.match(sentence.strip())
    if should:
        return Instruction(_finish(should.group(2)), "other")
    need = _YOU_NEED_RE.match(sentence.strip())
    if need:
        return Instruction(_finish(f"Use {need.group(1)}"), "other")
    if is_imperative(sentence):
        # The question asked again after the instruction ("Use Fahrenheit: what is 100 degrees Celsius?") is the
        # request the teacher already has: the instruction is what comes before it.
        text = _REASKED_RE.sub("", sentence.strip())
        joined = text.endswith(":") and bool(next_sentence.strip()) and not is_question(next_sentence)
        if joined:
            text = f"{text} {next_sentence.strip()}"
        text = _finish(re.sub(r"^(please|now|also|then)\s+", "", text, flags=re.IGNORECASE))
        return Instruction(text, "vague" if _VAGUE_RE.match(text) else "other", consumes_next=joined)
    return None


def imperative_hint(sentences: Sequence[str], max_sentences: int = 3) -> str:
    """The instructions in a correction's sentences (see the module docstring), joined; '' when there are none.

    ``sentences`` are the correction's sentences in the user's order, already stripped of politeness."""
    message = " ".join(sentences)
    message_low = message.lower().replace("\u2019", "'")
    quotes: list[str] = []
    found: list[tuple[int, Instruction]] = []
    skip = False
    for i, sentence in enumerate(sentences):
        quotes.extend(quoted(sentence))
        if skip:  # already part of the previous instruction
            skip = False
            continue
        nxt = sentences[i + 1] if i + 1 < len(sentences) else ""
        ins = rewrite(sentence, quotes, message_low, nxt)
        if ins is not None:
            found.append((i, ins))
            skip = ins.consumes_next
    if any(not ins.complaint and ins.kind != "vague" for _, ins in found):
        found = [(i, ins) for i, ins in found if not ins.complaint]
    best: dict[str, tuple[int, Instruction]] = {}
    others: list[tuple[int, Instruction]] = []
    for i, ins in found:
        if ins.kind in ("other", "vague"):
            others.append((i, ins))
        elif ins.kind not in best or ins.specificity > best[ins.kind][1].specificity:
            best[ins.kind] = (i, ins)
    if best or any(ins.kind == "other" for _, ins in others):
        others = [(i, ins) for i, ins in others if ins.kind != "vague"]
    chosen = sorted(list(best.values()) + others, key=lambda pair: pair[0])
    texts = list(dict.fromkeys(ins.text for _, ins in chosen))
    return " ".join(texts[:max_sentences])
