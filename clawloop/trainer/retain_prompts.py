"""General prompts for the retain term (``clawloop.trainer.retain``): what the model should keep answering as it
did before any user taught it a preference.

They are everyday requests of the kinds a small assistant answers (facts, sums, units, short definitions of
objects, how-tos, and requests to list, rewrite, translate or suggest), written to be unlike the users' own
questions in nothing but topic. None of them is a publication gate probe (``clawloop.gate.probes``,
``clawloop.gate.knowledge``) or a simulated user's question (``clawloop.sim.data.questions``), so the gate and
the held-out scores still measure what the term did on prompts it never trained on;
``tests/trainer/test_retain.py`` checks that.
"""

from __future__ import annotations

RETAIN_PROMPTS: tuple[str, ...] = (
    "Which continent is Brazil in?",
    "What currency is used in the United States?",
    "What language is spoken in Mexico?",
    "What is 3 + 4?",
    "What is 6 + 6?",
    "What is 9 - 3?",
    "What is 5 times 3?",
    "What is half of 10?",
    "How many legs does a spider have?",
    "How many wheels does a bicycle have?",
    "How many seconds are there in a minute?",
    "How many centimetres are there in a metre?",
    "How many letters are there in the English alphabet?",
    "Which planet is closest to the Sun?",
    "Which is the largest planet in our solar system?",
    "What is the freezing point of water in degrees Celsius?",
    "What is the chemical symbol for gold?",
    "Who painted the Mona Lisa?",
    "Who was the first person to walk on the Moon?",
    "What is the tallest mountain in the world?",
    "What is the longest river in Africa?",
    "What colour is grass?",
    "What colour do you get by mixing blue and yellow?",
    "What is the opposite of hot?",
    "What is a hammer used for?",
    "What is a violin?",
    "What does a pilot do?",
    "What does a firefighter do?",
    "Which month comes after March?",
    "Which day comes after Friday?",
    "How many days are there in a leap year?",
    "What is the plural of mouse?",
    "How do I tie my shoelaces?",
    "How do I sharpen a pencil?",
    "What should I do if I cut my finger?",
    "Name a fruit that is yellow.",
    "Name a bird that cannot fly.",
    "What do caterpillars turn into?",
    "What is the main ingredient in guacamole?",
    "Who invented the telephone?",
    "Give me two tips for keeping a houseplant alive.",
    "List three colours of the rainbow.",
    "Rewrite this more formally: we need the files by Monday.",
    "Translate 'good morning' into French.",
    "Write one sentence about the sea.",
    "Suggest a title for a story about a dragon.",
    "Explain what a fraction is.",
    "Give me a synonym for happy.",
    "Sort these numbers from smallest to largest: 5, 2, 9.",
    "How do I write a comment in Python?",
)
"""Fifty prompts: each step trains on a few (``retain_batch``), in a fixed shuffled order."""
