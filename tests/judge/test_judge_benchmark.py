"""The judge benchmark's labelled set and its scoring, against a local endpoint that knows the answers."""

import importlib.util
import json
from pathlib import Path

from clawloop.judge.prompts import flatten_messages
from clawloop.judge.scripted import ScriptedJudgeServer, last_user_text

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("judge_accuracy", ROOT / "benchmarks" / "judge_accuracy.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_labelled_set_is_big_and_balanced():
    cases = bench.load_cases(bench.DATA)
    assert len(cases) >= 60 and len({c["id"] for c in cases}) == len(cases)
    kinds = {(c["category"], c["expected_vote"]) for c in cases}
    assert kinds == {(cat, v) for cat in ("user", "tool") for v in (1, -1, 0)}
    assert sum(c["hint_expected"] for c in cases) >= 15
    # a short prefix of the balanced order covers every class
    assert {(c["category"], c["expected_vote"]) for c in bench.balanced_order(cases)[:6]} == kinds


def oracle(cases):
    by_next_state = {flatten_messages(c["next_state"]): c for c in cases}

    def respond(body):
        text = last_user_text(body)
        case = next(c for key, c in by_next_state.items() if key in text)
        if "[HINT_START]" in body["messages"][0]["content"]:
            return "\\boxed{1} [HINT_START]Do what the next state asks for.[HINT_END]" if case["hint_expected"] \
                else "\\boxed{-1}"
        return f"\\boxed{{{case['expected_vote']}}}"

    return respond


def test_perfect_endpoint_scores_100(tmp_path, capsys):
    cases = bench.load_cases(bench.DATA)
    with ScriptedJudgeServer(oracle(cases)) as server:
        code = bench.main(["--no-default", "--url", server.url, "--limit", "14", "--votes", "1",
                           "--details", str(tmp_path / "d.jsonl")])
    out = capsys.readouterr().out
    assert code == 0
    assert "eval agreement" in out and "100.0% (14/14)" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("hint agreement"))
    assert "100.0% (14/14)" in line
    assert "invalid eval votes" in out and "0.0% (0/14)" in out
    rows = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(rows) == 14 and all(r["vote"] == r["expected_vote"] for r in rows)


def test_rules_column_and_nothing_to_run(capsys):
    assert bench.main(["--rules", "--no-default", "--limit", "6", "--votes", "1"]) == 0
    out = capsys.readouterr().out
    assert "rules" in out and "eval agreement" in out
    assert bench.main(["--no-default"]) == 2
