"""The old-policy side of the teacher-support term: the teacher is asked for K' = max(topk, support_k) ids, recorded
scores narrower than that are not reused, and a step with the term on lifts a token the teacher wants that the
student ranks far down."""

from __future__ import annotations

import math
from concurrent.futures import Future

import torch

from clawloop.store import Store
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.model import load_train_models
from clawloop.trainer.old_policy import fill_old_side, teacher_width
from clawloop.trainer.step import make_optimizer, train_step
from clawloop.wire import TeacherScores

from trainer_helpers import HINTS, add_sample, logprob_table

RARE_ID = 31_337
"""A token the tiny random policy gives about 1/49,152 at every position (checked where used)."""


class WideTeacher:
    """A ``TeacherClient`` answering as many own ids as each request asks for (ids 100.., log-probs −2, −3, ...)."""

    timeout_s = 30.0

    def __init__(self):
        self.asked = []

    def submit(self, requests):
        self.asked.append(requests)
        out = []
        for r in requests:
            C, (T, K) = max(1, len(r.hints)), r.student_ids_T_K.shape
            width = r.teacher_k or K
            own = torch.arange(100, 100 + width).expand(C, T, width).contiguous()
            values = -2.0 - torch.arange(width, dtype=torch.float32).expand(C, T, width).contiguous()
            out.append(TeacherScores(student_ids_T_K=r.student_ids_T_K, teacher_ids_C_T_K=own,
                                     teacher_logprobs_C_T_K=values,
                                     teacher_at_student_C_T_K=torch.full((C, T, K), -2.0),
                                     hint_lens_C=torch.tensor([len(h) for h in r.hints] or [0]),
                                     teacher_token_logprobs_C_T=torch.full((C, T), -1.0)))
        future = Future()
        future.set_result(out)
        return future

    def close(self):
        pass


def _items(store, config):
    _, samples = store.lease_samples(100)
    items, drops, _ = prepare_items(store, samples, config, 0)
    assert not drops
    return items


def test_the_teacher_is_asked_for_max_of_topk_and_support_k_ids(make_config, base_model, tiny_tokenizer,
                                                               tmp_path):
    assert teacher_width(make_config()) == 4  # the term off: the teacher call is what it always was
    assert teacher_width(make_config(support_coef=0.5, support_k=2)) == 4
    for coef, expected in ((0.0, 4), (0.5, 8)):
        config = make_config(support_coef=coef, support_k=8)
        store = Store(tmp_path / f"store-{coef}.sqlite")
        add_sample(store, base_model, tiny_tokenizer, 0, hints=HINTS)  # recorded scores of width 4
        items = _items(store, config)
        teacher = WideTeacher()
        fill_old_side(load_train_models(config), items, config, teacher=teacher)
        if expected == 4:  # recorded at the very same ids and wide enough: reused, nobody asked
            assert not teacher.asked and items[0].info["teacher_reused"] == 1.0
        else:  # the recorded set is narrower than K': the teacher is asked for K' ids
            ((request,),) = teacher.asked
            assert request.teacher_k == expected
        targets = items[0].targets
        assert targets.teacher_ids_C_T_K.shape[-1] == expected
        assert targets.old_at_teacher_C_T_K.shape[-1] == expected and targets.student_ids_T_K.shape[-1] == 4


def _promote_rare_token(targets):
    """The teacher's most likely id at every position becomes RARE_ID at q = 0.5; its other ids get 0.1 each."""
    ids = targets["teacher_ids_C_T_K"].clone()
    assert not (ids == RARE_ID).any()
    ids[..., 0] = RARE_ID
    values = torch.full(ids.shape, math.log(0.1))
    values[..., 0] = math.log(0.5)
    targets["teacher_ids_C_T_K"], targets["teacher_logprobs_C_T_K"] = ids, values


def test_a_step_with_the_support_term_lifts_a_teacher_top_token_the_student_ranks_low(make_config, base_model,
                                                                                     tiny_tokenizer, tmp_path):
    gains = {}
    for coef in (0.0, 1.0):
        config = make_config(method="opd", support_coef=coef, support_k=4)
        store = Store(tmp_path / f"store-{coef}.sqlite")
        for i in range(2):
            add_sample(store, base_model, tiny_tokenizer, i, reward=0.0, hints=HINTS[:1],
                       edit_targets=_promote_rare_token)
        items = _items(store, config)
        torch.manual_seed(0)
        models = load_train_models(config)

        def rare_logprobs() -> torch.Tensor:
            return torch.cat([logprob_table(models.causal_lm, it.turn.prompt_ids, it.turn.response_ids,
                                            it.temperature)[:, RARE_ID] for it in items])

        before = rare_logprobs()
        # The student ranks the teacher's favourite far outside its top-k: p ≈ 2e-5 at every position.
        assert float(before.exp().max()) < 1e-3
        metrics = train_step(models, make_optimizer(models, config), items, config)
        assert metrics["updates_applied"] == 1.0 and metrics["opd_applied"] == 1.0
        if coef:
            assert metrics["opd_support_applied"] == 1.0 and metrics["opd_support_loss"] > 0
            assert metrics["opd_support_teacher_mass"] > 0.79
        gains[coef] = float((rare_logprobs() - before).mean())
    # Without the term the rare token is outside every subset and moves only by accident; with it, it rises.
    assert gains[1.0] > 0.5, gains
    assert gains[1.0] > gains[0.0] + 0.5, gains
