"""The embedded HF engine on the tiny model: sampling, log-probs, stopping, batching, scoring, publishing.

References are computed independently with plain full forwards of the same model (no KV cache, no batching).
"""

from __future__ import annotations

import asyncio
import gc
import warnings
import weakref

import pytest
import torch

from clawloop.engines.base import (
    Engine,
    EngineError,
    Generation,
    PromptTooLongError,
    Publisher,
    SamplingParams,
    ScoreRequest,
    TokenEvent,
)
from clawloop.engines.hf import HFEngine, cache_kwargs

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def run(coro):
    return asyncio.run(coro)


def gen(engine, prompt, params=GREEDY):
    return run(engine.generate(prompt, params))


def full_logits(model, ids):
    """[len(ids), V] float32 logits of one plain forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def response_logprobs(model, prompt, response, temperature=1.0):
    """log_softmax(logits / T) of each response token, from a single forward of prompt + response."""
    logprobs = torch.log_softmax(full_logits(model, prompt + response) / temperature, dim=-1)
    P = len(prompt)
    return torch.stack([logprobs[P - 1 + t, tok] for t, tok in enumerate(response)])


def test_implements_the_engine_protocol(tiny_engine):
    assert isinstance(tiny_engine, Engine) and isinstance(tiny_engine, Publisher)
    assert tiny_engine.max_context == 2048  # the tiny config's max_position_embeddings
    assert 2 in tiny_engine.eos_token_ids


def test_greedy_is_deterministic_and_equals_hf_generate(tiny_engine, chat_ids, tiny_tokenizer):
    prompt = chat_ids("Tell me about owls.")
    first, second = gen(tiny_engine, prompt), gen(tiny_engine, prompt)
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == 16 and first.finish_reason == "length"
    with torch.no_grad():
        out = tiny_engine.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert first.token_ids == out[0, len(prompt):].tolist()
    assert first.text == tiny_tokenizer.decode(first.token_ids)
    assert first.prompt_tokens == len(prompt) and first.policy_version == tiny_engine.policy_version


def test_seeded_sampling_is_reproducible(tiny_engine, chat_ids):
    prompt = chat_ids("Write a poem.")
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=7)
    a, b = gen(tiny_engine, prompt, params), gen(tiny_engine, prompt, params)
    c = gen(tiny_engine, prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=8))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_are_those_of_the_sampling_distribution(tiny_engine, chat_ids, temperature):
    prompt = chat_ids("Name three rivers.")
    g = gen(tiny_engine, prompt, SamplingParams(temperature=temperature, max_tokens=12, seed=3))
    expected = response_logprobs(tiny_engine.model, prompt, g.token_ids, temperature)
    assert len(g.logprobs) == len(g.token_ids) == 12
    assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)


def test_greedy_logprobs_use_the_plain_log_softmax(tiny_engine, chat_ids):
    prompt = chat_ids("Name three rivers.")
    g = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=8))
    expected = response_logprobs(tiny_engine.model, prompt, g.token_ids, 1.0)
    assert torch.allclose(torch.tensor(g.logprobs), expected, atol=1e-4)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(tiny_engine, chat_ids):
    prompt = chat_ids("Count to ten.")
    temperature, top_p = 0.5, 0.3
    g = gen(tiny_engine, prompt, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=10, seed=5,
                                                top_logprobs=3))
    logits = full_logits(tiny_engine.model, prompt + g.token_ids)
    P = len(prompt)
    for t, tok in enumerate(g.token_ids):
        probs = torch.softmax(logits[P - 1 + t] / temperature, dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        n_keep = int((sorted_probs.cumsum(0) - sorted_probs < top_p).sum())
        nucleus = order[:n_keep].tolist()
        assert tok in nucleus
        expected = torch.log(probs[tok] / sorted_probs[:n_keep].sum())
        assert abs(g.logprobs[t] - float(expected)) < 1e-4
        alternatives = g.top_logprobs[t]
        assert [i for i, _ in alternatives] == nucleus[:3]  # never a token outside the nucleus
        assert alternatives[0][1] >= g.logprobs[t] - 1e-6


def test_top_logprobs_are_the_best_alternatives(tiny_engine, chat_ids):
    prompt = chat_ids("Hi")
    g = gen(tiny_engine, prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=1, top_logprobs=4))
    logprobs = torch.log_softmax(full_logits(tiny_engine.model, prompt + g.token_ids), dim=-1)
    P = len(prompt)
    for t in range(6):
        values, ids = logprobs[P - 1 + t].topk(4)
        assert [i for i, _ in g.top_logprobs[t]] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in g.top_logprobs[t]]), values, atol=1e-4)


def test_the_kv_cache_goes_in_under_the_name_the_installed_transformers_declares(tiny_model_path, chat_ids):
    """A fresh install gets the newest transformers 5.x: its forward renamed ``past_key_values`` to ``cache`` and
    warns on the old name at every call, which would fill a user's console; the engine must use the new name."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    ids = chat_ids("Name a colour.")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            cache = DynamicCache()
            first = model(input_ids=torch.tensor([ids]), **cache_kwargs(model, cache))
            step = model(input_ids=first.logits[:, -1:].argmax(-1), **cache_kwargs(model, cache))
    assert cache.get_seq_length() == len(ids) + 1  # the cache was filled: it reached the model under its name
    solo = full_logits(model, ids + [int(first.logits[0, -1].argmax())])[-1]
    torch.testing.assert_close(step.logits[0, -1].float(), solo, atol=1e-4, rtol=1e-4)


