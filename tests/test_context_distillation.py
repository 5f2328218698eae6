"""Context distillation: the teacher's own answers to a hinted turn, stored, leased and trained like any sample,
on the tiny model with a real store, a scripted judge server and the real tokenizer."""

import asyncio

import pytest
import torch

from clawloop.config import Config, ConfigError
from clawloop.engines.model_files import end_token_ids
from clawloop.dashboard.readmodel import RunView
from clawloop.engines.base import Generation
from clawloop.judge.client import HTTPJudgeClient
from clawloop.judge.scripted import ScriptedJudgeServer
from clawloop.judge.votes import Judge, JudgeSettings
from clawloop.pipeline import Pipeline
from clawloop.renderers import chat_render_fn
from clawloop.store import CONTEXT_KIND, Store, TurnState
from clawloop.teacher import DRAFT_PREFIX, HINT_PREFIX, Teacher
from clawloop.wire import TeacherRequest

from pipeline_support import CaseJudge, add_judgeable_turn
from tests.test_pipeline import run_until_drained

HINT_TEXT = "Give the temperature in Fahrenheit."


class RecordingEngine:
    """The tiny engine, keeping every prompt it was asked to answer and every answer it sampled."""

    def __init__(self, engine):
        self.engine = engine
        self.asked: list[list[int]] = []
        self.answers: list[list[int]] = []

    async def generate(self, prompt_ids, params):
        self.asked.append(list(prompt_ids))
        answer = await self.engine.generate(prompt_ids, params)
        self.answers.append(list(answer.token_ids))
        return answer

    async def score(self, requests):
        return await self.engine.score(requests)


@pytest.fixture
def judge_server():
    with ScriptedJudgeServer(CaseJudge()) as server:
        yield server


def make_config(server, tmp_path, tiny_model_path, **overrides):
    values = dict(model=str(tiny_model_path), device="cpu", judge_url=server.url, judge_model="m", prm_m=3,
                  judge_timeout_s=2.0, judge_retries=1, topk=4, context_samples=2, context_max_tokens=6,
                  run_dir=str(tmp_path / "run"), rollout_batch_size=8, micro_batch_size=4, lr=1e-3,
                  checkpoint_every=1000, metrics_backends=["jsonl"], gate=False,
                  context_guard=False)  # the random tiny model's answers are word salad the guard would drop
    values.update(overrides)
    return Config.from_dict(values)


def make_pipeline(store, config, teacher_engine, tokenizer):
    client = HTTPJudgeClient(config.judge_url, "m", timeout_s=config.judge_timeout_s, retries=config.judge_retries,
                             backoff_s=0.01, concurrency=8)
    teacher = Teacher(teacher_engine, chat_render_fn(tokenizer), config, tokenizer=tokenizer)
    return Pipeline(store, config, judge=Judge(client, JudgeSettings.from_config(config)), poll_interval_s=0.1,
                    teacher=teacher)


def context_samples(store):
    return [s for s in store.samples() if s.kind == CONTEXT_KIND]


def judged_with_context(tmp_path, server, tiny_model_path, tiny_engine, tiny_tokenizer, **overrides):
    """A store whose one hinted turn went through the pipeline; (store, config, source turn id, teacher engine)."""
    config = make_config(server, tmp_path, tiny_model_path, **overrides)
    store = Store(tmp_path / "run.db")
    source = add_judgeable_turn(store, tiny_tokenizer, "good")
    engine = RecordingEngine(tiny_engine)
    assert run_until_drained(make_pipeline(store, config, engine, tiny_tokenizer))
    return store, config, source, engine


def test_a_hinted_turn_yields_the_teachers_answers_without_the_hint(tmp_path, judge_server, tiny_model_path,
                                                                    tiny_engine, tiny_tokenizer):
    store, _, source, engine = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                   tiny_tokenizer)
    served = store.get_turn(source)
    assert served.sample_kind == "rl+opd" and store.get_sample(source).info["context_answers"] == 2

    contexts = context_samples(store)
    assert len(contexts) == 2 and store.context_turn_ids(source) == [s.turn_id for s in contexts]
    for sample in contexts:
        turn = store.get_turn(sample.turn_id)
        assert turn.state == TurnState.READY and turn.sample_kind == CONTEXT_KIND
        assert store.context_source(sample.turn_id) == source
        # Trained on the un-hinted prompt: the served ids and request, no hint anywhere.
        assert turn.prompt_ids == served.prompt_ids and turn.messages == served.messages
        assert HINT_TEXT not in tiny_tokenizer.decode(turn.prompt_ids)
        # sft: a +1 vote and no hint candidates, so only the GRPO branch trains it.
        assert sample.reward == 1.0 and sample.hints == [] and sample.info["hint"] == HINT_TEXT
    # The teacher was asked under the hint, and what it sampled is exactly what is stored.
    assert len(engine.asked) == 2
    assert all(HINT_PREFIX + HINT_TEXT in tiny_tokenizer.decode(ids) for ids in engine.asked)
    assert sorted(store.get_turn(s.turn_id).response_ids for s in contexts) == sorted(engine.answers)
    assert sum(1 for t in store.turns() if t.sample_kind == CONTEXT_KIND) == 2


