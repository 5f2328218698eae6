"""The judge (process reward model): prompts, vote parsing, hint candidates and the clients that ask a model.

``votes.Judge`` runs one turn's m evaluative and m hint votes; ``client`` talks to an OpenAI-compatible endpoint or
an in-process engine; ``parse`` reads boxed votes and hints; ``prompts`` writes what the judge sees;
``scripted`` is a rule-driven judge server for tests and dry runs.
"""

from clawloop.judge.client import Completion, EngineJudgeClient, HTTPJudgeClient, JudgeClient
from clawloop.judge.parse import majority, parse_eval, parse_hint, select_candidates
from clawloop.judge.votes import Judge, Judgement, JudgeSettings

__all__ = [
    "Completion", "EngineJudgeClient", "HTTPJudgeClient", "JudgeClient", "Judge", "Judgement", "JudgeSettings",
    "majority", "parse_eval", "parse_hint", "select_candidates",
]
