"""Shared by tests/test_pipeline.py and its crash worker: judgeable turns in a real store, and a scripted judge.

Each turn's answer carries a ``case=<name>`` marker; the scripted judge reads it from the prompt and answers as
that case prescribes (per vote kind, cycling through a list of replies).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from clawloop.renderers import ChatRenderer
from clawloop.judge.scripted import Hang, Raw, Reply, Status, last_user_text
from clawloop.store import Store, TurnRecord

HINT = "[HINT_START]Give the temperature in Fahrenheit.[HINT_END]"

# case -> (evaluative replies, hint replies); each list is cycled over the votes of that kind.
CASES: dict[str, tuple[list[Reply], list[Reply]]] = {
    "good": (["The user moves on. \\boxed{1}"], ["\\boxed{1} " + HINT]),
    "hint_only": (["\\boxed{1}", "\\boxed{-1}", "no vote"], ["\\boxed{1} " + HINT]),  # 1, -1, invalid: tie -> 0
    "rl_only": (["\\boxed{-1}"], ["Nothing to add. \\boxed{-1}"]),
    "nothing": (["\\boxed{0}"], ["\\boxed{-1}"]),
    "hang": ([Hang(60)], [Hang(60)]),
    "error": ([Status(500, "judge down")], [Status(503)]),
    "garbage_text": (["I think it is fine."], ["\\boxed{ 1 } [HINT_START]broken"]),
    "garbage_body": ([Raw(b"\x00\xff not json")], [Raw(b'{"choices": "nope"}')]),
    "mixed": ([Hang(60), "\\boxed{-1}"], [Status(500)]),  # one valid eval vote survives
}


class CaseJudge:
    """The scripted judge's responder; thread-safe (the server runs one thread per connection)."""

    def __init__(self, cases: dict[str, tuple[list[Reply], list[Reply]]] = CASES):
        self.cases = cases
        self.counters: dict[tuple[str, str], itertools.count] = {}
        self.lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> Reply:
        text = last_user_text(body)
        case = text.split("case=", 1)[1].split()[0].strip(".") if "case=" in text else "nothing"
        kind = "hint" if "[HINT_START]" in body["messages"][0]["content"] else "eval"
        replies = self.cases[case][0 if kind == "eval" else 1]
        with self.lock:
            n = next(self.counters.setdefault((case, kind), itertools.count()))
        return replies[n % len(replies)]


def add_judgeable_turn(store: Store, tokenizer: Any, case: str, session: str = "s",
                       next_state: list[dict[str, Any]] | None = None) -> int:
    """A served turn (real rendered prompt ids, tokenised answer ending in EOS) whose next state arrived."""
    messages = [{"role": "user", "content": "What is the temperature in Paris?"}]
    prompt_ids = ChatRenderer(tokenizer).render(messages).ids
    answer = f"It is 20 degrees. case={case}"
    response_ids = list(tokenizer(answer, add_special_tokens=False)["input_ids"]) + [2]
    turn = TurnRecord(session_id=session, messages=messages, prompt_ids=prompt_ids, response_ids=response_ids,
                      logprobs=[-1.0] * len(response_ids), temperature=0.6, top_p=1.0, policy_version=0,
                      response_text=answer, assistant_message={"role": "assistant", "content": answer})
    turn_id = store.add_turn(turn)
    ns = next_state if next_state is not None else [{"role": "user", "content": "In Fahrenheit please."}]
    assert store.set_next_state(turn_id, ns)
    return turn_id
