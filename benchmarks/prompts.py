"""The prompts the engine benchmarks generate from: long-answer questions, so every request decodes its full
token budget, rendered with the model's chat template."""

QUESTIONS = [
    "Write a long story about a lighthouse keeper.",
    "Explain how bread is made, step by step, in detail.",
    "Describe the water cycle to a ten-year-old.",
    "List twenty animals and say one fact about each.",
    "Write a detailed travel guide to Lisbon.",
    "Explain the rules of chess thoroughly.",
    "Tell me the history of the bicycle.",
    "Write a long letter to a friend about your garden.",
]


def chat_prompt(tokenizer, question: str) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
