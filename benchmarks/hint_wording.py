"""Does the hint's wording change how hard the teacher pulls? Narrated complaint vs imperative instruction.

    python benchmarks/hint_wording.py                    # default model, all held-out questions, greedy follow
    python benchmarks/hint_wording.py --questions 4 --no-follow --threads 1

The teacher is the frozen base model reading the turn's prompt with the hint appended exactly as
``clawloop.teacher.inject_hint`` does it. For each persona correction the simulated users send, two hints are
compared on the persona's held-out questions (never seen in training):

* **narrated** — the correction as the rule judge used to pass it on: the user's sentences with politeness removed
  ("You forgot the "In short," at the start. Always begin with it.");
* **imperative** — what the rule judge writes now (``clawloop.judge.rules.decide``): the instruction the
  correction implies ("Begin every answer with "In short,".").

Printed side by side:

1. for the ``inshort`` persona (whose preference fixes the first tokens): the teacher's probability of the first
   token "In" at the first response position, whether it is in the teacher's top-k (k = ``topk``, the width the
   distillation uses) and its rank, and the probability of the whole opening "In short," (teacher-forced),
   averaged over the held-out questions, per correction;
2. unless ``--no-follow``: for every persona, how often the teacher's greedy answer under each hint follows the
   preference (the persona's own checker), i.e. how often the distillation target shows the student the
   preferred behaviour;
3. unless ``--no-facts``: for every persona, how many of the gate's knowledge probes (``clawloop.gate.knowledge``)
   the teacher still answers right under the imperative hint, of those the un-hinted model answers right, with
   the lost ones. A student distilled toward that teacher is pulled toward the same losses, which the gate's
   knowledge check then rejects.

    python benchmarks/hint_wording.py --no-opening --no-follow      # the facts table alone, about a minute

With ``--draft`` a last table sets the imperative hint alone against the hint with a draft answer to rewrite
(``inject_hint(..., draft=...)``, what the ``teacher_draft`` setting shows the teacher; the draft is the un-hinted
model's own greedy answer, as a served answer is at the start of a run): the knowledge probes the teacher keeps,
how often its greedy answer to a held-out question follows the preference, and its mean P("In") at the first
position, for ``inshort`` and ``brief``.

    python benchmarks/hint_wording.py --no-opening --no-follow --no-facts --draft    # about 8 minutes, 1 thread

With ``--placement`` a last table sets the hint after the question only against the hint in the system prompt as
well (``hint_placement``; the system prompt keeps the template's default text before it): the knowledge probes the
teacher keeps, how often its greedy answer to a held-out question follows, and its mean P("In") at the first
position, for ``inshort`` and ``brief``.

    python benchmarks/hint_wording.py --no-opening --no-follow --no-facts --placement  # about 4 minutes, 2 threads

With ``--openings`` a last table tries candidate opening words for a persona of one's own, each as the hint
``Begin every answer with "<opening>".``: the un-hinted model's mean probability of its first token at the first
position (how far from the student's own choices the preference lies), how often the hinted teacher's greedy answer
to a held-out ``everyday`` question opens with it and passes the guard (``OpeningChecker``), and how many knowledge
probes the hinted teacher keeps. A preference the student can take from its teacher without the gate rejecting it
needs both a teacher that follows and one that keeps its facts.

    python benchmarks/hint_wording.py --no-opening --no-follow --no-facts --openings "So," "Well," "Answer:"

With ``--forced`` a last table counts how many sampled answers to the knowledge probes state their fact (8 per
probe at temperature 0.6, ``KNOWLEDGE_TOKENS`` tokens, as the gate samples them) when the answer is made to open
with each given text, by the plain model and by the teacher reading ``inshort``'s hint (after the question, and in
the system prompt too): whether the model still knows its facts behind a new opening, and behind part of it. The
retain term's examples behind a hint (``retain_behind_hint``, docs/retain.md) rest on this.

    python benchmarks/hint_wording.py --no-opening --no-follow --no-facts --forced "" "In short," "In"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from clawloop.config import Config  # noqa: E402
from clawloop.engines import model_files  # noqa: E402
from clawloop.gate.guard import check as guard_check  # noqa: E402
from clawloop.gate.knowledge import KNOWLEDGE, KNOWLEDGE_TOKENS, knows  # noqa: E402
from clawloop.judge.rules import as_instruction, decide, split_sentences  # noqa: E402
from clawloop.renderers import chat_render_fn, template_default_system  # noqa: E402
from clawloop.sim.checkers import OpeningChecker  # noqa: E402
from clawloop.sim.data.questions import POOLS  # noqa: E402
from clawloop.sim.personas import PERSONAS  # noqa: E402
from clawloop.teacher import inject_hint  # noqa: E402


def narrated_hint(correction: str) -> str:
    """The correction's sentences with politeness stripped: the rule judge's hint before it wrote instructions."""
    return " ".join(p for p in (as_instruction(s) for s in split_sentences(correction)) if p)


def imperative_hint(correction: str) -> str:
    return decide([{"role": "user", "content": correction}]).hint


@torch.no_grad()
def opening_stats(model: Any, render: Any, tokenizer: Any, question: str, hint: str, opening: str,
                  k: int, draft: str | None = None, system: str | None = None) -> dict[str, float]:
    """P(first token of ``opening``), its rank, top-k membership and P(whole ``opening``) under the hinted prompt
    (with ``draft``, and the hint in the system prompt too, when given: ``inject_hint``'s arguments)."""
    prompt_ids = render(inject_hint([{"role": "user", "content": question}], hint, draft, system=system), None)
    target_ids = tokenizer(opening, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt_ids + target_ids])
    logprobs_T_V = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1  # the position that predicts the first response token
    first_V = logprobs_T_V[start]
    first = target_ids[0]
    rank = int((first_V > first_V[first]).sum()) + 1
    seq_lp = sum(float(logprobs_T_V[start + i, t]) for i, t in enumerate(target_ids))
    return {"p_first": float(first_V[first].exp()), "rank": rank, "in_topk": float(rank <= k),
            "p_opening": float(torch.tensor(seq_lp).exp())}


