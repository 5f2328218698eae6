"""Does an objective carry a preference the model would never write on its own? A short on-policy loop, per variant.

    python benchmarks/support_pull.py                                   # inshort, base vs the support term
    python benchmarks/support_pull.py --variant none: --variant sup4:support_coef=1,support_k=4 \\
        --variant sup16:support_coef=1,support_k=16 --rounds 8

The loop is the online one without a server, so it runs in minutes: each round the current policy samples its
answers to ``--batch`` of the persona's training questions (temperature 0.6, seeded), the persona judges each (a
correction gives a -1 and the rule judge's hint, a good answer +1), the samples are stored, and one training step
runs on them through the trainer everyone uses (``trainer.core.Trainer``: old-policy pass, the frozen base model
as the hint-conditioned teacher, the objective, the optimizer). Every variant starts from the same weights, seed
and settings (the demo preset, gate off: this measures what a step does, not what gets served) and differs only
in the settings it names. A variant with ``context_samples`` set also stores, for each hinted turn, the teacher's
own answers as context samples, written as the judging pipeline writes them (under the variant's ``opd_target``).

Printed per variant, on the persona's held-out questions (never trained on), before and after the rounds:

* ``P(first)``: the policy's probability (τ = 1) of the preference's first token at the first answer position
  (for ``inshort``, "In"), mean over the questions;
* ``follows``: the share of greedy answers that follow the preference (the persona's checker) and pass the
  degeneracy guard: what the demo's score counts;
* ``guard``: the share of greedy answers that pass the guard alone; each failing answer after the rounds is printed
  with the guard's reasons;
* ``facts kept``: of the knowledge probes the starting model answers correctly (the publication gate's, greedy,
  at the gate's token limit), how many it still does; each forgotten one is printed with its answer;
* the share of 8 answers per knowledge probe, sampled at the serving temperature (0.6, the same seed before and
  after), that state the fact, overall and per probe (before>after), which is what users are served.

``--fact-caps 32 48`` also counts the knowledge probes' facts, greedy and sampled, in answers of those many
tokens (the same seed: a longer cap extends the same draws): whether a fact the gate's limit misses is lost or
only said later, after a preference's opening.

``--persona-file F`` trains a persona from a file instead (``clawloop/sim/persona_file.py``), and ``--first-word W``
also reports the mean probability of ``W``'s first token at the start of a held-out answer, as is done for
``inshort``'s "In": whether a preference is learnable can be tried before an online run.

``--dice 6`` applies the publication gate's sampled fact rules (its knowledge probes, drawn and judged as the gate
does) to the policy after every round under 6 sets of dice, set 0 being the check's own: per set the reference's
and the policy's answers stating their facts, the policy's shortfall against the reference's mean over the gate's
``gate_reference_dice`` sets, and under how many sets the gate would reject, held to the reference's count under
each set alone or, as the gate holds it, to the lower of that and the mean. How much of a verdict is the model and
how much the draw.

``--scales 0.3 0.5`` also scores each variant with its LoRA update multiplied by those factors (weight-space
interpolation toward the starting weights): how much of a preference and of the facts a smaller move keeps.

``--replay RUN_DIR --replay-steps 1,2`` trains instead on what an online run trained at those steps: the samples
its store records as consumed by each step, one step per recorded step, in order, from the starting weights (the
store is copied; the run is not touched). The online loop's batches are not this loop's (multi-turn prompts,
thanked follow-ups), and what they cost in facts is what a candidate of the run was rejected for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from clawloop.assemble import offline_teacher  # noqa: E402
from clawloop.engines import model_files  # noqa: E402
from clawloop.gate.gate import PublicationGate, forgot_sampled, tolerated_regressions  # noqa: E402
from clawloop.gate.knowledge import KNOWLEDGE, KNOWLEDGE_TOKENS, knows  # noqa: E402
from clawloop.judge.rules import decide_user  # noqa: E402
from clawloop.pipeline import context_params, context_sample  # noqa: E402
from clawloop.sim.demo import demo_config  # noqa: E402
from clawloop.sim.persona_file import resolve_persona  # noqa: E402
from clawloop.store import SampleRecord, Store, TurnRecord  # noqa: E402
from clawloop.trainer.core import Trainer  # noqa: E402
from clawloop.trainer.leasing import BatchLeaser  # noqa: E402
from clawloop.trainer import versions as history  # noqa: E402
from clawloop.trainer.model import TrainModels, load_train_models, load_trainable_state_dict  # noqa: E402
from clawloop.trainer.publish import LocalVersion  # noqa: E402
from clawloop.trainer.step import zero_momentum  # noqa: E402
from clawloop.trainer.teacher_client import in_process  # noqa: E402

MAX_NEW_TOKENS = 48
FIRST_TOKENS = {"inshort": "In"}


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value,key=value`` → (name, settings); values are read as int, float, bool or text, and a value
    with ``+`` as a list of texts (``lora_target_modules=q_proj+v_proj``)."""
    name, _, rest = text.partition(":")
    settings: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, raw = item.partition("=")
        value: Any = raw
        for cast in (int, float):
            try:
                value = cast(raw)
                break
            except ValueError:
                pass
        if raw in ("true", "false"):
            value = raw == "true"
        if isinstance(value, str) and "+" in raw:
            value = raw.split("+")
        settings[key.strip()] = value
    return name, settings


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=True)["input_ids"])


