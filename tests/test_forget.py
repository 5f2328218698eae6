"""Forgetting one user in the store: their records go, the others' stay, and no byte of their text is left in the
SQLite file or its write-ahead log."""

import pytest

from clawloop.store import CONTEXT_KIND, ContextSample, SampleRecord, Store, StoreInUse, TurnRecord, VoteRecord

ALICE, BOB = "fp-alice", "fp-bob"
ALICE_TEXT, BOB_TEXT = "Zanzibar-quartz-71", "Kilimanjaro-opal-42"


def turn(owner: str, text: str, session: str, index: int = 0) -> TurnRecord:
    question = f"What is {text}?"
    return TurnRecord(session_id=session, owner=owner, turn_index=index,
                      messages=[{"role": "user", "content": question}], prompt_ids=[1, 2, 3],
                      response_ids=[10, 11], logprobs=[-0.5, -0.5], temperature=0.6, top_p=0.95, policy_version=0,
                      response_text=f"{text} is a thing.",
                      assistant_message={"role": "assistant", "content": f"{text} is a thing."})


def judged(store: Store, tid: int, owner: str, text: str, *, context: bool = False) -> None:
    assert store.set_next_state(tid, [{"role": "user", "content": f"No, {text} is shorter."}])
    (claimed,) = store.claim_judgeable(1)
    assert claimed.id == tid
    store.add_votes([VoteRecord(turn_id=tid, kind="hint", index=0, score=-1, raw_text=f"The user wants {text}.",
                                hint=f"Answer {text} in one sentence.")])
    extra = []
    if context:
        answer = turn(owner, text, claimed.session_id)
        answer.response_text = f"{text}, briefly."
        extra = [ContextSample(index=0, turn=answer, sample=SampleRecord(turn_id=0, reward=1.0, kind=CONTEXT_KIND))]
    assert store.put_sample(SampleRecord(turn_id=tid, reward=-1.0, kind="rl+opd",
                                         hints=[f"Answer {text} in one sentence."], info={"why": text}), extra)


def file_bytes(store: Store) -> bytes:
    """The database file and whatever its write-ahead log and shared-memory index hold now."""
    found = b""
    for suffix in ("", "-wal", "-shm"):
        path = store.path.with_name(store.path.name + suffix)
        if path.exists():
            found += path.read_bytes()
    return found


def two_users(tmp_path) -> tuple[Store, list[int], list[int]]:
    store = Store(tmp_path / "store.sqlite")
    alice = [store.add_turn(turn(ALICE, ALICE_TEXT, "a1", i)) for i in range(2)]
    bob = [store.add_turn(turn(BOB, BOB_TEXT, "b1", i)) for i in range(2)]
    judged(store, alice[0], ALICE, ALICE_TEXT, context=True)
    judged(store, alice[1], ALICE, ALICE_TEXT)
    for tid in bob:
        judged(store, tid, BOB, BOB_TEXT)
    lease, batch = store.lease_samples(3)
    step_one = [s.turn_id for s in batch]
    store.commit_step(lease, step=1, policy_version=1, metrics={}, turn_ids=step_one)
    lease, batch = store.lease_samples(10)
    store.commit_step(lease, step=2, policy_version=2, metrics={}, turn_ids=[s.turn_id for s in batch])
    # The gate's evidence quotes recent prompts: one of Alice's, and a shipped probe nobody owns.
    probes = [{"source": f"fixed:{alice[0]}", "prompt": f"What is {ALICE_TEXT}?", "answer": f"{ALICE_TEXT}!",
               "accepted_answer": f"{ALICE_TEXT}.", "ok": False},
              {"source": f"recent:{bob[0]}", "prompt": f"What is {BOB_TEXT}?", "answer": "fine", "ok": True},
              {"source": "shipped", "prompt": "What is a tree?", "answer": "A plant.", "ok": True}]
    evidence = {"accepted": False, "reasons": [f"1 earlier fix(es) broken (What is {ALICE_TEXT}?)"], "probes": probes}
    store.record_version(1, 1, "accepted", {"accepted": True, "probes": probes[1:]})
    store.record_version(2, 2, "accepted", evidence)
    store.record_event("gate_rejected", evidence, step=2, version=2)
    return store, alice, bob