@torch.no_grad()
def greedy(model: Any, render: Any, tokenizer: Any, question: str, hint: str, max_tokens: int,
           draft: str | None = None, system: str | None = None) -> str:
    """The greedy answer to ``question`` with ``hint`` (and ``draft``, and the hint in the system prompt too, when
    given) injected (none when ``hint`` is empty)."""
    messages = [{"role": "user", "content": question}]
    prompt_ids = render(inject_hint(messages, hint, draft, system=system) if hint else messages, None)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="Teacher model (default SmolLM2-135M-Instruct, or tiny).")
    ap.add_argument("--questions", type=int, default=0, help="Held-out questions per persona (0 = all).")
    ap.add_argument("--threads", type=int, default=2, help="Torch threads.")
    ap.add_argument("--no-follow", action="store_true", help="Skip the greedy follow-rate table.")
    ap.add_argument("--no-opening", action="store_true", help="Skip the \"In short,\" opening table.")
    ap.add_argument("--no-facts", action="store_true", help="Skip the knowledge-probe table.")
    ap.add_argument("--draft", action="store_true", help="Add the table of the hint alone vs the hint with a "
                    "draft answer to rewrite (teacher_draft).")
    ap.add_argument("--placement", action="store_true", help="Add the table of the hint after the question only "
                    "vs in the system prompt too (hint_placement = system_and_user).")
    ap.add_argument("--max-tokens", type=int, default=48, help="Greedy answer length for the follow rate.")
    ap.add_argument("--follow-questions", type=int, default=4, help="Held-out questions per persona for the "
                    "follow rate (0 = all; every one costs a greedy answer per distinct hint).")
    ap.add_argument("--openings", nargs="+", default=[], metavar="OPENING",
                    help="Add the table of candidate opening words (each as 'Begin every answer with \"OPENING\".').")
    ap.add_argument("--forced", nargs="+", default=None, metavar="OPENING",
                    help="Add the table of sampled knowledge facts behind each forced opening ('' for none).")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    path = model_files.resolve_model(args.model)
    tokenizer = model_files.load_tokenizer(path)
    model = model_files.load_model(path, device="cpu")
    render = chat_render_fn(tokenizer)
    k = Config().topk

    def questions(persona: Any) -> list[str]:
        qs = list(persona.heldout_questions)
        return qs[: args.questions] if args.questions else qs

    if not args.no_opening:
        opening_table(model, render, tokenizer, questions(PERSONAS["inshort"]), k, args.model)
    if not args.no_follow:
        follow_table(model, render, tokenizer, args.follow_questions, args.max_tokens)
    if not args.no_facts:
        facts_table(model, render, tokenizer)
    if args.draft:
        draft_table(model, render, tokenizer, args.max_tokens, k)
    if args.placement:
        placement_table(model, render, tokenizer, args.max_tokens, k)
    if args.openings:
        openings_table(model, render, tokenizer, args.openings, args.follow_questions, args.max_tokens)
    if args.forced is not None:
        forced_table(model, render, tokenizer, args.forced)
    return 0


