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
