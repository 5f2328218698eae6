"""General prompts for the retain term (``clawloop.trainer.retain``): what the model should keep answering as it
did before any user taught it a preference.

They are everyday requests of the kinds a small assistant answers (facts, words, sequences, how-tos, and requests
to list, sort, translate or describe). None of them is a publication gate probe (``clawloop.gate.probes``,
``clawloop.gate.knowledge``) or a simulated user's question (``clawloop.sim.data.questions``), nor a twin of one
in form ("What is 3 + 4?" beside the gate's "What is 7 + 5?"), so that the gate and the held-out scores still
measure prompts the term never trained on; ``tests/trainer/test_retain.py`` checks both.
"""

from __future__ import annotations

RETAIN_PROMPTS: tuple[str, ...] = (
    "Which continent is Brazil in?",
    "What currency is used in the United States?",
    "What language is spoken in Mexico?",
    "Who painted the Mona Lisa?",
    "Who was the first person to walk on the Moon?",
    "Who invented the telephone?",
    "What do caterpillars turn into?",
    "What do spiders spin?",
    "What do cows eat?",
    "Can penguins fly?",
    "Is a tomato a fruit or a vegetable?",
    "Is the Sun a star?",
    "Which month comes after March?",
    "Which day comes after Friday?",
    "What is the first letter of the English alphabet?",
    "What comes next: 2, 4, 6?",
    "Count from one to five.",
    "Spell the word cat backwards.",
    "What is the plural of mouse?",
    "What is the opposite of hot?",
    "Give me a synonym for happy.",
    "Translate 'good morning' into French.",
    "Complete the saying: the early bird catches the...",
    "Sort these numbers from smallest to largest: 5, 2, 9.",
    "List three colours of the rainbow.",
    "Name a fruit that is yellow.",
    "Name a bird that cannot fly.",
    "What is the main ingredient in guacamole?",
    "What is a hammer used for?",
    "What does a pilot do?",
    "What does a firefighter do?",
    "How do I tie my shoelaces?",
    "How do I sharpen a pencil?",
    "What should I do if I cut my finger?",
    "Why do we brush our teeth?",
    "Why do people wear sunglasses?",
    "How do I write a comment in Python?",
    "Make a short shopping list for a picnic.",
    "Describe the colour of a ripe banana.",
    "Tell me a fun fact about elephants.",
    "What sound does a cat make?",
    "What shape is a football?",
    "Where does the Sun rise?",
    "What do you call a baby dog?",
    "What do you wear on your feet?",
    "Which is heavier, a kilogram of feathers or a kilogram of stone?",
    "What are the three primary colours?",
    "What instrument has black and white keys?",
    "How do you greet someone in Spanish?",
    "What do you use to cut paper?",
)
"""Fifty prompts: each step trains on a few (``retain_batch``), in a fixed shuffled order."""
