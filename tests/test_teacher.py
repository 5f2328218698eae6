"""Hint injection and the teacher's scores at given ids, checked against an independent forward pass."""

import asyncio
import gzip
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from clawloop.renderers import ChatRenderer
from clawloop.config import Config
from clawloop.engines.base import SamplingParams
from clawloop.judge.prompts import content_text
from clawloop.openclaw_format import is_ephemeral
from clawloop.renderers import chat_render_fn
from clawloop.store import TurnRecord
from clawloop.teacher import Teacher, inject_hint, train_temperature
from clawloop.wire import TeacherRequest, TeacherScores
from tests.counting_engine import CountingEngine

TOOL_LOOP = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "List the files."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "a.txt b.txt"},
]
TOOLS = [{"type": "function", "function": {"name": "ls", "description": "list files",
                                           "parameters": {"type": "object", "properties": {}}}}]


# ---- hint injection -------------------------------------------------------------------------------------

def test_hint_goes_into_last_user_message_only():
    messages = TOOL_LOOP[:1] + [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}] \
        + TOOL_LOOP[1:]
    out = inject_hint(messages, "Sort them by size.")
    assert out[3]["content"] == "List the files.\n\n[user's hint / instruction]\nSort them by size."
    # everything else untouched, including the tool messages after the last user message and earlier users
    assert out[:3] == messages[:3] and out[4:] == messages[4:]
    assert messages[3]["content"] == "List the files."  # the input is not modified


def test_hint_goes_to_the_user_s_words_not_to_openclaw_s_internal_context():
    """OpenClaw with its default tools ends each request with a user message holding only its runtime context
    (a real request, tests/data/openclaw): the hint goes after what the user wrote, before that block."""
    with gzip.open(Path(__file__).parent / "data" / "openclaw" / "compacted-default-tools.json.gz", "rt",
                   encoding="utf-8") as fh:
        messages = json.load(fh)["requests"][0]["messages"]
    assert is_ephemeral(messages[-1])
    out = inject_hint(messages, "Answer in one short sentence.")
    changed = [i for i, (a, b) in enumerate(zip(messages, out)) if a != b]
    assert len(changed) == 1 and out[-1] == messages[-1]
    target = out[changed[0]]
    assert target["role"] == "user" and not is_ephemeral(messages[changed[0]])
    assert content_text(target["content"]).endswith("[user's hint / instruction]\nAnswer in one short sentence.")
    assert not any(not is_ephemeral(m) for m in messages[changed[0] + 1:] if m.get("role") == "user")


def test_hint_without_user_message_adds_one():
    messages = [{"role": "system", "content": "sys"}]
    assert inject_hint(messages, "Be brief.") == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "[user's hint / instruction]\nBe brief."}]
    assert inject_hint([], "Be brief.") == [{"role": "user", "content": "[user's hint / instruction]\nBe brief."}]


def test_hint_into_content_parts():
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert inject_hint(messages, "Wave.")[0]["content"] == "Hello there\n\n[user's hint / instruction]\nWave."


def test_draft_sits_between_the_hint_and_the_hint_again():
    messages = [{"role": "user", "content": "How many days are in a week?"}]
    out = inject_hint(messages, 'Begin every answer with "In short,".', draft="There are 7 days in a week.")
    assert out[0]["content"] == ('How many days are in a week?\n\n[user\'s hint / instruction]\n'
                                 'Begin every answer with "In short,".\n\n'
                                 '[a correct answer to rewrite so that it follows the instruction]\n'
                                 'There are 7 days in a week.\n\nBegin every answer with "In short,".')
    assert inject_hint([], "Be brief.", draft="Long.")[0]["content"] == (
        "[user's hint / instruction]\nBe brief.\n\n[a correct answer to rewrite so that it follows the "
        "instruction]\nLong.\n\nBe brief.")


