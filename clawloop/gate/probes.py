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
    # Short "what is" questions: the commonest everyday request, and where a slightly shifted small model first
    # falls into greedy loops ("A turtle is a reptile … They are found in … They are found in …") while it still
    # answers everything else soundly. Animals first: a measured demo version that looped on 3 of 14 held-out
    # definitions of living things passed twelve everyday probes and eight definitions of objects, and failed
    # on turtle, lizard, squirrel and owl below (docs/publication-gate.md).
    "What is a turtle?",
    "What is a lizard?",
    "What is a squirrel?",
    "What is an owl?",
    "What is a mushroom?",
    "What is a telescope?",
    "What is a kettle?",
    "What is an umbrella?",
)
"""Twenty probes: a collapse shows on almost every one; the early signs (loops on simple definitions) on a few,
so the definitions are a larger share than in everyday traffic. Of similar length, so they share a batch."""