def test_stop_string_cuts_text_and_keeps_ids_through_the_completing_token(tiny_engine, chat_ids, tiny_tokenizer):
    prompt = chat_ids("Describe the sea.")
    full = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=24))
    stop = full.text[12:15]
    cut = full.text.find(stop)
    g = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=(stop, "never-seen")))
    assert g.finish_reason == "stop"
    assert g.text == full.text[:cut]
    n = len(g.token_ids)
    assert g.token_ids == full.token_ids[:n] and len(g.logprobs) == n
    assert stop in tiny_tokenizer.decode(g.token_ids)  # the last id completed the stop string...
    assert stop not in tiny_tokenizer.decode(g.token_ids[:-1])  # ...and no earlier one did


def test_max_tokens_and_stop_token_ids(tiny_engine, chat_ids, tiny_tokenizer):
    prompt = chat_ids("Go on.")
    full = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    short = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=3))
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    k = next(i for i in range(3, 12) if full.token_ids[i] not in full.token_ids[:i])
    g = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                stop_token_ids=(full.token_ids[k],)))
    assert g.finish_reason == "stop"
    assert g.token_ids == full.token_ids[: k + 1]  # the stop token is kept in the ids...
    assert g.text == tiny_tokenizer.decode(full.token_ids[:k])  # ...but not in the text


def test_eos_ends_generation(tiny_engine, tiny_tokenizer, chat_ids):
    prompt = chat_ids("Go on.")
    full = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    k = next(i for i in range(2, 12) if full.token_ids[i] not in full.token_ids[:i])
    # An engine whose EOS is the k-th greedy token (sharing the same model object).
    engine = HFEngine(tiny_engine.model, tiny_tokenizer, num_threads=2, eos_token_ids=[full.token_ids[k]])
    try:
        g = gen(engine, prompt, SamplingParams(temperature=0.0, max_tokens=12))
    finally:
        engine.close_sync()
    assert g.finish_reason == "stop" and g.token_ids == full.token_ids[: k + 1]
    assert g.text == tiny_tokenizer.decode(full.token_ids[:k])


def test_concurrent_requests_are_batched_and_each_equals_its_solo_result(tiny_engine, chat_ids):
    prompts = [chat_ids("Tell me a story about " + "a cat " * n) for n in range(1, 7)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=6 + 3 * i) if i % 2 == 0
        else SamplingParams(temperature=1.0, max_tokens=6 + 3 * i, seed=i)
        for i in range(6)
    ]
    solo = [gen(tiny_engine, p, sp) for p, sp in zip(prompts, params)]
    steps0, rows0 = tiny_engine.stats["decode_steps"], tiny_engine.stats["decode_rows"]
    forwards0 = tiny_engine.stats["prefill_forwards"]

    async def together():
        return await asyncio.gather(*[tiny_engine.generate(p, sp) for p, sp in zip(prompts, params)])

    batched = run(together())
    steps = tiny_engine.stats["decode_steps"] - steps0
    rows = tiny_engine.stats["decode_rows"] - rows0
    assert rows / steps > 1.5  # sequences really shared decode steps...
    assert tiny_engine.stats["prefill_forwards"] - forwards0 < len(prompts)  # ...and prefill forwards
    for a, b in zip(solo, batched):
        assert a.token_ids == b.token_ids
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)
        assert a.text == b.text and a.finish_reason == b.finish_reason