def test_system_placement_adds_the_hint_to_the_system_prompt_too():
    """``hint_placement = "system_and_user"``: the hint also ends the system message, or starts a new one after
    the template's default text; the user message gets it as before, and the input is not modified."""
    hinted = "\n\n[user's hint / instruction]\nBe brief."
    out = inject_hint(TOOL_LOOP, "Be brief.", system="ignored while a system message exists")
    assert out[0] == {"role": "system", "content": "You are terse." + hinted}
    assert out[1]["content"] == "List the files." + hinted and out[2:] == TOOL_LOOP[2:]
    assert TOOL_LOOP[0]["content"] == "You are terse."
    question = [{"role": "user", "content": "Q?"}]
    assert inject_hint(question, "Be brief.", system="Default.") == [
        {"role": "system", "content": "Default." + hinted}, {"role": "user", "content": "Q?" + hinted}]
    assert inject_hint(question, "Be brief.", system="")[0] == {"role": "system", "content": hinted.lstrip()}


def test_system_placement_keeps_the_templates_default_system_prompt(tiny_engine, tiny_tokenizer):
    """The teacher's hinted prompt under ``system_and_user`` is the served prompt with the hint added after the
    default system text the template writes (SmolLM2's), not a prompt that lost that text."""
    messages = [{"role": "user", "content": "Name a fruit."}]
    turn = make_turn(tiny_tokenizer, tiny_engine, messages, max_tokens=4)
    render = chat_render_fn(tiny_tokenizer)
    teacher = Teacher(tiny_engine, render, Config(model="tiny", topk=4, hint_placement="system_and_user"),
                      tokenizer=tiny_tokenizer)
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert tiny_tokenizer.decode(turn.prompt_ids).startswith(f"<|im_start|>system\n{default}<|im_end|>")
    assert tiny_tokenizer.decode(teacher.prompt_ids(turn, "Be brief.")) == (
        f"<|im_start|>system\n{default}\n\n[user's hint / instruction]\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nName a fruit.\n\n[user's hint / instruction]\nBe brief.<|im_end|>\n"
        "<|im_start|>assistant\n")
    assert teacher.prompt_ids(turn, "") == turn.prompt_ids


def test_train_temperature_rule():
    cfg = SimpleNamespace(train_temperature=0.0)
    assert train_temperature(cfg, 0.6) == 0.6
    assert train_temperature(cfg, 0.0) == 1.0  # greedy turns score at 1
    assert train_temperature(SimpleNamespace(train_temperature=0.8), 0.6) == 0.8


# ---- targets on the tiny model ----------------------------------------------------------------------------

def make_turn(tokenizer, engine, messages, tools=None, max_tokens=6):
    prompt_ids = ChatRenderer(tokenizer).render(messages, tools).ids
    gen = asyncio.run(engine.generate(prompt_ids, SamplingParams(temperature=0.7, max_tokens=max_tokens, seed=3)))
    return TurnRecord(session_id="s", messages=messages, tools=tools, prompt_ids=prompt_ids,
                      response_ids=gen.token_ids, logprobs=gen.logprobs, temperature=0.7, top_p=1.0,
                      policy_version=0, response_text=gen.text, id=1)


