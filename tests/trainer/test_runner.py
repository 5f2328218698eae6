"""The runner seam under the one ``train_step``: what a runner hands the objective is each sample's logits at the
positions predicting its response, whatever the micro-batch around it."""

from __future__ import annotations

import torch

from clawloop.store import Store
from clawloop.trainer.batch import micro_batches, prepare_items
from clawloop.trainer.model import load_train_models
from clawloop.trainer.runner import LocalRunner

from trainer_helpers import add_sample


def test_local_runner_gives_each_sample_its_response_logits(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="rl", rollout_batch_size=3, micro_batch_size=3)
    store = Store(tmp_path / "store.sqlite")
    for i in range(3):  # different prompt and answer lengths: the micro-batch is right-padded
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0)
    items, _, _ = prepare_items(store, store.lease_samples(3)[1], config, 0)
    models = load_train_models(config)
    runner = LocalRunner(models.device)
    (group,) = micro_batches(items, 3)
    assert len({it.input_ids_L.numel() for it in group}) > 1

    forward = runner.forward(models.causal_lm, group)
    seen = []
    for item, logits_T_V in forward.samples():
        # The same sample alone, through the whole model: row p - 1 + t predicts response token t.
        alone_L_V = models.causal_lm(input_ids=item.input_ids_L.view(1, -1)).logits[0]
        p, t = item.prompt_len, item.response_len
        torch.testing.assert_close(logits_T_V, alone_L_V[p - 1:p - 1 + t], atol=1e-5, rtol=1e-4)
        forward.add_loss(logits_T_V.logsumexp(-1).mean() / len(group))
        seen.append(item.turn_id)
    assert seen == [it.turn_id for it in group]
    forward.backward()
    grads = [p.grad for p in models.trainable_parameters()]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads)  # the leaf's gradient reached the decoder
    assert (runner.shard(5), runner.rounds(2), runner.gather("x")) == ([0, 1, 2, 3, 4], 2, ["x"])


def test_the_runner_soft_caps_logits_as_the_model_s_forward_does(make_config, base_model, tiny_tokenizer,
                                                                 soft_capped_model, tmp_path):
    """A model that soft-caps its logits (Gemma 2) trains on the capped ones: the runner applies the output layer
    itself, and must give what the model's own forward gives, as the teacher's scoring and the FSDP runner do."""
    config = make_config(method="rl", rollout_batch_size=2, micro_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0)
    items, _, _ = prepare_items(store, store.lease_samples(2)[1], config, 0)
    (group,) = micro_batches(items, 2)
    forward = LocalRunner(torch.device("cpu")).forward(soft_capped_model, group)
    for item, logits_T_V in forward.samples():
        alone_L_V = soft_capped_model(input_ids=item.input_ids_L.view(1, -1)).logits[0]
        p, t = item.prompt_len, item.response_len
        assert float(logits_T_V.detach().abs().max()) <= 0.5  # capped
        torch.testing.assert_close(logits_T_V, alone_L_V[p - 1:p - 1 + t], atol=1e-5, rtol=1e-4)
