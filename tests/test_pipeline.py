"""The judge -> sample pipeline on a real store, a real local judge server and the tiny model."""

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from clawloop.config import Config
from clawloop.engines.base import SamplingParams
from clawloop.judge.client import HTTPJudgeClient
from clawloop.judge.scripted import ScriptedJudgeServer
from clawloop.judge.votes import Judge, JudgeSettings
from clawloop.pipeline import Pipeline, sample_kind
from clawloop.store import Store, TurnState, VoteRecord

from pipeline_support import CaseJudge, add_judgeable_turn

HERE = Path(__file__).resolve().parent


def test_sample_kind_rule():
    assert sample_kind(1, True) == "rl+opd" and sample_kind(-1, True) == "rl+opd"
    assert sample_kind(0, True) == "opd"
    assert sample_kind(1, False) == "rl" and sample_kind(-1, False) == "rl"
    assert sample_kind(0, False) is None


@pytest.fixture
def judge_server():
    with ScriptedJudgeServer(CaseJudge()) as server:
        yield server


def make_pipeline(store, server, engine, tokenizer, **overrides):
    pipe_kw = {k: overrides.pop(k) for k in ("turn_deadline_s", "max_attempts", "concurrency") if k in overrides}
    settings = dict(model="tiny", judge_url=server.url, judge_model="m", prm_m=3, judge_timeout_s=0.5,
                    judge_retries=1, topk=4)
    config = Config(**{**settings, **overrides}).validate()
    client = HTTPJudgeClient(server.url, "m", timeout_s=config.judge_timeout_s, retries=config.judge_retries,
                             backoff_s=0.01, concurrency=8)
    judge = Judge(client, JudgeSettings.from_config(config))
    pipe_kw.setdefault("concurrency", 3)
    return Pipeline(store, config, judge=judge, poll_interval_s=0.1, **pipe_kw)


class CountingScores:
    """Counts ``score`` calls on an engine (the pipeline must make none: the trainer asks the teacher)."""

    def __init__(self, engine):
        self.engine, self.calls, self.inner = engine, 0, engine.score

    async def score(self, requests):
        self.calls += 1
        return await self.inner(requests)

    def __enter__(self):
        self.engine.score = self.score
        return self

    def __exit__(self, *exc):
        del self.engine.score


def run_until_drained(pipeline, timeout_s=60.0):
    async def go():
        await pipeline.start()
        pipeline.notify()
        drained = await pipeline.drain(timeout_s=timeout_s)
        await pipeline.stop()
        return drained

    return asyncio.run(go())


def outcomes(store):
    out = {}
    for turn in store.turns():  # a sample's kind, or why the turn was dropped
        out[turn.id] = (turn.state, turn.sample_kind or turn.reason)
    return out


def test_assembly_rules(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "run.db")
    ids = {case: add_judgeable_turn(store, tiny_tokenizer, case)
           for case in ("good", "hint_only", "rl_only", "nothing")}
    empty = add_judgeable_turn(store, tiny_tokenizer, "good", next_state=[])
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer)
    with CountingScores(tiny_engine) as counter:
        assert run_until_drained(pipeline)
    assert counter.calls == 0  # votes and hints only: no student top-k, no teacher at judging time

    got = outcomes(store)
    assert got[ids["good"]] == (TurnState.READY, "rl+opd")
    assert got[ids["hint_only"]] == (TurnState.READY, "opd")
    assert got[ids["rl_only"]] == (TurnState.READY, "rl")
    assert got[ids["nothing"]] == (TurnState.DROPPED, "no_signal")
    assert got[empty] == (TurnState.DROPPED, "no_next_state")

    samples = {s.turn_id: s for s in store.samples()}
    good = samples[ids["good"]]
    assert good.reward == 1.0 and good.hints == ["Give the temperature in Fahrenheit."]
    assert good.info["eval_scores"] == [1, 1, 1] and "teacher" not in good.info
    assert samples[ids["hint_only"]].reward == 0.0 and samples[ids["hint_only"]].hints
    assert samples[ids["rl_only"]].reward == -1.0 and samples[ids["rl_only"]].hints == []
    assert all(s.targets is None and s.teacher_version == 0 for s in samples.values())  # the trainer asks later

    votes = store.votes(ids["good"])
    assert sorted((v.kind, v.index) for v in votes) == [("eval", i) for i in range(3)] + [("hint", i) for i in range(3)]
    assert all(v.attempt == 0 and v.raw_text and v.latency_s > 0 for v in votes)