def reference_logprobs(model, prompt_ids, response_ids, temperature):
    """Independent computation: one plain forward, log-softmax of logits / T at the response positions."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    p, t = len(prompt_ids), len(response_ids)
    return torch.log_softmax(logits[p - 1:p - 1 + t] / temperature, dim=-1)


@pytest.fixture
def teacher(tiny_engine, tiny_tokenizer):
    config = Config(model="tiny", topk=4)
    return Teacher(tiny_engine, chat_render_fn(tiny_tokenizer), config)


def ask(teacher, turn, hints, ids_T_K, temperature=0.7):
    (scores,) = asyncio.run(teacher.score([TeacherRequest(turn, list(hints), ids_T_K, temperature)]))
    return scores


def test_scores_match_a_direct_forward_pass(teacher, tiny_engine, tiny_tokenizer):
    turn = make_turn(tiny_tokenizer, tiny_engine, TOOL_LOOP, TOOLS)
    hints = ["Sort by size.", "Show sizes in bytes, largest first."]
    T, K, C = len(turn.response_ids), 4, 2
    model = tiny_engine.model
    student_ref = reference_logprobs(model, turn.prompt_ids, turn.response_ids, 0.7)
    student_ids_T_K = student_ref.topk(K, dim=-1).indices
    assert teacher.render_matches(turn)
    out = ask(teacher, turn, hints, student_ids_T_K)
    assert isinstance(out, TeacherScores)
    assert torch.equal(out.student_ids_T_K, student_ids_T_K) and out.student_ids_T_K.dtype == torch.int64
    for name in ("teacher_ids_C_T_K", "teacher_logprobs_C_T_K", "teacher_at_student_C_T_K"):
        assert getattr(out, name).shape == (C, T, K), name
    assert out.teacher_ids_C_T_K.dtype == torch.int64 and out.teacher_logprobs_C_T_K.dtype == torch.float32
    assert out.hint_lens_C.tolist() == [len(h) for h in hints]
    assert out.teacher_token_logprobs_C_T.shape == (C, T) and out.student_logprobs_T_K is None
    for c, hint in enumerate(hints):
        prompt = ChatRenderer(tiny_tokenizer).render(inject_hint(TOOL_LOOP, hint), TOOLS).ids
        assert teacher.prompt_ids(turn, hint) == prompt
        ref = reference_logprobs(model, prompt, turn.response_ids, 0.7)
        top = ref.topk(K, dim=-1)
        assert torch.equal(out.teacher_ids_C_T_K[c], top.indices)
        torch.testing.assert_close(out.teacher_logprobs_C_T_K[c], top.values, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.teacher_at_student_C_T_K[c], ref.gather(-1, student_ids_T_K),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.teacher_token_logprobs_C_T[c],
                                   ref.gather(-1, torch.tensor(turn.response_ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)


def test_hint_changes_teacher_logprobs(teacher, tiny_engine, tiny_tokenizer):
    messages = [{"role": "user", "content": "Name a fruit."}]
    turn = make_turn(tiny_tokenizer, tiny_engine, messages)
    ids_T_K = reference_logprobs(tiny_engine.model, turn.prompt_ids, turn.response_ids, 0.7).topk(4, -1).indices
    anchor = ask(teacher, turn, [], ids_T_K)
    hinted = ask(teacher, turn, ["Answer with the single word: banana"], ids_T_K)
    assert anchor.hint_lens_C.tolist() == [0]
    diff = (anchor.teacher_at_student_C_T_K - hinted.teacher_at_student_C_T_K).abs()
    assert diff.max() > 1e-3  # the teacher reads the hint
    # the hint is in the teacher prompt, in the last user message, before the generation prompt
    text = tiny_tokenizer.decode(teacher.prompt_ids(turn, "Answer with the single word: banana"))
    assert text.endswith("<|im_start|>user\nName a fruit.\n\n[user's hint / instruction]\n"
                         "Answer with the single word: banana<|im_end|>\n<|im_start|>assistant\n")


def test_teacher_draft_scores_the_answer_under_its_own_text(tiny_engine, tiny_tokenizer):
    """With ``teacher_draft`` the hinted prompt carries the served answer's text (end tokens dropped) between the
    hint and the hint again, and the scores are those of a direct forward under that prompt; the un-hinted prompt
    stays the stored one."""
    messages = [{"role": "user", "content": "Name a fruit."}]
    turn = make_turn(tiny_tokenizer, tiny_engine, messages, max_tokens=8)
    render = chat_render_fn(tiny_tokenizer)
    teacher = Teacher(tiny_engine, render, Config(model="tiny", topk=4, teacher_draft=True), tokenizer=tiny_tokenizer)
    hint = "Answer with one word."
    draft = tiny_tokenizer.decode([i for i in turn.response_ids if i != tiny_tokenizer.eos_token_id],
                                  skip_special_tokens=True).strip()
    assert draft
    prompt = render(inject_hint(messages, hint, draft=draft), None)
    assert teacher.prompt_ids(turn, hint) == prompt
    assert teacher.prompt_ids(turn, "") == turn.prompt_ids
    ids_T_K = reference_logprobs(tiny_engine.model, turn.prompt_ids, turn.response_ids, 0.7).topk(4, -1).indices
    scores = ask(teacher, turn, [hint], ids_T_K)
    ref = reference_logprobs(tiny_engine.model, prompt, turn.response_ids, 0.7)
    torch.testing.assert_close(scores.teacher_at_student_C_T_K[0], ref.gather(-1, ids_T_K), atol=1e-4, rtol=1e-4)
    plain = Teacher(tiny_engine, render, Config(model="tiny", topk=4), tokenizer=tiny_tokenizer)
    assert plain.prompt_ids(turn, hint) == render(inject_hint(messages, hint), None) != prompt
    with pytest.raises(ValueError, match="teacher_draft needs the tokenizer"):  # refused when built, not per sample
        Teacher(tiny_engine, render, Config(model="tiny", topk=4, teacher_draft=True))


def test_one_engine_call_covers_every_candidate_of_every_request(tiny_engine, tiny_tokenizer):
    counting = CountingEngine(tiny_engine)
    teacher = Teacher(counting, chat_render_fn(tiny_tokenizer), Config(model="tiny", topk=4))
    first = make_turn(tiny_tokenizer, tiny_engine, [{"role": "user", "content": "Count to three."}])
    second = make_turn(tiny_tokenizer, tiny_engine, [{"role": "user", "content": "Name a colour."}])
    ids = [reference_logprobs(tiny_engine.model, t.prompt_ids, t.response_ids, 0.7).topk(4, -1).indices
           for t in (first, second)]
    # at ids other than the top-k (a flipped order, a shifted set) the answer is exactly that gather
    ids[1] = torch.flip(ids[1], dims=[-1])
    requests = [TeacherRequest(first, ["Use digits.", "Write the numbers as words."], ids[0], 0.7),
                TeacherRequest(second, [], ids[1], 0.7)]
    together = asyncio.run(teacher.score(requests))
    assert len(counting.calls) == 1 and len(counting.calls[0]) == 3
    assert [r.at_ids_T_K.tolist() for r in counting.calls[0]] == [ids[0].tolist()] * 2 + [ids[1].tolist()]
    alone = [asyncio.run(teacher.score([r]))[0] for r in requests]
    for a, b in zip(together, alone):
        for name, value in a.tensors().items():
            torch.testing.assert_close(value, b.tensors()[name], atol=1e-5, rtol=1e-5)
    assert together[1].teacher_at_student_C_T_K.shape == (1, len(second.response_ids), 4)


def test_render_mismatch_is_reported(teacher, tiny_engine, tiny_tokenizer):
    turn = make_turn(tiny_tokenizer, tiny_engine, [{"role": "user", "content": "Hi"}])
    assert teacher.render_matches(turn)
    turn.prompt_ids = turn.prompt_ids[:-1] + [turn.prompt_ids[-1], 198]  # not what rendering gives today
    assert teacher.render_matches(turn) is False


def test_ids_that_do_not_fit_the_response_are_refused(teacher, tiny_engine, tiny_tokenizer):
    turn = make_turn(tiny_tokenizer, tiny_engine, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="do not fit"):
        ask(teacher, turn, [], torch.zeros(len(turn.response_ids) + 1, 4, dtype=torch.int64))


# ---- the real model ---------------------------------------------------------------------------------------

@pytest.mark.real_model
def test_real_model_hint_raises_logprob_of_the_hinted_word():
    from clawloop.engines import model_files
    from clawloop.engines.hf import HFEngine

    path = model_files.default_model_dir()
    tokenizer = model_files.load_tokenizer(path)
    engine = HFEngine(path, tokenizer, device="cpu", num_threads=2)
    try:
        teacher = Teacher(engine, chat_render_fn(tokenizer), Config(topk=4))
        messages = [{"role": "user", "content": "Name a fruit."}]
        prompt_ids = ChatRenderer(tokenizer).render(messages).ids
        response_ids = tokenizer("Banana", add_special_tokens=False)["input_ids"] + [2]
        turn = TurnRecord(session_id="s", messages=messages, prompt_ids=prompt_ids, response_ids=response_ids,
                          logprobs=[0.0] * len(response_ids), temperature=1.0, top_p=1.0, policy_version=0, id=1)
        hint = "Answer with the single word: banana"
        at = torch.tensor([[i] for i in response_ids])  # gather at the response's own tokens
        plain = asyncio.run(teacher.score([TeacherRequest(turn, [], at, 1.0)]))[0].teacher_at_student_C_T_K[0, :, 0]
        hinted = asyncio.run(teacher.score([TeacherRequest(turn, [hint], at, 1.0)]))[0] \
            .teacher_at_student_C_T_K[0, :, 0]
        n_word = len(response_ids) - 1
        print("log p(banana) un-hinted", plain[:n_word].sum().item(), "hinted", hinted[:n_word].sum().item())
        assert hinted[:n_word].sum() > plain[:n_word].sum() + 1.0, (plain, hinted)
    finally:
        engine.close_sync()
