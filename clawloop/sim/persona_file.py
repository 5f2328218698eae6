"""A persona defined in a TOML or JSON file, for ``clawloop demo --persona-file`` and ``clawloop eval --persona-file``.

Fields (``examples/personas/one_sentence_cook.toml`` is a complete example):

* ``name``: letters, digits, ``-`` and ``_`` (it names run folders and session ids); not a built-in persona's
  name, so the cells of ``clawloop eval`` never mix a file's persona with the built-in one;
* ``preference``: the preference as the user would state it (what a perfect hint says);
* ``corrections``: the user's replies to an answer that ignores the preference (one or more);
* ``checker``: a table with ``kind`` (one of ``checkers.CHECKER_KINDS``) and that checker's arguments;
* the questions: ``pool`` (a pool of ``clawloop/sim/data/questions.py``), or both ``train_questions`` and
  ``heldout_questions`` (no question in both lists: held-out questions are never trained on; questions that
  differ only in case or spacing count as the same question, for this and for the lists' minimum lengths);
* optional: ``description`` (who the user is, for an LLM-written user), ``thanks`` (each with ``{question}``),
  ``farewells``, ``check_topic`` (default true: an answer must mention what was asked), ``session_turns``.

Every problem is a ``PersonaFileError`` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from clawloop.sim.checkers import CHECKER_KINDS
from clawloop.sim.data.questions import POOLS
from clawloop.sim.personas import PERSONAS, Persona

MIN_TRAIN_QUESTIONS = 6
"""Fewer and the training sessions keep asking the same few questions: a learnt answer to one of them would pass
for a learnt preference."""
MIN_HELDOUT_QUESTIONS = 5
"""The held-out score moves in steps of 1/n; with fewer than 5 questions two answers decide the default target."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
_REQUIRED = ("name", "preference", "corrections", "checker")
_OPTIONAL = ("description", "thanks", "farewells", "check_topic", "session_turns", "pool", "train_questions",
             "heldout_questions")
