"""How often does a judge agree with hand-written labels? (evaluative vote and "is a hint expected")

    python benchmarks/judge_accuracy.py                       # the embedded default judge (frozen SmolLM2)
    python benchmarks/judge_accuracy.py --limit 24 --max-tokens 64 --votes 1
    python benchmarks/judge_accuracy.py --url http://host:8000/v1 --model Qwen/Qwen3-8B --key $KEY [--no-default]
    python benchmarks/judge_accuracy.py --rules --no-default  # the keyword judge (judge_backend = rules), instant

The labelled set and the scoring live in the package (``clawloop.judge.check``, the code behind
``clawloop judge check``, which checks one judge the way ``clawloop serve`` would build it); this script puts
several judges side by side. ``--limit N`` takes a class-balanced prefix, so a short run still covers every class.

Each judge runs exactly as the pipeline runs it (``clawloop.judge.votes.Judge``: same prompts, m votes of each
kind, majority, hint candidates). Printed per judge: agreement of the majority vote with the label overall and per
expected class, hint agreement (a candidate was accepted iff a hint was expected) with its precision and recall,
the invalid-vote rate per kind, latency p50/p95, and trivial baselines for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clawloop.config import Config  # noqa: E402
from clawloop.judge.check import (balanced_order, baselines, default_cases_path, load_cases,  # noqa: E402,F401
                                  metrics, print_table, run_judge)
from clawloop.judge.client import EngineJudgeClient, HTTPJudgeClient, JudgeClient  # noqa: E402
from clawloop.judge.votes import Judge, JudgeSettings  # noqa: E402

DATA = default_cases_path()


def default_client(config: Config, timeout_s: float) -> tuple[JudgeClient, Any]:
    """The embedded judge: the frozen base model on an in-process engine, rendered like serving."""
    from clawloop.engines import model_files
    from clawloop.engines.hf import HFEngine
    from clawloop.renderers import chat_render_fn

    path = model_files.resolve_model(config.model)
    tokenizer = model_files.load_tokenizer(path)
    engine = HFEngine(path, tokenizer, device=config.device, dtype=config.dtype,
                      max_batch_size=config.max_batch_size, num_threads=config.num_threads)
    render = chat_render_fn(tokenizer)
    client = EngineJudgeClient(engine, lambda messages: render(messages, None), timeout_s=timeout_s,
                               concurrency=config.max_batch_size)
    return client, engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--limit", type=int, default=0, help="Use a class-balanced subset of this many cases.")
    ap.add_argument("--url", default="", help="An OpenAI-compatible judge endpoint (…/v1) to compare.")
    ap.add_argument("--model", default="", help="Model name at --url (default: its first model).")
    ap.add_argument("--key", default="", help="Bearer key for --url.")
    ap.add_argument("--no-default", action="store_true", help="Skip the embedded default judge.")
    ap.add_argument("--rules", action="store_true", help="Also score the keyword judge (judge_backend = rules).")
    ap.add_argument("--default-model", default="default", help="Model of the embedded judge (default, tiny, or a "
                    "local folder).")
    ap.add_argument("--votes", type=int, default=None, help="Votes of each kind (default: config prm_m).")
    ap.add_argument("--max-tokens", type=int, default=None, help="Judge max tokens (default: config).")
    ap.add_argument("--temperature", type=float, default=None, help="Judge temperature (default: config).")
    ap.add_argument("--judge-context", choices=("none", "last_user", "full"), default=None)
    ap.add_argument("--timeout", type=float, default=None, help="Time limit of one judge call (s).")
    ap.add_argument("--case-concurrency", type=int, default=4, help="Cases judged at once.")
    ap.add_argument("--threads", type=int, default=0, help="Torch threads of the embedded engine (0 = all).")
    ap.add_argument("--details", type=Path, default=None, help="Write per-case results (JSONL) here.")
    args = ap.parse_args(argv)

    overrides: dict[str, Any] = {"model": args.default_model, "num_threads": args.threads}
    for name, value in (("prm_m", args.votes), ("judge_max_tokens", args.max_tokens),
                        ("judge_temperature", args.temperature), ("judge_context", args.judge_context),
                        ("judge_timeout_s", args.timeout)):
        if value is not None:
            overrides[name] = value
    config = Config().replace(**overrides)
    settings = JudgeSettings.from_config(config)

    cases = balanced_order(load_cases(args.data))
    if args.limit:
        cases = cases[: args.limit]
    print(f"{len(cases)} cases; votes m={settings.votes_m}, max_tokens={settings.max_tokens}, "
          f"temperature={settings.temperature}, judge_context={settings.judge_context}", flush=True)

    columns: dict[str, dict[str, str]] = {}
    details: list[dict[str, Any]] = []

    async def run_all() -> None:
        if args.rules:
            from clawloop.judge.rules import RuleJudge

            results, wall_s = await run_judge(RuleJudge(settings), cases, args.case_concurrency)
            columns["rules"] = metrics(results, wall_s)
            details.extend({"judge": "rules", **r} for r in results)
        judges: list[tuple[str, JudgeClient, Any]] = []
        if not args.no_default:
            client, engine = default_client(config, config.judge_timeout_s)
            judges.append((f"embedded {args.default_model}", client, engine))
        if args.url:
            client = HTTPJudgeClient(args.url, args.model, args.key, timeout_s=config.judge_timeout_s,
                                     retries=config.judge_retries, concurrency=config.judge_concurrency)
            judges.append((args.model or args.url, client, None))
        for name, client, engine in judges:
            print(f"judging with {name} ...", file=sys.stderr, flush=True)
            results, wall_s = await run_judge(Judge(client, settings), cases, args.case_concurrency,
                                              progress=sys.stderr)
            columns[name] = metrics(results, wall_s)
            details.extend({"judge": name, **r} for r in results)
            await client.close()
            if engine is not None:
                await engine.close()

    if args.no_default and not args.url and not args.rules:
        print("nothing to run: --no-default without --url or --rules", file=sys.stderr)
        return 2
    asyncio.run(run_all())
    print()
    print_table(columns, "Judge agreement with the labels")
    print()
    for name, value in baselines(cases).items():
        print(f"baseline {name}: {value}")
    if args.details:
        args.details.parent.mkdir(parents=True, exist_ok=True)
        with args.details.open("w", encoding="utf-8") as f:
            for d in details:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        print(f"per-case results: {args.details}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
