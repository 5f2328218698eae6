"""Replay a comparison's kept versions: does the hint's own judgement of the gate's answers follow the held-out score?

    python scripts/preference_replay.py results/eval-final [--cells hybrid-brief-s2 opd-brief-s2 ...] [--without-end]

In the comparison before the gate's preference check, some accepted versions unlearnt part of the preference
(README, "Method comparison"). This asks, offline, whether the signal that check now reads
(``clawloop.gate.preference``) would have seen it, and how much it moves between versions that kept their score
(which sets the check's margin). For an answer y to a probe x:

    R(y) = log π_ref(y | x ⊕ h) − log π_ref(y | x)      (summed over the answer's tokens, its end token included)

with π_ref the starting weights and h the run's most frequent selected hint (the hint's implicit reward: how much
more likely the hint makes that answer). For each accepted version v2, v3, … of a cell that still has its
``versions/`` and store (they stay local; only ``result.json`` is committed), it takes the guard probes on which
the version's own gate evidence also records the last accepted version's answer (the shipped and corrected
probes), and prints the mean R of the new version's answers against the last accepted one's, beside the
held-out scores both were measured at when served, and the same means per answer token (what the gate's check
compares; ``clawloop.gate.preference``). Answers are read from the evidence as text and tokenised again, which may
differ from the ids the gate decoded by a token here and there; an answer shorter than the gate's cap is taken to
have ended, so its end token is scored, as the gate's check reads it; ``--without-end`` leaves it out, as the check
read answers before it compared them per token. One thread; a few seconds a version on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="A comparison folder (holding cells/).")
    parser.add_argument("--cells", nargs="*", default=None, help="Cell folder names (default: every cell).")
    parser.add_argument("--without-end", action="store_true",
                        help="Score the answers without their end token, as the gate's check read them before it "
                             "compared rewards per token.")
    args = parser.parse_args(argv)

    import torch

    from clawloop.engines.model_files import default_model_dir, load_model, load_tokenizer, turn_end_token_id
    from clawloop.gate.preference import implicit_rewards, per_token
    from clawloop.renderers.chat import ChatRenderer
    from clawloop.teacher import inject_hint

    torch.set_num_threads(1)
    model_dir = default_model_dir()
    tokenizer, model = load_tokenizer(model_dir), load_model(model_dir).eval()
    end_id = turn_end_token_id(tokenizer)

    renderer = ChatRenderer(tokenizer)  # as the server renders a request (and the teacher a hinted one)

    def render(messages: list[dict]) -> list[int]:
        return list(renderer.render(messages).ids)

    def answer_ids(text: str, cap: int) -> list[int]:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return ids + [end_id] if len(ids) < cap and not args.without_end else ids

    cells = sorted(Path(args.out, "cells").iterdir()) if args.cells is None else [
        Path(args.out, "cells", name) for name in args.cells]
    print("| cell | version | held-out score, last accepted → this | probes | mean R, last accepted → this | "
          "this one's R higher on | mean R per token, last accepted → this | drop per token |")
    print("|---|---|---|---|---|---|---|---|")
    for cell in cells:
        store, versions = cell / "store.sqlite", cell / "versions"
        if not (store.exists() and versions.exists() and (cell / "result.json").exists()):
            print(f"{cell.name}: no kept store or versions, skipped", file=sys.stderr)
            continue
        db = sqlite3.connect(f"file:{store}?mode=ro", uri=True)
        selected = [json.loads(h)[0] for (h,) in db.execute(
            "SELECT hints FROM samples WHERE hints != '[]' ORDER BY turn_id")]
        if not selected:
            print(f"{cell.name}: no hinted sample (an rl cell), skipped", file=sys.stderr)
            continue
        hint = collections.Counter(selected).most_common(1)[0][0]
        scores = {c["policy_version"]: c["score"] for c in json.loads((cell / "result.json").read_text())["curve"]}
        for folder in sorted(versions.glob("v*"), key=lambda p: int(p.name[1:])):
            version = int(folder.name[1:])
            evidence = json.loads((folder / "version.json").read_text()).get("evidence") or {}
            cap = int(evidence.get("thresholds", {}).get("probe_tokens", 64))
            probes = [p for p in evidence.get("probes", [])
                      if p["source"] != "knowledge" and p.get("accepted_answer") is not None]
            if version < 2 or not probes:
                continue
            plain, hinted, mine, theirs = [], [], [], []
            for p in probes:
                if p["source"] == "shipped":
                    messages = [{"role": "user", "content": p["prompt"]}]
                else:
                    turn_id = int(p["source"].split(":", 1)[1])
                    messages = json.loads(db.execute("SELECT messages FROM turns WHERE id = ?",
                                                     (turn_id,)).fetchone()[0])
                plain.append(render(messages))
                hinted.append(render(inject_hint(messages, hint)))
                mine.append(answer_ids(p["answer"], cap))
                theirs.append(answer_ids(p["accepted_answer"], cap))
            r_mine = implicit_rewards(model, plain, hinted, mine)
            r_theirs = implicit_rewards(model, plain, hinted, theirs)
            higher = sum(a > b for a, b in zip(r_mine, r_theirs))
            t_mine = statistics.mean(per_token(r, len(a)) for r, a in zip(r_mine, mine))
            t_theirs = statistics.mean(per_token(r, len(a)) for r, a in zip(r_theirs, theirs))
            print(f"| {cell.name} | v{version} | {scores.get(version - 1, float('nan')):.2f} → "
                  f"{scores.get(version, float('nan')):.2f} | {len(probes)} | {statistics.mean(r_theirs):.2f} → "
                  f"{statistics.mean(r_mine):.2f} | {higher} of {len(probes)} | {t_theirs:.3f} → {t_mine:.3f} | "
                  f"{t_theirs - t_mine:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