def test_forgetting_a_user_leaves_none_of_their_text_in_the_file_or_its_log(tmp_path):
    store, alice, bob = two_users(tmp_path)
    context_ids = [t.id for t in store.turns() if t.owner == ALICE and t.id not in alice]
    assert len(context_ids) == 1
    trained = {s["step"]: set(s["turn_ids"]) for s in store.steps()}
    assert trained == {1: {*alice, *context_ids}, 2: set(bob)}  # samples are leased in the order they were made
    before = file_bytes(store)
    assert ALICE_TEXT.encode() in before and BOB_TEXT.encode() in before  # the check below can fail

    result = store.forget_owner(ALICE)

    assert result.turn_ids == sorted(alice + context_ids)
    assert (result.sessions, result.votes, result.samples, result.context_turns) == (1, 2, 3, 1)
    assert result.steps == [1]  # the steps that trained on her samples; step 2 trained on Bob's alone
    assert result.versions_scrubbed == [2] and result.events_scrubbed == 1
    assert result.log_truncated
    after = file_bytes(store)
    assert ALICE_TEXT.encode() not in after
    assert BOB_TEXT.encode() in after
    assert store.path.with_name("store.sqlite-wal").stat().st_size == 0
    # Bob's records are whole; Alice's probe keeps its verdict and loses its text, and the reason quoting her
    # prompt has it cut.
    assert [t.id for t in store.turns()] == bob
    assert {s.turn_id for s in store.samples()} == set(bob)
    (version,) = [v for v in store.versions() if v["version"] == 2]
    fixed, recent, shipped = version["evidence"]["probes"]
    assert fixed == {"source": f"fixed:{alice[0]}", "prompt": "[forgotten]", "answer": "[forgotten]",
                     "accepted_answer": "[forgotten]", "ok": False}
    assert recent["prompt"] == f"What is {BOB_TEXT}?" and shipped["answer"] == "A plant."
    assert version["evidence"]["reasons"] == ["1 earlier fix(es) broken ([forgotten])"]
    # The steps keep their ids (no text), so the record still says what trained on the deleted samples.
    assert [s["step"] for s in store.steps()] == [1, 2]
    store.close()
    reopened = Store(tmp_path / "store.sqlite")
    assert [t.id for t in reopened.turns()] == bob
    assert ALICE_TEXT.encode() not in file_bytes(reopened)
    reopened.close()


def test_a_reader_holding_the_log_is_reported_and_forgetting_again_finishes(tmp_path):
    store, _, _ = two_users(tmp_path)
    reader = Store(tmp_path / "store.sqlite", readonly=True)
    reader.db.connection.execute("BEGIN")
    reader.db.connection.execute("SELECT COUNT(*) FROM turns").fetchone()  # a read transaction pins the log

    first = store.forget_owner(ALICE, reader_wait_s=0.2)

    assert not first.log_truncated and first.samples == 3
    assert [t.owner for t in store.turns()] == [BOB, BOB]
    reader.db.connection.execute("COMMIT")
    reader.close()
    second = store.forget_owner(ALICE)
    assert second.turn_ids == [] and second.log_truncated
    assert ALICE_TEXT.encode() not in file_bytes(store)
    store.close()


def test_forgetting_needs_an_owner(tmp_path):
    store, alice, bob = two_users(tmp_path)
    with pytest.raises(ValueError, match="would forget everyone"):
        store.forget_owner("")
    assert store.forget_owner("fp-nobody").turn_ids == []
    assert sorted(t.id for t in store.turns() if t.owner) != [] and len(store.turns()) == 5
    store.close()


def test_forgetting_is_refused_while_another_writer_has_the_store_open(tmp_path):
    store, alice, _ = two_users(tmp_path)
    server = Store(tmp_path / "store.sqlite")  # another writer: a running server, say
    with pytest.raises(StoreInUse, match="open for writing elsewhere"):
        store.forget_owner(ALICE)
    assert {t.id for t in store.turns()} >= set(alice)  # nothing was deleted
    server.close()
    assert store.forget_owner(ALICE).samples == 3
    store.close()