_PYTHON_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
# Values a checker argument must take, beyond its type: (test, what it must be).
_ARGUMENT_RULES: dict[str, tuple[Any, str]] = {
    "language": (lambda v: v in ("french", "spanish", "english"), "one of french, spanish, english"),
    "min_hits": (lambda v: v >= 1, "at least 1"),
    "min_share": (lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "max_words": (lambda v: v >= 1, "at least 1"),
    "min_sentences": (lambda v: v >= 1, "at least 1"),
    "max_sentences": (lambda v: v >= 1, "at least 1"),
    "min_items": (lambda v: v >= 1, "at least 1"),
    "word": (lambda v: bool(v.strip()), "not empty"),
    "phrase": (lambda v: bool(v.strip()), "not empty"),
    "min_words_after": (lambda v: v >= 0, "0 or more"),
    "min_words_before": (lambda v: v >= 0, "0 or more"),
}
# Checker arguments whose first may not exceed the second (either one given or the checker's default), else no
# answer could pass.
_ORDERED_ARGUMENTS = (("min_sentences", "max_sentences"),)


class PersonaFileError(ValueError):
    """A persona file that cannot be read or does not define a usable persona."""


def read_persona_file(path: str | Path) -> dict[str, Any]:
    """The file's fields, parsed as TOML (``.toml``) or JSON (``.json``)."""
    path = Path(path)
    if path.suffix.lower() not in (".toml", ".json"):
        raise PersonaFileError(f"persona file {path}: the name must end in .toml or .json")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PersonaFileError(f"persona file {path}: cannot be read ({exc.strerror or exc})") from exc
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise PersonaFileError(f"persona file {path}: not valid {path.suffix[1:].upper()} ({exc})") from exc
    if not isinstance(data, dict):
        raise PersonaFileError(f"persona file {path}: must hold a table of fields, not {type(data).__name__}")
    return data


def load_persona_file(path: str | Path) -> Persona:
    """The persona ``path`` defines; ``PersonaFileError`` names the file and the field of any problem."""
    return persona_from_fields(read_persona_file(path), str(path))


def persona_from_fields(data: dict[str, Any], source: str) -> Persona:
    def fail(field: str, problem: str) -> PersonaFileError:
        return PersonaFileError(f"persona file {source}: field '{field}': {problem}")

    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise fail(unknown[0], f"unknown field (known: {', '.join(_REQUIRED + _OPTIONAL)})")
    for key in _REQUIRED:
        if key not in data:
            raise fail(key, "missing")

    def text(key: str) -> str:
        value = data[key]
        if not isinstance(value, str) or not value.strip():
            raise fail(key, "must be a non-empty string")
        return value.strip()

    def texts(key: str, minimum: int = 1) -> tuple[str, ...]:
        value = data[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise fail(key, "must be a list of non-empty strings")
        if len(value) < minimum:
            raise fail(key, f"has {len(value)}, needs at least {minimum}")
        return tuple(v.strip() for v in value)

    def questions(key: str, minimum: int) -> tuple[str, ...]:
        # The same question asked twice is one question: it neither varies the sessions nor adds a score step.
        listed = texts(key)
        distinct = len({_question_key(q) for q in listed})
        if distinct < minimum:
            raise fail(key, f"has {distinct} different question(s), needs at least {minimum}")
        return listed

    name = text("name")
    if not _NAME_RE.match(name):
        raise fail("name", f"{name!r} may hold only letters, digits, '-' and '_' (it names folders and sessions)")
    if name in PERSONAS:
        raise fail("name", f"{name!r} is a built-in persona's name; pick another so their runs are not mixed up")
    preference = text("preference")
    options: dict[str, Any] = {}
    if "description" in data:
        options["description"] = text("description")
    if "thanks" in data:
        options["thanks"] = texts("thanks")
        for template in options["thanks"]:
            problem = _thanks_problem(template)
            if problem:
                raise fail("thanks", f"{template!r}: {problem}")
    if "farewells" in data:
        options["farewells"] = texts("farewells")
    if "check_topic" in data:
        if not isinstance(data["check_topic"], bool):
            raise fail("check_topic", "must be true or false")
        options["check_topic"] = data["check_topic"]
    if "session_turns" in data:
        turns = data["session_turns"]
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise fail("session_turns", "must be a whole number of at least 1")
        options["session_turns"] = turns

    has_lists = "train_questions" in data or "heldout_questions" in data
    if "pool" in data:
        if has_lists:
            raise fail("pool", "give either a pool or train_questions and heldout_questions, not both")
        pool_name = text("pool")
        if pool_name not in POOLS:
            raise fail("pool", f"no question pool {pool_name!r} (known: {', '.join(sorted(POOLS))})")
    elif has_lists:
        for key in ("train_questions", "heldout_questions"):
            if key not in data:
                raise fail(key, "missing (train_questions and heldout_questions go together)")
        pool_name = ""
        options["own_train_questions"] = questions("train_questions", MIN_TRAIN_QUESTIONS)
        options["own_heldout_questions"] = questions("heldout_questions", MIN_HELDOUT_QUESTIONS)
        held_out = {_question_key(q) for q in options["own_heldout_questions"]}
        shared = [q for q in options["own_train_questions"] if _question_key(q) in held_out]
        if shared:
            raise fail("heldout_questions", f"{len(shared)} question(s) also in train_questions, e.g. {shared[0]!r}; "
                       "a held-out question must never be trained on")
    else:
        raise fail("pool", f"missing: give a pool ({', '.join(sorted(POOLS))}) or train_questions and "
                   "heldout_questions")

    return Persona(
        name=name,
        preference=preference,
        description=options.pop("description", f"You chat with an AI assistant and ask it questions. You want "
                                               f"this from every answer: {preference}"),
        checker=checker_from_table(data["checker"], fail),
        pool_name=pool_name,
        corrections=texts("corrections"),
        source=source,
        **options,
    )


def _question_key(question: str) -> str:
    """What makes two questions the same one: their words, whatever the case and spacing."""
    return " ".join(question.casefold().split())


def _thanks_problem(template: str) -> str | None:
    """Why a thanks reply cannot be filled in with the next question, else None (checked here, since the reply is
    only formatted mid-run, after the persona's first good answer)."""
    marker = "\x00question\x00"
    try:
        filled = template.format(question=marker)
    except (KeyError, IndexError, AttributeError, ValueError) as exc:
        return (f"only {{question}} may stand in braces (write {{{{ and }}}} for literal ones): "
                f"{type(exc).__name__}: {exc}")
    if marker not in filled:
        return "must hold {question} (where the next question goes)"
    return None


def checker_from_table(table: Any, fail: Any) -> Any:
    """The checker a ``[checker]`` table names: ``kind`` plus that class's fields as arguments."""
    if not isinstance(table, dict):
        raise fail("checker", "must be a table with a 'kind' and the checker's arguments")
    if "kind" not in table:
        raise fail("checker.kind", f"missing (known kinds: {', '.join(CHECKER_KINDS)})")
    kind = table["kind"]
    if kind not in CHECKER_KINDS:
        raise fail("checker.kind", f"unknown checker kind {kind!r} (known: {', '.join(CHECKER_KINDS)})")
    cls = CHECKER_KINDS[kind]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    arguments = {k: v for k, v in table.items() if k != "kind"}
    for key, value in arguments.items():
        if key not in fields or (key == "language" and kind != "language"):  # french/spanish fix their language
            fields.pop("language", None) if kind != "language" else None
            accepted = ", ".join(fields) or "none"
            raise fail(f"checker.{key}", f"not an argument of checker kind {kind!r} (accepted: {accepted})")
        want = _PYTHON_TYPES[str(fields[key].type)]
        # TOML and JSON write 2 for 2.0; a bool is never a number here.
        ok = (isinstance(value, want) and not isinstance(value, bool)) or (want is float and isinstance(value, int)
                                                                          and not isinstance(value, bool))
        if not ok:
            raise fail(f"checker.{key}", f"must be {want.__name__}, got {value!r}")
        rule = _ARGUMENT_RULES.get(key)
        if rule is not None and not rule[0](value):
            raise fail(f"checker.{key}", f"must be {rule[1]}, got {value!r}")
    checker = cls(**{k: float(v) if _PYTHON_TYPES[str(fields[k].type)] is float else v
                     for k, v in arguments.items()})
    for low, high in _ORDERED_ARGUMENTS:
        if hasattr(checker, low) and getattr(checker, low) > getattr(checker, high):
            raise fail(f"checker.{low}", f"must be at most {high} ({getattr(checker, high)}), got "
                       f"{getattr(checker, low)}")
    return checker


def resolve_persona(name: str, persona_file: str = "") -> Persona:
    """The persona a run asks for: the one ``persona_file`` defines, else the built-in one called ``name``."""
    from clawloop.sim.personas import get_persona

    return load_persona_file(persona_file) if persona_file else get_persona(name)
