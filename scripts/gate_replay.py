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
"""

from __future__ import annotations

import argparse
import json
import sys
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="a `clawloop eval --out` folder")
    ap.add_argument("--cells", nargs="*", help="cell folder names (default: every cell with kept versions)")
    ap.add_argument("--bar", type=float, nargs="*", default=[0.95, 0.93], help="pooled guard pass rates to try")
    args = ap.parse_args(argv)

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
    # Only the gate's per-probe verdicts are used (pooled below); its own accept/reject is not.
    gate = PublicationGate(load_tokenizer(models.model_dir), probe_tokens=64, probes=EXTRA_PROBES)
    rows = []
    for cell in cells:
        heldout = heldout_guard_by_version(cell)
        for v in list_versions(cell):
            if v == 0 or v not in heldout:
                continue
            stored = load_version(cell, v)
            load_trainable_state_dict(models, stored.weights)
            extra = gate.check(models.causal_lm, models.reference_model)
            own = [p for p in stored.meta["evidence"]["probes"] if p.get("reference_ok", True)]
            counted = [o for o in extra.probes if o.reference_ok]
            pooled = (sum(p["ok"] for p in own) + sum(o.ok for o in counted)) / (len(own) + len(counted))
            failed = [o.prompt for o in counted if not o.ok]
            rows.append((cell.name, v, heldout[v], pooled, failed))
            print(f"{cell.name} v{v}: held-out guard {heldout[v]:.2f}, pooled probes {pooled:.3f}, "
                  f"extra failed {len(failed)}/{len(counted)} ({extra.seconds:.0f}s)", flush=True)
    low = [r for r in rows if r[2] < LOW]
    print(f"\n{len(rows)} accepted versions replayed, {len(low)} below {LOW} held out")
    for bar in args.bar:
        stopped_low = sum(r[3] < bar for r in low)
        stopped_sound = sum(r[3] < bar for r in rows if r[2] >= LOW)
        print(f"pooled bar {bar}: stops {stopped_low} of {len(low)} low versions and {stopped_sound} of "
              f"{len(rows) - len(low)} sound ones")
    for name, v, h, pooled, failed in low:
        print(f"  low: {name} v{v} held-out {h:.2f} pooled {pooled:.3f} extra failed: {', '.join(failed) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