def test_a_request_joining_a_running_batch_changes_nothing(tiny_engine, chat_ids):
    long_prompt, short_prompt = chat_ids("A long answer please " * 5), chat_ids("Short.")
    long_params = SamplingParams(temperature=0.0, max_tokens=30)
    short_params = SamplingParams(temperature=0.8, max_tokens=10, seed=11)
    solo_long, solo_short = gen(tiny_engine, long_prompt, long_params), gen(tiny_engine, short_prompt, short_params)

    async def staggered():
        joined = None
        final = None
        async for item in tiny_engine.generate_stream(long_prompt, long_params):
            if isinstance(item, TokenEvent) and joined is None and len(item.text_delta) >= 0:
                joined = asyncio.ensure_future(tiny_engine.generate(short_prompt, short_params))
            if isinstance(item, Generation):
                final = item
        return final, await joined

    long_g, short_g = run(staggered())
    assert long_g.token_ids == solo_long.token_ids
    assert short_g.token_ids == solo_short.token_ids
    assert torch.allclose(torch.tensor(short_g.logprobs), torch.tensor(solo_short.logprobs), atol=1e-4)


def test_stream_events_add_up_to_the_final_generation(tiny_engine, chat_ids):
    prompt = chat_ids("Stream something.")
    full = gen(tiny_engine, prompt, SamplingParams(temperature=0.0, max_tokens=20))
    stop = full.text[10:13]

    async def collect(params):
        return [item async for item in tiny_engine.generate_stream(prompt, params)]

    for params in [
        SamplingParams(temperature=0.9, max_tokens=20, seed=4),
        SamplingParams(temperature=0.0, max_tokens=20, stop=(stop,)),
        # A stop string that starts like the text but never completes: held back, then released at the end.
        SamplingParams(temperature=0.0, max_tokens=20, stop=(full.text[4:8] + "\x00never",)),
    ]:
        items = run(collect(params))
        events, final = items[:-1], items[-1]
        assert isinstance(final, Generation) and all(isinstance(e, TokenEvent) for e in events)
        assert "".join(e.text_delta for e in events) == final.text
        assert [e.token_id for e in events] == final.token_ids
        assert [e.logprob for e in events] == final.logprobs
        assert not any(s in "".join(e.text_delta for e in events) for s in params.stop)
        assert final.token_ids == gen(tiny_engine, prompt, params).token_ids


def test_prompt_too_long_and_bad_input_are_refused(tiny_engine):
    with pytest.raises(PromptTooLongError):
        gen(tiny_engine, [5] * 2040, SamplingParams(max_tokens=16))
    with pytest.raises(EngineError):
        gen(tiny_engine, [], GREEDY)
    with pytest.raises(EngineError):
        gen(tiny_engine, [49152], GREEDY)
    with pytest.raises(EngineError):
        gen(tiny_engine, [5, 6], SamplingParams(top_p=0.0))


def test_an_abandoned_stream_stops_generating(tiny_engine, chat_ids):
    prompt = chat_ids("Never mind.")
    tokens0 = tiny_engine.stats["generated_tokens"]

    async def abandon():
        stream = tiny_engine.generate_stream(prompt, SamplingParams(temperature=0.0, max_tokens=1000))
        async for _ in stream:
            break
        await stream.aclose()
        return await tiny_engine.generate(prompt, GREEDY)

    g = run(abandon())
    assert len(g.token_ids) == 16
    # The abandoned request left the batch within a step or two instead of running to 1000 tokens.
    assert tiny_engine.stats["generated_tokens"] - tokens0 < 100


# ------------------------------------------------------------------------------------------------ score


def test_score_equals_a_manual_forward(tiny_engine, chat_ids):
    prompts = [chat_ids("First question?"), chat_ids("A second, longer question " * 3)]
    responses = [[300, 400, 500, 2], list(range(1000, 1017))]
    temperature = 0.7
    at_ids = [torch.randint(0, 49152, (len(r), 5)) for r in responses]
    results = run(tiny_engine.score([
        ScoreRequest(p, r, top_k=4, temperature=temperature, at_ids_T_K=a)
        for p, r, a in zip(prompts, responses, at_ids)
    ]))
    for p, r, a, res in zip(prompts, responses, at_ids, results):
        logprobs = torch.log_softmax(full_logits(tiny_engine.model, p + r) / temperature, dim=-1)
        rows = logprobs[len(p) - 1 : len(p) - 1 + len(r)]  # position P-1+t predicts r[t]
        assert torch.allclose(res.logprobs_T, rows.gather(1, torch.tensor(r)[:, None])[:, 0], atol=1e-4)
        values, ids = rows.topk(4, dim=-1)
        assert torch.equal(res.topk_ids_T_K, ids)
        assert torch.allclose(res.topk_logprobs_T_K, values, atol=1e-4)
        assert torch.allclose(res.at_ids_logprobs_T_K, rows.gather(1, a), atol=1e-4)
        assert res.logprobs_T.dtype == torch.float32 and res.topk_ids_T_K.dtype == torch.int64
        assert res.policy_version == tiny_engine.policy_version


