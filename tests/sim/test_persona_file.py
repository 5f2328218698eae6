"""Personas defined in TOML or JSON files: the shipped example, the errors a user gets for a broken file, and the
demo and eval commands running such a persona."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from clawloop.cli import main
from clawloop.judge.rules import decide_user
from clawloop.sim import compare
from clawloop.sim import demo as demo_module
from clawloop.sim.checkers import BriefChecker, OpeningChecker
from clawloop.sim.driver import Simulation, evaluate
from clawloop.sim.persona_file import PersonaFileError, load_persona_file, resolve_persona
from clawloop.sim.personas import get_persona

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "personas" / "one_sentence_cook.toml"


def test_the_shipped_example_loads_with_its_own_questions_and_checker():
    persona = load_persona_file(EXAMPLE)
    assert persona.name == "one-sentence-cook" and persona.source == str(EXAMPLE)
    assert persona.checker == BriefChecker(max_words=20)
    assert len(persona.train_questions) >= 6 and len(persona.heldout_questions) >= 5
    assert not set(persona.train_questions) & set(persona.heldout_questions)
    assert persona.checker("Boil it for ten minutes in salted water.")
    assert not persona.checker("Boil it for ten minutes. Then drain it and add some oil so it does not stick.")


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_persona_file_loads_and_teaches_through_the_rule_judge(path):
    persona = load_persona_file(path)
    assert persona.checker.describe() and persona.heldout_questions
    # The demo's default judge must read every correction as one, with a hint, or nothing would be learnt; and the
    # hint must carry the preference, not some other request the judge read into the correction ("Too much text"
    # once became "Answer briefly." for a user who wanted a list): it shares a content word with it.
    wanted = set(re.findall(r"[a-z]{5,}", persona.preference.lower())) - {"answer", "every", "always", "reply"}
    for correction in persona.corrections:
        decision = decide_user([correction])
        assert decision.score == -1 and decision.hint, correction
        assert wanted & set(re.findall(r"[a-z]+", decision.hint.lower())), (correction, decision.hint)


def _write(tmp_path, fields, suffix=".json"):
    path = tmp_path / f"persona{suffix}"
    path.write_text(json.dumps(fields))
    return path


BASE = {"name": "ahoy", "preference": 'Begin every answer with "Ahoy".', "corrections": ['Say "Ahoy" first!'],
        "checker": {"kind": "opening", "word": "Ahoy", "min_words_after": 2}, "pool": "places"}


def test_a_json_persona_with_a_pool_and_checker_arguments(tmp_path):
    persona = load_persona_file(_write(tmp_path, {**BASE, "session_turns": 2, "check_topic": False}))
    assert persona.checker == OpeningChecker(word="Ahoy", min_words_after=2)
    assert persona.train_questions == get_persona("inshort").train_questions  # the 'places' pool
    assert persona.session_turns == 2 and persona.check_topic is False
    assert persona.description  # an LLM-written user gets a description even when the file gives none


@pytest.mark.parametrize("change, field, words", [
    ({"preference": None}, "preference", "missing"),
    ({"colour": "blue"}, "colour", "unknown field"),
    ({"checker": {"kind": "rhyming"}}, "checker.kind", "unknown checker kind 'rhyming'"),
    ({"checker": {"word": "Ahoy"}}, "checker.kind", "missing"),
    ({"checker": {"kind": "opening", "phrase": "Ahoy"}}, "checker.phrase", "not an argument of checker kind"),
    ({"checker": {"kind": "brief", "max_words": "twenty"}}, "checker.max_words", "must be int"),
    ({"checker": {"kind": "brief", "max_words": 0}}, "checker.max_words", "at least 1"),
    ({"checker": {"kind": "french", "language": "spanish"}}, "checker.language", "not an argument"),
    ({"checker": {"kind": "language", "language": "german"}}, "checker.language", "one of french"),
    ({"corrections": []}, "corrections", "needs at least 1"),
    ({"pool": "cooking"}, "pool", "no question pool 'cooking'"),
    ({"pool": None}, "pool", "missing"),
    ({"train_questions": ["a?"] * 6, "heldout_questions": ["b?"] * 5}, "pool", "not both"),
    ({"pool": None, "train_questions": ["a?"] * 6}, "heldout_questions", "missing"),
    ({"pool": None, "train_questions": ["a?", "b?"], "heldout_questions": ["c?"] * 5}, "train_questions",
     "has 2 different question(s), needs at least 6"),
    ({"pool": None, "train_questions": [f"q{i}?" for i in range(6)],
      "heldout_questions": ["q1?"] + [f"c{i}?" for i in range(4)]},
     "heldout_questions", "also in train_questions"),
    ({"name": "brief"}, "name", "built-in persona"),
    ({"name": "my persona"}, "name", "only letters"),
    ({"thanks": ["Thanks!"]}, "thanks", "{question}"),
    ({"session_turns": 0}, "session_turns", "at least 1"),
])
def test_a_broken_file_is_refused_naming_the_file_and_the_field(tmp_path, change, field, words):
    fields = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    path = _write(tmp_path, fields)
    with pytest.raises(PersonaFileError) as info:
        load_persona_file(path)
    message = str(info.value)
    assert str(path) in message and f"field '{field}'" in message and words in message


def _refusal(tmp_path, change):
    """The message loading ``BASE`` with ``change`` raises."""
    fields = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(PersonaFileError) as info:
        load_persona_file(_write(tmp_path, fields))
    return str(info.value)


@pytest.mark.parametrize("thanks", ["Thanks {question} {x}", "Thanks {} {question}", "Thanks {0} {question}",
                                    "Thanks {question.upper()}", "Thanks {question:d}", "Thanks {{question}}"])
def test_a_thanks_reply_that_cannot_be_filled_in_is_refused_when_the_file_loads(tmp_path, thanks):
    # Formatted only after the persona's first good answer, it would otherwise stop a run midway.
    assert "field 'thanks'" in _refusal(tmp_path, {"thanks": ["Thanks! {question}", thanks]})


def test_a_thanks_reply_with_escaped_braces_loads(tmp_path):
    persona = load_persona_file(_write(tmp_path, {**BASE, "thanks": ["Thanks {{really}}! {question}"]}))
    assert persona.thanks[0].format(question="Why?") == "Thanks {really}! Why?"


@pytest.mark.parametrize("checker, field, words", [
    ({"kind": "numbered_list", "min_items": 0}, "checker.min_items", "at least 1"),
    ({"kind": "paragraph", "min_sentences": 0}, "checker.min_sentences", "at least 1"),
    ({"kind": "paragraph", "max_sentences": 0, "min_sentences": 0}, "checker.max_sentences", "at least 1"),
    ({"kind": "paragraph", "min_sentences": 3, "max_sentences": 2}, "checker.min_sentences",
     "at most max_sentences (2), got 3"),
    ({"kind": "paragraph", "min_sentences": 5}, "checker.min_sentences", "at most max_sentences (4), got 5"),
])
def test_checker_arguments_that_every_or_no_answer_would_pass_are_refused(tmp_path, checker, field, words):
    message = _refusal(tmp_path, {"checker": checker})
    assert f"field '{field}'" in message and words in message


OWN_QUESTIONS = {"pool": None, "train_questions": [f"How do I cook dish {i}?" for i in range(6)],
                 "heldout_questions": [f"What is dish {i}?" for i in range(5)]}


def test_questions_differing_only_in_case_or_spacing_are_one_question(tmp_path):
    fields = {k: v for k, v in {**BASE, **OWN_QUESTIONS}.items() if v is not None}
    assert load_persona_file(_write(tmp_path, fields)).heldout_questions == \
        tuple(OWN_QUESTIONS["heldout_questions"])
    repeated = {**OWN_QUESTIONS, "train_questions": ["How do I cook rice?", "how do I cook  rice?"] * 3}
    message = _refusal(tmp_path, repeated)
    assert "field 'train_questions'" in message and "has 1 different question(s), needs at least 6" in message
    leaked = {**OWN_QUESTIONS, "heldout_questions": ["what is DISH 9?", *OWN_QUESTIONS["heldout_questions"][1:]]}
    leaked["train_questions"] = [*OWN_QUESTIONS["train_questions"][:5], "What is  dish 9?"]
    message = _refusal(tmp_path, leaked)
    assert "field 'heldout_questions'" in message and "also in train_questions" in message


def test_unreadable_files_are_refused_with_the_reason(tmp_path):
    bad_toml = tmp_path / "p.toml"
    bad_toml.write_text("name = \n")
    with pytest.raises(PersonaFileError, match=r"p\.toml: not valid TOML"):
        load_persona_file(bad_toml)
    with pytest.raises(PersonaFileError, match="must end in .toml or .json"):
        load_persona_file(tmp_path / "p.yaml")
    with pytest.raises(PersonaFileError, match="cannot be read"):
        load_persona_file(tmp_path / "absent.toml")


class EchoServer:
    """Answers every question with one short sentence about it and records what was asked."""

    def __init__(self, questions):
        self.questions = questions
        self.asked: list[str] = []

    def chat(self, messages, *, session_id, turn_type, done=False, **params):
        if done and turn_type == "main":  # a session's closing request: its answer is never shown
            return {"choices": [{"message": {"content": "."}}]}
        # The question being asked: the opening one, or the one the user's thanks went on to.
        question = next(q for q in self.questions if q in messages[-1]["content"])
        self.asked.append(question)
        return {"choices": [{"message": {"content": f"To {question.lower().rstrip('?')}, keep it simple."}}],
                "clawloop": {"policy_version": 0}}

    def end_session(self, session_id):
        pass

    def close(self):
        pass


def test_a_file_persona_drives_sessions_and_evaluation_with_its_own_questions():
    persona = resolve_persona("brief", str(EXAMPLE))  # the file replaces the built-in name
    server = EchoServer(persona.train_questions + persona.heldout_questions)
    sessions = Simulation("http://unused", persona, seed=0, client=server).run(6)
    assert sum(len(s.turns) for s in sessions) == 6
    assert set(server.asked) <= set(persona.train_questions)
    assert all(t.satisfied and t.sound for s in sessions for t in s.turns)  # short, on topic: the checker agrees
    result = evaluate("http://unused", persona, client=server)
    assert [i.question for i in result.items] == list(persona.heldout_questions) and result.score == 1.0


def test_demo_and_eval_take_a_persona_file(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_run_loop(config, options, out=print, **kwargs):
        seen.append(options)
        return {"before": {"score": 0.0, "guard_pass_rate": 1.0}, "after": {"score": 0.5, "guard_pass_rate": 1.0},
                "curve": [{"interactions": 0, "score": 0.0, "guard_pass_rate": 1.0}], "steps": 2,
                "timings_s": {"total_s": 1.0}, "sessions_to_stable_effect": 3}

    monkeypatch.setattr(demo_module, "run_loop", fake_run_loop)
    monkeypatch.setattr(demo_module, "print_result", lambda summary: None)
    assert main(["demo", "--model", "tiny", "--persona-file", str(EXAMPLE), "--interactions", "3"]) == 0
    assert seen[-1].persona_file == str(EXAMPLE) and resolve_persona(seen[-1].persona, seen[-1].persona_file).name \
        == "one-sentence-cook"

    monkeypatch.setattr(compare, "run_loop", fake_run_loop)
    out = tmp_path / "eval"
    assert main(["eval", "--model", "tiny", "--persona-file", str(EXAMPLE), "--methods", "hybrid", "--seeds", "0",
                 "--out", str(out)]) == 0
    assert [o.persona for o in seen[1:]] == ["one-sentence-cook"]  # no built-in persona unless --personas names it
    assert seen[-1].persona_file == str(EXAMPLE)
    assert json.loads((out / "personas" / "one-sentence-cook.json").read_text()) == \
        tomllib.loads(EXAMPLE.read_text())
    assert "| one-sentence-cook | hybrid | 0 |" in (out / "table.md").read_text()

    # The same name defined differently would mix incomparable cells in one folder: refused.
    changed = tmp_path / "cook.toml"
    changed.write_text(EXAMPLE.read_text().replace("max_words = 20", "max_words = 12"))
    capsys.readouterr()
    assert main(["eval", "--model", "tiny", "--persona-file", str(changed), "--methods", "hybrid", "--seeds", "1",
                 "--out", str(out)]) == 2
    assert "defined differently" in capsys.readouterr().out and len(seen) == 2


def test_a_broken_persona_file_stops_demo_and_eval_before_anything_runs(tmp_path, capsys):
    broken = _write(tmp_path, {**BASE, "checker": {"kind": "rhyming"}})
    for command, folder in (("demo", "--run-dir"), ("eval", "--out")):
        assert main([command, "--model", "tiny", folder, str(tmp_path / command), "--persona-file", str(broken)]) == 2
        assert not (tmp_path / command).exists()
        err = capsys.readouterr().err
        assert str(broken) in err and "checker.kind" in err
    assert main(["demo", "--model", "tiny", "--persona-file", str(EXAMPLE), "--persona-file", str(EXAMPLE)]) == 2
    assert "give --persona-file once" in capsys.readouterr().err
