"""``clawloop judge check``: score a judge on hand-labelled cases before trusting it with training.

The labelled set (``clawloop/judge/data/judge_cases.jsonl``, shipped with the package) was written for clawloop:
each case has the request, the assistant's answer (text or a tool call), the next state (user replies, tool
results, or both), the expected evaluative vote (+1 / -1 / 0) and whether a hint is expected. ``limit`` takes a
class-balanced prefix (cases are interleaved by (next-state role, expected vote) before cutting), so a short run
still covers every class.

Each judge runs exactly as the pipeline runs it (same prompts, m votes of each kind, majority, hint candidates).
``metrics`` gives the agreement of the majority vote with the label overall and per class, hint agreement (a
candidate was accepted iff a hint was expected) with its precision and recall, the invalid-vote rate per kind, and
vote latency (p50/p95). ``benchmarks/judge_accuracy.py`` compares several judges side by side with the same code.
An HTTP judge gets start-up's endpoint check first (``endpoint_check``): a wrong key or path stops the command.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

from clawloop.judge.describe import judge_backend
from clawloop.judge.endpoint_check import check_judge_endpoint
from clawloop.judge.factory import build_judge, configured_turn_deadline_s, load_base_engine
from clawloop.renderers import chat_render_fn
from clawloop.store import TurnRecord

CASES_RESOURCE = "data/judge_cases.jsonl"


def default_cases_path() -> Path:
    return Path(str(resources.files("clawloop.judge").joinpath(CASES_RESOURCE)))


def load_cases(path: Path | None = None) -> list[dict[str, Any]]:
    """The labelled cases (the packaged set when ``path`` is None); each is checked for its two labels."""
    text = (path or default_cases_path()).read_text(encoding="utf-8")
    cases = [json.loads(line) for line in text.splitlines() if line.strip()]
    for c in cases:
        if c.get("expected_vote") not in (1, -1, 0) or not isinstance(c.get("hint_expected"), bool):
            raise ValueError(f"case {c.get('id')!r}: expected_vote must be 1, -1 or 0 and hint_expected a bool")
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
    return TurnRecord(session_id=f"check-{case['id']}", messages=case["request"], prompt_ids=[], response_ids=[0],
                      logprobs=[0.0], temperature=1.0, top_p=1.0, policy_version=0,
                      response_text=answer.get("content") or "", assistant_message=answer,
                      next_state=case["next_state"], id=index + 1)


async def run_judge(judge: Any, cases: list[dict[str, Any]], concurrency: int = 4, deadline_s: float | None = None,
                    progress: TextIO | None = None) -> tuple[list[dict[str, Any]], float]:
    """Judge every case (``concurrency`` at a time); per-case results and the wall time."""
    sem = asyncio.Semaphore(max(1, concurrency))
    done = 0

    async def one(i: int, case: dict[str, Any]) -> dict[str, Any]:
        nonlocal done
        async with sem:
            out = await judge.judge(case_turn(case, i), deadline_s=deadline_s)
        done += 1
        if progress is not None:
            print(f"\r  {done}/{len(cases)} cases", end="", file=progress, flush=True)
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
    if progress is not None:
        print(file=progress)
    return list(results), time.monotonic() - start


def pct(num: int, den: int) -> str:
    return f"{100.0 * num / den:5.1f}% ({num}/{den})" if den else "   n/a"


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))]


def summary(results: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """The headline numbers as plain values (what ``--json`` prints and tests read)."""
    n = len(results)
    eval_scores = [s for r in results for s in r["eval_scores"]]
    hint_scores = [s for r in results for s in r["hint_scores"]]
    all_scores = eval_scores + hint_scores
    latencies = [x for r in results for x in r["latency_s"]]
    return {
        "cases": n,
        "eval_agreement": sum(r["vote"] == r["expected_vote"] for r in results) / n if n else None,
        "hint_agreement": sum(bool(r["candidates"]) == r["hint_expected"] for r in results) / n if n else None,
        "invalid_vote_rate": sum(s is None for s in all_scores) / len(all_scores) if all_scores else None,
        "latency_p50_s": quantile(latencies, 0.5),
        "latency_p95_s": quantile(latencies, 0.95),
        "wall_s": wall_s,
    }


def metrics(results: list[dict[str, Any]], wall_s: float) -> dict[str, str]:
    """Every number of one judge, formatted for a table column."""
    n = len(results)
    row: dict[str, str] = {}
    row["eval agreement"] = pct(sum(r["vote"] == r["expected_vote"] for r in results), n)
    for cls, name in ((1, "+1"), (-1, "-1"), (0, " 0")):
        sub = [r for r in results if r["expected_vote"] == cls]
        row[f"  expected {name}"] = pct(sum(r["vote"] == cls for r in sub), len(sub))
    for cat in ("user", "tool"):
        sub = [r for r in results if r["category"] == cat]
        row[f"  next state {cat}"] = pct(sum(r["vote"] == r["expected_vote"] for r in sub), len(sub))
    predicted = Counter(r["vote"] for r in results)
    row["votes given +1/-1/0"] = f"{predicted[1]}/{predicted[-1]}/{predicted[0]}"
    got_hint = [bool(r["candidates"]) for r in results]
    want = [r["hint_expected"] for r in results]
    row["hint agreement"] = pct(sum(g == w for g, w in zip(got_hint, want)), n)
    tp = sum(g and w for g, w in zip(got_hint, want))
    row["  hint precision"] = pct(tp, sum(got_hint))
    row["  hint recall"] = pct(tp, sum(want))
    eval_scores = [s for r in results for s in r["eval_scores"]]
    hint_scores = [s for r in results for s in r["hint_scores"]]
    row["invalid votes"] = pct(sum(s is None for s in eval_scores + hint_scores), len(eval_scores + hint_scores))
    row["  invalid eval votes"] = pct(sum(s is None for s in eval_scores), len(eval_scores))
    row["  invalid hint votes"] = pct(sum(s is None for s in hint_scores), len(hint_scores))
    errors = sum(bool(e) and "boxed" not in e for r in results for e in r["eval_errors"] + r["hint_errors"])
    row["transport errors"] = str(errors)
    head = summary(results, wall_s)
    for key, name in (("latency_p50_s", "vote latency p50"), ("latency_p95_s", "vote latency p95")):
        value = head[key]
        row[name] = "n/a" if value is None else (f"{value * 1000:.2f} ms" if value < 1 else f"{value:.2f} s")
    row["wall time"] = f"{wall_s:.0f} s"
    return row


def baselines(cases: list[dict[str, Any]]) -> dict[str, str]:
    n = len(cases)
    return {
        "always +1 (eval agreement)": pct(sum(c["expected_vote"] == 1 for c in cases), n),
        "always 0 (eval agreement)": pct(sum(c["expected_vote"] == 0 for c in cases), n),
        "never a hint (hint agreement)": pct(sum(not c["hint_expected"] for c in cases), n),
    }


def print_table(columns: dict[str, dict[str, str]], title: str, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    names = list(columns)
    rows = list(next(iter(columns.values())))
    width0 = max(len(r) for r in rows) + 2
    widths = [max(len(name), *(len(columns[name][r]) for r in rows)) + 2 for name in names]
    print(title, file=out)
    print("".ljust(width0) + "".join(name.rjust(w) for name, w in zip(names, widths)), file=out)
    for r in rows:
        print(r.ljust(width0) + "".join(columns[name][r].rjust(w) for name, w in zip(names, widths)), file=out)


def verdict(head: dict[str, Any], min_agreement: float = 0.8, max_invalid: float = 0.1) -> str:
    """One line saying whether the numbers are good enough to train on (thresholds are advice, not rules)."""
    problems = []
    if head["eval_agreement"] is not None and head["eval_agreement"] < min_agreement:
        problems.append(f"evaluative agreement {head['eval_agreement']:.0%} < {min_agreement:.0%}")
    if head["invalid_vote_rate"] is not None and head["invalid_vote_rate"] > max_invalid:
        problems.append(f"invalid votes {head['invalid_vote_rate']:.0%} > {max_invalid:.0%}")
    if problems:
        return "NOT RECOMMENDED for training: " + "; ".join(problems) + "."
    return "usable: agreement and invalid-vote rate are within the recommended bounds."


# ---- the command ---------------------------------------------------------------------------------------------


async def check_config(config: Any, cases: list[dict[str, Any]], *, case_concurrency: int = 4,
                       progress: TextIO | None = None) -> tuple[str, list[dict[str, Any]], float]:
    """Build the judge ``config`` selects (as ``clawloop serve`` would), score it on ``cases`` and release it.
    Returns (judge name, per-case results, wall time)."""
    backend = judge_backend(config)
    engine = None
    if backend == "engine":
        engine = load_base_engine(config)
        judge = build_judge(config, base_engine=engine, render=chat_render_fn(engine.tokenizer))
        name = f"engine ({config.model})"
    else:
        judge = build_judge(config)
        name = "rules" if backend == "rules" else f"http ({config.judge_model or config.judge_url})"
    try:
        results, wall_s = await run_judge(judge, cases, case_concurrency, deadline_s=configured_turn_deadline_s(config),
                                          progress=progress)
    finally:
        await judge.client.close()
        if engine is not None:
            await engine.close()
    return name, results, wall_s


def run_command(config: Any, *, cases_path: Path | None = None, limit: int = 0, case_concurrency: int = 4,
                details: Path | None = None, as_json: bool = False, out: TextIO | None = None) -> int:
    """``clawloop judge check``: print the table (or JSON) for the judge ``config`` selects."""
    out = out or sys.stdout
    if judge_backend(config) == "http":  # a wrong key or path: one clear error, not every case failing
        check_judge_endpoint(config)
    cases = balanced_order(load_cases(cases_path))
    if limit:
        cases = cases[:limit]
    if not as_json:
        print(f"{len(cases)} labelled cases; votes m={config.prm_m}, max_tokens={config.judge_max_tokens}, "
              f"temperature={config.judge_temperature}, judge_context={config.judge_context}", file=out, flush=True)
    progress = sys.stderr if sys.stderr.isatty() and not as_json else None
    name, results, wall_s = asyncio.run(check_config(config, cases, case_concurrency=case_concurrency,
                                                     progress=progress))
    head = summary(results, wall_s)
    if details is not None:
        details.parent.mkdir(parents=True, exist_ok=True)
        with details.open("w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps({"judge": name, **r}, ensure_ascii=False) + "\n")
    if as_json:
        print(json.dumps({"judge": name, **head}), file=out)
        return 0
    print(file=out)
    print_table({name: metrics(results, wall_s)}, "Judge agreement with the labels", out=out)
    print(file=out)
    for label, value in baselines(cases).items():
        print(f"baseline {label}: {value}", file=out)
    print(f"\n{name}: {verdict(head)}", file=out)
    if details is not None:
        print(f"per-case results: {details}", file=out)
    return 0