def test_score_at_own_topk_ids_reproduces_topk(tiny_engine, chat_ids):
    prompt, response = chat_ids("Q"), [10, 20, 30]
    (first,) = run(tiny_engine.score([ScoreRequest(prompt, response, top_k=6)]))
    (again,) = run(tiny_engine.score([ScoreRequest(prompt, response, top_k=0, at_ids_T_K=first.topk_ids_T_K)]))
    assert torch.allclose(again.at_ids_logprobs_T_K, first.topk_logprobs_T_K, atol=1e-6)
    assert (first.topk_logprobs_T_K[:, :-1] >= first.topk_logprobs_T_K[:, 1:]).all()
    assert again.topk_ids_T_K.shape == (3, 0)


def test_score_of_a_generation_returns_its_sampling_logprobs(tiny_engine, chat_ids):
    prompt = chat_ids("Say something.")
    g = gen(tiny_engine, prompt, SamplingParams(temperature=0.8, max_tokens=10, seed=2))
    (res,) = run(tiny_engine.score([ScoreRequest(prompt, g.token_ids, temperature=0.8)]))
    assert torch.allclose(res.logprobs_T, torch.tensor(g.logprobs), atol=1e-4)


def test_score_in_small_chunks_gives_the_same_numbers(tiny_engine, tiny_tokenizer, chat_ids):
    requests = [ScoreRequest(chat_ids("x " * n), list(range(100 + n, 120 + n)), top_k=3) for n in range(1, 6)]
    whole = run(tiny_engine.score(requests))
    engine = HFEngine(tiny_engine.model, tiny_tokenizer, num_threads=2, score_batch_tokens=64, score_chunk_rows=3)
    try:
        chunked = run(engine.score(requests))
    finally:
        engine.close_sync()
    for a, b in zip(whole, chunked):
        assert torch.allclose(a.logprobs_T, b.logprobs_T, atol=1e-5)
        assert torch.equal(a.topk_ids_T_K, b.topk_ids_T_K)


# ---------------------------------------------------------------------------------------------- publish


def perturbed(model, seed=0, scale=0.05):
    """A state dict of new weights, as a trainer would publish (tied tensors stay tied: same values)."""
    g = torch.Generator().manual_seed(seed)
    by_storage = {}
    out = {}
    for k, v in model.state_dict().items():
        if v.data_ptr() not in by_storage:
            by_storage[v.data_ptr()] = v + scale * torch.randn(v.shape, generator=g)
        out[k] = by_storage[v.data_ptr()].clone()
    return out


@pytest.fixture
def own_engine(tiny_model_path, request):
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=4,
                      swap_mode=getattr(request, "param", "double_buffer"))
    yield engine
    engine.close_sync()


def test_publish_bumps_the_version_and_changes_outputs(own_engine, chat_ids):
    prompt = chat_ids("Hello there")
    before = gen(own_engine, prompt)
    new_weights = perturbed(own_engine.model)
    assert run(own_engine.publish(new_weights)) == 1 == own_engine.policy_version
    after = gen(own_engine, prompt)
    assert after.policy_version == 1 and before.policy_version == 0
    assert after.token_ids != before.token_ids
    # The served weights are the published ones (copied: later edits of the dict do not leak in).
    assert all(torch.equal(own_engine.model.state_dict()[k], v) for k, v in new_weights.items())
    for v in new_weights.values():
        v.zero_()
    assert gen(own_engine, prompt).token_ids == after.token_ids
    (scored,) = run(own_engine.score([ScoreRequest(prompt, after.token_ids)]))
    assert scored.policy_version == 1


