"""Can the served model follow each persona's preference when told? (``python -m clawloop.sim.probe``)

For every persona, the held-out questions are answered greedily twice through the HTTP API: as asked, and
with the preference appended the way a hindsight hint is injected (``Persona.instruct``). A persona is worth
a learning demo when the instructed score is clearly above the plain one: the hint-conditioned teacher can
then show the policy something it does not do yet. Prints one table row per persona.

Without ``--base-url`` it starts a server on ``--model`` (the default SmolLM2-135M-Instruct) in a temporary
run folder with training off. This is a manual check, not a test: on a 2-core CPU it takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from typing import Any

from clawloop.sim.driver import evaluate
from clawloop.sim.persona_file import load_persona_file
from clawloop.sim.personas import PERSONAS, Persona, get_persona


def probe(base_url: str, personas: list[Persona], n: int, max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    rows = []
    for persona in personas:
        questions = persona.heldout_questions[:n]
        row: dict[str, Any] = {"persona": persona.name, "n": len(questions)}
        for instruct in (False, True):
            result = evaluate(base_url, persona, questions, max_tokens=max_tokens, instruct=instruct,
                              concurrency=concurrency)
            key = "with" if instruct else "without"
            row[key] = result.summary()
            row[key + "_items"] = [vars(i) for i in result.items]
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(row: dict[str, Any]) -> str:
    w, wo = row["with"], row["without"]
    return (f"| {row['persona']:<8} | {wo['score']:.2f} (guard {wo['guard_pass_rate']:.2f}) "
            f"| {w['score']:.2f} (guard {w['guard_pass_rate']:.2f}) | {row['n']} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="", help="a running clawloop (or any OpenAI-compatible) server")
    ap.add_argument("--model", default="default", help="model to serve when no --base-url is given")
    ap.add_argument("--personas", default=",".join(PERSONAS))
    ap.add_argument("--persona-file", action="append", default=[], metavar="FILE",
                    help="also probe the persona a TOML or JSON file defines (may be repeated)")
    ap.add_argument("-n", type=int, default=12, help="held-out questions per persona")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the started server")
    ap.add_argument("--json", default="", help="also write every answer to this file")
    args = ap.parse_args(argv)
    personas = [get_persona(x) for x in args.personas.split(",") if x]
    personas += [load_persona_file(path) for path in args.persona_file]
    print("| persona  | plain score | instructed score | n |\n|---|---|---|---|", flush=True)
    if args.base_url:
        rows = probe(args.base_url, personas, args.n, args.max_tokens, args.concurrency)
    else:
        from clawloop.config import Config
        from clawloop.serve import Server

        with tempfile.TemporaryDirectory(prefix="clawloop-probe-") as run_dir:
            config = Config.load(env={}, model=args.model, port=0, run_dir=run_dir, train=False,
                                 num_threads=args.threads, max_batch_size=max(1, args.concurrency))
            with Server(config) as server:
                rows = probe(server.base_url, personas, args.n, args.max_tokens, args.concurrency)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
