"""The shipped probe prompts: short, diverse, general requests a sound assistant answers in plain text.

Every candidate version answers these (greedy) before it may be served. They are deliberately unlike any
evaluation set: everyday requests across topics and forms (a fact, a how-to, a list, a rewrite, a bit of code,
a definition, advice), so that a policy pushed toward one user's preference still has to answer them soundly.
The run's own recent prompts are added to them at each check (``clawloop.gate.gate``).
"""

from __future__ import annotations

PROBES: tuple[str, ...] = (
    "What does a thermometer measure?",
    "Give me two tips for writing a clear email.",
    "Explain what a noun is.",
    "Name three planets of the solar system.",
    "How do plants get energy from sunlight?",
    "Write one sentence describing autumn leaves.",
    "What is the difference between weather and climate?",
    "Suggest a name for a friendly grey cat.",
    "Rewrite this more politely: give me the report now.",
    "What does the Python function len() return?",
    "Why do bicycles have gears?",
    "How many minutes are there in three hours?",
)
"""Twelve probes: enough to see a collapse (it shows on almost every prompt), few enough to check cheaply."""