def test_anchor_samples_are_written_as_judged(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    """With ``opd_on_unhinted = anchor`` an RL-only sample is still just votes: its anchor candidate is scored by
    the trainer (tests/trainer/test_teacher_client.py)."""
    store = Store(tmp_path / "run.db")
    tid = add_judgeable_turn(store, tiny_tokenizer, "rl_only")
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, opd_on_unhinted="anchor")
    with CountingScores(tiny_engine) as counter:
        assert run_until_drained(pipeline)
    (sample,) = store.samples()
    assert sample.turn_id == tid and sample.kind == "rl" and sample.hints == [] and sample.targets is None
    assert counter.calls == 0


def test_method_presets_skip_unneeded_work(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "rl.db")
    good = add_judgeable_turn(store, tiny_tokenizer, "good")
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, method="rl")
    assert run_until_drained(pipeline)
    (sample,) = store.samples()
    assert sample.kind == "rl" and sample.targets is None and sample.hints == []
    assert {v.kind for v in store.votes(good)} == {"eval"}

    store = Store(tmp_path / "opd.db")
    good = add_judgeable_turn(store, tiny_tokenizer, "good")
    rl_only = add_judgeable_turn(store, tiny_tokenizer, "rl_only")
    assert run_until_drained(make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, method="opd"))
    assert {v.kind for v in store.votes(good)} == {"hint"}
    assert outcomes(store)[good] == (TurnState.READY, "opd")
    assert outcomes(store)[rl_only] == (TurnState.DROPPED, "no_signal")


def test_faulty_judge_never_stalls_anything(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    """The judge hangs, errors and talks garbage: every turn still ends with a recorded reason, the good ones
    become samples, and the engine keeps answering requests meanwhile."""
    store = Store(tmp_path / "run.db")
    cases = ["hang", "error", "garbage_text", "garbage_body", "mixed", "good", "hang", "good"]
    ids = [add_judgeable_turn(store, tiny_tokenizer, c) for c in cases]
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, concurrency=4)

    async def go():
        await pipeline.start()
        # While hanging judge calls are in flight, serving goes on.
        while store.count_turns().get(TurnState.JUDGING, 0) == 0:
            await asyncio.sleep(0.01)
        gen = await asyncio.wait_for(tiny_engine.generate([1, 4093, 198], SamplingParams(max_tokens=4)), 30)
        drained = await pipeline.drain(timeout_s=60)
        await pipeline.stop()
        return gen, drained

    gen, drained = asyncio.run(go())
    assert drained and len(gen.token_ids) > 0
    got = outcomes(store)
    assert set(store.count_turns()) <= {TurnState.READY, TurnState.DROPPED}
    for tid, case in zip(ids, cases):
        state, reason = got[tid]
        if case == "good":
            assert (state, reason) == (TurnState.READY, "rl+opd")
        elif case == "mixed":
            assert (state, reason) == (TurnState.READY, "rl")
        else:
            assert (state, reason) == (TurnState.DROPPED, "judge_failed"), case
        votes = store.votes(tid)
        assert len(votes) == 6  # every vote recorded, valid or not
        if case in ("hang", "error", "garbage_body"):
            assert all(v.score is None and v.error for v in votes)
    hang_errors = {v.error for v in store.votes(ids[0])}
    assert all("timed out" in e for e in hang_errors)
    assert any("HTTP 500" in v.error for v in store.votes(ids[1]))
    garbage = store.votes(ids[2])
    assert all(v.raw_text and "no \\boxed" in v.error for v in garbage if v.kind == "eval")
    assert all("unreadable response body" in v.error for v in store.votes(ids[3]))
    assert pipeline.busy == 0


