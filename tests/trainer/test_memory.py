"""Training memory controls: the per-sample token budget, token-bounded micro-batches, activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from clawloop.store import Store, TurnState
from clawloop.trainer.batch import micro_batches, prepare_items
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import load_train_models
from clawloop.trainer.recompute import AUTO_MIN_TOKENS, checkpointed_layers, wants_checkpointing
from clawloop.trainer.step import make_optimizer, train_step

from trainer_helpers import HINTS, add_sample

LONG_ANSWER = "The report covers caching, retries, timeouts and the rollout plan for every region. " * 6


def _sample_tokens(store, turn_id) -> int:
    turn = store.get_turn(turn_id)
    return len(turn.prompt_ids) + len(turn.response_ids)


def test_sample_over_the_token_budget_is_dropped_with_a_reason_and_the_step_still_trains(
        make_config, base_model, tiny_tokenizer, tmp_path):
    store = Store(tmp_path / "store.sqlite")
    short = add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    long = add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0, answer=LONG_ANSWER)
    budget = _sample_tokens(store, short) + 1
    assert _sample_tokens(store, long) > budget
    trainer = Trainer(make_config(max_train_tokens=budget), store, console=None)
    before = [p.detach().clone() for p in trainer.models.trainable_parameters()]
    lease, samples = store.lease_samples(2)

    metrics = trainer.run_batch(lease, samples)

    assert metrics is not None and metrics["samples"] == 1 and metrics["dropped"] == 1
    assert store.drop_reasons() == {"too_long": 1}
    assert store.count_samples() == {TurnState.CONSUMED: 1, TurnState.DROPPED: 1}
    (row,) = store.steps()
    assert row["turn_ids"] == [short]
    moved = sum(float((a.detach() - b).abs().sum()) for a, b in zip(trainer.models.trainable_parameters(), before))
    assert moved > 0


class _Item:
    def __init__(self, n: int):
        self.input_ids_L = torch.zeros(n, dtype=torch.long)


def test_micro_batches_respect_the_token_budget_and_keep_an_oversized_sample_alone():
    items = [_Item(n) for n in (100, 900, 300, 5000, 200, 250)]
    groups = micro_batches(items, size=4, max_tokens=1000)
    lengths = [[int(it.input_ids_L.numel()) for it in g] for g in groups]
    assert sorted(n for g in lengths for n in g) == [100, 200, 250, 300, 900, 5000]  # every item exactly once
    for g in lengths:
        assert len(g) <= 4
        assert len(g) == 1 or len(g) * max(g) <= 1000
    assert [5000] in lengths and [900] in lengths
    # Without a token budget: groups of `size` in length order, as before.
    plain = micro_batches(items, size=4)
    assert [[int(it.input_ids_L.numel()) for it in g] for g in plain] == [[100, 200, 250, 300], [900, 5000]]


def test_auto_checkpointing_only_for_long_micro_batches():
    assert not wants_checkpointing("auto", AUTO_MIN_TOKENS)
    assert wants_checkpointing("auto", AUTO_MIN_TOKENS + 1)
    assert wants_checkpointing("on", 1) and not wants_checkpointing("off", 10 ** 6)
    with pytest.raises(ValueError):
        wants_checkpointing("sometimes", 10)


def _saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_checkpointed_decoder_keeps_far_less_for_the_backward(make_config):
    models = load_train_models(make_config())
    decoder = models.causal_lm.get_decoder()
    ids_B_L = torch.randint(3, 1000, (1, 256))

    def forward():
        decoder(input_ids=ids_B_L, use_cache=False)[0].sum().backward()

    plain = _saved_bytes(forward)
    with checkpointed_layers(decoder):
        checkpointed = _saved_bytes(forward)
    assert checkpointed < plain / 3, (checkpointed, plain)
    assert all("forward" not in vars(layer) for layer in decoder.layers)  # the wrapper is gone afterwards


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpointing_on_and_off_give_the_same_loss_and_update(make_config, base_model, tiny_tokenizer,
                                                                 tmp_path, lora):
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0, hints=HINTS[:1])
    add_sample(store, base_model, tiny_tokenizer, 2, reward=-1.0)
    add_sample(store, base_model, tiny_tokenizer, 3, reward=1.0, answer=LONG_ANSWER)
    _, samples = store.lease_samples(4)
    results = {}
    for mode in ("off", "on"):
        config = make_config(method="hybrid", lora=lora, rollout_batch_size=4, micro_batch_size=2,
                             gradient_checkpointing=mode, grad_clip=0.0)
        models = load_train_models(config)
        optimizer = make_optimizer(models, config)
        items, drops, _ = prepare_items(store, samples, config, 0)
        assert not drops
        metrics = train_step(models, optimizer, items, config)
        assert metrics["checkpointed_micro_batches"] == (2.0 if mode == "on" else 0.0)
        results[mode] = (metrics, [p.detach().clone() for p in models.trainable_parameters()])
    (m_off, p_off), (m_on, p_on) = results["off"], results["on"]
    assert m_on["loss"] == pytest.approx(m_off["loss"], rel=1e-5, abs=1e-7)
    assert m_on["grad_norm"] == pytest.approx(m_off["grad_norm"], rel=1e-4)
    for a, b in zip(p_on, p_off):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("values", [dict(gradient_checkpointing="sometimes"), dict(attn_implementation="flash"),
                                    dict(max_train_tokens=0), dict(micro_batch_tokens=0)])
def test_memory_settings_are_validated(make_config, values):
    from clawloop.config import ConfigError

    with pytest.raises(ConfigError):
        make_config(**values)
