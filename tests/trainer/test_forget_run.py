"""``clawloop forget`` on a stopped run: the versions and checkpoints trained on the user's samples go, the run
resumes from weights that never saw them with the other users' samples requeued, a receipt holds ids and counts
only, and a forget cut short is finished at the next start."""

import json
import shutil

import pytest
import torch

from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.trainer import forget as forget_module
from clawloop.trainer.checkpoint import load_latest, save_checkpoint
from clawloop.trainer.forget import finish_pending_forget, forget_command, forget_user
from clawloop.trainer.resume import plan_resume
from clawloop.trainer.versions import has_version, save_version

ALICE, BOB = "k_alice", "k_bob"
ALICE_TEXT, BOB_TEXT = "Zanzibar-quartz-71", "Kilimanjaro-opal-42"


def served(store: Store, owner: str, text: str, session: str, index: int) -> int:
    tid = store.add_turn(TurnRecord(session_id=session, owner=owner, turn_index=index,
                                    messages=[{"role": "user", "content": f"What is {text}?"}], prompt_ids=[1, 2],
                                    response_ids=[3, 4], logprobs=[-0.1, -0.1], temperature=0.6, top_p=1.0,
                                    policy_version=0, response_text=f"{text} is a thing."))
    assert store.set_next_state(tid, [{"role": "user", "content": f"Shorter, {text}."}])
    store.claim_judgeable(1)
    assert store.put_sample(SampleRecord(turn_id=tid, reward=-1.0, kind="rl+opd", hints=[f"Be brief about {text}."]))
    return tid


def train_step(store: Store, run_dir, step: int, turns: list[int]) -> None:
    """A committed step on exactly ``turns``, its accepted version and its checkpoint (weights: the step number)."""
    lease, batch = store.lease_samples(len(turns))
    assert [s.turn_id for s in batch] == turns
    store.commit_step(lease, step=step, policy_version=step, metrics={}, turn_ids=turns)
    weights = {"w": torch.full((2,), float(step))}
    store.record_version(step, step, "accepted", {"accepted": True, "probes": [
        {"source": f"recent:{turns[0]}", "prompt": "quoted", "answer": "a", "ok": True}]})
    save_version(run_dir, step, step, weights, None, lora=True, keep=10)
    save_checkpoint(run_dir, step, step, weights, {"state": {}, "param_groups": []}, keep_last=10)


@pytest.fixture
def run(tmp_path):
    """Step 1 trained on Bob alone, step 2 on Alice and Bob, step 3 on Bob; versions 1-3 and checkpoints 1-3."""
    run_dir = tmp_path / "run"
    store = Store(run_dir / "store.sqlite")
    save_version(run_dir, 0, 0, {"w": torch.zeros(2)}, None, lora=True, keep=10)
    bob = [served(store, BOB, BOB_TEXT, "b", i) for i in range(2)]
    train_step(store, run_dir, 1, bob)
    mixed = [served(store, ALICE, ALICE_TEXT, "a", 0), served(store, BOB, BOB_TEXT, "b", 2)]
    train_step(store, run_dir, 2, mixed)
    late = [served(store, BOB, BOB_TEXT, "b", 3)]
    train_step(store, run_dir, 3, late)
    store.export_jsonl(run_dir / "export")
    yield run_dir, store, {"alice": [mixed[0]], "bob_retrained": [mixed[1], late[0]]}
    store.close()


def every_byte(folder) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


