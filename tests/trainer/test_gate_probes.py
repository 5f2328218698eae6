"""What the publication gate probes: the shipped prompts and the run's recent distinct prompts, with the guard's
question rules wherever the question is known."""

from __future__ import annotations

import contextlib
import gzip
import json
from pathlib import Path

import torch

from clawloop.openclaw_format import housekeeping_kind
from clawloop.api.schemas import parse_chat_request
from clawloop.gate import gate as gate_module
from clawloop.gate.gate import MAX_PROMPT_TOKENS, RECENT_TAIL_TOKENS, PublicationGate, closing_exchanges
from clawloop.gate.guard import question_of
from clawloop.gate.generation import length_buckets, probe_answers, sampling_uniforms
from clawloop.gate.probes import PROBES
from clawloop.gate.scoring import answer_logprobs
from clawloop.renderers.chat import ChatRenderer
from clawloop.store import Store, TurnRecord


def _turn(messages, prompt_ids, i):
    return TurnRecord(session_id=f"s{i}", messages=messages, prompt_ids=prompt_ids, response_ids=[5, 2],
                      logprobs=[-0.1, -0.2], temperature=1.0, top_p=1.0, policy_version=0, turn_index=0)


def test_a_recent_prompt_gives_the_guard_its_closing_wh_question():
    assert question_of([{"role": "user", "content": " What is a glacier? "}]) == "What is a glacier?"
    assert question_of([{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": [{"type": "text", "text": "What is a frog?"}]}]) == \
        "What is a frog?"
    # Later in a conversation the last message's question is the question ("Bye!" to it is off topic).
    assert question_of([{"role": "user", "content": "What is a frog?"}, {"role": "assistant", "content": "A."},
                        {"role": "user", "content": "Thanks! What is a lake?"}]) == "What is a lake?"
    assert question_of([{"role": "user", "content": "That doesn't answer my question. Why do stars shine?"}]) == \
        "Why do stars shine?"
    # Thanks, farewells and requests about the answer name no topic: "You're welcome." is a fine reply to the
    # first, a compliant short re-answer to the others.
    for said in ("Great, thanks for your help.", "I only have time for one sentence. Can you keep it that short?",
                 'Where is my "In short,"? Please start your answers with it.', "Shorter, please.",
                 'I like answers that open with "In short,". Can you do that?'):
        assert question_of([{"role": "user", "content": said}]) is None, said
    # Real prompts' forms: a contraction, a dot or colon inside the sentence, something after the question mark.
    for said, question in (("What's a glacier?", "What's a glacier?"), ("What is Node.js?", "What is Node.js?"),
                           ("So. What happens at 10:30?", "What happens at 10:30?"),
                           ('"What is a turtle?"', '"What is a turtle?'),
                           ("Hi!\nWhat is a turtle?! 🐢", "What is a turtle?")):
        assert question_of([{"role": "user", "content": said}]) == question, said
    # A tool result or an image says nothing the guard can check the answer against.
    assert question_of([{"role": "user", "content": "Run it."}, {"role": "tool", "content": "ok"}]) is None
    assert question_of([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]) is None
    assert question_of([{"role": "user", "content": "   "}]) is None and question_of([]) is None


def test_recent_prompts_are_distinct_newest_first(tmp_path, tiny_tokenizer):
    store = Store(tmp_path / "store.sqlite")
    assert store.recent_prompts(3) == []  # a run with no turns yet
    asked = ["What is a frog?", "What is a lake?", "What is a frog?", "What is a whale?"]
    for i, q in enumerate(asked):
        messages = [{"role": "user", "content": q}]
        ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        store.add_turn(_turn(messages, list(ids["input_ids"] if hasattr(ids, "keys") else ids), i))
    recent = store.recent_prompts(3)
    assert [m[0]["content"] for _, _, m in recent] == ["What is a whale?", "What is a frog?", "What is a lake?"]
    assert [turn_id for turn_id, _, _ in recent] == [4, 3, 2]  # the older copy of the frog question is skipped

    gate = PublicationGate(tiny_tokenizer, recent_prompts=lambda: store.recent_prompts(3))
    probes = gate.probe_set()
    assert len(probes) == len(PROBES) + 3
    assert [(p.source, p.question) for p in probes[len(PROBES):]] == [
        ("recent:4", "What is a whale?"), ("recent:3", "What is a frog?"), ("recent:2", "What is a lake?")]


def test_length_buckets_keep_short_probes_apart_from_long_prompts():
    lengths = [40, 36, 208, 43, 156, 35, 77, 1000]
    groups = length_buckets(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every prompt, once
    assert groups == [[5, 1, 0, 3, 6], [4, 2], [7]]  # sorted by length; a group spans at most 2x its shortest + 32
    assert length_buckets([]) == []


def test_probe_answers_in_buckets_equal_each_prompt_answered_alone(base_model, tiny_tokenizer):
    torch.manual_seed(0)
    prompts = [[1] + [int(t) for t in torch.randint(3, 200, (n,))] for n in (5, 60, 7, 130, 6)]
    assert len(length_buckets([len(p) for p in prompts])) > 1
    eos = [tiny_tokenizer.eos_token_id]
    answers, logprobs = probe_answers(base_model, prompts, 8, eos)
    for p, a, lp in zip(prompts, answers, logprobs):
        alone, alone_lp = probe_answers(base_model, [p], 8, eos)
        assert a == alone[0]
        torch.testing.assert_close(lp, alone_lp[0], atol=1e-4, rtol=1e-4)
    # The reference pass reads the same positions: the model's own greedy answers score as their generation did.
    for lp, again in zip(logprobs, answer_logprobs(base_model, prompts, answers)):
        torch.testing.assert_close(lp, again, atol=1e-4, rtol=1e-4)


def test_sampled_rows_draw_the_same_answer_whatever_shares_their_batch(base_model, tiny_tokenizer):
    """A sampled row's answer depends only on the model, its prompt and its uniforms: the reference and a candidate
    drawing a knowledge probe's answers with the same uniforms compare models, not dice. Near temperature 0 a draw
    is the greedy answer; other uniforms draw other answers; no log-softmax rows are kept for a sampled answer."""
    torch.manual_seed(2)
    prompts = [[1] + [int(t) for t in torch.randint(3, 200, (n,))] for n in (6, 9, 7)]
    eos = [tiny_tokenizer.eos_token_id]
    dice = [sampling_uniforms("What is 7 + 5?", i, 10) for i in range(3)]
    together, logprobs = probe_answers(base_model, prompts, 10, eos, uniforms=[dice[0], None, dice[2]],
                                        temperature=1.0)
    alone, _ = probe_answers(base_model, [prompts[2]], 10, eos, uniforms=[dice[2]], temperature=1.0)
    assert together[2] == alone[0] and len(together[2]) == 10
    assert logprobs[0].shape[0] == 0 and logprobs[1].shape[0] == len(together[1])  # greedy rows keep theirs
    assert together[1] == probe_answers(base_model, [prompts[1]], 10, eos)[0][0]
    cold, _ = probe_answers(base_model, [prompts[0]], 10, eos, uniforms=[dice[0]], temperature=1e-4)
    assert cold[0] == probe_answers(base_model, [prompts[0]], 10, eos)[0][0]
    draws = {tuple(probe_answers(base_model, [prompts[0]], 10, eos, uniforms=[d], temperature=1.0)[0][0])
             for d in dice}
    assert len(draws) == 3  # the tiny random model's distributions are flat: other dice, other answers
    torch.testing.assert_close(sampling_uniforms("What is 7 + 5?", 1, 10), dice[1])
    # A row whose answer is settled (a knowledge probe's, once it names the fact) leaves at once; the others go on.
    settled, _ = probe_answers(base_model, prompts, 10, eos, uniforms=[dice[0], None, dice[2]], temperature=1.0,
                                done=[lambda ids: len(ids) >= 3, None, None])
    assert settled[0] == together[0][:3] and settled[1:] == together[1:]


def test_rows_that_end_early_leave_the_batch_without_changing_any_answer(base_model, tiny_tokenizer):
    """The gate decodes only the rows still answering; every answer and its log-softmax rows equal those of the
    model's own ``generate`` on that prompt alone, also when the rows end at different steps."""
    torch.manual_seed(1)
    prompts = [[1] + [int(t) for t in torch.randint(3, 200, (n,))] for n in (9, 14, 6, 11)]
    eos = [tiny_tokenizer.eos_token_id]
    free, _ = probe_answers(base_model, prompts, 12, eos)
    # End-of-turn ids chosen from the free answers, so that the rows end after 1, 3 and 6 tokens, and one never.
    stops = {free[0][1], free[1][3], free[2][6]} - set(free[3])
    eos = eos + sorted(stops)
    answers, logprobs = probe_answers(base_model, prompts, 12, eos, batches=lambda n: [list(range(len(n)))])
    assert len({len(a) for a in answers}) >= 3  # the rows did end at different steps
    for p, a, lp in zip(prompts, answers, logprobs):
        out = base_model.generate(input_ids=torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos[0], temperature=None, top_p=None, top_k=None, output_logits=True,
                                  return_dict_in_generate=True)
        row = out.sequences[0, len(p):].tolist()
        cut = next((j for j, t in enumerate(row) if t in eos), len(row))
        assert a == row[:cut]
        expected = torch.log_softmax(torch.stack(out.logits, dim=1)[0, :cut].float(), dim=-1)
        torch.testing.assert_close(lp, expected, atol=1e-4, rtol=1e-4)


def test_a_question_asked_again_costs_the_reference_no_second_answer(tmp_path, tiny_tokenizer, base_model,
                                                                      monkeypatch):
    store = Store(tmp_path / "store.sqlite")
    messages = [{"role": "user", "content": "What is a frog?"}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    store.add_turn(_turn(messages, ids, 0))
    gate = PublicationGate(tiny_tokenizer, probe_tokens=4, probes=["Name a colour."],
                           recent_prompts=lambda: store.recent_prompts(4))
    answered = []

    def counting_probe_answers(model, prompts, max_tokens, eos_ids, **sampling):
        answered.append(len(prompts))
        return probe_answers(model, prompts, max_tokens, eos_ids, **sampling)

    monkeypatch.setattr(gate_module, "probe_answers", counting_probe_answers)
    gate.check(base_model, lambda: contextlib.nullcontext(base_model))
    assert answered == [2, 2]  # the candidate, then the reference once for each probe
    store.add_turn(_turn(messages, ids, 1))  # the same question in a new session: a new turn, the same prompt
    result = gate.check(base_model, lambda: contextlib.nullcontext(base_model))
    assert [p.source for p in result.probes] == ["shipped", "recent:2"]
    assert answered == [2, 2, 2]  # the candidate only: the reference's verdict on that prompt is known


OPENCLAW_TRAFFIC = Path(__file__).resolve().parents[1] / "data" / "openclaw"


def _served(tokenizer, name):
    """The main requests of a recorded OpenClaw run, stored as the server stores them: normalised messages and the
    serving renderer's prompt ids (with the tools OpenClaw sent)."""
    with gzip.open(OPENCLAW_TRAFFIC / f"{name}.json.gz", "rt", encoding="utf-8") as fh:
        requests = json.load(fh)["requests"]
    renderer = ChatRenderer(tokenizer)
    out = []
    for r in requests:
        req = parse_chat_request(r["body"])
        if not housekeeping_kind(req.messages):
            out.append((req.messages, renderer.render(req.messages, req.tools, req.tool_choice).ids))
    return out


def test_long_agent_prompts_are_probed_as_their_closing_exchanges(tmp_path, tiny_tokenizer, base_model):
    store = Store(tmp_path / "store.sqlite")
    served = _served(tiny_tokenizer, "runA")  # one three-turn OpenClaw conversation
    for i, (messages, ids) in enumerate(served):
        assert len(ids) > MAX_PROMPT_TOKENS  # OpenClaw's system prompt alone is longer than the cap
        store.add_turn(_turn(messages, ids, i))
    gate = PublicationGate(tiny_tokenizer, probe_tokens=4, probes=["Name a colour."],
                           recent_prompts=lambda: store.recent_prompts(8))
    recent = gate.probe_set()[1:]
    assert [p.source for p in recent] == ["recent:3", "recent:2", "recent:1"]
    # What the user wrote, without OpenClaw's timestamp and runtime envelopes; the question is known again.
    assert [(p.prompt, p.question) for p in recent] == [
        ("Thanks, that's all.", None), ("Too long, answer in one sentence.", None),
        ("What is the capital of France?", "What is the capital of France?")]
    for p in recent:
        assert len(p.ids) <= RECENT_TAIL_TOKENS
        text = tiny_tokenizer.decode(p.ids)
        assert p.prompt in text and text.endswith("<|im_start|>assistant\n")
        assert "running inside OpenClaw" not in text and "Runtime: agent=" not in text and "[Mon 2026" not in text
    # The candidate answers them (and the reference once each), like any probe.
    result = gate.check(base_model, lambda: contextlib.nullcontext(base_model))
    assert [p.source for p in result.probes] == ["shipped", "recent:3", "recent:2", "recent:1"]
    assert all(p.tokens > 0 for p in result.probes)
    # The same question in another OpenClaw session: another served prompt (its runtime line names the session),
    # the same bounded form, probed once, so one borderline answer cannot count as two regressions.
    messages, ids = _served(tiny_tokenizer, "runB")[0]
    assert ids != served[0][1] and question_of(messages) == "What is the capital of France?"
    store.add_turn(_turn(messages, ids, 3))
    assert [p.source for p in gate.probe_set()[1:]] == ["recent:4", "recent:3", "recent:2"]


def test_a_bounded_prompt_keeps_whole_exchanges_that_fit_and_the_ends_of_a_long_message(tiny_tokenizer):
    gate = PublicationGate(tiny_tokenizer, probes=[])
    served = _served(tiny_tokenizer, "runB")
    third = served[2]
    # The answer before "Thanks, that's all." is short: that exchange fits and is kept, older ones are not.
    kept = tiny_tokenizer.decode(gate.bounded_ids(third[0]))
    assert kept.count("<|im_start|>user") == 2 and "Too long, answer in one sentence." in kept
    assert "capital of France" not in kept and kept.endswith("Thanks, that's all.<|im_end|>\n<|im_start|>assistant\n")
    # A text to summarise, longer than the budget: its instruction and its end are kept, the middle is cut.
    summarise = served[4][0]
    assert summarise[-1]["content"].startswith("[Mon 2026-11-23 20:08 UTC] Summarize the following text")
    ids = gate.bounded_ids(summarise)
    text = tiny_tokenizer.decode(ids)
    assert len(ids) <= RECENT_TAIL_TOKENS and "Summarize the following text in one sentence" in text
    assert "\n…\n" in text and "## Seeing it learn: `make demo` and `clawloop eval`<|im_end|>" in text
    # A prompt that ends in a tool result has no closing user message: the long one is left out.
    tool_turn = [{"role": "system", "content": "Use tools. " * 600}, {"role": "user", "content": "List files."},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "a.txt"}]
    assert closing_exchanges(tool_turn) == [] and gate.bounded_ids(tool_turn) == []