def answer(models: TrainModels, tokenizer: Any, question: str, *, temperature: float, seed: int,
           max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt_ids(tokenizer, question)])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = models.policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                     temperature=temperature if temperature > 0 else None, top_p=1.0,
                                     use_cache=True, pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:].tolist()


SAMPLED_FACT_ANSWERS = 8


def sampled_knows(models: TrainModels, tokenizer: Any, probe: Any, max_new_tokens: int = KNOWLEDGE_TOKENS) -> float:
    """Share of ``SAMPLED_FACT_ANSWERS`` answers sampled at the serving temperature (0.6) that state the fact within
    ``max_new_tokens`` (the same seed at every cap, so a longer cap extends the same answers)."""
    ids = torch.tensor([prompt_ids(tokenizer, probe.question)]).repeat(SAMPLED_FACT_ANSWERS, 1)
    torch.manual_seed(0)
    with torch.no_grad():
        out = models.policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new_tokens, do_sample=True, temperature=0.6, top_p=1.0,
                                     use_cache=True, pad_token_id=tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return sum(knows(t, probe.answers) for t in texts) / len(texts)


def heldout(models: TrainModels, tokenizer: Any, persona: Any, first_id: int | None,
            fact_caps: list[int] = ()) -> dict[str, Any]:
    p_first, follows, sound, unsound = [], 0, 0, []
    questions = persona.heldout_questions
    for question in questions:
        ids = torch.tensor([prompt_ids(tokenizer, question)])
        with torch.no_grad():
            logits = models.policy(input_ids=ids).logits[0, -1].float()
        if first_id is not None:
            p_first.append(float(torch.softmax(logits, -1)[first_id]))
        text = tokenizer.decode(answer(models, tokenizer, question, temperature=0.0, seed=0),
                                skip_special_tokens=True)
        verdict = persona.judge(text, question)
        follows += verdict.ok
        sound += verdict.sound
        if not verdict.sound:
            unsound.append(f"{question} → {text!r} ({', '.join(verdict.guard_reasons)})")
    n = len(questions)
    known = knowledge(models, tokenizer, KNOWLEDGE_TOKENS)
    # The knowledge probes again with longer answers: is a fact lost, or only said later?
    by_cap = {cap: knowledge(models, tokenizer, cap) for cap in fact_caps}
    return {"p_first": sum(p_first) / len(p_first) if p_first else float("nan"), "follows": follows / n,
            "guard": sound / n, "unsound": unsound, **known, "by_cap": by_cap}


