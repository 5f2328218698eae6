"""Simulated users: the rule-based one and the LLM-driven one over an OpenAI-compatible endpoint."""

from __future__ import annotations


from clawloop.sim.personas import get_persona
from clawloop.sim.user import LLMUser, RuleBasedUser, system_prompt

from sim_support import verdict_simulator

ENGLISH = "Bread is made from flour, water and salt."
FRENCH = "Le pain est fait avec de la farine, de l'eau et du sel."


# A deterministic stand-in for a capable simulator model (the think block must be stripped).
fake_simulator = verdict_simulator(
    "<think>They wrote English again.</think> Écrivez en français, please: I want French answers.",
    "Merci beaucoup !", "Merci, au revoir !")


def test_rule_based_user_is_reproducible():
    p = get_persona("french")
    a, b = RuleBasedUser(p, seed=3), RuleBasedUser(p, seed=3)
    texts_a = [a.reply([], ENGLISH, "Q?").text for _ in range(8)]
    texts_b = [b.reply([], ENGLISH, "Q?").text for _ in range(8)]
    assert texts_a == texts_b


def test_llm_user_writes_the_reply_from_a_persona_prompt(fake_openai):
    fake_openai.responder = fake_simulator
    p = get_persona("french")
    user = LLMUser(p, fake_openai.base_url + "/v1", model="sim-model", api_key="sk-test", seed=0)
    conversation = [{"role": "user", "content": "What is bread made of?"}]

    bad = user.reply(conversation, ENGLISH, "What is jam?")
    assert bad.source == "llm" and bad.kind == "correction" and not bad.verdict.satisfied
    assert bad.text == "Écrivez en français, please: I want French answers."  # think block stripped

    good = user.reply(conversation, FRENCH, "What is jam?")
    assert good.source == "llm" and good.kind == "thanks"
    assert good.text == "Merci beaucoup ! What is jam?"

    last = user.reply(conversation, FRENCH, None)
    assert last.kind == "farewell" and last.text == "Merci, au revoir !"

    req = fake_openai.chat_requests()[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["authorization"] == "Bearer sk-test"
    assert req["body"]["model"] == "sim-model"
    system = req["body"]["messages"][0]
    assert system["role"] == "system" and p.preference in system["content"]
    assert system["content"] == system_prompt(p)
    # The simulator sees the question and the answer it reacts to.
    assert "What is bread made of?" in req["body"]["messages"][1]["content"]
    assert ENGLISH in req["body"]["messages"][1]["content"]


def test_llm_user_without_the_verdict_is_not_told_the_checker_result(fake_openai):
    fake_openai.responder = lambda body, headers: "Please reply in French."
    user = LLMUser(get_persona("french"), fake_openai.base_url + "/v1", model="m", share_verdict=False)
    user.reply([], ENGLISH, "Q?")
    assert "Note:" not in fake_openai.chat_requests()[0]["body"]["messages"][1]["content"]


def test_llm_user_falls_back_to_scripted_replies_when_the_endpoint_fails(fake_openai):
    fake_openai.fail_with = 500
    p = get_persona("french")
    user = LLMUser(p, fake_openai.base_url + "/v1", model="m", seed=0)
    reply = user.reply([], ENGLISH, "Q?")
    assert reply.source == "rules-fallback" and reply.text in p.corrections
    assert user.fallbacks == 1


def test_llm_user_falls_back_on_an_empty_message(fake_openai):
    fake_openai.responder = lambda body, headers: "<think>hmm</think>   "
    user = LLMUser(get_persona("inshort"), fake_openai.base_url + "/v1", model="m", seed=0)
    reply = user.reply([], "In short, a ship is a large boat.", "What is a map?", question="What is a ship?")
    assert reply.source == "rules-fallback" and reply.kind == "thanks" and reply.text.endswith("What is a map?")
