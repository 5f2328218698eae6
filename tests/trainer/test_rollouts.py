"""Student rollouts (``opd_rollouts``): the trainer samples its own answers to the batch's hinted prompts and
trains them under the same hints by the OPD branch, without a vote and without storing them."""

from __future__ import annotations

import pytest
import torch

from clawloop.config import ConfigError
from clawloop.engines.model_files import end_token_ids, turn_end_token_id
from clawloop.store import Store, TurnState
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import load_train_models
from clawloop.trainer.publish import LocalVersion
from clawloop.trainer.rollouts import ROLLOUT_KIND, rollout_items
from clawloop.trainer.step import rewards_for

from trainer_helpers import HINTS, TableTeacher, add_sample, logprob_table


class StoredFail(TableTeacher):
    """Answers for rollouts (negative turn ids) and fails every call that asks about a stored sample."""

    def submit(self, requests):
        if any(r.turn.id is not None and r.turn.id > 0 for r in requests):
            self.fail = True
        try:
            return super().submit(requests)
        finally:
            self.fail = False


def _items(store, config):
    _, samples = store.lease_samples(100)
    items, drops, _ = prepare_items(store, samples, config, 0)
    assert not drops
    return items


def test_rollouts_are_the_current_weights_own_samples_drawn_again_alike(make_config, tiny_tokenizer, tmp_path):
    config = make_config(opd_rollouts=3, opd_rollout_tokens=12, seed=5)
    models = load_train_models(config)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, models.causal_lm, tiny_tokenizer, 0, reward=-1.0, hints=HINTS)
    add_sample(store, models.causal_lm, tiny_tokenizer, 1, reward=1.0)  # no hint: no rollout
    items = _items(store, config)
    ends, turn_end = end_token_ids(tiny_tokenizer), turn_end_token_id(tiny_tokenizer)
    first = rollout_items(models, items, config, step=1, end_ids=ends, turn_end=turn_end)
    assert len(first) == 3 and all(it.sample.kind == ROLLOUT_KIND for it in first)
    parent = items[0] if items[0].sample.hints else items[1]
    for it in first:
        assert it.turn_id < 0 and it.sample.reward == 0.0 and it.sample.hints == parent.sample.hints
        assert it.sample.info["rollout_of"] == parent.turn_id and it.sample.targets is None
        assert it.turn.prompt_ids == parent.turn.prompt_ids and it.temperature == parent.temperature
        ids = it.response_ids_T.tolist()
        assert 1 <= len(ids) <= 13 and all(i not in ends for i in ids[:-1])
        assert len(ids) <= 12 or ids[-1] == turn_end  # past the cap only by the end of turn it sampled
        # The behaviour log-probs are the sampling's own: the model's at the turn's temperature.
        table = logprob_table(models.causal_lm, list(it.turn.prompt_ids), ids, it.temperature)
        body = len(ids) if ids[-1] != turn_end else len(ids) - 1
        expected = table.gather(1, torch.tensor(ids)[:, None])[:body, 0]
        torch.testing.assert_close(it.behaviour_logprobs_T[:body], expected, atol=1e-4, rtol=0)
    assert len({tuple(it.response_ids_T.tolist()) for it in first}) > 1  # three dice, not one answer thrice
    again = rollout_items(models, items, config, step=1, end_ids=ends, turn_end=turn_end)
    assert [it.response_ids_T.tolist() for it in again] == [it.response_ids_T.tolist() for it in first]
    later = rollout_items(models, items, config, step=2, end_ids=ends, turn_end=turn_end)
    assert [it.response_ids_T.tolist() for it in later] != [it.response_ids_T.tolist() for it in first]


@pytest.mark.parametrize("mode,group_norm", [("baseline", False), ("raw", True), ("balanced", False)])
def test_a_rollout_has_no_advantage_and_leaves_the_batch_s_advantages_as_they_were(mode, group_norm, make_config,
                                                                                   tiny_tokenizer, tmp_path):
    """Nobody voted on a rollout: under every advantage mode its GRPO advantage is 0, and the stored samples'
    advantages are what they would be without it (a baseline or a group norm counting it would push it up)."""
    config = make_config(opd_rollouts=2, opd_rollout_tokens=6, advantage_mode=mode, group_norm=group_norm)
    models = load_train_models(config)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, models.causal_lm, tiny_tokenizer, 0, reward=-1.0, hints=HINTS)
    add_sample(store, models.causal_lm, tiny_tokenizer, 1, reward=-1.0, hints=HINTS)
    add_sample(store, models.causal_lm, tiny_tokenizer, 2, reward=1.0)
    items = _items(store, config)
    rollouts = rollout_items(models, items, config, step=1, end_ids=end_token_ids(tiny_tokenizer),
                             turn_end=turn_end_token_id(tiny_tokenizer))
    assert len(rollouts) == 4
    alone = rewards_for(items, config)
    together = rewards_for(items + rollouts, config)
    assert together[:len(items)] == alone and together[len(items):] == [0.0] * 4
    assert any(a != 0.0 for a in alone)