def knowledge(models: TrainModels, tokenizer: Any, max_new_tokens: int) -> dict[str, list[Any]]:
    """The knowledge probes answered in at most ``max_new_tokens``: each greedy answer, whether it states its fact,
    and the share of sampled answers that do."""
    texts = [tokenizer.decode(answer(models, tokenizer, k.question, temperature=0.0, seed=0,
                                     max_new_tokens=max_new_tokens), skip_special_tokens=True) for k in KNOWLEDGE]
    return {"facts": [knows(text, k.answers) for text, k in zip(texts, KNOWLEDGE)], "fact_answers": texts,
            "sampled_facts": [sampled_knows(models, tokenizer, k, max_new_tokens) for k in KNOWLEDGE]}


def fact_gate(config: Any, tokenizer: Any) -> PublicationGate:
    """A gate asking only the knowledge probes, sampled as the trainer's gate samples them."""
    if not (config.gate_knowledge_samples > 0 and config.default_temperature > 0):
        raise SystemExit("--dice needs sampled knowledge answers (gate_knowledge_samples > 0, default_temperature > 0)")
    return PublicationGate(tokenizer, knowledge=KNOWLEDGE, knowledge_samples=config.gate_knowledge_samples,
                           knowledge_temperature=config.default_temperature, probe_tokens=config.gate_probe_tokens,
                           max_fact_drop=config.gate_max_fact_drop, min_guard_pass=config.gate_min_guard_pass,
                           reference_dice=config.gate_reference_dice)


def dice_verdicts(gate: PublicationGate, models: TrainModels, sets: int,
                  reference: dict[int, list[tuple[str, int, int]]]) -> list[dict[str, Any]]:
    """The gate's sampled fact rules under ``sets`` sets of dice, each set taken as if it were the check's own (set
    0 is): per set, the answers stating their fact (the reference's over the facts it stated at least once under
    that set, the policy's over the same), the facts forgotten, and whether the share rule would reject, held to
    the reference's count under that set alone (``one_draw``, the rule before ``gate_reference_dice``) or, as the
    gate holds it, to the lower of that count and the reference's mean over the gate's ``reference_dice`` sets
    (``fewer``), and whether the forgotten rule would (at the tolerance of a candidate that is not near-identical).
    ``mean_drop`` is the policy's shortfall on all facts against that mean. ``reference`` caches the starting
    weights' counts per set (the LoRA update scaled by 0)."""
    for d in range(max(sets, gate.reference_dice)):
        if d not in reference:
            with adapter_scaled(models.policy, 0.0) as start:
                reference[d] = gate.fact_counts(start, d)
    mean = [sum(reference[d][f][1] for d in range(gate.reference_dice)) / gate.reference_dice
            for f in range(len(KNOWLEDGE))]
    rows = []
    for d in range(sets):
        mine = gate.fact_counts(models.policy, d)
        asked = [(f, r, c) for f, ((_, r, _), (_, c, _)) in enumerate(zip(reference[d], mine)) if r > 0]
        counted = [(r, c) for (_, r, n), (_, c, _) in zip(reference[d], mine) if 2 * r >= n]
        ref_right, right = sum(r for _, r, _ in asked), sum(c for _, _, c in asked)
        bar = min(float(ref_right), sum(mean[f] for f, _, _ in asked))
        forgotten = sum(forgot_sampled(c, r) for r, c in counted)
        keep = 1.0 - gate.max_fact_drop
        rows.append({"reference": ref_right, "bar": bar, "policy": right, "forgotten": forgotten,
                     "mean_drop": 1.0 - sum(c for _, c, _ in mine) / sum(mean),
                     "one_draw": right < keep * ref_right - 1e-9, "fewer": right < keep * bar - 1e-9,
                     "too_many_forgotten": forgotten > tolerated_regressions(len(counted), gate.min_guard_pass)})
    return rows