def test_turn_deadline(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "run.db")
    tid = add_judgeable_turn(store, tiny_tokenizer, "hang")
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, judge_timeout_s=30,
                             turn_deadline_s=0.5)
    assert run_until_drained(pipeline)
    assert outcomes(store)[tid] == (TurnState.DROPPED, "judge_failed")
    assert all("deadline" in v.error for v in store.votes(tid))


def test_polling_picks_up_turns_without_notify(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "run.db")
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer)

    async def go():
        await pipeline.start()
        await asyncio.sleep(0.2)
        tid = add_judgeable_turn(store, tiny_tokenizer, "rl_only")  # nobody calls notify()
        for _ in range(600):
            if store.get_turn(tid).state == TurnState.READY:
                break
            await asyncio.sleep(0.05)
        await pipeline.stop()
        return tid

    tid = asyncio.run(go())
    assert store.get_turn(tid).state == TurnState.READY


def test_restart_redoes_interrupted_work_with_a_new_attempt(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "run.db")
    tid = add_judgeable_turn(store, tiny_tokenizer, "good")
    # A previous process claimed it, wrote one vote and died.
    assert [t.id for t in store.claim_judgeable(1)] == [tid]
    store.add_votes([VoteRecord(turn_id=tid, kind="eval", index=0, score=-1, raw_text="\\boxed{-1}")])
    assert run_until_drained(make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer))
    (sample,) = store.samples()
    assert sample.kind == "rl+opd" and sample.reward == 1.0 and sample.info["attempt"] == 1  # old vote ignored
    assert sorted({v.attempt for v in store.votes(tid)}) == [0, 1]


def test_a_turn_that_keeps_failing_is_dropped(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "run.db")
    tid = add_judgeable_turn(store, tiny_tokenizer, "good")
    store.add_votes([VoteRecord(turn_id=tid, kind="eval", index=0, score=None, attempt=a) for a in range(3)])
    assert run_until_drained(make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, max_attempts=3))
    assert outcomes(store)[tid] == (TurnState.DROPPED, "too_many_attempts")


class ThreadRecordingStore(Store):
    """A real store that records which thread each of the pipeline's calls ran on."""

    CALLS = ("recover", "claim_judgeable", "add_votes", "put_sample", "drop_turn", "votes", "count_turns",
             "transition")

    def __init__(self, path):
        super().__init__(path)
        self.threads: list[tuple[str, int]] = []
        for name in self.CALLS:
            setattr(self, name, self._recording(name, getattr(super(), name)))

    def _recording(self, name, method):
        def call(*args, **kwargs):
            self.threads.append((name, threading.get_ident()))
            return method(*args, **kwargs)
        return call


def test_store_calls_never_block_the_event_loop(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    """Every store call of the pipeline runs in a worker thread, so serving on the loop never waits for the
    store's lock (which a trainer transaction may hold)."""
    store = ThreadRecordingStore(tmp_path / "run.db")
    cases = ["good", "nothing", "hang"]
    for case in cases:
        add_judgeable_turn(store, tiny_tokenizer, case)
    empty = add_judgeable_turn(store, tiny_tokenizer, "good", next_state=[])
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, judge_timeout_s=30,
                             turn_deadline_s=1.0)
    store.threads.clear()

    async def go():
        loop_thread = threading.get_ident()
        await pipeline.start()
        pipeline.notify()
        assert await pipeline.drain(timeout_s=60)
        await pipeline.stop()
        return loop_thread

    loop_thread = asyncio.run(go())
    called = {name for name, _ in store.threads}
    assert {"recover", "claim_judgeable", "add_votes", "put_sample", "drop_turn", "votes", "count_turns"} <= called
    on_loop = [name for name, thread in store.threads if thread == loop_thread]
    assert on_loop == [], on_loop
    assert outcomes(store)[empty] == (TurnState.DROPPED, "no_next_state")


