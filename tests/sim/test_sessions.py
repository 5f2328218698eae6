"""Sessions to a stable effect and who talked to which version, read from what the simulated user received; the
loss terms a run trained, read from the step metrics; and how the demo and the comparison table report them."""

from __future__ import annotations

import pytest

from clawloop.sim import compare
from clawloop.sim.demo import learning_lines
from clawloop.sim.driver import Simulation
from clawloop.sim.personas import get_persona
from clawloop.sim.sessions import (served_summary, session_record, sessions_per_version, sessions_to_stable_effect,
                                   share_after_base)
from clawloop.sim.trained_terms import active_branches, steps_per_term

SHORT = "{topic} is simple and easy to learn."  # one short sentence on the question's topic: 'brief' accepts it
LONG = ("{topic} has a long history. Many people have written about it. There are several ways to see it, and "
        "each one has its own details that take a while to explain properly.")


class ScriptedServer:
    """Stands in for the server's HTTP API: each main-turn request gets the next (version, follows) of the script,
    the way a clawloop response carries the version that wrote it in its ``clawloop`` field."""

    def __init__(self, script: list[tuple[int, bool]]) -> None:
        self.script = list(script)
        self.served: list[int] = []

    def chat(self, messages, *, session_id, turn_type, done=False, **params):
        if done:  # the closing request of a session: its answer is never shown to anyone
            return {"choices": [{"message": {"content": "."}}], "clawloop": {"policy_version": -1}}
        version, follows = self.script.pop(0)
        self.served.append(version)
        topic = messages[0]["content"].rstrip("?").split()[-1].capitalize()
        text = (SHORT if follows else LONG).format(topic=topic)
        return {"choices": [{"message": {"content": text}}], "clawloop": {"policy_version": version}}

    def end_session(self, session_id):
        pass

    def close(self):
        pass


def _records(oks):
    return [{"index": i, "first_answer_version": 0, "first_satisfied": ok, "first_sound": True}
            for i, ok in enumerate(oks, start=1)]


def test_stable_effect_is_the_first_of_three_sessions_in_a_row_that_open_well():
    assert sessions_to_stable_effect(_records([False, True, True, False, True, True, True, True])) == 5
    assert sessions_to_stable_effect(_records([True, True, False, True, True])) is None
    assert sessions_to_stable_effect(_records([True, True, True])) == 1
    assert sessions_to_stable_effect([]) is None


def test_a_first_answer_that_fails_the_guard_breaks_the_run():
    records = _records([True, True, True, True])
    records[1]["first_sound"] = False  # follows the preference with a degenerate answer: not a success
    assert sessions_to_stable_effect(records) is None
    records[1]["first_sound"] = True
    assert sessions_to_stable_effect(records) == 1


def test_older_records_are_read_from_their_combined_flag():
    old = [{"first_followed": ok} for ok in (False, True, True, True)]
    assert sessions_to_stable_effect(old) == 2


def test_session_records_hold_what_the_user_received_and_which_version_wrote_it():
    # Session 1: v0 writes a long first answer (corrected), then a short one. Sessions 2-4: the first answers are
    # short, written by v1, v1 and v2; the rest of each session mixes versions as publications happen mid-session.
    script = [(0, False), (0, True), (0, True),
              (1, True), (1, True), (2, True),
              (1, True), (2, True), (2, True),
              (2, True), (2, True), (2, True)]
    server = ScriptedServer(script)
    sim = Simulation("http://unused", get_persona("brief"), seed=0, client=server)
    records = [session_record(i, sim.run_session()) for i in range(1, 5)]

    assert [r["first_answer_version"] for r in records] == [0, 1, 1, 2]
    assert [r["first_satisfied"] for r in records] == [False, True, True, True]
    assert all(r["first_sound"] for r in records)
    assert records[1]["answer_versions"] == [1, 1, 2]
    assert sessions_to_stable_effect(records) == 2
    assert sessions_per_version(records) == {"v0": 1, "v1": 2, "v2": 1}
    assert share_after_base(records) == pytest.approx(0.75)
    assert served_summary(records)["sessions_to_stable_effect"] == 2


def test_versions_are_listed_in_order_and_unreported_ones_apart():
    records = [{"first_answer_version": v} for v in (10, 2, None, 2, 0)]
    assert list(sessions_per_version(records).items()) == [("v0", 1), ("v2", 2), ("v10", 1), ("unknown", 1)]
    assert share_after_base(records) == pytest.approx(0.6) and share_after_base([]) is None


# The metrics of a real hybrid step, as the store records them (values made up).
HYBRID_STEP = {"loss": 0.3, "grpo_loss": 0.1, "opd_applied": 0.5, "opd_loss": 0.2, "ref_kl": 0.01,
               "updates_applied": 1.0, "samples": 4.0, "samples_excluded_nonfinite": 0.0, "num_samples": 4.0,
               "hinted_samples": 2.0, "context_samples": 0.0, "time_loss_s": 0.4, "advantage_mean": -0.25,
               "advantage_negative_mean": -0.5}


