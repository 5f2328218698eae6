"""The retain term: keep what the starting model answers on prompts no user asked, while a user's preference is
learnt.

Why: a step that teaches one user's preference moves every trainable weight, and on a small model that also
moves its answers to unrelated questions (measured: the facts it states, docs/retain.md). Mixing a term on
general data into each update is the usual remedy (PPO-ptx mixes in pre-training gradients; learning without
forgetting distils the old model's own outputs); this is the distilling kind, since clawloop has the starting
weights at hand and no pre-training corpus.

Choices:

* Prompts: ``clawloop.trainer.retain_prompts`` (general requests that are neither gate probes nor simulated users'
  questions, so the gate and the held-out scores still measure prompts the term never trained on).
* Targets, computed from the starting weights (LoRA: the adapter off; full fine-tuning: the frozen copy), so they
  never drift with the policy: each prompt, rendered as the server renders a user's message, gets its greedy
  answer (``retain_tokens`` at most, read with the gate's decoder), and at each answer position the starting
  weights' top-K log-probs (K = ``retain_k``, τ = 1) are kept, taken from the very logits that decoded the answer.
  The answers' ids are kept on disk with the gate's (``kept``: ``clawloop.gate.kept_answers``), so a later run
  reads them and takes the rows from one forward over prompt and answer instead of decoding again (3.8x faster on
  the CPU default: ``benchmarks/retain_targets.py``).
  They are built ``BUILD_CHUNK`` prompts at a time, in the order the term takes them (``RetainTargets``): when an
  update needs prompts not built yet, or while the trainer has nothing to train. Built all at once before the
  first update, they held that update back by the time of 50 answers (95 s on the 2-core CPU beside a simulated
  user, who then waited for it); now the first update waits for one chunk at most.
* Trained positions R: every answer position but those that open a sentence after the first (where the model
  decides whether to go on at all), and, with ``retain_opening`` off, the first (how an answer opens). How long an
  answer goes on and how it opens are where users' style preferences live ("one short sentence", "In short, …"),
  so the term never trains where a later sentence would start and leaves the opening to a setting; within the
  sentences, which facts and which words, and no loop where the starting model had none, is what it keeps.
* Loss, over ``retain_batch`` prompts per update (a fixed shuffled order, taken round-robin):

      L_retain = retain_coef · (1/B) Σ_prompts (1/|R|) Σ_{t∈R} KL_{K+1}(q_ref,t ‖ p_θ,t)

  the forward KL over the starting weights' top-K plus one tail bin (``clawloop.losses.support.teacher_support_kl``:
  its gradient on logit u is p_u − q_u, so a word the starting model would write is pulled back whatever the
  policy's own probability of it). It is added to the batch's gradient before clipping, so one optimizer update
  carries both; it is reported as ``retain_kl`` (the mean KL before the update) and ``time_retain_s``.
* Behind the preference's opening (``retain_behind_hint``, off by default): a preference about how answers open
  ("Begin every answer with "In short,"") moves the opening on every prompt, and behind an opening the starting
  weights never wrote the plain targets have nothing to keep. Measured on SmolLM2-135M's knowledge probes: forced
  to open with "In short," the starting weights still state 96 of 136 sampled facts (89 unforced), behind "In"
  alone 73 ("In mathematics, …"), and the hinted teacher itself 40–51. So with this setting each picked prompt's
  example is built behind the trainer's most frequent hint: its opening is the hinted starting weights' greedy
  tokens before the first one the plain starting weights also rank first (as ``opd_target = "opening_end"`` cuts
  it), trained toward the hinted rows, then the plain starting weights' greedy continuation behind that opening,
  trained toward the plain rows. A prompt whose hinted and plain answers open alike keeps its plain example.
  The same examples measure whether a hint is about the opening at all (``opening_share``, over the first
  ``OPENING_MEASURE`` prompts of the order): the trainer's ``opening_preference = auto`` takes them, and frees the
  plain examples' first position, only for a hint that changes the opening of at least ``opening_min_share`` of
  them (docs/opening.md).
* One process only: the torchrun trainer's ranks would each have to run the same forwards in step, which this
  does not do yet, so a multi-rank trainer refuses ``retain_coef > 0``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch

from clawloop.gate.generation import probe_answers
from clawloop.gate.kept_answers import KeptAnswers, request_key
from clawloop.losses.support import teacher_support_kl
from clawloop.renderers.chat import ChatRenderer
from clawloop.teacher import inject_hint

SENTENCE_ENDS = (".", "!", "?")
CLOSERS = "\"')]\u201d\u2019"
"""Characters that may close a sentence after its end mark ('He said "Hi."', "(See above.)")."""
BUILD_CHUNK = 8
"""Prompts answered together when the targets are built (two updates' worth at the default ``retain_batch``)."""
OPENING_MEASURE = 16
"""Retain prompts (the first of the term's shuffled order) whose openings, plain and behind a hint, tell how often
the hint changes how an answer opens (``RetainTerm.opening_share``)."""
ANSWERS_FORMAT = 1
"""Part of a kept answer's key (``answer_key``): bumped when this module changes how the answers are decoded (the
gate's decoder itself is in the kept file's code fingerprint, this module is not)."""


@dataclass
class RetainExample:
    """One prompt with the starting weights' answer and its targets."""

    prompt: str
    input_ids_L: torch.Tensor
    """[P + T] int64: the rendered prompt, then the starting weights' answer."""
    prompt_len: int
    ref_ids_T_K: torch.Tensor
    """[T, K] the starting weights' top-K ids at each answer position (position t predicts answer token t)."""
    ref_logprobs_T_K: torch.Tensor
    """[T, K] their log-probs (τ = 1)."""
    positions_T: torch.Tensor
    """[T] bool: the positions the term trains (see the module docstring)."""


def sentence_ends(tokenizer: Any, answer_ids: Sequence[int]) -> list[int]:
    """The indices i of ``answer_ids`` after which a sentence ends: the text since the previous end holds a letter
    and ends in ".", "!" or "?" (a closing quote or bracket may follow) with the next token (if any) opening with
    white space ("3.5" and a list's "1." end none), or holds a line break after its first character. An
    abbreviation's full stop ("Mr. Smith") counts as an end: that only leaves one more position untrained."""
    ids = list(answer_ids)
    ends: list[int] = []
    start = 0
    for i in range(len(ids)):
        text = tokenizer.decode(ids[start: i + 1], skip_special_tokens=True)
        if not any(c.isalpha() for c in text):
            continue
        ended = "\n" in text.lstrip()
        if not ended and text.rstrip().rstrip(CLOSERS).endswith(SENTENCE_ENDS):
            following = tokenizer.decode(ids[start: i + 2], skip_special_tokens=True)[len(text):]
            ended = not following or following[0].isspace()
        if ended:
            ends.append(i)
            start = i + 1
    return ends


def retain_positions(tokenizer: Any, answer_ids: Sequence[int], *, opening: bool = True) -> torch.Tensor:
    """[T] bool over an answer's positions (position t predicts token t): every one but those that open a sentence
    after the first, where the model decides whether to go on at all, and (``opening`` False) the first."""
    positions_T = torch.ones(len(answer_ids), dtype=torch.bool)
    for i in sentence_ends(tokenizer, answer_ids):
        if i + 1 < len(answer_ids):
            positions_T[i + 1] = False
    if not opening:
        positions_T[:1] = False
    return positions_T


def answer_key(prompt: str, prompt_ids: Sequence[int], *, max_tokens: int, end_ids: Sequence[int]) -> str:
    """The key of a retain prompt's greedy answer among the starting weights' kept answers (``kept`` of
    ``build_examples``): named apart from every gate probe's."""
    return request_key(f"retain/{ANSWERS_FORMAT}:{prompt}", prompt_ids, cap=max_tokens, eos_ids=end_ids, samples=0,
                       temperature=0.0, dice_set=0, facts=())


@torch.no_grad()
def build_examples(reference: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], *, k: int, max_tokens: int,
                   end_ids: list[int], opening: bool = True, kept: KeptAnswers | None = None
                   ) -> list[RetainExample | None]:
    """The targets of ``prompts`` from ``reference`` (the starting weights), per the module docstring, one per
    prompt in their order: None for a prompt whose answer has no position to train (an empty answer).

    ``kept``: the starting weights' answers kept from earlier runs (``clawloop.gate.kept_answers``, shipped text
    only, as these prompts are). A prompt whose greedy answer is kept there is not decoded again: one forward over
    prompt and answer gives its rows (the same logits as the decoder's in exact arithmetic, in a fraction of the
    time: one pass instead of one per answer token). Answers decoded here are added to it."""
    renderer = ChatRenderer(tokenizer)  # as the server renders a user's message
    rendered = [list(renderer.render([{"role": "user", "content": prompt}]).ids) for prompt in prompts]
    keys = [answer_key(p, ids, max_tokens=max_tokens, end_ids=end_ids) for p, ids in zip(prompts, rendered)]
    answers: list[list[int] | None] = [None] * len(prompts)
    if kept is not None:
        for i, key in enumerate(keys):
            found = kept.get(key)
            answers[i] = list(found[0]) if found else None
    todo = [i for i, a in enumerate(answers) if a is None]
    tops: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    # A few prompts at a time: the decoder keeps a [T, V] log-softmax row per answer token until it returns.
    for start in range(0, len(todo), BUILD_CHUNK):
        chunk = todo[start: start + BUILD_CHUNK]
        decoded, logprobs = probe_answers(reference, [rendered[i] for i in chunk], max_tokens, end_ids)
        for i, answer, logprobs_T_V in zip(chunk, decoded, logprobs):
            top = logprobs_T_V[:len(answer)].float().topk(k, dim=-1)
            answers[i], tops[i] = list(answer), (top.indices.cpu(), top.values.cpu())
    if kept is not None and todo:
        kept.put({keys[i]: [answers[i]] for i in todo})
    examples: list[RetainExample | None] = []
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, rendered)):
        answer = answers[i] or []
        positions_T = retain_positions(tokenizer, answer, opening=opening)
        if not bool(positions_T.any()):
            examples.append(None)
            continue
        input_ids_L = torch.tensor(prompt_ids + answer, dtype=torch.long)
        ids_T_K, logprobs_T_K = tops[i] if i in tops else _answer_top_k(reference, input_ids_L, len(answer), k)
        examples.append(RetainExample(
            prompt=prompt, input_ids_L=input_ids_L, prompt_len=len(prompt_ids), ref_ids_T_K=ids_T_K,
            ref_logprobs_T_K=logprobs_T_K, positions_T=positions_T))
    return examples


