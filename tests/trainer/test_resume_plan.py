"""The restart rule both trainers follow (``trainer.resume.plan_resume``)."""

from __future__ import annotations

from clawloop.trainer.resume import plan_resume


def test_steps_after_the_checkpoint_are_requeued_and_numbers_go_on():
    plan = plan_resume(2, 5)
    assert (plan.step, plan.requeue_after) == (5, 2) and "steps 3..5" in plan.note


def test_without_a_checkpoint_everything_is_trained_again_from_the_start():
    plan = plan_resume(None, 3)
    assert (plan.step, plan.requeue_after) == (3, 0) and "starting weights" in plan.note


def test_where_requeueing_is_not_allowed_the_plan_says_what_is_missing_and_numbers_go_on():
    plan = plan_resume(2, 5, can_requeue=False)
    assert (plan.step, plan.requeue_after) == (5, None) and "steps 3..5 are not requeued" in plan.note
    assert "not in the checkpoint of step 2" in plan.note


def test_a_store_behind_the_checkpoint_takes_the_checkpoints_counters():
    plan = plan_resume(4, 1)
    assert (plan.step, plan.requeue_after) == (4, None) and "behind" in plan.note
    assert plan_resume(4, 4).requeue_after is None and plan_resume(None, 0).step == 0