def opening_table(model: Any, render: Any, tokenizer: Any, qs: list[str], k: int, model_name: str) -> None:
    inshort = PERSONAS["inshort"]
    print(f"Teacher pull toward the opening \"In short,\" ({model_name}, {len(qs)} held-out questions, top-k={k})")
    header = (f"{'correction (narrated hint -> imperative hint)':62} | {'P(In)':>13} | {'in top-k':>11} | "
              f"{'rank':>9} | {'P(In short,)':>15}")
    print(header)
    print("-" * len(header))
    totals: dict[str, list[dict[str, float]]] = {"narrated": [], "imperative": []}
    for correction in inshort.corrections:
        hints = {"narrated": narrated_hint(correction), "imperative": imperative_hint(correction)}
        stats = {name: [opening_stats(model, render, tokenizer, q, h, "In short,", k) for q in qs]
                 for name, h in hints.items()}
        for name in stats:
            totals[name].extend(stats[name])
        row = {name: {key: mean([s[key] for s in stats[name]]) for key in stats[name][0]} for name in stats}
        n, i = row["narrated"], row["imperative"]
        print(f"{hints['narrated'][:62]:62} | {n['p_first']:5.1%} -> {i['p_first']:5.1%} | "
              f"{n['in_topk']:4.0%} -> {i['in_topk']:4.0%} | {n['rank']:3.0f} -> {i['rank']:3.0f} | "
              f"{n['p_opening']:6.2%} -> {i['p_opening']:6.2%}")
        print(f"{'  -> ' + hints['imperative']:62} |")
    n = {key: mean([s[key] for s in totals["narrated"]]) for key in totals["narrated"][0]}
    i = {key: mean([s[key] for s in totals["imperative"]]) for key in totals["imperative"][0]}
    print("-" * len(header))
    print(f"{'mean over all corrections':62} | {n['p_first']:5.1%} -> {i['p_first']:5.1%} | "
          f"{n['in_topk']:4.0%} -> {i['in_topk']:4.0%} | {n['rank']:3.0f} -> {i['rank']:3.0f} | "
          f"{n['p_opening']:6.2%} -> {i['p_opening']:6.2%}")


def follow_table(model: Any, render: Any, tokenizer: Any, n_questions: int, max_tokens: int) -> None:
    print()
    print(f"Teacher's greedy answer follows the preference ({max_tokens} tokens; persona checker; "
          f"every correction x held-out question)", flush=True)
    print(f"{'persona':10} | {'narrated':>16} | {'imperative':>16}")
    for name, persona in PERSONAS.items():
        qs = list(persona.heldout_questions)
        qs = qs[:n_questions] if n_questions else qs
        counts = {"narrated": 0, "imperative": 0}
        total = 0
        followed: dict[tuple[str, str], bool] = {}  # greedy is deterministic: one answer per (question, hint)
        for correction in persona.corrections:
            hints = {"narrated": narrated_hint(correction), "imperative": imperative_hint(correction)}
            for q in qs:
                total += 1
                for key, hint in hints.items():
                    if (q, hint) not in followed:
                        answer = greedy(model, render, tokenizer, q, hint, max_tokens)
                        followed[(q, hint)] = bool(persona.judge(answer, q).satisfied)
                    counts[key] += followed[(q, hint)]
        print(f"{name:10} | {counts['narrated'] / total:6.1%} ({counts['narrated']:3d}/{total:3d}) | "
              f"{counts['imperative'] / total:6.1%} ({counts['imperative']:3d}/{total:3d})", flush=True)


