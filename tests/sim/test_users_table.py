"""`clawloop eval-users` prints, per user, what its answers follow, the versions it was served and its rejections."""

from __future__ import annotations

from clawloop.sim.users import summary_table


def _summary(**brief_user):
    scores = {"score": 0.0, "guard": 1.0, "follows": {"brief": 0.0, "paragraph": 0.0}}
    return {
        "personas": ["brief", "paragraph"],
        "before": {"brief": scores, "paragraph": scores},
        "after": {"brief": {"score": 0.86, "guard": 1.0, "follows": {"brief": 0.86, "paragraph": 0.0}},
                  "paragraph": {"score": 0.57, "guard": 0.93, "follows": {"brief": 0.0, "paragraph": 0.57}}},
        "sessions_to_stable_effect": {"brief": 15, "paragraph": None},
        "users": {"brief": {"versions": [1, 3], "share_after_base": 0.75, **brief_user},
                  "paragraph": {"versions": [], "share_after_base": None, "gate_checks": 9, "gate_rejections": 9}},
    }


def test_each_user_row_has_its_own_versions_share_and_gate_rejections():
    rows = summary_table(_summary(gate_checks=9, gate_rejections=7)).splitlines()
    assert "gate rejections" in rows[0] and rows[1].count("---") == 9  # 7 columns + one per persona
    assert rows[2] == "| brief | 0.00 → 0.86 | 1.00 | 0.00 → 0.86 | 0.00 → 0.00 | 15 | 2 (75%) | 7 of 9 |"
    assert rows[3] == "| paragraph | 0.00 → 0.57 | 0.93 | 0.00 → 0.00 | 0.00 → 0.57 | not reached | 0 | 9 of 9 |"


def test_a_summary_written_before_the_gate_counts_still_prints():
    rows = summary_table(_summary()).splitlines()
    assert rows[2].endswith("| 2 (75%) | – |")