def dice_line(rows: list[dict[str, Any]], reference_dice: int) -> str:
    drops = [r["mean_drop"] for r in rows]
    rejected = sum(r["fewer"] or r["too_many_forgotten"] for r in rows)
    one_draw = sum(r["one_draw"] or r["too_many_forgotten"] for r in rows)
    mean = sum(drops) / len(drops)
    sd = (sum((x - mean) ** 2 for x in drops) / max(1, len(drops) - 1)) ** 0.5
    return (f"gate's fact rules under {len(rows)} dice sets: reference " + " ".join(str(r["reference"]) for r in rows)
            + "; policy " + " ".join(str(r["policy"]) for r in rows)
            + f"; drop against the reference's mean over {reference_dice} sets {mean:+.1%} ± {sd:.1%}, forgotten "
            + " ".join(str(r["forgotten"]) for r in rows)
            + f"; rejected under {rejected} of {len(rows)} (held to each set's one draw: {one_draw})")


def context_answers(config: Any, teacher: Any, turn: TurnRecord, hints: list[str]) -> list[Any]:
    """The turn's context answers (``context_samples`` of them, under ``opd_target``), as the judging pipeline
    writes them."""
    out = []
    for i in range(int(config.context_samples)):
        generated = asyncio.run(teacher.answer(turn, hints[i % len(hints)], context_params(config, turn, i),
                                               config.opd_target))
        if generated.token_ids and all(list(generated.token_ids) != c.turn.response_ids for c in out):
            out.append(context_sample(config, turn, hints, i, i % len(hints), generated))
    return out


def store_round(store: Store, tokenizer: Any, models: TrainModels, persona: Any, questions: list[str],
                rng: random.Random, round_index: int, config: Any = None, teacher: Any = None) -> tuple[int, int]:
    """Sample, judge and store one batch; returns (answers following the preference, hinted samples). With
    ``context_samples`` set, a hinted turn also gets the teacher's context answers."""
    good = hinted = 0
    for i, question in enumerate(questions):
        prompt = prompt_ids(tokenizer, question)
        response = answer(models, tokenizer, question, temperature=0.6, seed=rng.randrange(2 ** 31))
        text = tokenizer.decode(response, skip_special_tokens=True)
        verdict = persona.judge(text, question)
        messages = [{"role": "user", "content": question}]
        tid = store.add_turn(TurnRecord(session_id=f"r{round_index}-{i}", messages=messages, prompt_ids=prompt,
                                        response_ids=response, logprobs=[0.0] * len(response), temperature=0.6,
                                        top_p=1.0, policy_version=round_index))
        if verdict.ok:
            reply, reward, hints = "Thanks!", 1.0, []
            good += 1
        else:
            reply = rng.choice(persona.corrections)
            decision = decide_user([reply])
            reward, hints = float(decision.score), [decision.hint] if decision.hint else []
            hinted += bool(hints)
        store.set_next_state(tid, [{"role": "user", "content": reply}])
        store.claim_judgeable(1)
        context = []
        if hints and config is not None and config.context_samples > 0:
            context = context_answers(config, teacher, store.get_turn(tid), hints)
            if context and round_index == 0 and i == 0:
                print(f"    context answer: {context[0].turn.response_text!r}", flush=True)
        store.put_sample(SampleRecord(turn_id=tid, reward=reward, kind="rl+opd" if hints else "rl", hints=hints),
                         context)
    return good, hinted


@contextlib.contextmanager
def adapter_scaled(policy: Any, scale: float) -> Any:
    """The policy with every LoRA update multiplied by ``scale`` (0 = the starting weights, 1 = as trained)."""
    layers = [m for m in policy.modules() if isinstance(getattr(m, "scaling", None), dict)]
    saved = [dict(m.scaling) for m in layers]
    for m in layers:
        m.scaling = {k: v * scale for k, v in m.scaling.items()}
    try:
        yield policy
    finally:
        for m, s in zip(layers, saved):
            m.scaling = s


