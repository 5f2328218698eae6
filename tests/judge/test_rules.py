"""The keyword rule judge: what it reads as approval, correction and tool error, the hints it writes, and that its
records look like an LLM judge's (parseable boxed votes, m of each kind) when the pipeline runs it."""

import asyncio
import json
from pathlib import Path

import pytest

from clawloop.config import Config
from clawloop.judge.factory import build_judge
from clawloop.judge.parse import parse_eval, parse_hint
from clawloop.judge.rules import RuleJudge, as_instruction, decide
from clawloop.judge.votes import JudgeSettings
from clawloop.sim.data.questions import POOLS
from clawloop.sim.personas import PERSONAS
from clawloop.store import TurnRecord

CASES = Path(__file__).resolve().parents[2] / "clawloop" / "judge" / "data" / "judge_cases.jsonl"


def user(text):
    return [{"role": "user", "content": text}]


def turn(next_state, turn_id=3):
    return TurnRecord(session_id="s", messages=user("What is a volcano?"), prompt_ids=[1, 2], response_ids=[3],
                      logprobs=[-1.0], temperature=0.6, top_p=1.0, policy_version=0, response_text="A mountain.",
                      assistant_message={"role": "assistant", "content": "A mountain."}, next_state=next_state,
                      id=turn_id)


@pytest.mark.parametrize("reply", [
    "Thanks!",
    "Thanks! That's what I needed.",
    "Correct, thanks.",
    "Perfect. Now write one that checks whether a string is a palindrome.",
    "Great, and how many feet is that?",
    "Nice summary. Can you do Hamlet next?",           # a new request after approval is not a correction
    "Thanks! Could you please explain tides?",
    "Thank you. Why don't stars fall from the sky?",   # negation inside the next question
    "Good answer, thanks! Why should I drink water every day?",
    "Great, thank you. Next question: How can I make my writing clearer?",
    "No problem, that worked.",
    "Parfait, merci beaucoup !",
])
def test_approval_is_plus_one_without_hint(reply):
    d = decide(user(reply))
    assert d.score == 1, d
    assert d.hint == ""


@pytest.mark.parametrize("reply, hint", [
    # A correction's hint is the instruction it implies, in imperative form: the teacher reads it as one.
    ("That's too long. Please answer in one short sentence.", "Answer in one short sentence."),
    ("Too long, answer in one sentence.", "Answer in one sentence."),
    ("Could you say that in French? I only speak French.", "Answer in French."),
    ("Thanks, but please answer in French.", "Answer in French."),  # thanks does not rescue a change request
    ("Again in English... please always reply to me in French.", "Always answer in French."),
    ('Start with "In short," next time, please.', 'Begin every answer with "In short,".'),
    ('You forgot the "In short," at the start. Always begin with it.', 'Begin every answer with "In short,".'),
    ('Where is my "In short,"? Please start your answers with it.', 'Begin every answer with "In short,".'),
    ('I like answers that open with "In short,". Can you do that?', 'Begin every answer with "In short,".'),
    ('Please end your answers with "Hope this helps".', 'End every answer with "Hope this helps".'),
    ("Shorter, please. One sentence is enough for me.", "Answer in one sentence."),
    ("Please be brief: a single sentence of at most 25 words.", "Answer in one sentence of at most 25 words."),
    ("Way too long. Keep it under 50 words.", "Answer in at most 50 words."),
    ("One short sentence, please.", "Answer in one short sentence."),
    ("Wrong, answer in one word: what is 100 degrees Celsius?", "Answer in one word."),
    ("In Spanish, please! No hablo inglés.", "Answer in Spanish."),
    ("Please use bullet points.", "Answer in bullet points."),
    # A format named alone is asked for, and a numbered list takes its article; a complaint about length beside a
    # request is dropped (the request is what the user wants instead), a request for brevity is not.
    ("Numbered list please!", "Answer with a numbered list."),
    ("Too much text in one block. A numbered list, please.", "Answer with a numbered list."),
    ("That's too long. Please answer with a numbered list.", "Answer with a numbered list."),
    ("Shorter, please. Use a numbered list.", "Answer briefly. Answer with a numbered list."),
    ("That's too long.", "Answer briefly."),
    ("You didn't answer what I asked: What is a volcano?", "Answer the question: What is a volcano?"),
    ("That's not a haiku. It must be 5-7-5. Fix it. And make it rhyme.", "Make it 5-7-5. Make it rhyme."),
    ("You need sudo for that file.", "Use sudo for that file."),
    ("You should cite your sources.", "Cite your sources."),
    # No instruction to extract: what the user states, without the complaint about the answer, is the hint.
    ("No, I said descending. Largest first.", "I said descending. Largest first."),
    ("Wrong, it was Jane Austen.", "It was Jane Austen."),
    ("That's Python. I asked for JavaScript.", "I asked for JavaScript."),
])
def test_correction_is_minus_one_with_an_instruction_hint(reply, hint):
    d = decide(user(reply))
    assert d.score == -1, d
    assert d.hint == hint


