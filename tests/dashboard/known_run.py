"""A run folder whose records are known exactly, written through the store's own API (the way serving, the judge
and the trainer write them), for the dashboard's JSON tests.

Session ``s1``: turn 1 judged -1 with two hint candidates, trained at step 1; turn 2 dropped (no next state).
Session ``s2``: turn 3 still awaiting its next message. Versions: v1 accepted at step 1, v2 accepted then rolled
back to v1. ``eval_before.json`` is a demo evaluation.

``add_rejected_step`` goes on from there the way the trainer records a rejection (clawloop/trainer/core.py):
session ``s3`` (its first request opens with an agent's long system prompt) has turn 4, trained at step 2, which
the gate rejects (a ``gate_rejected`` event naming step 2 and the restored version 1, then the step's commit),
and turn 5, trained at step 3, which the gate accepts as v3.

The teacher targets of turn 1 make the dashboard's numbers checkable by hand: candidate 1 shares every student
top-k id (overlap 2 at each of the 3 tokens) and candidate 0 only the first token's, so ``sequence_optimal``
picks candidate 1; with student log-probs (-1, -1, -2.5) at the sampled tokens and candidate 1's (-0.5, -3, -2),
the clipped (±1) advantages are (0.5, -1.0, 0.5).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from clawloop.store import SampleRecord, Store, TurnRecord, VoteRecord

RESPONSE_IDS = [10, 11, 12]
HINTS = ["Be brief.", "Answer in one short sentence."]
EXPECTED_ADVANTAGES = [0.5, -1.0, 0.5]
EVAL_RAW = "The user says it is wrong.\n\\boxed{-1}"
LONG_SYSTEM_PROMPT = ("You are a personal assistant running inside an agent. " * 160
                      + "Tools, skills and the workspace are listed below.\nEND OF THE SYSTEM PROMPT")
"""As long as an agent's system prompt (OpenClaw's is about 8,500 characters); its last words mark its end."""


def turn(session: str, index: int, text: str, system: str = "") -> TurnRecord:
    messages = [{"role": "user", "content": f"question {session}/{index}"}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return TurnRecord(session_id=session, messages=messages,
                      prompt_ids=[1, 2, 3], response_ids=list(RESPONSE_IDS), logprobs=[-1.0, -1.2, -2.4],
                      temperature=1.0, top_p=1.0, policy_version=0, response_text=text,
                      assistant_message={"role": "assistant", "content": text}, turn_index=index)


def targets() -> dict[str, torch.Tensor]:
    student_ids_T_K = torch.tensor([[10, 20], [11, 21], [12, 22]])
    teacher_ids_C_T_K = torch.stack([torch.tensor([[10, 20], [40, 41], [50, 51]]), student_ids_T_K])
    return {
        "student_ids_T_K": student_ids_T_K,
        "student_logprobs_T_K": torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-2.5, -3.0]]),
        "teacher_ids_C_T_K": teacher_ids_C_T_K,
        "teacher_logprobs_C_T_K": torch.full((2, 3, 2), -1.5),
        "teacher_at_student_C_T_K": torch.full((2, 3, 2), -1.5),
        "hint_lens_C": torch.tensor([len(h) for h in HINTS]),
        "student_token_logprobs_T": torch.tensor([-1.0, -1.0, -2.5]),
        "teacher_token_logprobs_C_T": torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -3.0, -2.0]]),
    }


def write_known_run(run_dir: Path) -> dict[str, int]:
    run_dir.mkdir(parents=True, exist_ok=True)
    store = Store(run_dir / "store.sqlite")
    try:
        t1 = store.add_turn(turn("s1", 0, "Paris is a city."))
        t2 = store.add_turn(turn("s1", 1, "Sorry: Paris."))
        t3 = store.add_turn(turn("s2", 0, "Seven."))
        assert store.set_next_state(t1, [{"role": "user", "content": "That is wrong, be brief."}])
        assert store.drop_turn(t2, "no_next_state")
        (claimed,) = store.claim_judgeable()
        assert claimed.id == t1
        store.add_votes([VoteRecord(turn_id=t1, kind="eval", index=0, score=-1, raw_text=EVAL_RAW),
                         VoteRecord(turn_id=t1, kind="hint", index=0, score=1, hint=HINTS[1],
                                    raw_text=f"[HINT_START]{HINTS[1]}[HINT_END] \\boxed{{1}}")])
        assert store.put_sample(SampleRecord(turn_id=t1, reward=-1.0, kind="rl+opd", hints=list(HINTS),
                                             targets=targets(), info={"kind_reason": "hint(s) and a ±1 vote"}))
        lease, leased = store.lease_samples(4)
        assert [s.turn_id for s in leased] == [t1]
        store.commit_step(lease, 1, 1, {"loss": 0.5, "opd_loss": 0.4, "grpo_loss": 0.1, "grad_norm": 2.0,
                                        "opd_overlap_at_h_star": 2.0}, [t1])
        store.record_version(1, 1, "accepted", {"accepted": True, "guard_pass": 1.0, "kl": 0.01})
        store.record_event("gate_accepted", {"accepted": True, "guard_pass": 1.0, "kl": 0.01}, step=1, version=1)
        store.record_version(2, 1, "accepted", {"accepted": True, "guard_pass": 0.95, "kl": 0.02})
        store.record_rollback(1, 2, {"reason": "test rollback"})
    finally:
        store.close()
    (run_dir / "eval_before.json").write_text(json.dumps({"score": 0.25, "guard_pass_rate": 1.0, "n": 4}))
    return {"t1": t1, "t2": t2, "t3": t3}


def judge_and_train(store: Store, turn_id: int, step: int, reward: float, before_commit,
                    gate_due_in: int = 0) -> None:
    """Judge ``turn_id`` into a sample, lease it and commit it as ``step``, recording the gate's decision first
    (``before_commit()`` records it and returns the version the step row carries), as the trainer does.
    ``gate_due_in`` > 0: the step's metrics say the gate checks it that many steps later (``gate_every`` > 1)."""
    assert store.set_next_state(turn_id, [{"role": "user", "content": "Thanks!" if reward > 0 else "Wrong."}])
    (claimed,) = store.claim_judgeable()
    assert claimed.id == turn_id
    store.add_votes([VoteRecord(turn_id=turn_id, kind="eval", index=0, score=int(reward), raw_text="\\boxed{1}")])
    assert store.put_sample(SampleRecord(turn_id=turn_id, reward=reward, kind="rl"))
    lease, leased = store.lease_samples(4)
    assert [s.turn_id for s in leased] == [turn_id]
    metrics = {"loss": 0.1 * step, "published": 0.0, **({"gate_due_in": float(gate_due_in)} if gate_due_in else {})}
    store.commit_step(lease, step, before_commit(), metrics, [turn_id])


