"""Cost of the publication gate next to the cost of the training step it follows, on the default model.

One process loads SmolLM2-135M-Instruct for training (LoRA r16, lr 1e-3, kl 0.05, GRPO; ``--demo-preset``: the
demo's own settings, whose step adds the retain term), writes ``--steps × --samples`` served turns with real
chat-template prompts and ``--tokens`` answer tokens into a temporary store, and runs ``--steps`` steps through
``clawloop.trainer.core.Trainer`` with the gate checking every step (the default). Each line shows the optimizer
step's time and the gate check's time (greedy answers to the shipped probes plus the run's ``gate_recent_prompts``
recent distinct prompts, ``gate_probe_tokens`` each, then the KL forward pass, and for a candidate every other rule
accepts the preference reading under ``--hint``), and their ratio; the line below splits the check's time into its
parts (``GateResult.seconds_by_part``). The first check also answers every probe with the reference once (its
verdicts are kept), so it is slower than the steady state. Before the gate's own check, the same candidate is
checked by a plain gate (on unless ``--no-plain``: shipped and recent probes only, without the knowledge probes and
the run's corrected prompts), so the two times are measured side by side on the same weights; the line also says
whether both decided alike and how many of their common answers are equal. With ``--without-kept-states`` the other
gate is the trainer's own without the reference's kept prompt states (``clawloop.gate.scoring``), and the line
below it compares the parts' times; with ``--step-allocator`` it is a copy of the trainer's own run under a
training step's mmap threshold (``clawloop.memory``), as every check ran before that was raised outside the steps;
with ``--kept-answers`` it is a copy of the trainer's gate keeping the starting weights' answers in an empty file
(``clawloop.gate.kept_answers``), which the trainer's own gate then reads, as a later run on the same machine
would.
The last lines time the greedy answers to probes of mixed lengths in one padded batch and in the gate's length
groups, side by side, then the reference's forward over those answers with and without kept prompt states, then
(LoRA) with the adapter as it trains against merged for the check, then the gate's decoding (rows leave the batch
as they end) against one ``generate`` call per group, as the candidate answers and with most answers cut short.

    .venv/bin/python benchmarks/gate.py                    # 3 steps of 4 samples x 64 tokens, 1 thread
    .venv/bin/python benchmarks/gate.py --threads 2 --probe-tokens 16
    .venv/bin/python benchmarks/gate.py --threads 2 --steps 6 --demo-preset --without-kept-states
    .venv/bin/python benchmarks/gate.py --threads 2 --steps 3 --demo-preset --no-plain --work-ahead
    .venv/bin/python benchmarks/gate.py --threads 2 --steps 3 --demo-preset --step-allocator
    .venv/bin/python benchmarks/gate.py --threads 2 --steps 3 --demo-preset --no-plain --kept-answers
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FILLER = ("The meeting agreed to move the launch by a week, to ask the design team for two more mock-ups, "
          "and to review the budget on Friday. ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--probe-tokens", type=int, default=64)
    parser.add_argument("--recent-prompts", type=int, default=None, help="gate_recent_prompts (default: the "
                        "setting's default)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--full", action="store_true", help="Full fine-tuning instead of LoRA.")
    parser.add_argument("--no-plain", dest="plain", action="store_false", help="Skip the plain gate's check.")
    parser.add_argument("--without-kept-states", action="store_true", help="Check each candidate first with the "
                        "trainer's gate as it is but without the reference's kept prompt states (instead of the "
                        "plain gate), to time the KL and preference forwards both ways on the same candidates.")
    parser.add_argument("--hint", default="Answer in one short sentence.", help="The hint the preference check "
                        "reads (the benchmark's samples carry none); '' leaves the check without one.")
    parser.add_argument("--demo-preset", action="store_true", help="Train with the demo's preset (hybrid, the retain "
                        "term; gate_every 1 here) instead of plain GRPO, so the check is set against the step the "
                        "demo runs.")
    parser.add_argument("--step-allocator", action="store_true", help="Check each candidate first with a copy of "
                        "the trainer's gate run under a training step's mmap threshold (clawloop.memory: how every "
                        "check ran before the threshold was raised outside the steps), to time the check both "
                        "ways on the same candidates.")
    parser.add_argument("--kept-answers", action="store_true", help="Check each candidate first with a copy of "
                        "the trainer's gate that keeps the starting weights' answers in an empty file (as a run on a "
                        "new machine), then with the trainer's own gate reading that file (as a later run or a "
                        "restart): the first check, and the one that first draws the reference's other dice, side "
                        "by side.")
    parser.add_argument("--work-ahead", action="store_true", help="Before the first step, let the trainer do its "
                        "work ahead (Trainer.prepare, as the online loop does while nothing is ready: the retain "
                        "term's targets, the reference's answers and its other dice) and time each piece; the first "
                        "check then answers nothing with the reference but the run's own prompts.")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from clawloop.config import Config
    from clawloop.engines.model_files import default_model_dir, load_tokenizer
    from clawloop.gate.kept_answers import KeptAnswers
    from clawloop.sim.demo import DEMO_PRESET
    from clawloop.store import SampleRecord, Store, TurnRecord
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion

    model_dir = default_model_dir()
    tokenizer = load_tokenizer(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        preset = {**DEMO_PRESET, "gate_every": 1} if args.demo_preset else {"method": "rl", "lr": 1e-3,
                                                                              "kl_coef": 0.05}
        config = Config.from_dict(dict(preset, model=str(model_dir), device="cpu", run_dir=tmp,
                                       lora=not args.full, rollout_batch_size=args.samples,
                                       gate_probe_tokens=args.probe_tokens, metrics_backends=["jsonl"],
                                       # answers kept by earlier runs would hide the reference's part of a check
                                       gate_kept_answers=args.kept_answers,
                                       **({} if args.recent_prompts is None else
                                          {"gate_recent_prompts": args.recent_prompts})))
        store = Store(Path(tmp) / "store.sqlite")
        text_ids = tokenizer(FILLER * (args.tokens // 20 + 2), add_special_tokens=False)["input_ids"]
        for i in range(args.samples * args.steps):
            messages = [{"role": "user", "content": f"Question {i}: summarise the meeting notes in a sentence."}]
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
            response = list(text_ids[i:i + args.tokens - 1]) + [2]
            tid = store.add_turn(TurnRecord(session_id=f"s{i}", messages=messages, prompt_ids=prompt,
                                            response_ids=response, logprobs=[-1.0] * args.tokens, temperature=0.6,
                                            top_p=1.0, policy_version=0))
            store.set_next_state(tid, [{"role": "user", "content": "thanks"}])
            store.claim_judgeable(1)
            store.put_sample(SampleRecord(turn_id=tid, reward=1.0 if i % 2 else -1.0, kind="rl"))
        trainer = Trainer(config, store, LocalVersion(), console=None)
        if args.hint:  # the samples carry no hint; the preference check reads this one as if they had
            trainer.hint_counts[args.hint] += 1
        if args.kept_answers:
            trainer.gate.kept_answers = KeptAnswers(Path(tmp) / "kept-answers.json")
        side = (SideBySide(trainer.gate, without_states(trainer.gate)) if args.without_kept_states
                else SideBySide(trainer.gate, cold_copy(trainer.gate)) if args.kept_answers
                else SideBySide(trainer.gate, UnderStepAllocator(same_gate(trainer.gate))) if args.step_allocator
                else SideBySide(trainer.gate, plain_gate(tokenizer, config, store)) if args.plain else None)
        if side is not None:
            trainer.gate = side  # type: ignore[assignment]
        mode = ("full fine-tuning" if args.full else f"LoRA r{config.lora_rank}") + (
            f", demo preset ({config.method}, retain_coef {config.retain_coef:g})" if args.demo_preset else "")
        print(f"gate benchmark: SmolLM2-135M-Instruct, {mode}, {args.threads} thread(s), batch {args.samples} x "
              f"{args.tokens} tokens, {len(trainer.gate.shipped)} shipped probes + {config.gate_recent_prompts} "
              f"recent prompts x {args.probe_tokens} tokens, {len(trainer.gate.knowledge)} knowledge probes x "
              f"{trainer.gate.knowledge_tokens} tokens")
        if args.work_ahead:
            pieces, more = [], True
            while more:
                t0 = time.perf_counter()
                more = trainer.prepare()
                pieces.append(time.perf_counter() - t0)
            print(f"worked ahead: {len(pieces)} pieces in {sum(pieces):.2f}s ("
                  + ", ".join(f"{s:.2f}s" for s in pieces) + "; the retain term's targets first where there is one)")
        for _ in range(args.steps):
            lease, leased = store.lease_samples(args.samples)
            t0 = time.perf_counter()
            m = trainer.run_batch(lease, leased)
            wall = time.perf_counter() - t0
            train_s, gate_s = m["step_time_s"], m.get("gate_s", 0.0)
            print(f"step {m['step']}: train step {train_s:.2f}s | gate check {gate_s:.2f}s "
                  f"(ratio gate/train {gate_s / train_s:.2f}) | whole step {wall:.2f}s | "
                  f"{'accepted' if m.get('gate_accepted') else 'rejected'} "
                  + (f"guard {m['gate_guard_pass']:.2f} KL {m['gate_kl']:.3f}" if "gate_kl" in m
                     else "on the knowledge probes alone"))
            parts = [(label, m[f"gate_{part}_s"]) for part, label in PARTS if f"gate_{part}_s" in m]
            print("  where the check's time went: " + ", ".join(f"{label} {s:.2f}s ({s / train_s:.2f}x a step)"
                                                             for label, s in parts))
            if side is not None and side.last:
                other, same, total, agree = side.last
                what = ("without kept prompt states" if args.without_kept_states
                        else "with no answers kept yet (then the trainer's gate reading the ones it kept)"
                        if args.kept_answers
                        else "under a training step's mmap threshold" if args.step_allocator
                        else "plain gate (no knowledge probes or corrected prompts)")
                print(f"  {what}, the same candidate: {other.seconds:.2f}s (ratio to train "
                      f"{other.seconds / train_s:.2f}, to the gate's check {other.seconds / max(gate_s, 1e-9):.2f}x) "
                      f"| same decision: {agree} | same answers: {same}/{total}")
                if args.without_kept_states or args.kept_answers:
                    mine = {part: m[f"gate_{part}_s"] for part, _ in PARTS if f"gate_{part}_s" in m}
                    theirs = other.seconds_by_part
                    print("    parts without / with: " + ", ".join(
                        f"{label} {theirs[part]:.2f}s / {mine[part]:.2f}s ({theirs[part] / max(mine[part], 1e-9):.2f}x)"
                        if part in mine and part in theirs else
                        f"{label} {theirs[part]:.2f}s / none" if part in theirs else f"{label} none / {mine[part]:.2f}s"
                        for part, label in PARTS if part in mine or part in theirs)
                        + (f" | KL {other.kl:.5f} / {m['gate_kl']:.5f}" if other.kl_measured and "gate_kl" in m
                           else " | no KL measured"))
                if args.without_kept_states:
                    states = trainer.gate.prompt_states
                    print(f"    kept prompt states: {states.tokens} tokens, {states.nbytes / 2 ** 20:.1f} MiB")
        compare_batching(trainer, tokenizer, args.probe_tokens)
        trainer.close()
        store.close()


PARTS = (("reference_answers", "the reference's first answers"), ("reference_dice", "the reference's other dice"),
         ("knowledge", "knowledge probes"), ("guard", "guard probes"), ("kl", "KL forward"),
         ("preference", "preference reading"))


def plain_gate(tokenizer, config, store):
    """Shipped and recent probes only: no knowledge probes, corrected prompts or preference check."""
    from clawloop.gate.gate import PublicationGate

    return PublicationGate(tokenizer, min_guard_pass=config.gate_min_guard_pass, max_kl=config.gate_max_kl,
                           probe_tokens=config.gate_probe_tokens,
                           recent_prompts=lambda: store.recent_prompts(config.gate_recent_prompts))


def same_gate(gate, *, fresh=()):
    """A copy of ``gate`` with its own kept verdicts and prompt states (the same tokenizer and prompt sources);
    each of its attributes named in ``fresh`` is left None."""
    import copy

    shared = (gate.tokenizer, gate.preference_hint, gate.recent_prompts, gate.fixed_prompts)  # the run's, not copied
    return copy.deepcopy(gate, memo={**{id(getattr(gate, name)): None for name in fresh},
                                     **{id(x): x for x in shared}})


def cold_copy(gate):
    """A copy of ``gate`` keeping the starting weights' answers in the trainer's gate's file, which it fills
    first."""
    from clawloop.gate.kept_answers import KeptAnswers

    other = same_gate(gate, fresh=("kept_answers",))
    other.kept_answers = KeptAnswers(gate.kept_answers.path)
    return other


def without_states(gate):
    """A copy of ``gate`` that scores every prompt afresh (its own kept verdicts, the same tokenizer)."""
    return same_gate(gate, fresh=("prompt_states",))


class UnderStepAllocator:
    """A gate whose checks run under ``training_allocations`` (large tensors mapped afresh, as in a step)."""

    def __init__(self, gate):
        self.gate = gate

    def __getattr__(self, name):
        return getattr(self.gate, name)

    def check(self, candidate, reference, kl_to="reference"):
        from clawloop.memory import training_allocations

        with training_allocations():
            return self.gate.check(candidate, reference, kl_to=kl_to)


class SideBySide:
    """Stands in for the trainer's gate: checks each candidate with another gate first (timed), then with the
    trainer's own gate, whose result the trainer gets."""

    def __init__(self, gate, other):
        self.gate = gate
        self.other = other
        self.last = None

    def __getattr__(self, name):
        return getattr(self.gate, name)

    def check(self, candidate, reference, kl_to="reference"):
        other = self.other.check(candidate, reference, kl_to=kl_to)
        result = self.gate.check(candidate, reference, kl_to=kl_to)
        answers = {(p.source, p.prompt): p.answer for p in result.probes}
        common = [(answers[(p.source, p.prompt)], p.answer) for p in other.probes if (p.source, p.prompt) in answers]
        self.last = (other, sum(a == b for a, b in common), len(common), other.accepted == result.accepted)
        return result