def test_forget_retires_what_trained_on_the_user_and_resumes_from_what_never_did(run):
    run_dir, store, ids = run
    archived = run_dir / "archive" / "20261126T000000Z"  # what a --fresh restart would have moved aside
    shutil.copytree(run_dir / "versions" / "v3", archived / "versions" / "v3")
    shutil.copytree(run_dir / "versions" / "v1", archived / "versions" / "v1")
    shutil.copytree(run_dir / "checkpoints" / "step_2", archived / "checkpoints" / "step_2")
    assert ALICE_TEXT.encode() in every_byte(run_dir)  # the check at the end can fail

    receipt = forget_user(store, run_dir, ALICE)

    assert receipt["turn_ids"] == ids["alice"] and receipt["samples"] == 1 and receipt["steps"] == [2]
    assert receipt["retired_versions"] == [2, 3]
    assert receipt["checkpoints_removed"] == ["step_2", "step_3", "archive/20261126T000000Z/step_2"]
    assert sorted(p.name for p in archived.rglob("*") if p.is_dir()) == ["checkpoints", "v1", "versions"]
    assert receipt["training_resumes_from"] == "step_1"
    assert receipt["export_lines_removed"]["turns.jsonl"] == 1
    assert not has_version(run_dir, 2) and not has_version(run_dir, 3) and has_version(run_dir, 1)
    assert {v["version"]: v["status"] for v in store.versions()} == {1: "accepted", 2: "retired", 3: "retired"}
    # What a restart resumes from: step 1's weights, never a retired version; Bob's samples of steps 2 and 3
    # are trained again, Alice's are gone.
    latest = load_latest(run_dir)
    assert (latest.step, latest.policy_version, float(latest.weights["w"][0])) == (1, 1, 1.0)
    plan = plan_resume(latest.step, store.last_step()[0])
    assert plan.requeue_after == 1
    assert store.requeue_after_step(plan.requeue_after) == len(ids["bob_retrained"])
    assert sorted(s.turn_id for s in store.samples("ready")) == ids["bob_retrained"]
    # Nothing of Alice's text anywhere in the run folder: store, log, export, versions, receipt.
    written = json.loads((run_dir / "receipts").glob("forget-*.json").__next__().read_text())
    assert written["owner"] == ALICE and written["retired_versions"] == [2, 3]
    everything = every_byte(run_dir)
    assert ALICE_TEXT.encode() not in everything
    assert BOB_TEXT.encode() in everything
    assert store.get_meta(forget_module.FORGET_PENDING) == ""


def test_a_forget_cut_short_after_the_store_is_finished_at_the_next_start(run, monkeypatch):
    run_dir, store, _ = run

    def crash(*_args, **_kwargs):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(forget_module, "remove_checkpoints_from", crash)
    with pytest.raises(KeyboardInterrupt):
        forget_user(store, run_dir, ALICE)
    monkeypatch.undo()
    # The store's part committed with its journal; the checkpoints trained on her samples are still on disk.
    assert (run_dir / "checkpoints" / "step_3").is_dir() and store.get_meta(forget_module.FORGET_PENDING)
    store.close()
    reopened = Store(run_dir / "store.sqlite")
    receipt = finish_pending_forget(reopened, run_dir)  # what the next start of the run does first
    assert receipt is not None and receipt["checkpoints_removed"] == ["step_2", "step_3"]
    assert not has_version(run_dir, 3) and load_latest(run_dir).step == 1
    assert finish_pending_forget(reopened, run_dir) is None
    assert ALICE_TEXT.encode() not in every_byte(run_dir)
    reopened.close()


def test_the_command_refuses_while_the_run_is_open_for_writing(run, capsys):
    run_dir, store, ids = run  # ``store`` stands for the running server's handle
    assert forget_command(run_dir, ALICE) == 1
    assert "open for writing elsewhere" in capsys.readouterr().err
    assert has_version(run_dir, 3) and ids["alice"][0] in {t.id for t in store.turns()}
    store.close()
    assert forget_command(run_dir, ALICE) == 0
    receipt = json.loads(capsys.readouterr().out)
    assert receipt["retired_versions"] == [2, 3] and receipt["log_truncated"]


KILLER = """
import os, signal, sys
from pathlib import Path
from clawloop.trainer import forget as f

def killed_after(fn, when=lambda *a: True):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        if when(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapped

point = sys.argv[1]
if point == "in the store's transaction":  # the journal written, the transaction not committed
    f.put_meta = killed_after(f.put_meta)
elif point == "between versions and checkpoints":
    f.remove_version = killed_after(f.remove_version)
elif point == "after the receipt":  # the receipt on disk, the journal not cleared
    f.write_text_atomically = killed_after(f.write_text_atomically,
                                           lambda path, *_: Path(path).parent.name == "receipts")
sys.exit(f.forget_command(sys.argv[2], sys.argv[3]))
"""


def forget_in_a_process(run_dir, point: str) -> int:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", KILLER, point, str(run_dir), ALICE], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    return done.returncode


def run_state(run_dir) -> tuple:
    """What a forget changes, receipts aside: the files of the run folder and the store's rows that matter."""
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                   if p.is_file() and "receipts" not in p.parts and not p.name.startswith("store.sqlite"))
    store = Store(run_dir / "store.sqlite")
    try:
        turns = sorted(t.id for t in store.turns())
        versions = {v["version"]: v["status"] for v in store.versions()}
        pending = store.get_meta(forget_module.FORGET_PENDING)
    finally:
        store.close()
    return files, turns, versions, pending


@pytest.mark.parametrize("point", ["in the store's transaction", "between versions and checkpoints",
                                   "after the receipt"])