class ScriptedTeacherEngine:
    """A teacher engine that answers with the given texts in turn (tokenised by the real tokenizer), as a small
    model's hinted answers can be: sound, or an echo of the question."""

    def __init__(self, tokenizer, texts):
        self.tokenizer = tokenizer
        self.texts = list(texts)

    async def generate(self, prompt_ids, params):
        text = self.texts.pop(0)
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + end_token_ids(self.tokenizer)[:1]
        return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason="stop", policy_version=0,
                          prompt_tokens=len(prompt_ids), text=text)


def test_an_answer_the_guard_flags_is_not_trained_as_a_good_one(tmp_path, judge_server, tiny_model_path,
                                                                 tiny_tokenizer):
    sound, echo = "It is 68 degrees Fahrenheit in Paris today.", "What is the temperature in Paris?"
    config = make_config(judge_server, tmp_path, tiny_model_path, context_guard=True)
    store = Store(tmp_path / "run.db")
    source = add_judgeable_turn(store, tiny_tokenizer, "good")  # asks "What is the temperature in Paris?"
    engine = ScriptedTeacherEngine(tiny_tokenizer, [echo, sound])
    pipeline = make_pipeline(store, config, engine, tiny_tokenizer)
    assert run_until_drained(pipeline)

    contexts = context_samples(store)
    assert [store.get_turn(s.turn_id).response_text for s in contexts] == [sound]
    info = store.get_sample(source).info
    # Which index drew the echo depends on which call reached the engine first.
    assert info["context_answers"] == 1 and [u.split(": ")[1] for u in info["context_unsound"]] == ["echo"]
    assert pipeline.stats["context_unsound"] == 1
    # The dashboard's session view says which answer was left out and why.
    turns = {t["turn_id"]: t for t in RunView(tmp_path, store_path=tmp_path / "run.db").session("s")["turns"]}
    assert turns[source]["sample"]["info"]["context_unsound"] == info["context_unsound"]

    # With the setting off, both are kept.
    config_off = make_config(judge_server, tmp_path / "off", tiny_model_path, context_guard=False)
    store_off = Store(tmp_path / "off.db")
    add_judgeable_turn(store_off, tiny_tokenizer, "good")
    engine_off = ScriptedTeacherEngine(tiny_tokenizer, [echo, sound])
    assert run_until_drained(make_pipeline(store_off, config_off, engine_off, tiny_tokenizer))
    kept = sorted(store_off.get_turn(s.turn_id).response_text for s in context_samples(store_off))
    assert kept == sorted([echo, sound])


def test_drafted_context_answers_show_the_teacher_the_served_answer_and_scoring_does_not(
        tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer):
    store, config, source, engine = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                        tiny_tokenizer, context_draft=True)
    served = store.get_turn(source)
    draft = tiny_tokenizer.decode([i for i in served.response_ids if i not in set(end_token_ids(tiny_tokenizer))],
                                  skip_special_tokens=True).strip()
    assert draft and len(engine.asked) == 2
    for ids in engine.asked:  # asked: hint, the served answer to rewrite, hint again
        text = tiny_tokenizer.decode(ids)
        assert DRAFT_PREFIX + draft in text and text.count(HINT_TEXT) == 2
    assert len(context_samples(store)) == 2
    # The teacher's scores of the served turn read the hint alone (teacher_draft is off).
    teacher = Teacher(engine, chat_render_fn(tiny_tokenizer), config, tokenizer=tiny_tokenizer)
    scored = tiny_tokenizer.decode(teacher.prompt_ids(served, HINT_TEXT))
    assert HINT_PREFIX + HINT_TEXT in scored and DRAFT_PREFIX not in scored


def test_under_a_mixed_target_the_answer_is_the_unhinted_ones_cut_where_the_hinted_prompt_would_stop(
        tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer):
    store, _, source, engine = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                   tiny_tokenizer, opd_target="end", context_max_tokens=12)
    served = store.get_turn(source)
    contexts = context_samples(store)
    assert contexts and store.get_sample(source).info["context_answers"] == len(contexts)
    # Sampled from the un-hinted prompt (the served one); the hinted prompt only scored them.
    assert engine.asked and all(ids == served.prompt_ids for ids in engine.asked)
    ends = set(end_token_ids(tiny_tokenizer))
    for sample in contexts:
        response = store.get_turn(sample.turn_id).response_ids
        assert any(response == full or (response[-1] in ends and response[:-1] == full[:len(response) - 1])
                   for full in engine.answers)