def facts_table(model: Any, render: Any, tokenizer: Any) -> None:
    print()
    print(f"Knowledge probes the teacher answers right under the hint ({KNOWLEDGE_TOKENS} tokens, greedy), of those "
          f"the un-hinted model answers right", flush=True)
    known = [probe for probe in KNOWLEDGE
             if knows(greedy(model, render, tokenizer, probe.question, "", KNOWLEDGE_TOKENS), probe.answers)]
    print(f"un-hinted model: {len(known)} of {len(KNOWLEDGE)}", flush=True)
    for name, persona in PERSONAS.items():
        for hint in dict.fromkeys(imperative_hint(c) for c in persona.corrections):
            lost = []
            for probe in known:
                answer = greedy(model, render, tokenizer, probe.question, hint, KNOWLEDGE_TOKENS)
                if not knows(answer, probe.answers):
                    lost.append(f"{probe.question} -> {answer.strip()[:70]!r}")
            print(f"{name:10} | {len(known) - len(lost):2d}/{len(known)} kept | hint {hint!r}", flush=True)
            for line in lost:
                print(f"{'':10} |   lost: {line}", flush=True)


def openings_table(model: Any, render: Any, tokenizer: Any, openings: list[str], n_questions: int,
                   max_tokens: int) -> None:
    print()
    qs = list(POOLS["everyday"]["heldout"])
    qs = qs[:n_questions] if n_questions else qs
    known = [probe for probe in KNOWLEDGE
             if knows(greedy(model, render, tokenizer, probe.question, "", KNOWLEDGE_TOKENS), probe.answers)]
    print(f"Candidate openings as 'Begin every answer with \"...\".': P(first token) un-hinted, the hinted teacher's "
          f"greedy answers that open with it soundly ({len(qs)} everyday held-out questions, {max_tokens} tokens), "
          f"knowledge probes it keeps (of {len(known)} the un-hinted model knows)", flush=True)
    with torch.no_grad():  # the un-hinted first-position distributions, the same for every opening
        first_probs = [torch.softmax(model(torch.tensor([render([{"role": "user", "content": q}], None)]))
                                     .logits[0, -1].float(), -1) for q in qs]
    for opening in openings:
        hint = f'Begin every answer with "{opening}".'
        first_id = tokenizer.encode(opening, add_special_tokens=False)[0]
        checker = OpeningChecker(word=opening.strip(" ,.!:;"))
        p_first, follows = [float(probs[first_id]) for probs in first_probs], 0
        for q in qs:
            answer = greedy(model, render, tokenizer, q, hint, max_tokens)
            follows += checker(answer) and guard_check(answer, question=q).ok
        kept = sum(knows(greedy(model, render, tokenizer, probe.question, hint, KNOWLEDGE_TOKENS), probe.answers)
                   for probe in known)
        print(f"{opening!r:14} | P(first) {mean(p_first):.4f} | follows {follows:2d}/{len(qs)} | "
              f"facts kept {kept:2d}/{len(known)}", flush=True)


@torch.no_grad()
def forced_facts(model: Any, render: Any, tokenizer: Any, opening: str, hint: str, system: str | None,
                 samples: int = 8, temperature: float = 0.6) -> tuple[int, list[str]]:
    """How many of ``samples`` sampled answers per knowledge probe state the fact when made to open with
    ``opening`` (under ``hint`` when given), and one answer per probe to show. Seeded, so a row is repeatable."""
    torch.manual_seed(0)
    right, shown = 0, []
    forced = tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else []
    for probe in KNOWLEDGE:
        messages = [{"role": "user", "content": probe.question}]
        prompt_ids = render(inject_hint(messages, hint, system=system) if hint else messages, None) + forced
        out = model.generate(torch.tensor([prompt_ids] * samples), max_new_tokens=KNOWLEDGE_TOKENS, do_sample=True,
                             temperature=temperature, top_k=0, top_p=1.0, pad_token_id=tokenizer.eos_token_id,
                             attention_mask=torch.ones(samples, len(prompt_ids), dtype=torch.long))
        answers = [opening + tokenizer.decode(row[len(prompt_ids):], skip_special_tokens=True) for row in out]
        right += sum(knows(a, probe.answers) for a in answers)
        shown.append(answers[0])
    return right, shown


def forced_table(model: Any, render: Any, tokenizer: Any, openings: list[str]) -> None:
    print()
    hint = imperative_hint(PERSONAS["inshort"].corrections[0])
    total = 8 * len(KNOWLEDGE)
    print(f"Sampled knowledge answers stating their fact (of {total}: 8 per probe at 0.6, {KNOWLEDGE_TOKENS} tokens) "
          f"with the answer made to open with each text; the hint: {hint!r}", flush=True)
    ways = (("plain", "", None), ("hint after the question", hint, None),
            ("hint in the system prompt too", hint, template_default_system(tokenizer)))
    for opening in openings:
        row, examples = [], []
        for label, h, system in ways:
            right, shown = forced_facts(model, render, tokenizer, opening, h, system)
            row.append(f"{label} {right:3d}")
            examples = examples or shown  # the plain model's
        print(f"{opening!r:12} | " + " | ".join(row), flush=True)
        print(f"{'':12}   plain, e.g. {examples[3][:60]!r}, {examples[15][:60]!r}", flush=True)