def replay_store(run_dir: Path, steps: list[int], path: Path) -> list[int]:
    """A copy of ``run_dir``'s store at ``path`` in which only the samples consumed by ``steps`` are ready to
    train again; returns how many samples each of those steps had."""
    with sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True) as source, \
            sqlite3.connect(path) as copy:
        source.backup(copy)
    with sqlite3.connect(path) as db:
        counts = [db.execute("SELECT COUNT(*) FROM samples WHERE consumed_step=?", (s,)).fetchone()[0]
                  for s in steps]
        if not all(counts):
            raise SystemExit(f"{run_dir}: steps {steps} consumed {counts} samples (a step with none)")
        db.execute("UPDATE samples SET state='consumed', lease_id='', lease_expires=0")
        marks = ",".join("?" * len(steps))
        db.execute(f"UPDATE samples SET state='ready', consumed_step=NULL WHERE consumed_step IN ({marks})", steps)
    return counts


def run_variant(name: str, settings: dict[str, Any], args: argparse.Namespace, persona: Any, tokenizer: Any,
                teacher: Any, out: Any, before: dict[str, Any],
                reference_counts: dict[int, list[tuple[str, int, int]]] | None = None) -> dict[str, Any]:
    """One variant's rounds from the starting weights; ``before`` is their held-out scores (the same for every
    variant: same weights, same seed), filled by the first variant, and ``reference_counts`` the starting weights'
    fact counts per dice set (``--dice``), filled likewise."""
    reference_counts = {} if reference_counts is None else reference_counts
    with tempfile.TemporaryDirectory(prefix="clawloop-support-") as tmp:
        config = demo_config({"model": args.model, "num_threads": args.threads, "device": "cpu", "gate": False,
                              "seed": args.seed, "run_dir": tmp, "rollout_batch_size": args.batch,
                              "metrics_backends": [], **settings})
        torch.manual_seed(args.seed)
        models = load_train_models(config)
        first = FIRST_TOKENS.get(persona.name)
        first_id = tokenizer.encode(first, add_special_tokens=False)[0] if first else None
        if not before and not args.start_version:
            before.update(heldout(models, tokenizer, persona, first_id, args.fact_caps))
        counts = replay_store(args.replay, args.replay_steps, Path(tmp) / "store.sqlite") if args.replay else []
        store = Store(Path(tmp) / "store.sqlite")
        trainer = Trainer(config, store, LocalVersion(), run_dir=tmp, teacher=in_process(teacher), models=models,
                          console=None)
        if args.start_version:  # the run's kept version, weights and AdamW state, as its trainer had them
            kept = history.load_version(args.replay, args.start_version)
            load_trainable_state_dict(models, kept.weights)
            if kept.optimizer is not None and args.start_optimizer != "fresh":
                trainer.optimizer.load_state_dict(kept.optimizer)
                if args.start_optimizer == "no-momentum":
                    zero_momentum(trainer.optimizer)
            if not before:
                before.update(heldout(models, tokenizer, persona, first_id, args.fact_caps))
        gate = fact_gate(config, tokenizer) if args.dice else None
        dice: list[list[dict[str, Any]]] = []

        def measure_dice(label: str) -> None:
            if gate is not None:
                dice.append(dice_verdicts(gate, models, args.dice, reference_counts))
                out(f"  {name} {label}: {dice_line(dice[-1], gate.reference_dice)}")

        leaser = BatchLeaser(store, args.batch * (1 + int(config.context_samples)), partial=True)
        rng = random.Random(args.seed)
        pool = list(persona.train_questions)
        rng.shuffle(pool)
        started = time.perf_counter()
        good_total = 0
        for r, n in enumerate(counts):  # --replay: the run's own batches, oldest first
            lease_id, leased = BatchLeaser(store, n, partial=True).lease()
            metrics = trainer.run_batch(lease_id, leased) or {}
            terms = {k: round(v, 4) for k, v in metrics.items()
                     if k.endswith("_loss") and isinstance(v, float) and v != 0.0}
            out(f"  {name} replayed step {args.replay_steps[r]}: turns {sorted(x.turn_id for x in leased)}; {terms}")
            measure_dice(f"after step {args.replay_steps[r]}")
        for r in range(0 if args.replay else args.rounds):
            questions = [pool[(r * args.batch + i) % len(pool)] for i in range(args.batch)]
            good, hinted = store_round(store, tokenizer, models, persona, questions, rng, r, config, teacher)
            good_total += good
            lease_id, leased = leaser.lease()
            metrics = trainer.run_batch(lease_id, leased) or {}
            terms = {k: round(v, 4) for k, v in metrics.items()
                     if k.endswith("_loss") and isinstance(v, float) and v != 0.0}
            out(f"  {name} round {r + 1}/{args.rounds}: {good}/{len(questions)} sampled answers followed, "
                f"{hinted} hinted; {terms}")
            measure_dice(f"after round {r + 1}")
        step_s = (time.perf_counter() - started) / max(1, len(counts) if args.replay else args.rounds)
        after = heldout(models, tokenizer, persona, first_id, args.fact_caps)
        scaled = {}
        for scale in args.scales:
            with adapter_scaled(models.policy, scale):
                scaled[scale] = heldout(models, tokenizer, persona, first_id)
        trainer.close()
        store.close()
    return {"name": name, "settings": settings, "before": dict(before), "after": after, "sampled_followed": good_total,
            "seconds_per_round": step_s, "scaled": scaled, "dice": dice}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--persona", default="inshort")
    parser.add_argument("--persona-file", default="", metavar="FILE",
                        help="A persona from a TOML or JSON file (clawloop/sim/persona_file.py) instead of --persona.")
    parser.add_argument("--first-word", default="", metavar="WORD",
                        help="Also report the policy's mean probability of this word's first token at the start of "
                             "a held-out answer (built in for inshort: \"In\").")
    parser.add_argument("--model", default="default")
    parser.add_argument("--rounds", type=int, default=6, help="Sample-judge-train rounds per variant.")
    parser.add_argument("--batch", type=int, default=4, help="Answers (samples) per round; one step each.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", action="append", default=[],
                        help="name:key=value,... (settings on top of the demo preset); repeatable.")
    parser.add_argument("--replay", type=Path, default=None, metavar="RUN_DIR",
                        help="Train on an online run's own batches instead of sampling rounds (see --replay-steps).")
    parser.add_argument("--replay-steps", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2],
                        help="The run's steps whose samples are replayed, in order (default 1,2).")
    parser.add_argument("--start-version", type=int, default=0, metavar="N",
                        help="With --replay: start from the run's kept version N (its weights and optimizer state) "
                             "instead of the starting weights; 'before' is then that version's scores.")
    parser.add_argument("--start-optimizer", choices=("kept", "fresh", "no-momentum"), default="kept",
                        help="With --start-version: the version's AdamW state as kept, a fresh one, or the kept one "
                             "with its first moment (momentum) zeroed.")
    parser.add_argument("--fact-caps", type=int, nargs="*", default=[], metavar="TOKENS",
                        help="Also count the knowledge probes' facts (greedy and sampled) in answers of these many "
                             "tokens, beside the gate's own limit: a fact said after a preference's opening may fall "
                             "past it.")
    parser.add_argument("--dice", type=int, default=0, metavar="N",
                        help="After every round, the gate's sampled fact rules (its knowledge probes, answers and "
                             "rules) applied to the policy under N sets of dice, set 0 being the check's own: how "
                             "much of a verdict is the model and how much the draw.")
    parser.add_argument("--scales", type=float, nargs="*", default=[],
                        help="Also score each variant with its LoRA update scaled by these factors (weight-space "
                             "interpolation toward the starting weights).")
    args = parser.parse_args()
    if args.start_version and not args.replay:
        parser.error("--start-version needs --replay RUN_DIR (the run whose version it is)")
    torch.set_num_threads(args.threads)
    variants = [parse_variant(v) for v in (args.variant or ["select-only:support_coef=0",
                                                             "with-support:support_coef=1"])]
    persona = resolve_persona(args.persona, args.persona_file)
    if args.first_word:
        FIRST_TOKENS[persona.name] = args.first_word
    model_dir = model_files.resolve_model(args.model)
    tokenizer = model_files.load_tokenizer(model_dir)
    config = demo_config({"model": args.model, "num_threads": args.threads, "device": "cpu"})
    results = []
    before: dict[str, Any] = {}
    reference_counts: dict[int, list[tuple[str, int, int]]] = {}
    with offline_teacher(config) as teacher:
        for name, settings in variants:
            print(f"variant {name}: {settings or 'the demo preset'}", flush=True)
            results.append(run_variant(name, settings, args, persona, tokenizer, teacher,
                                       lambda line: print(line, flush=True), before, reference_counts))
    trained = (f"{args.replay}'s steps {','.join(map(str, args.replay_steps))}" if args.replay
               else f"{args.rounds} rounds of {args.batch}")
    print(f"\npersona {persona.name}, {trained}, seed {args.seed}; held-out "
          f"{len(persona.heldout_questions)} questions (before → after)")
    print(f"{'variant':<16} {'P(first)':>19} {'follows':>13} {'guard':>13} {'facts kept':>11} {'s/round':>8}")
    for r in results:
        b, a = r["before"], r["after"]
        known = [i for i, k in enumerate(b["facts"]) if k]
        kept = sum(a["facts"][i] for i in known)
        print(f"{r['name']:<16} {b['p_first']:>8.4f} → {a['p_first']:<8.4f} {b['follows']:>5.2f} → {a['follows']:<5.2f}"
              f" {b['guard']:>5.2f} → {a['guard']:<5.2f} {kept:>5}/{len(known):<5} {r['seconds_per_round']:>8.1f}")
        print(f"{'':<16} sampled fact rate {sum(b['sampled_facts']) / len(KNOWLEDGE):.2f} → "
              f"{sum(a['sampled_facts']) / len(KNOWLEDGE):.2f}; per fact "
              + " ".join(f"{x:.2f}>{y:.2f}" for x, y in zip(b['sampled_facts'], a['sampled_facts'])))
        for cap, ac in a["by_cap"].items():
            bc = b["by_cap"][cap]
            known_c = [i for i, k in enumerate(bc["facts"]) if k]
            print(f"{'':<16} at {cap} tokens: facts kept {sum(ac['facts'][i] for i in known_c)}/{len(known_c)}, "
                  f"sampled fact rate {sum(bc['sampled_facts']) / len(KNOWLEDGE):.2f} → "
                  f"{sum(ac['sampled_facts']) / len(KNOWLEDGE):.2f}")
        for scale, sa in r["scaled"].items():
            kept_s = sum(sa["facts"][i] for i in known)
            print(f"{'  × ' + format(scale, 'g'):<16} {b['p_first']:>8.4f} → {sa['p_first']:<8.4f} "
                  f"{b['follows']:>5.2f} → {sa['follows']:<5.2f} {b['guard']:>5.2f} → {sa['guard']:<5.2f} "
                  f"{kept_s:>5}/{len(known):<5}")
    for r in results:
        b, a = r["before"], r["after"]
        for i, k in enumerate(KNOWLEDGE):
            if b["facts"][i] and not a["facts"][i]:
                print(f"  {r['name']} forgot: {k.question} → {a['fact_answers'][i]!r}")
        for line in a["unsound"]:
            print(f"  {r['name']} fails the guard: {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
