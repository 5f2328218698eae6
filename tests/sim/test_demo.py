"""``clawloop demo`` end to end on the tiny model (real server, rule judge, teacher, trainer, HTTP), the demo's
settings precedence, and ``clawloop eval``'s table and resumable cells."""

from __future__ import annotations

import json
import re

import pytest

from clawloop.cli import main
from clawloop.sim import compare
from clawloop.sim.demo import DEMO_PRESET, demo_config
from clawloop.store import Store

from sim_support import verdict_simulator


def test_demo_runs_trains_and_writes_its_report(tmp_path, tiny_model_path, capsys):
    run_dir = tmp_path / "demo"
    # The tiny random model writes word salad, which the guard may judge either way on any probe, and reads a hint
    # as noise: neither the guard's share nor the preference check is asked for here (the gate's own decisions
    # are tested in tests/trainer/test_gate.py and tests/gate/); the KL bound stays.
    rc = main(["demo", "--model", "tiny", "--interactions", "6", "--eval-every", "3", "--rollout-batch-size", "2",
               "--heldout-n", "3", "--run-dir", str(run_dir), "--num-threads", "2", "--max-batch-size", "4",
               "--seed", "1", "--gate-every", "1", "--gate-probe-tokens", "8", "--gate-min-guard-pass", "0",
               "--no-gate-preference"])
    assert rc == 0
    printed = capsys.readouterr().out
    # The publication gate's decisions are shown as they happen, and summarised.
    assert "publication gate: on, checking every 1 step(s)" in printed
    assert printed.count("[gate] step ") == 3 and "[gate] step 1: accepted, serving v1" in printed
    assert "judge: rule judge" in printed  # says which judge and why
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/dashboard/ ", printed)  # where to watch it learn
    assert "[session   1] turns 3" in printed and "[session   2] turns 3" in printed
    assert "before: preference score" in printed and "after:  preference score" in printed

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["persona"] == "brief" and summary["seed"] == 1 and summary["interactions"] == 6
    for phase in ("before", "after"):
        assert 0.0 <= summary[phase]["score"] <= 1.0 and 0.0 <= summary[phase]["guard_pass_rate"] <= 1.0
    phases = [(p["phase"], p["interactions"]) for p in summary["curve"]]
    assert phases[:2] == [("before", 0), ("during", 3)] and phases[-1] == ("after", 6)
    # Every version that answered a session was scored, the one served in the last session too.
    assert summary["served_guard"]["served_unscored"] == []
    # Every answer got thanks or a correction, so every one became a sample; 6 samples in batches of 2.
    assert summary["steps"] == 3 and summary["caught_up"]
    assert summary["before"]["policy_version"] == 0 and summary["after"]["policy_version"] == 3
    assert summary["judge"]["backend"] == "rules"
    assert summary["gate"]["checks"] == 3 and summary["gate"]["rejections"] == 0
    assert [d["version"] for d in summary["gate"]["decisions"]] == [1, 2, 3]
    assert summary["settings"]["lora"] is True and summary["settings"]["rollout_batch_size"] == 2  # flag wins
    assert summary["settings"]["kl_coef"] == DEMO_PRESET["kl_coef"]  # preset fills the rest
    assert set(summary["timings_s"]) >= {"model_ready_s", "start_s", "simulation_s", "catch_up_s", "total_s"}
    png = (run_dir / "learning_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert json.loads((run_dir / "eval_after.json").read_text())["n"] == 3

    # What trained, from the step metrics the server recorded: every answer of the tiny model was corrected, so every
    # sample carries a hint (OPD in all 3 steps), and GRPO counts only where some advantage was non-zero.
    from clawloop.trainer.metrics import read_metrics

    terms = summary["trained_terms"]
    moved = sum(1 for m in read_metrics(run_dir) if m["advantage_mean"] or m["advantage_negative_mean"])
    assert terms["opd"] == 3 and terms["grpo"] == moved and "terms that trained (steps active, of 3):" in printed
    assert f"  GRPO: {moved}\n" in printed and "  OPD top-k select: 3\n" in printed
    # Who talked to which version, from the version each served answer carried: nothing was trained before the
    # first session, and the two sessions are counted once each.
    sessions = summary["sessions"]
    assert [s["index"] for s in sessions] == [1, 2] and sessions[0]["first_answer_version"] == 0
    assert all(v in (0, 1, 2, 3) for s in sessions for v in s["answer_versions"])
    assert sum(summary["sessions_per_version"].values()) == 2 and "sessions per version" in printed
    assert summary["share_after_v0"] in (0.0, 0.5)
    assert "sessions to a stable effect" in printed and "sessions_to_stable_effect" in summary

    # A second demo into the same folder would mix two runs: refused.
    assert main(["demo", "--model", "tiny", "--run-dir", str(run_dir)]) == 2


def test_demo_config_precedence(tmp_path):
    assert demo_config({}, env={}).judge_backend == "rules"
    config = demo_config({"lr": 3e-4}, env={"CLAWLOOP_KL_COEF": "0.2"})
    assert config.lr == 3e-4 and config.kl_coef == 0.2 and config.lora is DEMO_PRESET["lora"]
    # A judge URL alone means: use that judge.
    config = demo_config({"judge_url": "http://127.0.0.1:9/v1"}, env={})
    assert config.judge_backend == "http"
    file = tmp_path / "run.toml"
    file.write_text("rollout_batch_size = 8\n")
    assert demo_config({}, file=str(file), env={}).rollout_batch_size == 8


def _fake_summary(method, persona, seed, scores):
    curve = [{"interactions": 12 * i, "score": s, "guard_pass_rate": 1.0} for i, s in enumerate(scores)]
    return {"method": method, "persona": persona, "seed": seed, "curve": curve,
            "before": {"score": scores[0], "guard_pass_rate": 1.0}, "after": {"score": scores[-1],
                                                                             "guard_pass_rate": 0.9},
            "steps": 6, "timings_s": {"total_s": 120.0}}


def test_eval_cells_are_cached_and_resumed(tmp_path, monkeypatch):
    calls = []

    def fake_run_loop(config, options, out=print):
        calls.append((config.method, options.persona, options.seed))
        scores = {"rl": [0.0, 0.2, 0.4], "hybrid": [0.0, 0.6, 0.8]}[config.method]
        return _fake_summary(config.method, options.persona, options.seed, scores)

    monkeypatch.setattr(compare, "run_loop", fake_run_loop)
    out = tmp_path / "eval"
    base = ["eval", "--model", "tiny", "--personas", "brief", "--seeds", "0,1", "--out", str(out), "--target", "0.5"]
    assert main(base + ["--methods", "rl", "--max-cells", "1"]) == 0
    assert calls == [("rl", "brief", 0)]
    assert main(base + ["--methods", "rl,hybrid"]) == 0  # rl/seed 0 is cached; the three others run
    assert sorted(calls[1:]) == [("hybrid", "brief", 0), ("hybrid", "brief", 1), ("rl", "brief", 1)]

    table = json.loads((out / "table.json").read_text())
    rows = {r["method"]: r for r in table["rows"]}
    assert rows["hybrid"]["interactions_to_target_mean"] == 12 and rows["hybrid"]["reached_target"] == 2
    assert rows["rl"]["interactions_to_target_mean"] is None and rows["rl"]["final_score_mean"] == pytest.approx(0.4)
    md = (out / "table.md").read_text()
    assert "| brief | hybrid | 0,1 | 0.00 | 0.80 ± 0.00 (0.80–0.80) | 0.80, 0.80 | 12 (2/2) |" in md
    assert "not reached (0/2)" in md and (out / "comparison.png").exists()

    # Different shared settings in the same folder would mix incomparable cells: refused.
    assert main(base + ["--methods", "rl", "--lr", "0.5"]) == 2
    assert len(calls) == 4

    # A folder made before a setting existed (not in its settings.json) goes on while that setting is at its
    # default, and is refused once it is not.
    recorded = json.loads((out / "settings.json").read_text())
    del recorded["teacher_draft"]
    (out / "settings.json").write_text(json.dumps(recorded))
    assert main(base + ["--methods", "rl", "--seeds", "0,1,2"]) == 0
    assert calls[4:] == [("rl", "brief", 2)]
    assert main(base + ["--methods", "rl", "--seeds", "3", "--teacher-draft"]) == 2
    assert len(calls) == 5


def test_interactions_to_target():
    curve = [{"interactions": 0, "score": 0.0}, {"interactions": 16, "score": 0.5}, {"interactions": 32,
                                                                                     "score": 0.4}]
    assert compare.interactions_to_target(curve, 0.5) == 16
    assert compare.interactions_to_target(curve, 0.6) is None


# A stand-in simulator model for the 'brief' persona: corrects or thanks as the verdict note says.
brief_simulator = verdict_simulator("Too long again. One short sentence, please.", "Thanks, that was short.",
                                    "Thanks, bye.")


def test_demo_with_an_llm_driven_user(tmp_path, tiny_model_path, fake_openai, capsys, monkeypatch):
    fake_openai.responder = brief_simulator
    monkeypatch.setenv("SIM_USER_KEY", "sk-user")
    run_dir = tmp_path / "demo"
    rc = main(["demo", "--model", "tiny", "--interactions", "3", "--eval-every", "0", "--rollout-batch-size", "2",
               "--heldout-n", "2", "--run-dir", str(run_dir), "--num-threads", "2", "--max-batch-size", "4",
               "--user-url", fake_openai.base_url + "/v1", "--user-model", "sim-model", "--user-api-key-env",
               "SIM_USER_KEY"])
    assert rc == 0
    assert "user: messages written by sim-model" in capsys.readouterr().out
    requests = fake_openai.chat_requests()
    assert len(requests) == 3  # one message per interaction, each written by the simulator model
    assert all(r["body"]["model"] == "sim-model" and r["headers"]["authorization"] == "Bearer sk-user"
               for r in requests)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["user"] == {"kind": "llm", "url": fake_openai.base_url + "/v1", "model": "sim-model",
                               "fallback_replies": 0}
    assert "sk-user" not in (run_dir / "summary.json").read_text()
    # The policy saw the simulator's words as the user's replies.
    store = Store(run_dir / "store.sqlite")
    try:
        contents = [m.get("content") for t in store.turns() for m in t.messages]
    finally:
        store.close()
    assert any(c and c.startswith(("Too long again.", "Thanks, that was short.")) for c in contents)


@pytest.mark.parametrize("flags, message", [
    (["--user-url", "http://127.0.0.1:9/v1"], "--user-url needs --user-model"),
    (["--user-model", "m"], "--user-model needs --user-url"),
    (["--user-url", "127.0.0.1:9/v1", "--user-model", "m"], "must be an http(s) URL"),
])
def test_user_flags_are_checked(tmp_path, flags, message, capsys):
    for command in ("demo", "eval"):
        assert main([command, "--model", "tiny", "--run-dir", str(tmp_path / command), *flags]) == 2
        assert message in capsys.readouterr().err


def test_a_version_scored_between_evaluation_points_does_not_change_interactions_to_target():
    curve = [{"interactions": 0, "score": 0.0, "phase": "before"},
             {"interactions": 8, "score": 0.6, "phase": "version"},  # read off-schedule: not comparable
             {"interactions": 16, "score": 0.5, "phase": "during"}]
    assert compare.interactions_to_target(curve, 0.5) == 16


def test_the_comparison_plot_reads_a_seed_between_its_points_as_the_version_it_was_serving():
    from clawloop.sim.plot import score_at

    # Seeds are scored at different counts (a new version is scored when it starts being served): between its
    # points a seed still serves its last scored version, so averaging only the seeds scored at a count would
    # draw a dip that no user saw.
    curve = [{"interactions": 0, "score": 0.0}, {"interactions": 21, "score": 0.64},
             {"interactions": 36, "score": 0.86}]
    assert score_at(curve, 20) == 0.0 and score_at(curve, 21) == 0.64 and score_at(curve, 24) == 0.64
    assert score_at(curve, 72) == 0.86 and score_at([{"interactions": 3, "score": 0.5}], 0) is None


def test_lowest_served_guard_counts_every_scored_version():
    from clawloop.sim.demo import CurvePoint, served_guard

    def point(interactions, version, guard, phase):
        return CurvePoint(interactions=interactions, step=version, policy_version=version, score=0.0,
                          guard_pass_rate=guard, satisfied_rate=0.0, elapsed_s=0.0, phase=phase)

    curve = [point(0, 0, 1.0, "before"), point(8, 1, 0.79, "version"), point(24, 2, 0.93, "during"),
             point(40, 2, 1.0, "version"), point(72, 3, 1.0, "after")]
    sessions = [{"answer_versions": [0, 0, 1]}, {"answer_versions": [1, 2, 2]}, {"answer_versions": [2, 4]}]
    served = served_guard(curve, sessions)
    # v3, published after the user left, is scored (the next user would get it) and said to be unserved; v4
    # answered one turn and was replaced within the session, so nothing could score it.
    assert served == {"by_version": {"0": 1.0, "1": 0.79, "2": 0.93, "3": 1.0}, "lowest": 0.79,
                      "unserved": [3], "served_unscored": [4]}

    # The comparison table reports it, with each seed's gate rejections and the rollbacks.
    cells = [{**_fake_summary("hybrid", "brief", seed, [0.0, 0.9, 0.6]), "served_guard": served if seed else None,
              "gate": {"rejections": seed + 1, "rollbacks": 0}, "share_after_v0": 0.75} for seed in (0, 1)]
    (row,) = compare.aggregate(cells, 0.5)
    assert row["served_guard_lowest"] == 0.79 and row["gate_rejections"] == [1, 2] and row["rollbacks"] == [0, 0]
    assert row["peak_scores"] == [0.9, 0.9] and row["share_after_v0"] == [0.75, 0.75]
    table = compare.markdown_table([row], 0.5)
    assert "| 0.60 ± 0.00 (0.60–0.60) | 0.90, 0.90 |" in table  # each seed's peak beside its final score
    assert "| 0.79 (4) | 1,2 | 75%, 75% | 0 |" in table


def test_a_paced_user_never_runs_a_lag_ahead_of_the_trainer(tmp_path, tiny_model_path, capsys):
    run_dir = tmp_path / "paced"
    rc = main(["demo", "--model", "tiny", "--interactions", "9", "--eval-every", "0", "--rollout-batch-size", "2",
               "--heldout-n", "2", "--run-dir", str(run_dir), "--num-threads", "2", "--max-batch-size", "4",
               "--no-gate", "--max-lag", "3"])
    assert rc == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    sessions = summary["sessions"]
    assert len(sessions) == 3 and sessions[0]["waiting_before"] is None  # the first session has nothing to wait for
    # Every later session started with fewer than 3 answers waiting to be judged or trained on.
    assert all(s["waiting_before"] is not None and s["waiting_before"] < 3 for s in sessions[1:])
    assert summary["timings_s"]["pace_s"] >= 0.0 and summary["steps"] >= 4
    # The printed time says how long the user waited, which on a CPU can be most of a demo.
    wait = f"the user waiting for the trainer {summary['timings_s']['pace_s']:.0f}s"
    assert wait in capsys.readouterr().out