def compare_batching(trainer, tokenizer, probe_tokens: int) -> None:
    """Greedy answers to the shipped probes plus 8 prompts of growing length, up to about 500 tokens
    (conversations, as recent prompts are), once in a single batch padded to the longest prompt and once in
    length groups (the gate's default), on the same weights, side by side."""
    from clawloop.gate.gate import length_buckets, probe_answers

    prompts = [p.ids for p in trainer.gate.shipped]
    for n in range(8):
        history = FILLER * (2 * n + 1)
        messages = [{"role": "user", "content": history}, {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": "What was agreed?"}]
        prompts.append(list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]))
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    model = trainer.models.causal_lm
    timings, outputs = {}, {}
    one_batch = lambda lengths: [list(range(len(lengths)))]  # noqa: E731
    for name, batches in (("one batch", one_batch), ("length groups", length_buckets)):
        t0 = time.perf_counter()
        outputs[name], _ = probe_answers(model, prompts, probe_tokens, eos, batches=batches)
        timings[name] = time.perf_counter() - t0
    groups = [len(g) for g in length_buckets([len(p) for p in prompts])]
    print(f"greedy answers to {len(prompts)} probes ({min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens):"
          f" one batch {timings['one batch']:.2f}s | length groups {groups} {timings['length groups']:.2f}s | "
          f"speed-up {timings['one batch'] / timings['length groups']:.2f}x | same answers: "
          f"{sum(a == b for a, b in zip(outputs['one batch'], outputs['length groups']))}/{len(prompts)}")
    compare_scoring(trainer.models, prompts, outputs["length groups"])
    if trainer.models.lora:
        compare_merged(trainer.models, prompts, probe_tokens, eos)
    compare_decoding(model, prompts, probe_tokens, eos)