def test_a_forget_killed_with_sigkill_leaves_the_old_state_whole_or_is_finished_at_the_next_start(run, tmp_path,
                                                                                                    point):
    """``clawloop forget`` in its own process, killed by SIGKILL at a fixed point; the next start of the run
    (``finish_pending_forget``, as ``clawloop serve`` does first) either finds nothing pending and the run as it
    was, or finishes the forget into exactly the state of one never interrupted."""
    run_dir, store, ids = run
    store.close()
    before = run_state(run_dir)
    whole = tmp_path / "whole"
    shutil.copytree(run_dir, whole)
    assert forget_in_a_process(whole, "never") == 0
    after = run_state(whole)
    assert after[1] == [t for t in before[1] if t not in ids["alice"]]

    assert forget_in_a_process(run_dir, point) == -9  # SIGKILL: no cleanup ran
    reopened = Store(run_dir / "store.sqlite")
    try:
        receipt = finish_pending_forget(reopened, run_dir)
    finally:
        reopened.close()
    if point == "in the store's transaction":
        assert receipt is None and run_state(run_dir) == before
        assert ALICE_TEXT.encode() in every_byte(run_dir)  # nothing of the forget happened: it can be asked again
        assert forget_in_a_process(run_dir, "never") == 0
    else:
        assert receipt is not None and receipt["retired_versions"] == [2, 3]
    assert run_state(run_dir) == after
    assert ALICE_TEXT.encode() not in every_byte(run_dir) and BOB_TEXT.encode() in every_byte(run_dir)
    assert len(list((run_dir / "receipts").glob("forget-*.json"))) == 1


def test_forget_cuts_the_users_prompts_from_the_gate_evidence_kept_in_every_version_folder(run):
    run_dir, store, ids = run
    alice_turn = ids["alice"][0]
    # Bob's own adapter (per-user policies) was gated on probes spread across users, Alice's prompt among them.
    probes = [{"source": f"recent:{alice_turn}", "prompt": f"What is {ALICE_TEXT}?",
               "answer": f"{ALICE_TEXT} is a thing.", "ok": True},
              {"source": "knowledge:0", "prompt": "What is 2 + 2?", "answer": "4", "ok": True}]
    save_version(run_dir / "users" / BOB, 9, 9, {"w": torch.ones(2)}, None, lora=True, keep=10,
                 evidence={"accepted": True, "probes": probes,
                           "reasons": [f"1 earlier fix broken (What is {ALICE_TEXT}?)"]})
    assert ALICE_TEXT.encode() in every_byte(run_dir)
    receipt = forget_user(store, run_dir, ALICE)
    assert receipt["version_records_scrubbed"] >= 1
    assert ALICE_TEXT.encode() not in every_byte(run_dir)
    kept = json.loads((run_dir / "users" / BOB / "versions" / "v9" / "version.json").read_text())
    assert kept["evidence"]["probes"][1]["prompt"] == "What is 2 + 2?"  # other probes are left as they were
    assert kept["evidence"]["probes"][0]["ok"] is True and ALICE_TEXT not in kept["evidence"]["reasons"][0]


def test_forget_cuts_the_users_hint_that_the_gate_s_preference_check_quotes(run):
    """The gate's preference check reads the hint most often trained on and names it in its evidence: in the
    store's version and event records, in the version folders and in an export. With the rule judge that hint is
    the user's own words; forgetting the user cuts it from all of them."""
    run_dir, store, _ = run
    hint = "Answer about the Yellowstone-cabin-88 in French, never in English."
    tid = served(store, ALICE, ALICE_TEXT, "a", 1)
    with store.db.tx() as db:  # the judge's hint vote for that turn
        db.execute("UPDATE samples SET hints=? WHERE turn_id=?", (json.dumps([hint]), tid))
    evidence = {"accepted": True, "probes": [], "preference": {"hint": hint, "drop": 0.01}}
    store.record_version(7, 7, "accepted", evidence)
    store.record_event("gate_accepted", evidence, 7, 7)
    # Bob's own adapter (per-user policies) was read under it: its folder stays, the shared v7 is retired.
    save_version(run_dir / "users" / BOB, 7, 7, {"w": torch.ones(2)}, None, lora=True, keep=10, evidence=evidence)
    store.export_jsonl(run_dir / "export")
    assert b"Yellowstone-cabin-88" in every_byte(run_dir)
    forget_user(store, run_dir, ALICE)
    assert b"Yellowstone-cabin-88" not in every_byte(run_dir)
    kept = json.loads((run_dir / "users" / BOB / "versions" / "v7" / "version.json").read_text())
    assert kept["evidence"]["preference"]["drop"] == 0.01  # the reading stays, without the user's words