def add_rejected_step(run_dir: Path) -> dict[str, int]:
    """Extend a known run (see the module docstring) with a step the gate rejected and one it accepted."""
    store = Store(run_dir / "store.sqlite")
    try:
        t4 = store.add_turn(turn("s3", 0, "Rejected answer.", system=LONG_SYSTEM_PROMPT))
        t5 = store.add_turn(turn("s3", 1, "Accepted answer."))

        def reject() -> int:
            store.record_event("gate_rejected", {"steps": [2], "restored_version": 1, "accepted": False,
                                                 "guard_pass": 0.94, "kl": 5e-5, "reasons": ["guard 0.94 < 0.95"]},
                               step=2, version=1)
            return 1

        def accept() -> int:
            evidence = {"accepted": True, "guard_pass": 1.0, "kl": 0.01}
            store.record_version(3, 3, "accepted", evidence)
            store.record_event("gate_accepted", {"steps": [3], **evidence}, step=3, version=3)
            return 3

        judge_and_train(store, t4, 2, -1.0, reject)
        judge_and_train(store, t5, 3, 1.0, accept)
    finally:
        store.close()
    return {"t4": t4, "t5": t5}


def add_two_users_main_sessions(run_dir: Path, *, tool_call_for: str = "") -> None:
    """alice and bob each open a session they both call "main" (per-user keys: users choose their ids); the turn
    of ``tool_call_for`` ends with an assistant message that only calls a tool, and its result."""
    store = Store(run_dir / "store.sqlite")
    try:
        for owner in ("alice", "bob"):
            record = turn("main", 0, f"answer to {owner}")
            record.owner = owner
            if owner == tool_call_for:
                call = {"id": "c1", "type": "function",
                        "function": {"name": "web_search", "arguments": '{"q":"tides"}'}}
                record.messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                                    {"role": "tool", "tool_call_id": "c1", "content": "High tide at 6."}]
            store.add_turn(record)
    finally:
        store.close()