def test_a_group_that_fails_to_join_the_running_batch_fails_alone(tiny_model_path, monkeypatch):
    """Joining a new group extends every layer's cache; an error part-way (out of memory in a ``cat``) must fail
    that group only, never the requests already decoding (whose cache it would leave with mismatched rows)."""
    from clawloop.engines import hf

    engine = HFEngine(tiny_model_path, device="cpu", num_threads=1, eos_token_ids=[])
    real_pad, calls = hf._left_pad, {"armed": False, "n": 0}

    def fails_midway(x, n):
        if calls["armed"]:
            calls["n"] += 1
            if calls["n"] == 5:  # the second layer's keys
                raise torch.OutOfMemoryError("out of memory (injected)")
        return real_pad(x, n)

    monkeypatch.setattr(hf, "_left_pad", fails_midway)

    async def scenario():
        running = asyncio.ensure_future(engine.generate([1, 5, 6, 7], SamplingParams(temperature=0.0,
                                                                                     max_tokens=200)))
        await asyncio.sleep(0.05)
        calls["armed"] = True
        with pytest.raises(EngineError):
            await engine.generate([1, 9, 9], SamplingParams(temperature=0.0, max_tokens=5))
        return await running

    try:
        assert len(run(scenario()).token_ids) == 200
    finally:
        engine.close_sync()


def test_after_publications_no_earlier_model_stays_in_memory(own_engine, chat_ids):
    """Double-buffer publication runs new requests on a copy; once nothing runs on an older model it is freed,
    the starting one included: at rest the engine holds one model."""
    prompt = chat_ids("Hello there")
    models = [weakref.ref(own_engine.model)]
    for _ in range(2):
        run(own_engine.publish(perturbed(own_engine.model)))
        models.append(weakref.ref(own_engine.model))
        gen(own_engine, prompt)  # a request on the new model: the worker has swapped
    gc.collect()
    assert [m() is not None for m in models] == [False, False, True]


@pytest.mark.parametrize("own_engine", ["double_buffer", "drain"], indirect=True)
def test_a_request_in_flight_during_publish_finishes_on_its_old_weights(own_engine, chat_ids):
    prompt = chat_ids("Keep talking")
    params = SamplingParams(temperature=0.0, max_tokens=40)
    old = gen(own_engine, prompt, params)
    new_weights = perturbed(own_engine.model, seed=1)

    async def publish_mid_stream():
        final = during = after = version = None
        async for item in own_engine.generate_stream(prompt, params):
            if isinstance(item, TokenEvent) and version is None:
                publication = asyncio.ensure_future(own_engine.publish(new_weights))
                await asyncio.sleep(0.01)
                during = asyncio.ensure_future(own_engine.generate(prompt, params))  # arrives during the swap
                version = await publication
                after = await own_engine.generate(prompt, params)
            if isinstance(item, Generation):
                final = item
        return final, version, await during, after

    in_flight, version, during, after = run(publish_mid_stream())
    assert version == 1
    assert in_flight.policy_version == 0 and in_flight.token_ids == old.token_ids
    assert after.policy_version == 1 and after.token_ids != old.token_ids
    # A request that arrived mid-swap ran entirely on one set of weights, whichever it got.
    assert during.token_ids == (old.token_ids if during.policy_version == 0 else after.token_ids)


def test_publish_refuses_a_mismatched_state_dict_and_keeps_serving(own_engine, chat_ids):
    prompt = chat_ids("Still there?")
    before = gen(own_engine, prompt)
    bad = perturbed(own_engine.model)
    bad.pop("model.norm.weight")
    with pytest.raises(EngineError, match="missing"):
        run(own_engine.publish(bad))
    lora_like = {"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 2)}
    with pytest.raises(EngineError, match="merge LoRA"):
        run(own_engine.publish(lora_like))
    assert own_engine.policy_version == 0
    assert gen(own_engine, prompt).token_ids == before.token_ids


def test_publish_accepts_a_callable_and_tied_weights_given_once(own_engine, chat_ids):
    prompt = chat_ids("Edit me")
    sd = perturbed(own_engine.model, seed=3)
    sd.pop("lm_head.weight", None)  # tied to the embeddings: giving it once is enough
    assert run(own_engine.publish(sd)) == 1
    with torch.no_grad():
        expected = own_engine.model.model.embed_tokens.weight * 1.0
    assert run(own_engine.publish(lambda m: m.model.norm.weight.mul_(2.0))) == 2
    assert torch.equal(own_engine.model.model.embed_tokens.weight, expected)
    assert gen(own_engine, prompt).policy_version == 2