def test_stop_hands_in_flight_turns_back(tmp_path, judge_server, tiny_engine, tiny_tokenizer):
    store = Store(tmp_path / "run.db")
    tid = add_judgeable_turn(store, tiny_tokenizer, "hang")
    pipeline = make_pipeline(store, judge_server, tiny_engine, tiny_tokenizer, judge_timeout_s=30)

    async def go():
        await pipeline.start()
        while store.get_turn(tid).state != TurnState.JUDGING:
            await asyncio.sleep(0.01)
        await pipeline.stop()

    asyncio.run(go())
    assert store.get_turn(tid).state == TurnState.JUDGEABLE
    assert store.samples() == []


# ---- crash ------------------------------------------------------------------------------------------------

def test_kill_9_while_judging_then_restart(tmp_path, tiny_tokenizer):
    """Every judgeable turn becomes exactly one sample or one recorded drop, whatever the crash interrupted."""
    store_path = tmp_path / "run.db"
    store = Store(store_path)
    cases = ["good", "rl_only", "hint_only", "nothing", "good", "rl_only", "good", "hint_only"]
    held = 4  # this turn's judge calls after its first are held, so the kill finds it judging with one vote
    ids = [add_judgeable_turn(store, tiny_tokenizer, c, session=f"s{i}",
                              next_state=[{"role": "user", "content": "In Fahrenheit please. hold-this-turn"}]
                              if i == held else None)
           for i, c in enumerate(cases)]
    scripted = CaseJudge()
    release = threading.Event()
    held_calls = itertools.count()

    def judge(body):
        time.sleep(0.1)
        if "hold-this-turn" in json.dumps(body) and next(held_calls) > 0:
            release.wait(60)  # answered only after the kill (or never, if the worker is gone)
        return scripted(body)

    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cmd = [sys.executable, str(HERE / "pipeline_crash_worker.py"), str(store_path)]
    with ScriptedJudgeServer(judge) as server:
        first = subprocess.Popen(cmd + [server.url], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 240
            killed_while_judging = False
            while time.monotonic() < deadline and first.poll() is None:
                if (store.count_samples() and store.get_turn(ids[held]).state == TurnState.JUDGING
                        and store.votes(ids[held])):
                    first.send_signal(signal.SIGKILL)
                    killed_while_judging = True
                    break
                time.sleep(0.02)
            first.wait(30)
        finally:
            if first.poll() is None:
                first.kill()
            release.set()
        assert killed_while_judging, first.stderr.read().decode()[-3000:]
        assert first.returncode == -signal.SIGKILL
        interrupted = {t.id: store.votes(t.id) for t in store.turns(state=TurnState.JUDGING)}
        assert any(interrupted.values())  # at least one turn died with some of its votes written

        second = subprocess.run(cmd + [server.url], env=env, capture_output=True, timeout=300)
        assert second.returncode == 0, second.stderr.decode()[-3000:]
        assert b"drained=True" in second.stdout

    counts = store.count_turns()
    assert set(counts) <= {TurnState.READY, TurnState.DROPPED}, counts
    samples = store.samples()
    assert len({s.turn_id for s in samples}) == len(samples)  # never two samples for a turn
    by_turn = {s.turn_id: s for s in samples}
    for tid, case in zip(ids, cases):
        turn = store.get_turn(tid)
        if case == "nothing":
            assert (turn.state, turn.reason) == (TurnState.DROPPED, "no_signal")
            assert tid not in by_turn
        else:
            assert turn.state == TurnState.READY and by_turn[tid].kind == turn.sample_kind and turn.reason == ""
    for tid, earlier_votes in interrupted.items():
        if earlier_votes:  # judged again after the restart, under a new attempt number
            assert max(v.attempt for v in store.votes(tid)) == 1
            if tid in by_turn:
                assert by_turn[tid].info["attempt"] == 1
    assert all(s.targets is None for s in samples)