def test_a_branch_counts_only_in_steps_where_it_applied():
    assert active_branches(HYBRID_STEP) == {"grpo", "opd"}
    no_targets = {**HYBRID_STEP, "opd_applied": 0.0, "opd_loss": 0.0}  # no sample of the step had a hint
    assert active_branches(no_targets) == {"grpo"}
    rl_only = {"loss": 0.1, "grpo_loss": 0.1, "updates_applied": 1.0, "samples": 4.0}
    assert active_branches(rl_only) == {"grpo"}


def test_grpo_does_not_count_in_a_step_whose_advantages_were_all_zero():
    all_corrections = {**HYBRID_STEP, "grpo_loss": 0.0, "advantage_mean": 0.0, "advantage_negative_mean": 0.0}
    assert active_branches(all_corrections) == {"opd"}
    # It is still listed, with the steps it moved the weights in: none here, one of two there.
    assert steps_per_term([all_corrections]) == {"grpo": 0, "opd": 1}
    assert steps_per_term([all_corrections, HYBRID_STEP]) == {"grpo": 1, "opd": 2}


def test_branches_without_a_name_here_are_still_counted():
    step = {**HYBRID_STEP, "opd_support_applied": 0.25, "opd_support_loss": 0.3, "context_samples": 2.0,
            "rollout_samples": 4.0, "topk_kl_applied": 0.0, "topk_kl_loss": 0.0, "retain_behind_hint": 3.0,
            "opening_preference": 1.0}
    assert active_branches(step) == {"grpo", "opd", "opd_support", "context", "rollout", "retain_behind_hint",
                                     "opening"}
    counts = steps_per_term([step, HYBRID_STEP, {**HYBRID_STEP, "opd_applied": 0.0, "rollout_samples": 0.0,
                                                 "retain_behind_hint": 0.0, "opening_preference": 0.0}])
    assert counts == {"grpo": 3, "opd": 2, "topk_kl": 0, "opd_support": 1, "context": 1, "rollout": 1,
                      "retain_behind_hint": 1, "opening": 1}


def test_the_demo_says_what_trained_and_who_talked_to_which_version():
    summary = {"steps": 3, "trained_terms": {"grpo": 3, "opd": 2, "opd_support": 1},
               "samples_by_kind": {"rl": 2, "rl+opd": 10},
               **served_summary([{"index": i, "first_answer_version": v, "first_satisfied": ok, "first_sound": True}
                                 for i, (v, ok) in enumerate([(0, False), (0, True), (1, True), (1, True), (2, False)],
                                                             start=1)])}
    lines = learning_lines(summary)
    assert "  GRPO: 3" in lines and "  OPD top-k select: 2" in lines and "  OPD support: 1" in lines
    assert "samples by kind: rl 2, rl+opd 10" in lines
    assert "sessions per version (the one that wrote the first answer): v0: 2, v1: 2, v2: 1" in lines
    assert "sessions served by a version newer than v0: 3 of 5 (60%)" in lines
    assert lines[-1].endswith("from session 2 (sessions 2-4)")
    assert learning_lines({"steps": 0})[-1].endswith("not reached")


def _cell(seed, stable):
    return {"method": "hybrid", "persona": "brief", "seed": seed,
            "curve": [{"interactions": 0, "score": 0.0, "guard_pass_rate": 1.0}],
            "before": {"score": 0.0, "guard_pass_rate": 1.0}, "after": {"score": 0.5, "guard_pass_rate": 1.0},
            "steps": 6, "timings_s": {"total_s": 60.0}, "sessions_to_stable_effect": stable}


def test_the_table_reports_sessions_to_stable_effect_over_the_seeds_that_reached_it():
    (row,) = compare.aggregate([_cell(0, 4), _cell(1, None), _cell(2, 9)], 0.5)
    assert row["sessions_to_stable_effect"] == [4, None, 9]
    assert row["sessions_to_stable_effect_mean"] == pytest.approx(6.5) and row["reached_stable_effect"] == 2
    table = compare.markdown_table([row], 0.5)
    assert "sessions to stable effect (3 in a row; per seed)" in table.splitlines()[0]
    assert "| not reached (0/3) | 6.5 (2/3 reached: 4, –, 9) |" in table
    (row,) = compare.aggregate([_cell(0, None)], 0.5)
    assert "| not reached (0/1 reached) |" in compare.markdown_table([row], 0.5)
    # A cell run before the metric was stored is read from its session records.
    old = {**_cell(0, None), "sessions": [{"first_followed": ok} for ok in (False, True, True, True)]}
    del old["sessions_to_stable_effect"]
    assert compare.aggregate([old], 0.5)[0]["sessions_to_stable_effect"] == [2]