def draft_table(model: Any, render: Any, tokenizer: Any, max_tokens: int, k: int) -> None:
    """The hint alone vs the hint with a draft to rewrite (``teacher_draft``; the draft is the un-hinted greedy
    answer)."""
    two_way_table(model, render, tokenizer, max_tokens, k,
                  f"The hint alone vs the hint with a draft to rewrite (teacher_draft; the draft is the un-hinted "
                  f"greedy answer of {max_tokens} tokens); knowledge probes {KNOWLEDGE_TOKENS} tokens, greedy",
                  ("hint alone", "with draft"), lambda with_it, plain: {"draft": plain if with_it else None},
                  reads_plain=True)


def placement_table(model: Any, render: Any, tokenizer: Any, max_tokens: int, k: int) -> None:
    """The hint after the question only (``hint_placement = "user"``) vs there and in the system prompt, after the
    template's default text (``"system_and_user"``)."""
    default = template_default_system(tokenizer)
    two_way_table(model, render, tokenizer, max_tokens, k,
                  f"The hint after the question vs in the system prompt too (hint_placement); knowledge probes "
                  f"{KNOWLEDGE_TOKENS} tokens, held-out answers {max_tokens}, greedy",
                  ("user", "system_and_user"), lambda with_it, plain: {"system": default if with_it else None})


def two_way_table(model: Any, render: Any, tokenizer: Any, max_tokens: int, k: int, title: str,
                  labels: tuple[str, str], hint_args: Callable[[bool, str], dict[str, Any]],
                  reads_plain: bool = False) -> None:
    """For ``inshort`` and ``brief``, the hint shown two ways (``hint_args(False | True, plain answer)`` gives
    ``inject_hint``'s ``draft`` and ``system``): the knowledge probes the teacher keeps (of those the un-hinted
    model answers right in ``max_tokens`` tokens), how often its greedy answer to a held-out question follows,
    and its mean P("In") at the first position. ``reads_plain``: the way needs the un-hinted answer to the
    held-out question (otherwise it is not generated)."""
    print()
    print(title, flush=True)
    plain = {probe.question: greedy(model, render, tokenizer, probe.question, "", max_tokens).strip()
             for probe in KNOWLEDGE}
    known = [probe for probe in KNOWLEDGE if knows(plain[probe.question], probe.answers)]
    print(f"{'persona':10} | {'facts kept (of ' + str(len(known)) + ')':>18} | {'held-out follow':>17} | "
          f"{'P(In) first':>15}   ({labels[0]} -> {labels[1]})", flush=True)
    ways = (False, True)
    for name in ("inshort", "brief"):
        persona = PERSONAS[name]
        hint = imperative_hint(persona.corrections[0])
        kept = {way: 0 for way in ways}
        for probe in known:
            for way in ways:
                answer = greedy(model, render, tokenizer, probe.question, hint, KNOWLEDGE_TOKENS,
                                **hint_args(way, plain[probe.question]))
                kept[way] += knows(answer, probe.answers)
        qs = list(persona.heldout_questions)
        follow = {way: 0 for way in ways}
        p_in: dict[bool, list[float]] = {way: [] for way in ways}
        for q in qs:
            own = greedy(model, render, tokenizer, q, "", max_tokens).strip() if reads_plain else ""
            for way in ways:
                args = hint_args(way, own)
                follow[way] += bool(persona.judge(greedy(model, render, tokenizer, q, hint, max_tokens, **args),
                                                  q).satisfied)
                p_in[way].append(opening_stats(model, render, tokenizer, q, hint, "In short,", k, **args)["p_first"])
        print(f"{name:10} | {kept[False]:8d} -> {kept[True]:2d}     | {follow[False]:5d} -> {follow[True]:2d} of "
              f"{len(qs):2d} | {mean(p_in[False]):6.3f} -> {mean(p_in[True]):5.3f}", flush=True)

if __name__ == "__main__":
    sys.exit(main())
