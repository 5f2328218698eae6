"""Replay a comparison's kept versions through the publication gate with extra probes, offline.

    python scripts/gate_replay.py results/eval-gate [--cells hybrid-brief-s0 ...] [--bar 0.95]

Asks: had the gate also asked these questions, which accepted versions would it have stopped, and were those
the ones that measured below 0.9 on the held-out set? For every cell folder that still has its ``versions/``
(they stay local; only ``result.json`` is committed), each accepted version v1, v2, … is loaded into the run's
model and checked by a ``PublicationGate`` whose shipped probes are ``EXTRA_PROBES`` (the reference's verdicts
are computed once, as in a run). The version's own gate evidence gives its original probes' verdicts; pooled
with the extra ones at ``--bar``, that is the decision a gate with both probe sets would have made. The held-out
guard rate of a version is the one its cell's ``result.json`` recorded when it was served.

Prints, per threshold, how many low (held-out guard < 0.9) and sound versions the larger probe set stops, then
each low version with the extra probes it failed. One thread; about 10–20 s a version on a 2-core CPU.

    python scripts/gate_replay.py OUT --sampled 2

asks instead whether answers sampled the way users get them would: every shipped probe is answered ``--sampled``
times at the serving temperature by the version and by the starting weights, with the same dice
(``clawloop.gate.generation.sampling_uniforms``), and a sampled answer counts where the starting weights' answer
with those dice is sound, as the gate counts a greedy probe. Pooled with the version's own greedy evidence, that is
the decision a gate that also sampled would have made. Beside it, the guard pass rate of the answers the version
actually served in the run (from the store: what its users received).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path

EXTRA_PROBES = (
    # The kinds of question the grid's low versions failed held out: short definitions and "why" questions
    # (none of them is a simulation question or a shipped probe; checked at start).
    "What is a pebble?", "What is a canoe?", "What is a ladder?", "What is a violin?", "What is a tornado?",
    "What is a cactus?", "What is a wheel?", "What is paper made of?", "What is glass made of?",
    "Why do birds migrate?", "Why do cats purr?", "Why do we need sleep?", "Why does the wind blow?",
    "Why do dogs bark?", "Why do we yawn?", "Why does bread rise?",
)
LOW = 0.9


def heldout_guard_by_version(cell: Path) -> dict[int, float]:
    """Each served version's held-out guard rate, as the cell's result recorded it (its lowest scoring)."""
    served = json.loads((cell / "result.json").read_text()).get("served_guard") or {}
    return {int(v): float(g) for v, g in (served.get("by_version") or {}).items()}


def served_guard_by_version(cell: Path) -> dict[int, tuple[int, int]]:
    """Per version, how many of the answers it served in the run pass the guard (with the question rules where the
    user's message asks a question, as for the gate's recent prompts), and how many it served: what its users
    received, sampled. The answers to the simulated user's closing message (one token by design, never judged:
    ``no_next_state``) are left out."""
    from clawloop.gate.gate import question_of
    from clawloop.gate.guard import passes_guard

    if not (cell / "store.sqlite").is_file():
        return {}
    out: dict[int, list[int]] = {}
    with sqlite3.connect(f"file:{cell / 'store.sqlite'}?mode=ro", uri=True) as db:
        for version, messages, text in db.execute(
                "SELECT policy_version, messages, response_text FROM turns WHERE response_text IS NOT NULL "
                "AND reason IS NOT 'no_next_state'"):
            counts = out.setdefault(int(version), [0, 0])
            counts[0] += passes_guard(text, question=question_of(json.loads(messages)))
            counts[1] += 1
    return {v: (ok, n) for v, (ok, n) in out.items()}


class SampledProbes:
    """The shipped probes answered ``samples`` times each at ``temperature``, every answer with its own dice; the
    starting weights' verdicts with the same dice say which answers count (``answer_with_reference`` first)."""

    def __init__(self, tokenizer, probes, samples: int, temperature: float, tokens: int = 64):
        from clawloop.engines.model_files import end_token_ids

        self.tokenizer, self.tokens, self.temperature = tokenizer, tokens, temperature
        self.eos = end_token_ids(tokenizer)
        self.rows = [(q, i) for q in probes for i in range(samples)]
        self.counted: list[bool] = []

    def _answers(self, model) -> list[str]:
        from clawloop.gate.generation import probe_answers, sampling_uniforms

        prompts = [list(self.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                           add_generation_prompt=True, return_dict=True
                                                           )["input_ids"]) for q, _ in self.rows]
        dice = [sampling_uniforms(f"replay:{q}", i, self.tokens) for q, i in self.rows]
        answers, _ = probe_answers(model, prompts, self.tokens, self.eos, uniforms=dice,
                                   temperature=self.temperature)
        return [self.tokenizer.decode(a, skip_special_tokens=True) for a in answers]

    def _sound(self, model) -> list[bool]:
        from clawloop.gate.guard import passes_guard

        return [passes_guard(text, question=q) for (q, _), text in zip(self.rows, self._answers(model))]

    def answer_with_reference(self, reference) -> None:
        self.counted = self._sound(reference)
        print(f"starting weights: {sum(self.counted)} of {len(self.counted)} sampled answers sound", flush=True)

    def verdicts(self, model) -> list[tuple[str, bool]]:
        return [(q, ok) for (q, _), ok, counts in zip(self.rows, self._sound(model), self.counted) if counts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a `clawloop eval --out` folder")
    ap.add_argument("--cells", nargs="*", help="cell folder names (default: every cell with kept versions)")
    ap.add_argument("--bar", type=float, nargs="*", default=[0.95, 0.93], help="pooled guard pass rates to try")
    ap.add_argument("--sampled", type=int, default=0, metavar="N",
                    help="instead of the extra probes, answer the shipped probes N times each at the serving "
                         "temperature (the version and the starting weights with the same dice)")
    args = ap.parse_args(argv)
    if args.sampled < 0:
        ap.error("--sampled must be >= 0")

    import torch

    from clawloop.gate.gate import PublicationGate
    from clawloop.gate.probes import PROBES
    from clawloop.sim.data.questions import POOLS
    from clawloop.sim.demo import demo_config
    from clawloop.engines.model_files import load_tokenizer
    from clawloop.trainer.model import load_train_models, load_trainable_state_dict
    from clawloop.trainer.versions import list_versions, load_version

    asked = set(PROBES) | {q for pool in POOLS.values() for part in pool.values() for q in part}
    if clash := sorted(set(EXTRA_PROBES) & asked):
        print(f"extra probes already asked elsewhere: {clash}", file=sys.stderr)
        return 2
    cells = [args.out / "cells" / c for c in args.cells] if args.cells else sorted(
        p for p in (args.out / "cells").iterdir() if (p / "versions").is_dir())
    torch.set_num_threads(1)
    models = load_train_models(demo_config())  # the comparison's model and LoRA shape: the demo preset
    tokenizer = load_tokenizer(models.model_dir)
    gate, sampler = None, None
    if args.sampled:
        sampler = SampledProbes(tokenizer, PROBES, args.sampled, demo_config().default_temperature)
        with models.reference_model() as reference:  # the starting weights (LoRA: the adapter switched off)
            sampler.answer_with_reference(reference)
    else:  # only the gate's per-probe verdicts are used (pooled below); its own accept/reject is not
        gate = PublicationGate(tokenizer, probe_tokens=64, probes=EXTRA_PROBES)
    rows = []
    for cell in cells:
        heldout = heldout_guard_by_version(cell)
        served = served_guard_by_version(cell)
        for v in list_versions(cell):
            if v == 0 or v not in heldout:
                continue
            stored = load_version(cell, v)
            load_trainable_state_dict(models, stored.weights)
            started = time.monotonic()
            if sampler is not None:
                verdicts = sampler.verdicts(models.causal_lm)
            else:
                assert gate is not None
                extra = gate.check(models.causal_lm, models.reference_model)
                verdicts = [(o.prompt, o.ok) for o in extra.probes if o.reference_ok]
            own = [p for p in stored.meta["evidence"]["probes"] if p.get("reference_ok", True)]
            pooled = (sum(p["ok"] for p in own) + sum(ok for _, ok in verdicts)) / (len(own) + len(verdicts))
            failed = [prompt for prompt, ok in verdicts if not ok]
            rows.append((cell.name, v, heldout[v], pooled, failed))
            users = served.get(v)
            print(f"{cell.name} v{v}: held-out guard {heldout[v]:.2f}, served answers sound "
                  f"{'-' if users is None else f'{users[0]}/{users[1]}'}, pooled probes {pooled:.3f}, "
                  f"{'sampled' if sampler else 'extra'} failed {len(failed)}/{len(verdicts)} "
                  f"({time.monotonic() - started:.0f}s)", flush=True)
    low = [r for r in rows if r[2] < LOW]
    print(f"\n{len(rows)} accepted versions replayed, {len(low)} below {LOW} held out")
    for bar in args.bar:
        stopped_low = sum(r[3] < bar for r in low)
        stopped_sound = sum(r[3] < bar for r in rows if r[2] >= LOW)
        print(f"pooled bar {bar}: stops {stopped_low} of {len(low)} low versions and {stopped_sound} of "
              f"{len(rows) - len(low)} sound ones")
    for name, v, h, pooled, failed in low:
        print(f"  low: {name} v{v} held-out {h:.2f} pooled {pooled:.3f} failed: {', '.join(failed) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
