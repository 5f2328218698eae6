"""The trainer's side of a mixed distillation target (``opd_target``): the request names it, the teacher's mixed
rows become the sample's targets, and the step metrics say how much of the answer took the hinted row."""

from __future__ import annotations

import torch

from clawloop.renderers import chat_render_fn
from clawloop.store import Store
from clawloop.teacher import Teacher
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.model import load_train_models
from clawloop.trainer.old_policy import fill_old_side, teacher_metrics
from clawloop.trainer.teacher_client import InProcessTeacher

from trainer_helpers import HINTS, add_sample


class Recording(InProcessTeacher):
    """The real in-process teacher, keeping the requests it was sent."""

    def __init__(self, teacher: Teacher):
        super().__init__(teacher)
        self.asked = []

    def submit(self, requests):
        self.asked.append(requests)
        return super().submit(requests)


def test_a_mixed_target_reaches_the_samples_targets(make_config, base_model, tiny_engine, tiny_tokenizer,
                                                     tmp_path):
    config = make_config(opd_target="opening_end")
    store = Store(tmp_path / "store.sqlite")
    # A hinted sample (two hint candidates) with un-mixed scores recorded at today's ids: not reused.
    add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0)  # an rl sample: no OPD branch, nothing to mix
    _, samples = store.lease_samples(100)
    items, drops, _ = prepare_items(store, samples, config, 0)
    assert not drops
    teacher = Teacher(tiny_engine, chat_render_fn(tiny_tokenizer), config, tokenizer=tiny_tokenizer)
    client = Recording(teacher)
    try:
        fill_old_side(load_train_models(config), items, config, teacher=client)
    finally:
        client.close()
    ((request,),) = client.asked
    assert request.target == "opening_end" and request.hints == HINTS
    hinted = next(it for it in items if it.sample.hints)
    scores = hinted.scores
    assert scores is not None and scores.hinted_C_T is not None
    C = len(hinted.sample.hints)
    assert scores.hinted_C_T.shape == (C, hinted.response_len)
    # The targets the objective reads are the mixed rows.
    assert torch.equal(hinted.targets.teacher_ids_C_T_K, scores.teacher_ids_C_T_K)
    share = teacher_metrics(items)["teacher_hinted_share"]
    assert share == float(scores.hinted_C_T.float().mean()) and 0.0 < share <= 1.0