def test_unhinted_turns_and_the_default_make_no_context_answers(tmp_path, judge_server, tiny_model_path,
                                                                tiny_engine, tiny_tokenizer):
    config = make_config(judge_server, tmp_path, tiny_model_path, context_samples=0)
    store = Store(tmp_path / "run.db")
    add_judgeable_turn(store, tiny_tokenizer, "good")
    add_judgeable_turn(store, tiny_tokenizer, "rl_only")
    engine = RecordingEngine(tiny_engine)
    assert run_until_drained(make_pipeline(store, config, engine, tiny_tokenizer))
    assert engine.asked == [] and context_samples(store) == []

    config = make_config(judge_server, tmp_path, tiny_model_path)
    store = Store(tmp_path / "run2.db")
    add_judgeable_turn(store, tiny_tokenizer, "rl_only")
    assert run_until_drained(make_pipeline(store, config, engine, tiny_tokenizer))
    assert engine.asked == [] and context_samples(store) == []


def test_a_crash_before_the_write_leaves_nothing_and_the_retry_stores_each_answer_once(
        tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer):
    config = make_config(judge_server, tmp_path, tiny_model_path)
    path = tmp_path / "run.db"
    store = Store(path)
    source = add_judgeable_turn(store, tiny_tokenizer, "good")
    engine = RecordingEngine(tiny_engine)
    pipeline = make_pipeline(store, config, engine, tiny_tokenizer)

    def crash(*args, **kwargs):
        raise RuntimeError("the process dies here")

    store.put_sample = crash
    [turn] = store.claim_judgeable(1)
    with pytest.raises(RuntimeError):
        asyncio.run(pipeline.process(turn))
    first = list(engine.answers)
    assert len(first) == 2 and context_samples(store) == [] and store.get_turn(source).state == TurnState.JUDGING
    store.close()

    store = Store(path)  # the restarted process: recovery hands the turn back to the judge
    assert run_until_drained(make_pipeline(store, config, engine, tiny_tokenizer))
    contexts = context_samples(store)
    assert len(contexts) == 2 and len(store.turns()) == 3
    # Seeded per (turn, index): the retry sampled the very answers the crashed attempt had.
    assert sorted(store.get_turn(s.turn_id).response_ids for s in contexts) == sorted(first)


def test_a_greedy_turn_stores_its_one_answer_once(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                  tiny_tokenizer):
    config = make_config(judge_server, tmp_path, tiny_model_path)
    store = Store(tmp_path / "run.db")
    source = add_judgeable_turn(store, tiny_tokenizer, "good")
    with store.db.tx() as db:
        db.execute("UPDATE turns SET temperature=0 WHERE id=?", (source,))
    assert run_until_drained(make_pipeline(store, config, RecordingEngine(tiny_engine), tiny_tokenizer))
    assert len(context_samples(store)) == 1
    assert store.get_sample(source).info["context_repeats"] == 1


def test_context_samples_train_once_and_requeues_do_not_duplicate_them(tmp_path, judge_server, tiny_model_path,
                                                                      tiny_engine, tiny_tokenizer):
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion

    store, config, source, _ = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                   tiny_tokenizer)
    contexts = {s.turn_id for s in context_samples(store)}
    trainer = Trainer(config, store, LocalVersion(), console=None)

    # A failed step gives its lease back: the same three samples are ready again, none added.
    lease_id, leased = store.lease_samples(8)
    assert {s.turn_id for s in leased} == contexts | {source}
    store.release_lease(lease_id)
    assert store.count_samples() == {TurnState.READY: 3}

    metrics = trainer.run_batch(*store.lease_samples(8))
    assert metrics is not None and metrics["context_samples"] == 2.0 and metrics["samples"] == 3.0
    assert all(store.get_sample(t).consumed_step == 1 for t in contexts)
    assert store.lease_samples(8)[1] == []  # trained exactly once

    # Resuming from before that step requeues its samples: the same ones, trained again by the next step.
    assert store.requeue_after_step(0) == 3
    assert {s.turn_id for s in context_samples(store)} == contexts
    metrics = trainer.run_batch(*store.lease_samples(8))
    assert metrics["context_samples"] == 2.0 and store.count_samples() == {TurnState.CONSUMED: 3}
    assert sum(1 for s in store.samples() if s.kind == CONTEXT_KIND) == 2