def compare_scoring(models, prompts: list[list[int]], answers: list[list[int]], repeats: int = 3) -> None:
    """The reference's forward over those answers (the KL's), scoring whole sequences against scoring after kept
    prompt states (``clawloop.gate.scoring``, the default budget), alternately on the same weights; the states
    are made by a first call, timed on its own."""
    from clawloop.config import Config
    from clawloop.gate.scoring import PromptStates, answer_logprobs
    from clawloop.trainer.model import gate_reference

    states = PromptStates(Config().gate_prompt_state_tokens)
    timings: dict[str, list[float]] = {"whole": [], "kept": []}
    with gate_reference(models, None) as reference:
        t0 = time.perf_counter()
        first = answer_logprobs(reference, prompts, answers, states=states)
        first_s = time.perf_counter() - t0
        for _ in range(repeats):
            for name, kept in (("whole", None), ("kept", states)):
                t0 = time.perf_counter()
                out = answer_logprobs(reference, prompts, answers, states=kept)
                timings[name].append(time.perf_counter() - t0)
                if kept is None:
                    whole = out
    diff = max(float((a - b).abs().max()) for a, b in zip(whole, first) if a.numel())
    whole_s, kept_s = sorted(timings["whole"])[repeats // 2], sorted(timings["kept"])[repeats // 2]
    print(f"the reference's KL forward over those {len(answers)} answers ({sum(map(len, answers))} tokens): whole "
          f"sequences {whole_s:.2f}s | after kept prompt states {kept_s:.2f}s (the first call, making them, "
          f"{first_s:.2f}s; {states.tokens} tokens, {states.nbytes / 2 ** 20:.1f} MiB) | speed-up "
          f"{whole_s / kept_s:.2f}x (median of {repeats}) | largest log-probability difference {diff:.1e}")


def compare_merged(models, prompts: list[list[int]], probe_tokens: int, eos: list[int]) -> None:
    """The same greedy answers from the LoRA model as it trains (the adapter's extra matmuls in every adapted layer)
    and from the gate's view of it (``gate_candidate``: the adapter merged into the base layers for the check)."""
    from clawloop.gate.gate import probe_answers
    from clawloop.trainer.model import gate_candidate

    t0 = time.perf_counter()
    unmerged, _ = probe_answers(models.causal_lm, prompts, probe_tokens, eos)
    unmerged_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with gate_candidate(models) as candidate:
        merged, _ = probe_answers(candidate, prompts, probe_tokens, eos)
    merged_s = time.perf_counter() - t0
    print(f"greedy answers to {len(prompts)} probes, LoRA candidate: adapter unmerged {unmerged_s:.2f}s | merged for "
          f"the check {merged_s:.2f}s (merge included) | speed-up {unmerged_s / merged_s:.2f}x | same answers: "
          f"{sum(a == b for a, b in zip(unmerged, merged))}/{len(prompts)}")


def compare_decoding(model, prompts: list[list[int]], probe_tokens: int, eos: list[int]) -> None:
    """The gate's decoding (rows leave the batch as they end) against one ``generate`` call per length group, which
    decodes every row until the group's last one ends, on the same prompts and weights: once as the model answers,
    and once with three answers in four cut short (an extra end-of-turn id: a token each of those answers wrote
    early), the mix a candidate that learnt to answer briefly gives, with a few answers still long."""
    from clawloop.gate.gate import length_buckets, probe_answers

    groups = length_buckets([len(p) for p in prompts])
    for label in ("as answered", "3 in 4 cut short"):
        t0 = time.perf_counter()
        ours, _ = probe_answers(model, prompts, probe_tokens, eos)
        ours_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = {i: a for g in groups for i, a in zip(g, generate_group(model, [prompts[i] for i in g],
                                                                        probe_tokens, eos))}
        generate_s = time.perf_counter() - t0
        lengths = sorted(len(a) for a in ours)
        print(f"decoding {len(prompts)} probes {label}, answers of {lengths[0]}-{lengths[-1]} tokens (median "
              f"{lengths[len(lengths) // 2]}): rows leave as they end {ours_s:.2f}s | generate per group "
              f"{generate_s:.2f}s | speed-up {generate_s / ours_s:.2f}x | same answers: "
              f"{sum(ours[i] == theirs[i] for i in range(len(prompts)))}/{len(prompts)}")
        early = {a[min(len(a) - 1, 4)] for i, a in enumerate(ours) if a and i % 4 != 3}
        eos = eos + sorted(early - {t for a in ours[3::4] for t in a} - set(eos))


def generate_group(model, prompts: list[list[int]], max_tokens: int, eos: list[int]) -> list[list[int]]:
    """Greedy answers from one left-padded ``generate`` call: every row is decoded until the last one ends."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos[0], temperature=None, top_p=None, top_k=None)
    rows = out[:, width:].tolist()
    return [row[:next((j for j, t in enumerate(row) if t in eos), len(row))] for row in rows]

if __name__ == "__main__":
    main()
