"""``clawloop eval-users`` end to end on the tiny model: two simulated users, each through its own key, talk to one
per-user server at once; each user's samples train only that user's adapter, and the summary scores every user's
held-out answers by every persona's checker."""

from __future__ import annotations

import json

from clawloop.cli import main
from clawloop.store import Store


def test_two_simulated_users_train_their_own_adapters(tmp_path, tiny_model_path, capsys):
    out = tmp_path / "users"
    rc = main(["eval-users", "--model", "tiny", "--personas", "brief,inshort", "--interactions", "6",
               "--heldout-n", "3", "--out", str(out), "--num-threads", "2", "--rollout-batch-size", "2",
               "--max-lag", "0", "--gate-probe-tokens", "8", "--gate-min-guard-pass", "0", "--gate-every", "1"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| user | score before → after |" in printed and "| brief |" in printed and "| inshort |" in printed

    summary = json.loads((out / "run" / "summary.json").read_text())
    assert summary["personas"] == ["brief", "inshort"] and summary["caught_up"] and not summary["errors"]
    for name in ("brief", "inshort"):
        assert [s["interactions"] for s in summary["sessions"][name]] == [3, 6]
        assert set(summary["after"][name]["follows"]) == {"brief", "inshort"}
        assert 0.0 <= summary["after"][name]["score"] <= 1.0
    owners = {name: summary["users"][name]["owner"] for name in ("brief", "inshort")}
    assert owners["brief"] != owners["inshort"]
    store = Store(out / "run" / "store.sqlite")
    try:
        for name, owner in owners.items():
            # 6 answers each, every one thanked or corrected: 3 batches of 2, all of this user's own samples.
            steps = [s for s in store.steps() if s["owner"] == owner]
            assert len(steps) == summary["users"][name]["steps"] == 3
            assert {store.get_turn(t).owner for s in steps for t in s["turn_ids"]} == {owner}
            assert summary["users"][name]["versions"] == [v["version"] for v in store.versions(owner=owner)]
            # Every step is checked (--gate-every 1); the table counts this user's checks and rejections only.
            checks = [e for e in store.events() if e["kind"].startswith("gate_") and e["detail"]["owner"] == owner]
            assert summary["users"][name]["gate_checks"] == len(checks) == 3
            assert summary["users"][name]["gate_rejections"] == sum(e["kind"] == "gate_rejected" for e in checks)
    finally:
        store.close()
    assert (out / "run" / "table.md").read_text().startswith("| user |")