def test_the_trainer_trains_rollouts_under_the_hint_and_commits_only_stored_samples(make_config, base_model,
                                                                                    tiny_tokenizer, tmp_path):
    config = make_config(opd_rollouts=2, opd_rollout_tokens=10, rollout_batch_size=3, micro_batch_size=4)
    store = Store(tmp_path / "store.sqlite")
    hinted = add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0, hints=HINTS)
    thanked = add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0, hints=HINTS[:1])
    plain = add_sample(store, base_model, tiny_tokenizer, 2, reward=1.0)
    teacher = TableTeacher(base_model, tiny_tokenizer)
    trainer = Trainer(config, store, LocalVersion(), teacher=teacher, console=None)
    metrics = trainer.run_batch(*store.lease_samples(3))
    assert metrics is not None and metrics["rollout_samples"] == 4.0 and metrics["samples"] == 3.0
    asked = [r for call in teacher.asked for r in call]
    # The served answers' scores were recorded with them; the teacher was asked for the four rollouts, each under
    # its parent's hints.
    rollouts = [r for r in asked if r.turn.id is not None and r.turn.id < 0]
    assert len(asked) == 4 and len(rollouts) == 4 and sorted(len(r.hints) for r in rollouts) == [1, 1, 2, 2]
    served = {tuple(store.get_turn(t).response_ids) for t in (hinted, thanked)}
    assert all(tuple(r.turn.response_ids) not in served for r in rollouts)
    assert metrics["opd_applied"] > 0
    consumed = {s.turn_id for s in store.samples() if s.consumed_step == metrics["step"]}
    assert consumed == {hinted, thanked, plain}
    assert all(store.get_turn(t).state == TurnState.CONSUMED for t in consumed)
    assert all(t.id > 0 for t in store.turns())  # nothing of a rollout was written
    trainer.close()


def test_rollouts_alone_make_no_update(make_config, base_model, tiny_tokenizer, tmp_path):
    """A step whose stored samples were all left out (here: the teacher failed on the only one, which has no vote)
    makes no update from its rollouts: nothing would be committed for it."""
    config = make_config(opd_rollouts=2, opd_rollout_tokens=6, rollout_batch_size=1, micro_batch_size=1)
    store = Store(tmp_path / "store.sqlite")
    unvoted = add_sample(store, base_model, tiny_tokenizer, 0, reward=0.0, hints=HINTS,
                         edit_targets=lambda t: t.clear())
    teacher = StoredFail(base_model, tiny_tokenizer)
    trainer = Trainer(config, store, LocalVersion(), teacher=teacher, console=None)
    before = {k: v.clone() for k, v in trainer.models.causal_lm.state_dict().items()}
    assert trainer.run_batch(*store.lease_samples(1)) is None
    asked = [r.turn.id for call in teacher.asked for r in call]
    assert sorted(asked) == [-2, -1, unvoted]  # the rollouts were scored and trained, the sample was not
    after = trainer.models.causal_lm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert store.get_turn(unvoted).state == TurnState.DROPPED and trainer.step == 0
    trainer.close()


def test_a_rollout_fits_the_context_a_served_sample_must(make_config, tiny_tokenizer, tmp_path):
    config = make_config(opd_rollouts=2, opd_rollout_tokens=64)
    models = load_train_models(config)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, models.causal_lm, tiny_tokenizer, 0, reward=-1.0, hints=HINTS)
    items = _items(store, config)
    prompt = len(items[0].turn.prompt_ids)
    ends, turn_end = end_token_ids(tiny_tokenizer), turn_end_token_id(tiny_tokenizer)
    rollouts = rollout_items(models, items, config, step=1, end_ids=ends, turn_end=turn_end, max_context=prompt + 5)
    assert rollouts and all(prompt + it.response_len <= prompt + 5 for it in rollouts)
    assert all(len(it.response_ids_T) <= 4 or it.response_ids_T[-1] == turn_end for it in rollouts)
    assert rollout_items(models, items, config, step=1, end_ids=ends, turn_end=turn_end, max_context=prompt + 1) == []


def test_settings_are_checked(make_config):
    for bad in (dict(opd_rollouts=-1), dict(opd_rollouts=1, opd_rollout_tokens=0),
                dict(opd_rollouts=1, method="rl"), dict(opd_rollouts=1, method="combine")):
        with pytest.raises(ConfigError, match="opd_rollout"):
            make_config(**bad)
    assert make_config(opd_rollouts=2, method="opd").opd_rollouts == 2
