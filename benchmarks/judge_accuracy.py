"""How often does a judge agree with hand-written labels? (evaluative vote and "is a hint expected")

    python benchmarks/judge_accuracy.py                       # the embedded default judge (frozen SmolLM2)
    python benchmarks/judge_accuracy.py --limit 24 --max-tokens 64 --votes 1
    python benchmarks/judge_accuracy.py --url http://host:8000/v1 --model Qwen/Qwen3-8B --key $KEY [--no-default]
    python benchmarks/judge_accuracy.py --rules --no-default  # the keyword judge (judge_backend = rules), instant

The labelled set (``benchmarks/data/judge_cases.jsonl``) was written for clawloop: each case has the request,
the assistant's answer (text or a tool call), the next state (user replies, tool results, or both), the expected
evaluative vote (+1 / -1 / 0) and whether a hint is expected. ``--limit N`` takes a class-balanced prefix (cases are
interleaved by (next-state role, expected vote) before cutting), so a short run still covers every class.

Each judge runs exactly as the pipeline runs it (``clawloop.judge.votes.Judge``: same prompts, m votes of each
kind, majority, hint candidates). Printed per judge: agreement of the majority vote with the label overall and per
expected class, hint agreement (a candidate was accepted iff a hint was expected) with its precision and recall,
the invalid-vote rate per kind, latency, and two trivial baselines for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clawloop.config import Config  # noqa: E402
from clawloop.judge.client import EngineJudgeClient, HTTPJudgeClient, JudgeClient  # noqa: E402
from clawloop.judge.votes import Judge, JudgeSettings  # noqa: E402
from clawloop.store import TurnRecord  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "judge_cases.jsonl"


def load_cases(path: Path) -> list[dict[str, Any]]:
    cases = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for c in cases:
        assert c["expected_vote"] in (1, -1, 0), c["id"]
        assert isinstance(c["hint_expected"], bool), c["id"]
    return cases


def balanced_order(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Round-robin over (category, expected vote) groups, so every prefix covers all classes."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for c in cases:
        groups[(c["category"], c["expected_vote"])].append(c)
    keys = sorted(groups, key=lambda k: (k[0], -k[1]))
    out: list[dict[str, Any]] = []
    while any(groups[k] for k in keys):
        for k in keys:
            if groups[k]:
                out.append(groups[k].pop(0))
    return out


def case_turn(case: dict[str, Any], index: int) -> TurnRecord:
    answer = {"role": "assistant", **case["answer"]}
    return TurnRecord(session_id=f"bench-{case['id']}", messages=case["request"], prompt_ids=[], response_ids=[0],
                      logprobs=[0.0], temperature=1.0, top_p=1.0, policy_version=0,
                      response_text=answer.get("content") or "", assistant_message=answer,
                      next_state=case["next_state"], id=index + 1)


async def run_judge(judge: Judge, cases: list[dict[str, Any]], concurrency: int,
                    progress: bool = True) -> tuple[list[dict[str, Any]], float]:
    sem = asyncio.Semaphore(concurrency)
    done = 0

    async def one(i: int, case: dict[str, Any]) -> dict[str, Any]:
        nonlocal done
        async with sem:
            out = await judge.judge(case_turn(case, i))
        done += 1
        if progress:
            print(f"\r  {done}/{len(cases)} cases", end="", file=sys.stderr, flush=True)
        return {
            "id": case["id"], "category": case["category"], "expected_vote": case["expected_vote"],
            "hint_expected": case["hint_expected"], "vote": out.reward, "candidates": out.candidates,
            "eval_scores": [v.score for v in out.eval_votes], "hint_scores": [v.score for v in out.hint_votes],
            "eval_errors": [v.error for v in out.eval_votes], "hint_errors": [v.error for v in out.hint_votes],
            "raw": [v.raw_text for v in out.eval_votes + out.hint_votes],
            "latency_s": [v.latency_s for v in out.eval_votes + out.hint_votes],
        }

    start = time.monotonic()
    results = await asyncio.gather(*(one(i, c) for i, c in enumerate(cases)))
    if progress:
        print(file=sys.stderr)
    return list(results), time.monotonic() - start


def _pct(num: int, den: int) -> str:
    return f"{100.0 * num / den:5.1f}% ({num}/{den})" if den else "   n/a"


def metrics(results: list[dict[str, Any]], wall_s: float) -> dict[str, str]:
    n = len(results)
    row: dict[str, str] = {}
    agree = sum(r["vote"] == r["expected_vote"] for r in results)
    row["eval agreement"] = _pct(agree, n)
    for cls, name in ((1, "+1"), (-1, "-1"), (0, " 0")):
        sub = [r for r in results if r["expected_vote"] == cls]
        row[f"  expected {name}"] = _pct(sum(r["vote"] == cls for r in sub), len(sub))
    for cat in ("user", "tool"):
        sub = [r for r in results if r["category"] == cat]
        row[f"  next state {cat}"] = _pct(sum(r["vote"] == r["expected_vote"] for r in sub), len(sub))
    predicted = Counter(r["vote"] for r in results)
    row["votes given +1/-1/0"] = f"{predicted[1]}/{predicted[-1]}/{predicted[0]}"
    got_hint = [bool(r["candidates"]) for r in results]
    want = [r["hint_expected"] for r in results]
    row["hint agreement"] = _pct(sum(g == w for g, w in zip(got_hint, want)), n)
    tp = sum(g and w for g, w in zip(got_hint, want))
    row["  hint precision"] = _pct(tp, sum(got_hint))
    row["  hint recall"] = _pct(tp, sum(want))
    eval_scores = [s for r in results for s in r["eval_scores"]]
    hint_scores = [s for r in results for s in r["hint_scores"]]
    row["invalid eval votes"] = _pct(sum(s is None for s in eval_scores), len(eval_scores))
    row["invalid hint votes"] = _pct(sum(s is None for s in hint_scores), len(hint_scores))
    errors = sum(bool(e) and "boxed" not in e for r in results for e in r["eval_errors"] + r["hint_errors"])
    row["transport errors"] = str(errors)
    latencies = sorted(x for r in results for x in r["latency_s"])
    row["median vote latency"] = f"{latencies[len(latencies) // 2]:.1f} s" if latencies else "n/a"
    row["wall time"] = f"{wall_s:.0f} s"
    return row


def baselines(cases: list[dict[str, Any]]) -> dict[str, str]:
    n = len(cases)
    return {
        "always +1 (eval agreement)": _pct(sum(c["expected_vote"] == 1 for c in cases), n),
        "always 0 (eval agreement)": _pct(sum(c["expected_vote"] == 0 for c in cases), n),
        "never a hint (hint agreement)": _pct(sum(not c["hint_expected"] for c in cases), n),
    }


def print_table(columns: dict[str, dict[str, str]], title: str) -> None:
    names = list(columns)
    rows = list(next(iter(columns.values())))
    width0 = max(len(r) for r in rows) + 2
    widths = [max(len(name), *(len(columns[name][r]) for r in rows)) + 2 for name in names]
    print(title)
    print("".ljust(width0) + "".join(name.rjust(w) for name, w in zip(names, widths)))
    for r in rows:
        print(r.ljust(width0) + "".join(columns[name][r].rjust(w) for name, w in zip(names, widths)))


def default_client(config: Config, timeout_s: float) -> tuple[JudgeClient, Any]:
    """The embedded judge: the frozen base model on an in-process engine, rendered like serving."""
    from clawloop.engines import model_files
    from clawloop.engines.hf import HFEngine
    from clawloop.pipeline import chat_render_fn

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

            results, wall_s = await run_judge(RuleJudge(settings), cases, args.case_concurrency, progress=False)
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
            results, wall_s = await run_judge(Judge(client, settings), cases, args.case_concurrency)
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
