"""The embedded engine with adapter slots: requests of different users' adapters decode in one batch, each row
exactly as the model with its own adapter merged would write it, and each answer carries the version of the
adapter that wrote it, also when the adapter is republished while the answer is being written."""

import asyncio
import copy

import pytest
import torch

from clawloop.engines.base import EngineError, SamplingParams
from clawloop.engines.hf import HFEngine
from clawloop.engines.model_files import load_model
from tests.engines.adapters import merged, random_adapter

@torch.no_grad()
def assert_written_by(model, prompt, generation):
    """``generation`` is ``model``'s greedy answer to ``prompt``, with its log-probs."""
    ids = torch.tensor([prompt + generation.token_ids])
    logprobs_T_V = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
    assert generation.token_ids == logprobs_T_V.argmax(-1).tolist()
    expected = logprobs_T_V.gather(1, torch.tensor(generation.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=1e-4, rtol=1e-4)


@pytest.fixture
def base(tiny_model_path):
    return load_model(tiny_model_path, device="cpu").eval()


@pytest.fixture
def engine(base, tiny_tokenizer):
    engine = HFEngine(copy.deepcopy(base), tiny_tokenizer, adapter_slots=3, adapter_rank=8, max_batch_size=8,
                      eos_token_ids=[], num_threads=2)
    yield engine
    engine.close_sync()


def test_users_adapters_share_a_batch_and_each_row_is_its_own_adapters_answer(engine, base):
    ann, bo = random_adapter(base, 8, 1, scale=0.3), random_adapter(base, 4, 2, scale=0.3)
    assert engine.publish_adapter_sync("ann", ann, 2.0) == 1
    assert engine.publish_adapter_sync("bo", bo, 1.0) == 1
    prompt = [1, 17, 33, 95, 140, 7]

    async def answers():
        # A long base answer keeps the batch running while the others join it at a step boundary.
        long = asyncio.create_task(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=48)))
        await asyncio.sleep(0)
        others = [engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, adapter=name))
                  for name in ("ann", "bo", "ann")]
        return [await long, *await asyncio.gather(*others)]

    plain, ann_1, bo_1, ann_2 = asyncio.run(answers())
    assert engine.stats["max_running"] >= 3  # they did decode together
    assert_written_by(base, prompt, plain)
    assert_written_by(merged(base, ann, 2.0), prompt, ann_1)
    assert_written_by(merged(base, bo, 1.0), prompt, bo_1)
    assert ann_1.token_ids == ann_2.token_ids and ann_1.token_ids != bo_1.token_ids != plain.token_ids[:12]
    assert (plain.policy_version, ann_1.policy_version, bo_1.policy_version) == (0, 1, 1)


def test_an_answer_keeps_the_adapter_version_it_started_on_when_its_adapter_is_republished(engine, base):
    first, second = random_adapter(base, 8, 3, scale=0.3), random_adapter(base, 8, 4, scale=0.3)
    engine.publish_adapter_sync("ann", first, 1.0)
    prompt = [1, 5, 9, 200, 31]

    async def answers():
        stream = engine.generate_stream(prompt, SamplingParams(temperature=0.0, max_tokens=40, adapter="ann"))
        await stream.__anext__()  # the answer is running on version 1
        assert await engine.publish_adapter("ann", second, 1.0) == 2
        after = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, adapter="ann"))
        async for item in stream:
            running = item
        return running, after

    running, after = asyncio.run(answers())
    assert running.policy_version == 1 and after.policy_version == 2
    assert_written_by(merged(base, first, 1.0), prompt, running)
    assert_written_by(merged(base, second, 1.0), prompt, after)
    assert engine.adapter_version("ann") == 2


def test_unknown_adapters_and_weight_publication_are_refused(engine, base):
    async def ask(name):
        return await engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2, adapter=name))

    with pytest.raises(EngineError, match="no adapter named 'nobody'"):
        asyncio.run(ask("nobody"))
    with pytest.raises(EngineError, match="publish adapters"):
        engine.publish_sync(base.state_dict())
    with pytest.raises(EngineError, match="without '@'"):
        engine.publish_adapter_sync("a@1", random_adapter(base, 2, 5, scale=0.3), 1.0)
    with pytest.raises(EngineError, match="rank 16"):  # above the slots' rank: refused, nothing loaded
        engine.publish_adapter_sync("wide", random_adapter(base, 16, 6, scale=0.3), 1.0)
    assert engine.adapter_version("wide") is None


def test_more_users_than_slots_are_each_served_their_own_adapter(base, tiny_tokenizer):
    engine = HFEngine(copy.deepcopy(base), tiny_tokenizer, adapter_slots=1, adapter_rank=8, max_batch_size=4,
                      eos_token_ids=[], num_threads=2)
    try:
        ann, bo = random_adapter(base, 8, 5, scale=0.3), random_adapter(base, 8, 6, scale=0.3)
        engine.publish_adapter_sync("ann", ann, 1.0)
        engine.publish_adapter_sync("bo", bo, 1.0)  # one slot: Ann's adapter leaves it
        prompt = [1, 44, 8, 19, 230]

        def answer(name):
            return asyncio.run(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, adapter=name)))

        ann_answer, bo_answer, ann_again = answer("ann"), answer("bo"), answer("ann")
        assert_written_by(merged(base, ann, 1.0), prompt, ann_answer)  # loaded again from what was published
        assert_written_by(merged(base, bo, 1.0), prompt, bo_answer)
        assert ann_again.token_ids == ann_answer.token_ids and ann_again.logprobs == ann_answer.logprobs
        assert (ann_answer.policy_version, bo_answer.policy_version) == (1, 1)
    finally:
        engine.close_sync()
