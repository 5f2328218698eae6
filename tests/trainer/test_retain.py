"""The retain term: its targets are the starting weights' own answers and distributions, it trains every answer
position but where a later sentence opens, and in the trainer it keeps the policy's answers to prompts no user
asked closer to the starting weights while a step teaches something else."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from clawloop.config import ConfigError
from clawloop.engines.model_files import end_token_ids
from clawloop.gate.knowledge import KNOWLEDGE
from clawloop.gate.probes import PROBES
from clawloop.sim.data.questions import POOLS
from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import gate_reference
from clawloop.renderers.chat import ChatRenderer
from clawloop.teacher import inject_hint
from clawloop.trainer.retain import BUILD_CHUNK, RetainTargets, RetainTerm, build_examples, \
    build_opening_examples, retain_kl, retain_positions, sentence_ends
from clawloop.trainer.retain_prompts import RETAIN_PROMPTS

from trainer_helpers import render


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_prompts_are_neither_gate_probes_nor_users_questions_nor_their_twins():
    import difflib

    asked = [q.lower() for pool in POOLS.values() for split in pool.values() for q in split]
    asked += [p.lower() for p in PROBES] + [k.question.lower() for k in KNOWLEDGE]
    assert len(set(RETAIN_PROMPTS)) == len(RETAIN_PROMPTS) >= 32
    twins = [(p, q) for p in RETAIN_PROMPTS for q in asked
             if difflib.SequenceMatcher(None, p.lower(), q).ratio() >= 0.8]
    assert not twins  # "What is 3 + 4?" would be one of "What is 7 + 5?" (0.86), an exact copy 1.0


def test_the_positions_where_a_sentence_after_the_first_opens_are_not_trained(tiny_tokenizer):
    def untrained(text, **kw):
        ids = _ids(tiny_tokenizer, text)
        positions = retain_positions(tiny_tokenizer, ids, **kw).tolist()
        return [tiny_tokenizer.decode(ids[i:i + 1]) for i, on in enumerate(positions) if not on]

    assert untrained("The capital is Rome. It is old. Very old.") == [" It", " Very"]
    assert untrained("Pi is about 3.14 in short. Yes.") == [" Yes"]  # a decimal point ends no sentence
    assert untrained("1. Red\n2. Blue") == ["2"]  # a list's number neither, its line break does
    assert untrained("A violin is a string instrument") == []
    assert untrained("Sure! Here.", opening=False) == ["Sure", " Here"]
    assert untrained('He said "Hi." Then he left.') == [" Then"]  # a closing quote after the end mark
    ids = _ids(tiny_tokenizer, "Hello there. Bye")
    assert sentence_ends(tiny_tokenizer, ids) == [2]


def test_targets_are_the_starting_weights_top_k_along_their_own_greedy_answer(tiny_tokenizer, base_model):
    prompts = list(RETAIN_PROMPTS[:3])
    examples = build_examples(base_model, tiny_tokenizer, prompts, k=8, max_tokens=12,
                              end_ids=end_token_ids(tiny_tokenizer))
    assert [e.prompt for e in examples] == prompts
    for e in examples:
        with torch.no_grad():
            logits_L_V = base_model(input_ids=e.input_ids_L[None]).logits[0]
        answer = e.input_ids_L[e.prompt_len:]
        rows_T_V = torch.log_softmax(logits_L_V[e.prompt_len - 1: -1].float(), dim=-1)
        assert torch.equal(rows_T_V.argmax(-1), answer)  # the answer is the greedy one
        top = rows_T_V.topk(8, dim=-1)
        assert torch.equal(top.indices, e.ref_ids_T_K)
        assert torch.allclose(top.values, e.ref_logprobs_T_K, atol=1e-4)
        assert retain_kl(base_model, e, torch.device("cpu")).item() == pytest.approx(0.0, abs=1e-4)


def test_kept_answers_spare_a_later_run_the_decoding_and_give_the_same_targets(tiny_tokenizer, base_model,
                                                                               tmp_path, monkeypatch):
    from clawloop.gate.kept_answers import KeptAnswers
    from clawloop.trainer import retain

    prompts = list(RETAIN_PROMPTS[:3])
    settings = dict(k=8, max_tokens=12, end_ids=end_token_ids(tiny_tokenizer))
    first = build_examples(base_model, tiny_tokenizer, prompts, kept=KeptAnswers(tmp_path / "kept.json"), **settings)
    assert len(KeptAnswers(tmp_path / "kept.json")) == 3  # the answers, as ids, are on disk

    def no_decoding(*args, **kwargs):
        raise AssertionError("a kept answer was decoded again")

    monkeypatch.setattr(retain, "probe_answers", no_decoding)
    later = build_examples(base_model, tiny_tokenizer, prompts, kept=KeptAnswers(tmp_path / "kept.json"),
                           **settings)
    for a, b in zip(first, later):
        assert torch.equal(a.input_ids_L, b.input_ids_L) and torch.equal(a.positions_T, b.positions_T)
        # The same top-K, up to the order of near-ties: sorted log-probs agree, and so do most ids in place.
        assert torch.allclose(a.ref_logprobs_T_K, b.ref_logprobs_T_K, atol=1e-4)
        assert (a.ref_ids_T_K == b.ref_ids_T_K).float().mean() > 0.95
    # Another cap is another answer: decoded, not read.
    with pytest.raises(AssertionError, match="decoded again"):
        build_examples(base_model, tiny_tokenizer, prompts[:1], kept=KeptAnswers(tmp_path / "kept.json"),
                       **{**settings, "max_tokens": 10})


def _built(examples):
    """Targets whose examples are given (None: a prompt without one), as if built from the starting weights."""
    prompts = [f"prompt {i}" if e is None else e.prompt for i, e in enumerate(examples)]
    by_prompt = dict(zip(prompts, examples))
    return RetainTargets(prompts, lambda chunk: [by_prompt[p] for p in chunk])


def test_the_term_pulls_a_moved_model_back_and_takes_its_prompts_round_robin(tiny_tokenizer, base_model, tmp_path):
    import copy

    examples = build_examples(base_model, tiny_tokenizer, list(RETAIN_PROMPTS[:4]), k=8, max_tokens=12,
                              end_ids=end_token_ids(tiny_tokenizer))
    moved = copy.deepcopy(base_model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.02)
    term = RetainTerm(_built(examples), coef=1.0, batch=2, seed=0)
    seen = [e.prompt for _ in range(2) for e in term.take()]
    assert sorted(seen) == sorted(RETAIN_PROMPTS[:4])  # two batches of two cover the four once
    term.next = 0

    def mean_kl():
        with torch.no_grad():
            return sum(retain_kl(moved, e, torch.device("cpu")).item() for e in examples) / len(examples)

    # A resumed trainer starts further along the order; an example whose KL is not finite is left out of the
    # gradient, and the rest still trains.
    assert [e.prompt for e in RetainTerm(_built(examples), coef=1.0, batch=2, seed=0, start=2).take()] == seen[2:]
    broken = dataclasses.replace(examples[0], ref_logprobs_T_K=torch.full_like(examples[0].ref_logprobs_T_K, math.nan))
    partly = RetainTerm(_built([broken, examples[1]]), coef=1.0, batch=2, seed=0)
    moved.zero_grad()
    assert math.isfinite(partly.backward(moved, torch.device("cpu"))) and partly.skipped == 1
    assert all(torch.isfinite(p.grad).all() for p in moved.parameters() if p.grad is not None)

    before = mean_kl()
    optimizer = torch.optim.Adam(moved.parameters(), lr=1e-3)
    for _ in range(6):
        optimizer.zero_grad()
        term.backward(moved, torch.device("cpu"))
        optimizer.step()
    assert before > 0.01 and mean_kl() < 0.5 * before, (before, mean_kl())


def test_targets_are_built_a_chunk_at_a_time_in_the_order_the_term_takes_them(tiny_tokenizer, base_model):
    """The first update waits for the targets of one chunk of prompts, not of all of them: each chunk is the next
    prompts the round-robin takes, built in one batch, and the examples are those a build of every prompt at once
    gives. A trainer with nothing to train builds the next chunk ahead; a prompt without an example is passed
    over."""
    prompts = list(RETAIN_PROMPTS[:2 * BUILD_CHUNK + 3])
    end_ids = end_token_ids(tiny_tokenizer)
    at_once = dict(zip(prompts, build_examples(base_model, tiny_tokenizer, prompts, k=8, max_tokens=12,
                                               end_ids=end_ids)))
    asked: list[list[str]] = []

    def build(chunk):
        asked.append(list(chunk))
        return build_examples(base_model, tiny_tokenizer, chunk, k=8, max_tokens=12, end_ids=end_ids)

    term = RetainTerm(RetainTargets(prompts, build), coef=1.0, batch=3, seed=0)
    order = [prompts[i] for i in term.order]
    first = term.take()
    assert asked == [order[:BUILD_CHUNK]]  # one chunk: the next prompts in the term's order
    assert [e.prompt for e in first] == order[:3]
    for e in first:
        assert torch.equal(e.input_ids_L, at_once[e.prompt].input_ids_L)
        assert torch.equal(e.ref_ids_T_K, at_once[e.prompt].ref_ids_T_K)
        assert torch.allclose(e.ref_logprobs_T_K, at_once[e.prompt].ref_logprobs_T_K, atol=1e-5)
    term.take()  # prompts 3..5 of the order: built already
    assert len(asked) == 1
    assert term.build_ahead() is True and asked[1] == order[BUILD_CHUNK:2 * BUILD_CHUNK]
    assert term.build_ahead() is False and asked[2] == order[2 * BUILD_CHUNK:]
    assert term.targets.complete and len(asked) == 3

    empty = order[7]  # its answer has no position to train: passed over, and the round-robin goes on after it
    term.targets.examples[prompts.index(empty)] = None
    term.next = 6
    assert [e.prompt for e in term.take()] == [order[6], order[8], order[9]]


HINT = 'Begin every answer with "In short,".'


def test_behind_a_hint_the_opening_follows_the_hinted_starting_weights_and_the_rest_the_plain_ones(
        tiny_tokenizer, base_model):
    """The example behind a hint's opening: the hinted starting weights' greedy tokens up to the first one the plain
    starting weights also rank first, trained toward the hinted rows at every one of them, then the plain starting
    weights' greedy continuation behind that opening, trained toward the plain rows. A prompt whose hinted and
    plain answers open alike has none (its plain example stands)."""
    prompts = list(RETAIN_PROMPTS[:12])
    examples = build_opening_examples(base_model, tiny_tokenizer, prompts, HINT, k=8, max_tokens=16,
                                      end_ids=end_token_ids(tiny_tokenizer), opening_tokens=8)
    renderer = ChatRenderer(tiny_tokenizer)
    openings, cuts = [], []
    for prompt, e in zip(prompts, examples):
        user = [{"role": "user", "content": prompt}]
        plain = list(renderer.render(user).ids)
        hinted = list(renderer.render(inject_hint(user, HINT)).ids)
        with torch.no_grad():
            hinted_first = int(base_model(input_ids=torch.tensor([hinted])).logits[0, -1].argmax())
            plain_first = int(base_model(input_ids=torch.tensor([plain])).logits[0, -1].argmax())
        if e is None:
            assert hinted_first == plain_first
            continue
        assert e.prompt == prompt and e.input_ids_L[:e.prompt_len].tolist() == plain
        answer = e.input_ids_L[e.prompt_len:].tolist()
        with torch.no_grad():
            plain_rows = torch.log_softmax(base_model(input_ids=torch.tensor([plain + answer])).logits[0].float(),
                                           -1)[len(plain) - 1:-1]
            hinted_rows = torch.log_softmax(base_model(input_ids=torch.tensor([hinted + answer])).logits[0].float(),
                                            -1)[len(hinted) - 1:-1]
        o = next(t for t in range(len(answer) + 1) if t == len(answer) or answer[t] == int(plain_rows[t].argmax()))
        openings.append(o)
        # Where the cut must fall: the hinted greedy draft's first token that the plain weights also rank first.
        with torch.no_grad():
            draft = base_model.generate(torch.tensor([hinted]), max_new_tokens=8, do_sample=False,
                                        pad_token_id=0)[0, len(hinted):].tolist()
            draft = list(itertools.takewhile(lambda i: i not in end_token_ids(tiny_tokenizer), draft))
            plain_after = torch.log_softmax(base_model(input_ids=torch.tensor([plain + draft])).logits[0].float(),
                                            -1)[len(plain) - 1:-1].argmax(-1).tolist()
        cut = next((t for t, i in enumerate(draft) if i == plain_after[t]), len(draft))
        cuts.append(cut)
        assert o == cut and answer[:o] == draft[:o]
        assert 1 <= o <= 8 and answer[0] == hinted_first != plain_first
        assert answer[:o] == hinted_rows[:o].argmax(-1).tolist()  # the hinted greedy opening
        assert answer[o:] == plain_rows[o:].argmax(-1).tolist()  # the plain greedy answer behind it
        expected = torch.cat([hinted_rows[:o], plain_rows[o:]]).topk(8, dim=-1)
        assert torch.equal(e.ref_ids_T_K, expected.indices)
        assert torch.allclose(e.ref_logprobs_T_K, expected.values, atol=1e-4)
        assert bool(e.positions_T[:o].all())  # the opening is what the example teaches
    assert openings  # the random tiny model opens differently under the hint on some prompt
    assert any(c < 8 for c in cuts)  # and some opening ends at an agreement, not at the cap


def test_the_term_takes_the_examples_behind_its_hint_where_there_are_any(tiny_tokenizer, base_model):
    prompts = list(RETAIN_PROMPTS[:4])
    end_ids = end_token_ids(tiny_tokenizer)
    plain = build_examples(base_model, tiny_tokenizer, prompts, k=8, max_tokens=12, end_ids=end_ids)
    asked: list[tuple[list[str], str]] = []

    def behind(chunk, hint):
        asked.append((list(chunk), hint))
        return build_opening_examples(base_model, tiny_tokenizer, chunk, hint, k=8, max_tokens=12, end_ids=end_ids,
                                      opening_tokens=4)

    term = RetainTerm(_built(plain), coef=1.0, batch=4, seed=0, behind_hint=behind)
    assert [e.prompt for e in term.take()] == [prompts[i] for i in term.order] and not asked  # no hint yet
    term.hint = HINT
    taken = term.take()
    assert len(asked) == 1 and sorted(asked[0][0]) == sorted(prompts) and asked[0][1] == HINT
    by_prompt = dict(zip(asked[0][0], behind(asked[0][0], HINT)))
    for e in taken:
        want = by_prompt[e.prompt] or plain[prompts.index(e.prompt)]
        assert torch.equal(e.input_ids_L, want.input_ids_L)
    assert term.taken_behind_hint == sum(v is not None for v in by_prompt.values()) > 0
    term.take()
    assert len(asked) == 2  # built once per hint and prompt (the second entry is this test's own call)
    # A trainer with nothing to train builds the examples behind a new hint ahead, a chunk at a time.
    term.hint = "Answer in one short sentence."
    assert term.behind_pending() and term.build_ahead() is False and not term.behind_pending()
    assert sorted(asked[-1][0]) == sorted(prompts) and asked[-1][1] == term.hint
    term.take()
    assert len(asked) == 3  # nothing left to build when they are taken


def test_settings_are_checked(make_config):
    with pytest.raises(ConfigError, match="retain_coef"):
        make_config(retain_coef=-0.1)
    with pytest.raises(ConfigError, match="retain_batch"):
        make_config(retain_batch=0)
    assert make_config(retain_coef=0.5).retain_coef == 0.5
    with pytest.raises(ConfigError, match="retain_tokens"):
        make_config(retain_coef=1.0, retain_opening=False, retain_tokens=1)
    with pytest.raises(ConfigError, match="retain_behind_hint"):
        make_config(retain_behind_hint=True)
    assert make_config(retain_coef=1.0, retain_behind_hint=True).retain_behind_hint
    with pytest.raises(ConfigError, match="retain_tokens"):  # an opening preference frees the first position too
        make_config(retain_coef=1.0, retain_tokens=1)
    assert make_config(retain_coef=1.0, retain_tokens=1, opening_preference="never").retain_tokens == 1
    for bad in ({"opening_preference": "sometimes"}, {"opening_min_share": 1.5}, {"opening_support_coef": math.inf},
                {"opening_rollouts": -1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_config(**bad)
    with pytest.raises(ValueError, match="no examples"):  # no prompt's answer had a position to train
        RetainTerm(_built([None]), coef=1.0, batch=1, seed=0).take()


MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


def _train(make_config, tiny_tokenizer, tmp_path, retain_coef, steps=6):
    """A trainer teaching one sample's response (a +1 vote, GRPO only, large steps), and the mean retain KL of its
    policy on its retain prompts afterwards."""
    config = make_config(method="rl", rollout_batch_size=1, micro_batch_size=1, lr=1e-2, lora=True,
                         retain_coef=retain_coef, retain_batch=4, retain_tokens=12, advantage_mode="raw",
                         run_dir=str(tmp_path / f"run{retain_coef}"))
    store = Store(tmp_path / f"store{retain_coef}.sqlite")
    trainer = Trainer(config, store, console=None)
    prompt = render(tiny_tokenizer, MESSAGES)
    response = _ids(tiny_tokenizer, "Four, four, four.") + [2]
    metrics = {}
    for _ in range(steps):
        tid = store.add_turn(TurnRecord(session_id="s", turn_index=0, messages=MESSAGES, prompt_ids=prompt,
                                        response_ids=response, logprobs=[-1.0] * len(response), temperature=1.0,
                                        top_p=1.0, policy_version=trainer.policy_version))
        store.set_next_state(tid, [{"role": "user", "content": "Thanks."}])
        store.claim_judgeable(1)
        store.put_sample(SampleRecord(turn_id=tid, reward=1.0, kind="rl"))
        metrics = trainer.run_batch(*store.lease_samples(1))
    with gate_reference(trainer.models, None) as starting_weights:
        starting = [e for e in build_examples(starting_weights, tiny_tokenizer, list(PROMPTS), k=8, max_tokens=12,
                                              end_ids=end_token_ids(tiny_tokenizer)) if e is not None]
    with torch.no_grad():
        kl = sum(retain_kl(trainer.models.causal_lm, e, torch.device("cpu")).item() for e in starting)
    return metrics, kl / len(starting)


PROMPTS = RETAIN_PROMPTS[:8]


def test_in_the_trainer_the_term_keeps_the_other_prompts_nearer_the_starting_weights(monkeypatch, make_config,
                                                                                     tiny_tokenizer, tmp_path):
    monkeypatch.setattr("clawloop.trainer.core.RETAIN_PROMPTS", PROMPTS)  # each is trained 3 times in 6 steps
    plain, drift = _train(make_config, tiny_tokenizer, tmp_path, 0.0)
    kept, held = _train(make_config, tiny_tokenizer, tmp_path, 5.0)
    assert "retain_kl" not in plain and math.isfinite(kept["retain_kl"]) and kept["time_retain_s"] > 0
    assert kept["retain_applied"] == 1.0 and kept["retain_skipped_nonfinite"] == 0.0
    assert drift > 0.01 and held < 0.8 * drift, (drift, held)


def test_in_the_trainer_the_examples_are_built_behind_the_hint_most_often_trained(monkeypatch, make_config,
                                                                                 base_model, tiny_tokenizer,
                                                                                 tmp_path):
    from clawloop.trainer.publish import LocalVersion

    from trainer_helpers import HINTS, TableTeacher, add_sample

    monkeypatch.setattr("clawloop.trainer.core.RETAIN_PROMPTS", PROMPTS)
    config = make_config(retain_coef=1.0, retain_batch=4, retain_tokens=12, retain_behind_hint=True,
                         rollout_batch_size=3, micro_batch_size=3, opening_preference="never")
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0, hints=HINTS[1:])
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 2, reward=-1.0, hints=HINTS)
    trainer = Trainer(config, store, LocalVersion(), teacher=TableTeacher(base_model, tiny_tokenizer), console=None)
    metrics = trainer.run_batch(*store.lease_samples(3))
    assert metrics is not None and trainer.retain is not None and trainer.retain.hint == HINTS[0]
    built = [e for (hint, _), e in trainer.retain.opening_examples.items() if hint == HINTS[0]]
    assert len(built) == 4 and metrics["retain_behind_hint"] == sum(e is not None for e in built) > 0
    # The other prompts' examples behind the hint are left for the trainer's idle time (``prepare``).
    assert trainer.has_work_ahead()
    for _ in range(50):
        if not trainer.prepare():
            break
    assert not trainer.has_work_ahead() and len(trainer.retain.opening_examples) == len(PROMPTS)
    trainer.close()


@pytest.mark.parametrize("moved", [True, False])
def test_an_opening_preference_is_measured_on_the_retain_prompts(monkeypatch, make_config, base_model,
                                                                 tiny_tokenizer, tmp_path, moved):
    """``opening_preference = auto``: the first hinted step builds the measuring prompts' examples behind the hint;
    when the hint changes the opening of at least ``opening_min_share`` of them, the step trains the preference as
    an opening one: the examples behind the hint are taken, the plain ones leave their first position untrained,
    and the step trains with the ``opening_*`` settings. Otherwise nothing else is built behind the hint and the
    step is as configured. (The builder is replaced by one whose hint moves every opening or none.)"""
    from clawloop.trainer import core
    from clawloop.trainer.publish import LocalVersion

    from trainer_helpers import HINTS, TableTeacher, add_sample

    monkeypatch.setattr("clawloop.trainer.core.RETAIN_PROMPTS", PROMPTS)
    monkeypatch.setattr("clawloop.trainer.retain.OPENING_MEASURE", 4)
    built: list[str] = []

    def behind(models, config, prompts, hint):  # the plain example stands in for one behind a moved opening
        built.extend(prompts)
        return [dataclasses.replace(e, prompt=f"behind {e.prompt}") if moved and e is not None else None
                for e in core.starting_retain_examples(models, config, prompts)]

    monkeypatch.setattr("clawloop.trainer.core.opening_retain_examples", behind)
    taken: list[list] = []
    take = RetainTerm.take

    def watched(term):  # what the term trains on
        taken.append(take(term))
        return taken[-1]

    monkeypatch.setattr(RetainTerm, "take", watched)
    trained_with = []
    step = core.train_step

    def recorded(models, optimizer, items, config, **kwargs):
        trained_with.append(config)
        return step(models, optimizer, items, config, **kwargs)

    monkeypatch.setattr("clawloop.trainer.core.train_step", recorded)
    config = make_config(retain_coef=1.0, retain_batch=8, retain_tokens=12, rollout_batch_size=2,
                          micro_batch_size=2, opening_support_coef=0.7, opening_rollouts=0,
                         opening_restore_after_v0=3)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0, hints=HINTS)
    trainer = Trainer(config, store, LocalVersion(), teacher=TableTeacher(base_model, tiny_tokenizer), console=None)
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics is not None and metrics["opening_preference"] == float(moved)
    assert metrics["opening_moved_share"] == (1.0 if moved else 0.0)
    # Not moved: the 4 measuring prompts only; moved: every prompt the step took (all 8 here).
    assert len(built) == (len(PROMPTS) if moved else 4) and not trainer.has_work_ahead()
    (examples,) = taken
    assert all(e.prompt.startswith("behind ") == moved for e in examples)
    if not moved:  # the plain examples, whole
        assert all(bool(e.positions_T[0]) for e in examples)
    assert metrics["retain_behind_hint"] == (len(PROMPTS) if moved else 0)
    (used,) = trained_with
    assert (used.support_coef, metrics["support_coef"]) == ((0.7, 0.7) if moved else (0.3, 0.3))
    assert (used.gate_restore_after_v0 == 3) == moved
    trainer.close()


def test_a_plain_example_taken_for_an_opening_preference_leaves_its_first_position(base_model, tiny_tokenizer):
    (example,) = build_examples(base_model, tiny_tokenizer, [PROMPTS[0]], k=8, max_tokens=12,
                                end_ids=end_token_ids(tiny_tokenizer))
    term = RetainTerm(_built([example]), coef=1.0, batch=1, seed=0)
    assert bool(term.take()[0].positions_T[0])
    term.free_opening = True
    freed = term.take()[0]
    assert not bool(freed.positions_T[0]) and torch.equal(freed.positions_T[1:], example.positions_T[1:])
    assert bool(example.positions_T[0])  # the kept example itself is not changed