@pytest.mark.parametrize("reply, hint", [
    # The message of a real OpenClaw session, and the ways people write the same correction.
    ("Wrong, answer in one word: what is 100 degrees Celsius?", "Answer in one word."),
    ("[Wed 2026-11-25 22:31 UTC] Wrong, answer in one word: what is 100 degrees Celsius?", "Answer in one word."),
    ("No. Answer in one word: what is 100 degrees Celsius?", "Answer in one word."),
    ("Wrong, answer in one word. What is 100 degrees Celsius?", "Answer in one word."),
    ("That's wrong, answer in one word: What is the boiling point of water?", "Answer in one word."),
    ("Wrong answer. In one word: what is 100 degrees Celsius in Fahrenheit?", "Answer in one word."),
    ("Incorrect. Could you answer with a single word: how many legs does a spider have?", "Answer in one word."),
    ("One-word answer, please. What is the capital of Peru?", "Answer in one word."),
    ("Too wordy, answer in a few words: why is the sky blue?", "Answer in a few words."),
    ("Wrong, use Fahrenheit: what is 100 degrees Celsius?", "Use Fahrenheit."),
    ("Wrong! Reply in French: what is the capital of Spain?", "Answer in French."),
])
def test_a_correction_that_re_asks_the_question_gives_only_the_instruction(reply, hint):
    """The hint is the instruction in the correction, never the user's whole message: the complaint and the question
    asked again (which the teacher already has) are left out."""
    d = RuleJudge(JudgeSettings(votes_m=1)).decide(turn(user(reply)))
    assert d.score == -1, d
    assert d.hint == hint


@pytest.mark.parametrize("reply", [
    "Wrong. What is 100 degrees Celsius in Fahrenheit?",   # a complaint and the question again: nothing to teach
    "The date is wrong.",                                  # a complaint only
    "Two sentences contradict each other. Fix it.",        # a sentence count that is only mentioned; "Fix it." is vague
])
def test_a_correction_with_nothing_but_complaint_or_question_gives_no_hint(reply):
    d = decide(user(reply))
    assert d.score == -1 and d.hint == "", d


@pytest.mark.parametrize("reply", ["Try again.", "No. Ok."])
def test_a_correction_too_short_to_teach_gives_no_hint(reply):
    d = decide(user(reply))
    assert d.score == -1 and d.hint == ""  # "Try again." is 10 characters: a hint must be longer


@pytest.mark.parametrize("reply", [
    "I'll think about it.", "hmm", "?", "What's the weather tomorrow?", "My cat just knocked over a glass.",
    "Ok. Different topic: can you explain photosynthesis?", "",
])
def test_no_explicit_signal_is_zero(reply):
    d = decide(user(reply))
    assert d.score == 0 and d.hint == ""


@pytest.mark.parametrize("reply", [
    "Write a haiku about autumn.", "Tell me about Paris.", "Please summarize the plot of Hamlet.",
    "Can you also list the rivers of France?", "I need a recipe for pancakes.", "Write a poem that rhymes.",
    "Tell me more about tides.", "Could you recommend a good book?",
])
def test_a_new_task_without_thanks_is_not_a_correction(reply):
    """A user who moves on to another request says nothing against the answer: 0, and above all no hint, which
    would have the teacher score the answer under an unrelated instruction."""
    d = decide(user(reply))
    assert d.score == 0 and d.hint == ""


@pytest.mark.parametrize("reply, hint", [
    ("Make it shorter.", "Answer briefly."), ("Can you put that in a list?", "Answer with a list."),
    ("Please make it simpler.", "Make it simpler."), ("Write it as a poem.", "Write it as a poem."),
    ("Could you explain that again?", "Explain that again."), ("Remove the emojis.", "Remove the emojis."),
])
def test_a_request_that_points_back_at_the_answer_is_a_correction(reply, hint):
    d = decide(user(reply))
    assert d.score == -1 and d.hint == hint


def test_tool_results():
    err = decide([{"role": "tool", "content": "Traceback (most recent call last):\nFileNotFoundError: config.yml"}])
    assert err.score == -1 and err.hint == "The previous action failed with: FileNotFoundError: config.yml"
    assert decide([{"role": "tool", "content": "F.\n1 failed, 1 passed"}]).score == -1
    assert decide([{"role": "tool", "content": "24 passed in 3.2s"}]).score == 1
    assert decide([{"role": "tool", "content": "Lisbon has about 545,000 people (2021)."}]).score == 1
    assert decide([{"role": "tool", "content": '{"error": "rate limit exceeded, retry later"}'}]).score == 0
    assert decide([{"role": "tool", "content": "[]"}]).score == 0
    # A user's correction after a failing tool gives the user's words as the hint.
    both = decide([{"role": "tool", "content": "PermissionError: app.log"},
                   {"role": "user", "content": "You need sudo for that file."}])
    assert both.score == -1 and both.hint == "Use sudo for that file."