@torch.no_grad()
def build_opening_examples(reference: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], hint: str, *, k: int,
                           max_tokens: int, end_ids: list[int], opening_tokens: int, system: str | None = None
                           ) -> list[RetainExample | None]:
    """The targets of ``prompts`` behind ``hint``'s opening (``retain_behind_hint``; module docstring), one per
    prompt in their order: None where the hinted and plain starting weights open alike, or where the opening
    fills all of ``max_tokens`` (the plain example then stands). ``system``: where the teacher also reads the hint
    (``hint_system``)."""
    renderer = ChatRenderer(tokenizer)
    plain = [list(renderer.render([{"role": "user", "content": p}]).ids) for p in prompts]
    hinted = [list(renderer.render(inject_hint([{"role": "user", "content": p}], hint, system=system)).ids)
              for p in prompts]
    drafts, hinted_rows = probe_answers(reference, hinted, opening_tokens, end_ids)
    openings: list[list[int]] = []
    for prompt_ids, draft in zip(plain, drafts):
        if not draft:
            openings.append([])
            continue
        plain_top = _answer_top_k(reference, torch.tensor(prompt_ids + draft, dtype=torch.long), len(draft), 1)[0]
        agree = next((t for t, i in enumerate(draft) if i == int(plain_top[t, 0])), len(draft))
        openings.append(list(draft[:agree]))
    todo = [i for i, opening in enumerate(openings) if opening and len(opening) < max_tokens]
    rest, rest_rows = probe_answers(reference, [plain[i] + openings[i] for i in todo],
                                    [max_tokens - len(openings[i]) for i in todo], end_ids) if todo else ([], [])
    examples: list[RetainExample | None] = [None] * len(prompts)
    for i, tail, tail_rows_T_V in zip(todo, rest, rest_rows):
        opening = openings[i]
        answer = opening + list(tail)
        rows_T_V = hinted_rows[i][:len(opening)].float()
        if tail:  # an answer the plain weights end right after the opening has no rows of theirs
            rows_T_V = torch.cat([rows_T_V, tail_rows_T_V[:len(tail)].float().to(rows_T_V.device)])
        top = rows_T_V.topk(k, dim=-1)
        positions_T = retain_positions(tokenizer, answer, opening=True)
        positions_T[:len(opening)] = True  # the preference's opening is what this example teaches
        examples[i] = RetainExample(
            prompt=prompts[i], input_ids_L=torch.tensor(plain[i] + answer, dtype=torch.long),
            prompt_len=len(plain[i]), ref_ids_T_K=top.indices.cpu(), ref_logprobs_T_K=top.values.cpu(),
            positions_T=positions_T)
    return examples


