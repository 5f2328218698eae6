"""The degeneracy guard lives in the product now (``clawloop.gate.guard``: the publication gate uses it); the
simulation keeps importing it under this name."""

from clawloop.gate.guard import GuardConfig, GuardResult, check, echoes, on_topic, passes_guard, topic_words

__all__ = ["GuardConfig", "GuardResult", "check", "echoes", "on_topic", "passes_guard", "topic_words"]
