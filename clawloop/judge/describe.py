"""Which judge a configuration runs, and what it can and cannot see: said at start-up and in ``/v1/status``.

``auto`` (the default) is the HTTP judge when ``judge_url`` is set and the rule judge otherwise. The embedded
engine (the frozen 135M base model judging in-process) stays selectable with ``judge_backend = engine``, but it
is not a default: on the labelled cases it agrees with the labels far less often than the rules and most of its
votes are unparseable (docs/judge.md; measure any judge with ``clawloop judge check``).
"""

from __future__ import annotations

from clawloop.config import Config

HOW_TO_CONFIGURE = ("For an LLM judge set judge_url (an OpenAI-compatible …/v1 endpoint, hosted or local) with "
                    "judge_model and judge_api_key, and score it first with `clawloop judge check --judge-url URL "
                    "--judge-model M`.")


def judge_backend(config: Config) -> str:
    """Who judges: ``rules``, ``http`` (``judge_url``) or ``engine`` (the frozen base model); ``auto`` picks http
    when ``judge_url`` is set, else rules."""
    backend = config.judge_backend or "auto"
    if backend == "auto":
        return "http" if config.judge_url else "rules"
    return backend


def describe(config: Config) -> dict[str, str]:
    """``backend``, what it ``sees``, what it ``cannot_see``, and ``configure`` (how to get a better one)."""
    backend = judge_backend(config)
    if backend == "rules":
        return {
            "backend": "rules",
            "sees": "explicit feedback in the message after an answer: thanks or approval (+1), a correction or "
                    "change request (-1, rewritten as an imperative hint), a tool error (-1) or success (+1)",
            "cannot_see": "implicit dissatisfaction (a user who silently rephrases or gives up), whether an answer "
                          "was right or good when nobody says so (thanks after a wrong answer still count +1), and "
                          "feedback it has no keyword for",
            "configure": HOW_TO_CONFIGURE,
        }
    if backend == "http":
        model = config.judge_model or "the endpoint's first model"
        return {
            "backend": "http",
            "sees": f"the request, the answer and the next state, read by {model} at {config.judge_url}",
            "cannot_see": "anything beyond what that model understands; check it with `clawloop judge check`",
            "configure": "Score this endpoint with `clawloop judge check --judge-url URL --judge-model M`.",
        }
    return {
        "backend": "engine",
        "sees": f"the request, the answer and the next state, read by the frozen base model ({config.model})",
        "cannot_see": "reliably anything at 135M parameters: most of its votes are unparseable and it seldom "
                      "agrees with the labels (`clawloop judge check --backend engine`)",
        "configure": "Use judge_backend = rules (the default) or an LLM judge: " + HOW_TO_CONFIGURE,
    }


def startup_message(config: Config) -> str:
    """One paragraph for the log when the judge starts."""
    d = describe(config)
    names = {"rules": "the rule judge (no model; zero cost)", "http": f"an LLM judge over HTTP ({config.judge_url})",
             "engine": f"the embedded judge (the frozen base model {config.model}, in-process)"}
    return (f"clawloop judge: turns are judged by {names[d['backend']]}. It sees {d['sees']}. It cannot see "
            f"{d['cannot_see']}. {d['configure']} Dropped turns and their reasons are counted in /v1/status.")