def _answer_top_k(model: torch.nn.Module, input_ids_L: torch.Tensor, answer_len: int, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] ids and log-probs of the model's top-K at each of the answer's positions (position t predicts answer
    token t), from one forward over prompt and answer."""
    device = next(model.parameters()).device
    logits_T_V = model(input_ids=input_ids_L.to(device)[None], logits_to_keep=answer_len + 1).logits[0, :-1]
    top = torch.log_softmax(logits_T_V.float(), dim=-1).topk(k, dim=-1)
    return top.indices.cpu(), top.values.cpu()


class RetainTargets:
    """The targets of a fixed list of prompts, built on demand ``BUILD_CHUNK`` at a time by ``build`` (which
    answers a list of prompts with the starting weights: ``build_examples`` inside whatever context gives them).
    Shared by every trainer of one model (every user's under per-user policies): the starting weights are theirs
    in common."""

    def __init__(self, prompts: Sequence[str], build: Callable[[list[str]], list[RetainExample | None]]):
        if not prompts:
            raise ValueError("the retain term has no prompts")
        self.prompts = list(prompts)
        self.build = build
        self.examples: dict[int, RetainExample | None] = {}
        """Built so far, by prompt index (None: that prompt's answer had no position to train)."""

    def built(self, index: int) -> bool:
        return index in self.examples

    @property
    def complete(self) -> bool:
        return len(self.examples) == len(self.prompts)

    def build_next(self, order: Sequence[int]) -> None:
        """Builds the first ``BUILD_CHUNK`` prompts of ``order`` (prompt indices) not built yet, in one batch."""
        todo = [i for i in order if i not in self.examples][:BUILD_CHUNK]
        if todo:
            self.examples.update(zip(todo, self.build([self.prompts[i] for i in todo])))


def _without_opening(example: RetainExample) -> RetainExample:
    """``example`` with its first position left untrained."""
    positions_T = example.positions_T.clone()
    positions_T[:1] = False
    return replace(example, positions_T=positions_T)


def retain_kl(model: torch.nn.Module, example: RetainExample, device: torch.device) -> torch.Tensor:
    """The example's mean KL over its trained positions (gradient attached), per the module docstring. The output
    layer runs only where an answer token is predicted (``logits_to_keep``), never over the prompt."""
    answer_len = example.ref_ids_T_K.shape[0]
    input_ids = example.input_ids_L.to(device).unsqueeze(0)
    # The last answer_len + 1 positions predict answer tokens 0 .. T-1, then whatever would follow the answer.
    logits_T_V = model(input_ids=input_ids, logits_to_keep=answer_len + 1).logits[0, :-1].float()
    cur_at_ref_T_K = torch.log_softmax(logits_T_V, dim=-1).gather(-1, example.ref_ids_T_K.to(device))
    positions_T = example.positions_T.to(device)
    kl_T = teacher_support_kl(cur_at_ref_T_K, example.ref_logprobs_T_K.to(device), positions_T=positions_T)
    return kl_T.sum() / positions_T.sum().clamp(min=1)


class RetainTerm:
    """The round-robin over the prompts and their targets (built as taken, ``RetainTargets``); ``backward`` adds one
    update's share of the term."""

    def __init__(self, targets: RetainTargets, *, coef: float, batch: int, seed: int, start: int = 0,
                 behind_hint: Callable[[list[str], str], list[RetainExample | None]] | None = None):
        if coef <= 0 or batch < 1:
            raise ValueError(f"retain needs coef > 0 and batch >= 1 (got {coef}, {batch})")
        self.targets = targets
        self.coef = float(coef)
        self.batch = min(int(batch), len(targets.prompts))
        self.order = list(range(len(targets.prompts)))
        random.Random(seed).shuffle(self.order)
        self.next = start % len(self.order)
        """Where in the shuffled order the next batch starts (a resumed trainer passes how many it took before)."""
        self.skipped = 0
        """Examples left out of an update because their KL was not finite (the rest of the update trains)."""
        self.behind_hint = behind_hint
        """Builds prompts' examples behind a hint's opening (``build_opening_examples`` with the starting weights),
        or None (``retain_behind_hint`` off and ``opening_preference = never``)."""
        self.hint: str | None = None
        """The hint the next updates' examples are built behind (set by the trainer; None: the plain examples)."""
        self.opening_examples: dict[tuple[str, int], RetainExample | None] = {}
        """Built behind a hint so far, by (hint, prompt index)."""
        self.taken_behind_hint = 0
        """Examples taken behind a hint's opening so far (reported per step as ``retain_behind_hint``)."""
        self.use_behind = behind_hint is not None
        """Whether the taken examples are the ones behind the hint's opening (set by the trainer per step); when
        False, examples behind a hint are built only to measure ``opening_share``."""
        self.free_opening = False
        """Whether the plain examples leave an answer's first position untrained (set by the trainer per step)."""

    def opening_share(self, hint: str) -> float | None:
        """Of the ``OPENING_MEASURE`` measuring prompts, the share whose hinted starting weights open their answer
        otherwise than the plain ones do (those with an example behind ``hint``); None until all are built."""
        measured = self.order[:OPENING_MEASURE]
        if any((hint, i) not in self.opening_examples for i in measured):
            return None
        return sum(self.opening_examples[(hint, i)] is not None for i in measured) / len(measured)

    def measure_opening(self, hint: str) -> float:
        """``opening_share``, building the measuring prompts' examples behind ``hint`` first where needed."""
        self._build_behind(hint, self.order[:OPENING_MEASURE])
        share = self.opening_share(hint)
        assert share is not None
        return share

    def _ahead(self) -> list[int]:
        """The prompt indices in the order the term will take them, from the next one on."""
        return self.order[self.next:] + self.order[:self.next]

    def build_ahead(self) -> bool:
        """Builds the next chunk of targets the term will take (for a trainer with nothing to train): the plain
        ones, then, once a hint is set, those behind its opening; whether any are left to build."""
        if not self.targets.complete:
            self.targets.build_next(self._ahead())
        elif self._behind_todo():
            self._build_behind(self.hint or "", self._behind_todo()[:BUILD_CHUNK])
        return not self.targets.complete or bool(self._behind_todo())

    def behind_pending(self) -> bool:
        """Whether examples behind the current hint are left to build (``build_ahead`` would build some)."""
        return bool(self._behind_todo())

    def _behind_todo(self) -> list[int]:
        """The prompt indices, in the order the term takes them, with no example behind the hint built yet."""
        if self.behind_hint is None or not self.hint:
            return []
        wanted = self._ahead() if self.use_behind else self.order[:OPENING_MEASURE]
        return [i for i in wanted if (self.hint, i) not in self.opening_examples]

    def _build_behind(self, hint: str, indices: list[int]) -> None:
        """Builds the examples behind ``hint``'s opening of ``indices`` not built yet, ``BUILD_CHUNK`` at a time
        (the decoder keeps a [T, V] row per answer token until it returns)."""
        assert self.behind_hint is not None
        todo = [i for i in indices if (hint, i) not in self.opening_examples]
        for start in range(0, len(todo), BUILD_CHUNK):
            chunk = todo[start: start + BUILD_CHUNK]
            built = self.behind_hint([self.targets.prompts[i] for i in chunk], hint)
            self.opening_examples.update(((hint, i), e) for i, e in zip(chunk, built))

    def take(self) -> list[RetainExample]:
        """The next ``batch`` examples of the shuffled order (wrapping round; a prompt without one is passed over),
        building their targets first where needed."""
        picked: list[tuple[int, RetainExample]] = []
        for _ in range(len(self.order)):
            index = self.order[self.next]
            if not self.targets.built(index):
                self.targets.build_next(self._ahead())
            self.next = (self.next + 1) % len(self.order)
            example = self.targets.examples[index]
            if example is not None:
                picked.append((index, example))
                if len(picked) == self.batch:
                    break
        if not picked:
            raise ValueError("the retain term has no examples (no prompt's answer had a position to train)")
        return self._behind_hint(picked)

    def _behind_hint(self, picked: list[tuple[int, RetainExample]]) -> list[RetainExample]:
        """The picked examples, each replaced by its example behind ``hint``'s opening where it has one (with
        ``use_behind``), the plain ones without their first position where ``free_opening`` says so."""
        hint = self.hint
        if self.free_opening:
            picked = [(index, _without_opening(example)) for index, example in picked]
        if self.behind_hint is None or not hint or not self.use_behind:
            return [example for _, example in picked]
        self._build_behind(hint, [index for index, _ in picked])
        out = []
        for index, example in picked:
            behind = self.opening_examples[(hint, index)]
            self.taken_behind_hint += behind is not None
            out.append(behind if behind is not None else example)
        return out

    def backward(self, model: torch.nn.Module, device: torch.device) -> float:
        """Back-propagate ``coef`` times the mean KL over the next batch into the trainable weights' gradients;
        returns that mean KL (before the update) over the examples whose KL was finite (NaN if none was: an
        example whose KL is not finite is left out, so it cannot void the users' update)."""
        picked = self.take()
        values = []
        for example in picked:
            kl = retain_kl(model, example, device)
            if not bool(torch.isfinite(kl)):
                self.skipped += 1
                continue
            (kl * (self.coef / len(picked))).backward()
            values.append(float(kl.detach()))
        return sum(values) / len(values) if values else float("nan")