def test_context_samples_are_never_stale(tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer):
    """The policy did not sample them: its age neither drops them nor weights them."""
    from clawloop.trainer.batch import prepare_items

    store, config, source, _ = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                   tiny_tokenizer, staleness_mode="drop", max_staleness=0)
    items, drops, stats = prepare_items(store, store.samples(), config, current_version=5)
    assert drops == [(source, "stale")] and stats.gaps == []
    assert sorted(it.turn_id for it in items) == store.context_turn_ids(source)
    assert not any(it.importance_correct for it in items)


def test_objective_context_samples_carry_the_hints_and_are_scored_at_their_own_ids(
        tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer):
    store, config, source, engine = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine,
                                                        tiny_tokenizer, context_loss="objective")
    contexts = context_samples(store)
    assert len(contexts) == 2
    assert all(s.hints == store.get_sample(source).hints and s.reward == 0.0 for s in contexts)

    sample = contexts[0]
    turn = store.get_turn(sample.turn_id)
    teacher = Teacher(engine, chat_render_fn(tiny_tokenizer), config)
    T = len(turn.response_ids)
    ids_T_K = torch.arange(4).repeat(T, 1)
    [scores] = asyncio.run(teacher.score([TeacherRequest(turn=turn, hints=sample.hints, student_ids_T_K=ids_T_K,
                                                         temperature=0.6)]))
    assert tuple(scores.teacher_at_student_C_T_K.shape) == (1, T, 4)
    # Scored under the very prompt the teacher sampled the answer from.
    assert teacher.prompt_ids(turn, sample.hints[0]) in engine.asked


def test_the_dashboard_shows_the_context_kind(tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer):
    store, _, source, _ = judged_with_context(tmp_path, judge_server, tiny_model_path, tiny_engine, tiny_tokenizer)
    view = RunView(tmp_path, store_path=tmp_path / "run.db")
    overview = view.overview()
    assert overview["samples_by_kind"] == {"context": 2, "rl+opd": 1}
    assert overview["turns_total"] == 1 and overview["context_turns"] == 2  # only one turn was served
    assert sum(overview["turns_by_state"].values()) == 1  # the bars count what was served, as the total does
    turns = {t["turn_id"]: t for t in view.session("s")["turns"]}
    assert turns[source]["context_turn_ids"] == store.context_turn_ids(source)
    for turn_id in store.context_turn_ids(source):
        assert turns[turn_id]["sample"]["kind"] == CONTEXT_KIND and turns[turn_id]["context_of"] == source


def test_settings_are_checked(judge_server, tmp_path, tiny_model_path):
    assert Config().context_samples == 0  # off by default
    with pytest.raises(ConfigError, match="context_loss"):
        make_config(judge_server, tmp_path, tiny_model_path, context_loss="kl")
    with pytest.raises(ConfigError, match="GRPO branch"):
        make_config(judge_server, tmp_path, tiny_model_path, method="opd")
    with pytest.raises(ConfigError, match="OPD branch|hints"):
        make_config(judge_server, tmp_path, tiny_model_path, method="rl", context_loss="objective")
    make_config(judge_server, tmp_path, tiny_model_path, method="opd", context_loss="objective")
    with pytest.raises(ConfigError, match="context_draft"):
        make_config(judge_server, tmp_path, tiny_model_path, context_samples=0, context_draft=True)
    with pytest.raises(ConfigError, match="context_draft"):
        make_config(judge_server, tmp_path, tiny_model_path, context_draft=True, context_loss="objective")


def test_the_store_keeps_one_answer_per_turn_and_index(tmp_path, tiny_tokenizer):
    from clawloop.store import ContextSample, SampleRecord, TurnRecord

    store = Store(tmp_path / "run.db")
    source = add_judgeable_turn(store, tiny_tokenizer, "good")
    [served] = store.claim_judgeable(1)

    def answer(index, ids):
        turn = TurnRecord(session_id=served.session_id, messages=served.messages, prompt_ids=served.prompt_ids,
                          response_ids=ids, logprobs=[-0.5] * len(ids), temperature=0.6, top_p=1.0,
                          policy_version=0)
        return ContextSample(index=index, turn=turn, sample=SampleRecord(turn_id=0, reward=1.0, kind=CONTEXT_KIND))

    batch = [answer(0, [5, 6, 2]), answer(0, [7, 2]), answer(1, [8, 2])]
    assert store.put_sample(SampleRecord(turn_id=source, reward=1.0, kind="rl"), batch)
    assert [store.get_turn(t).response_ids for t in store.context_turn_ids(source)] == [[5, 6, 2], [8, 2]]
    assert batch[1].turn.id is None  # index 0 was taken: nothing of it was written
    # The turn has its sample: a second write, context and all, is refused.
    assert not store.put_sample(SampleRecord(turn_id=source, reward=1.0, kind="rl"), [answer(2, [9, 2])])
    assert len(store.context_turn_ids(source)) == 2 and len(store.turns()) == 3
