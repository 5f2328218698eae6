"""Helpers for the simulation tests (not fixtures)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def verdict_simulator(correction: str, thanks: str, farewell: str) -> Callable[[dict[str, Any], dict[str, str]], str]:
    """A ``fake_openai`` responder standing in for a capable simulator model: it follows the checker's verdict note
    that ``LLMUser`` passes on (the correction, or the thanks followed by the next question, or the farewell)."""

    def respond(body: dict[str, Any], headers: dict[str, str]) -> str:
        prompt = body["messages"][-1]["content"]
        if "does NOT follow" in prompt:
            return correction
        match = re.search(r"Your next question: (.*)", prompt)
        return f"{thanks} {match.group(1)}" if match else farewell

    return respond
