"""`clawloop judge check`: the packaged labelled cases, the rule judge's numbers, and an HTTP judge scored through
the command line against a local endpoint that knows the answers (with its key read from an environment
variable)."""

import json

from clawloop.cli import main
from clawloop.judge.check import default_cases_path, load_cases, quantile, summary
from clawloop.judge.prompts import flatten_messages
from clawloop.judge.scripted import ScriptedJudgeServer, last_user_text


def test_cases_ship_inside_the_package():
    path = default_cases_path()
    assert path.parts[-3:] == ("judge", "data", "judge_cases.jsonl") and path.is_file()
    assert len(load_cases()) >= 60


def test_rules_check_prints_agreement_invalid_rate_and_latency(capsys):
    assert main(["judge", "check", "--backend", "rules"]) == 0
    out = capsys.readouterr().out
    for row in ("eval agreement", "hint agreement", "invalid votes", "vote latency p50", "vote latency p95"):
        assert row in out, row
    assert "rules: usable" in out
    assert main(["judge", "check", "--json"]) == 0  # auto without judge_url is the rule judge
    head = json.loads(capsys.readouterr().out)
    assert head["judge"] == "rules" and head["cases"] == len(load_cases())
    assert head["eval_agreement"] >= 0.95 and head["hint_agreement"] >= 0.9 and head["invalid_vote_rate"] == 0.0


def oracle(cases):
    by_next_state = {flatten_messages(c["next_state"]): c for c in cases}

    def respond(body):
        case = next(c for key, c in by_next_state.items() if key in last_user_text(body))
        if "[HINT_START]" in body["messages"][0]["content"]:
            return "\\boxed{1} [HINT_START]Do what the user asks.[HINT_END]" if case["hint_expected"] else "\\boxed{-1}"
        return f"\\boxed{{{case['expected_vote']}}}"

    return respond


def test_http_judge_check_with_a_key_from_the_environment(capsys, monkeypatch):
    with ScriptedJudgeServer(oracle(load_cases()), api_key="sekrit") as server:
        monkeypatch.setenv("MY_JUDGE_KEY", "sekrit")
        code = main(["judge", "check", "--judge-url", server.url, "--judge-model", "oracle", "--judge-api-key-env",
                     "MY_JUDGE_KEY", "--limit", "12", "--prm-m", "1", "--json"])
        head = json.loads(capsys.readouterr().out)
        assert code == 0 and head["judge"] == "http (oracle)" and head["cases"] == 12
        assert head["eval_agreement"] == 1.0 and head["hint_agreement"] == 1.0 and head["invalid_vote_rate"] == 0
        # A judge that only talks nonsense is flagged.
        server.responder = lambda body: "I am not sure."
        assert main(["judge", "check", "--judge-url", server.url, "--judge-api-key-env", "MY_JUDGE_KEY",
                     "--limit", "6", "--prm-m", "1", "--judge-structured-output", "off"]) == 0
        out = capsys.readouterr().out
        assert "NOT RECOMMENDED" in out and "invalid votes 100%" in out
    monkeypatch.delenv("MY_JUDGE_KEY")
    assert main(["judge", "check", "--judge-url", "http://127.0.0.1:9/v1", "--judge-api-key-env",
                 "MY_JUDGE_KEY"]) == 2


def test_quantiles_and_summary():
    assert quantile([], 0.5) is None and quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and quantile([1, 2, 3, 4], 0.95) == 4
    rows = [{"vote": 1, "expected_vote": 1, "candidates": [], "hint_expected": False, "eval_scores": [1, None],
             "hint_scores": [-1, -1], "latency_s": [1.0, 2.0, 3.0, 4.0]}]
    head = summary(rows, 5.0)
    assert head["eval_agreement"] == 1.0 and head["invalid_vote_rate"] == 0.25 and head["latency_p50_s"] == 3.0