def test_every_persona_reply_reads_as_the_persona_meant_it():
    """The simulated users' thanks (with any next question) are +1; every correction, complaint and re-ask is -1
    with a hint. This is what lets the demo train on the rule judge."""
    questions = [q for pool in POOLS.values() for q in pool["train"] + pool["heldout"]]
    for persona in PERSONAS.values():
        for template in persona.thanks:
            for q in questions:
                d = decide(user(template.format(question=q)))
                assert (d.score, d.hint) == (1, ""), (template, q)
        for text in persona.farewells:
            assert decide(user(text)).score == 1, text
        for template in persona.corrections + persona.nonsense + persona.unanswered:
            for q in questions[::7]:
                d = decide(user(template.format(question=q)))
                assert d.score == -1 and len(d.hint) > 10, (template, q)


def test_agreement_with_the_labelled_judge_cases():
    cases = [json.loads(line) for line in CASES.read_text().splitlines() if line.strip()]
    votes = [decide(c["next_state"]).score == c["expected_vote"] for c in cases]
    hints = [bool(decide(c["next_state"]).hint) == c["hint_expected"] for c in cases]
    assert sum(votes) / len(votes) >= 0.95
    assert sum(hints) / len(hints) >= 0.9


def test_every_persona_correction_becomes_its_preference_as_an_instruction():
    """Each simulated user's corrections give the persona's own preference in imperative form (not a narrated
    complaint), which is what the teacher follows."""
    expected = {"inshort": 'Begin every answer with "In short,".', "french": "in French.",
                "spanish": "in Spanish.", "brief": "sentence"}
    for name, persona in PERSONAS.items():
        for text in persona.corrections:
            hint = decide(user(text)).hint
            assert expected[name] in hint, (text, hint)
            assert not hint.lower().startswith(("you ", "that's", "i ", "where")), (text, hint)


def test_as_instruction():
    assert as_instruction("Could you please write it in Spanish?") == "Write it in Spanish."
    assert as_instruction("Hmm, no, please use bullets") == "Use bullets."
    assert as_instruction("Please.") == ""


def test_votes_look_like_an_llm_judges_and_the_pipeline_builds_it():
    config = Config.load(env={}, judge_backend="rules", prm_m=3)
    judge = build_judge(config)
    assert isinstance(judge, RuleJudge)
    seen = []
    out = asyncio.run(judge.judge(turn(user("Too long. Please answer in one sentence.")), on_vote=seen.append))
    assert out.reward == -1 and out.candidates == ["Answer in one sentence."]
    assert len(out.eval_votes) == 3 and len(out.hint_votes) == 3 and len(seen) == 6
    assert [v.index for v in out.eval_votes] == [0, 1, 2]
    for v in out.eval_votes:
        assert v.turn_id == 3 and parse_eval(v.raw_text).score == -1 and "too much or too little" in v.raw_text
    for v in out.hint_votes:
        parsed = parse_hint(v.raw_text)
        assert parsed.score == 1 and parsed.hint == v.hint == "Answer in one sentence."

    good = asyncio.run(judge.judge(turn(user("Thanks!")), want_hints=False))
    assert good.reward == 1 and good.hint_votes == [] and good.candidates == []
    assert all(parse_eval(v.raw_text).score == 1 for v in good.eval_votes)
    hints_only = asyncio.run(judge.judge(turn(user("Please answer in Spanish.")), want_eval=False))
    assert hints_only.reward == 0 and hints_only.eval_votes == [] and hints_only.candidates == ["Answer in Spanish."]
    asyncio.run(judge.client.close())


def test_hint_min_chars_is_respected():
    judge = RuleJudge(JudgeSettings(votes_m=1, hint_min_chars=40))
    out = asyncio.run(judge.judge(turn(user("Please answer in French."))))
    assert out.reward == -1 and out.candidates == []
    assert out.hint_votes[0].score == -1 and parse_hint(out.hint_votes[0].raw_text).score == -1


def test_a_line_without_a_full_stop_is_a_sentence_of_its_own():
    """A line break ends a sentence: a correction on a line of its own is read, not swallowed by the next line."""
    from clawloop.judge.rules import split_sentences

    assert split_sentences("too long\nthanks for trying") == ["too long", "thanks for trying"]
    assert split_sentences('Wrong: It was Austen. "Yes." ok?!) x') == ["Wrong:", "It was Austen.", '"Yes."', "ok?!)",
                                                                        "x"]
    verdict = decide([{"role": "user", "content": "Way too long\nAnswer in one short sentence next time"}])
    assert verdict.score == -1 and "one short sentence" in verdict.hint


def test_a_message_of_hundreds_of_thousands_of_characters_is_judged_at_once():
    """One user's message must not hold the judge (and the event loop every user shares) for minutes: a line of
    dashes without a sentence end made a backtracking pattern quadratic (16,000 characters took seconds, a full
    context about an hour). Run apart, with a deadline far above the linear reading's fraction of a second."""
    import subprocess
    import sys

    script = ("from clawloop.judge.rules import decide\n"
              "for text in ['-' * 500_000 + '\\nx', 'a:' * 200_000, 'make it shorter and ' * 25_000]:\n"
              "    decide([{'role': 'user', 'content': text}])\n"
              "    decide([{'role': 'tool', 'content': text, 'tool_call_id': 'c'}])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
