"""The vLLM engine against real vLLM servers on SmolLM2-135M-Instruct, checked against the embedded engine.

Tolerance: vLLM and the embedded engine both compute in float32 but with different kernels (oneDNN GEMMs,
vLLM's CPU paged attention vs PyTorch SDPA), which here moves log-probs by about 5e-5 nats; ``TOL = 2e-3`` leaves
room for other CPUs while every mistake these tests look for is far larger: untempered instead of tempered
log-probs are off by ~0.5-1.7 nats at T=0.6, a missing top-p renormalisation by ~0.1-0.7, a wrong adapter or
stale weights change greedy tokens outright.
"""

from __future__ import annotations

import asyncio
import copy

import httpx
import pytest
import torch

from clawloop.engines.base import SamplingParams, ScoreRequest
from clawloop.engines.sampling import sampling_logprobs
from clawloop.engines.base import EngineError
from clawloop.engines.vllm_publish import CheckpointPublisher, LoRAPublisher, UserAdapterPublisher

pytestmark = [pytest.mark.vllm, pytest.mark.real_model, pytest.mark.timeout(1800)]

TOL = 2e-3
EOS = 2


def reference_logprobs(model, prompt: list[int], ids: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """log pi(ids[t] | prefix) under the sampling distribution, from one HF forward of prompt + ids."""
    with torch.inference_mode():
        logits_T_V = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    n = len(ids)
    logprobs_T_V = sampling_logprobs(logits_T_V, torch.full((n,), temperature), torch.full((n,), top_p))
    return logprobs_T_V.gather(1, torch.tensor(ids)[:, None])[:, 0]


def max_gap(a, b) -> float:
    return float((torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max())


def assert_same_topk(got, want) -> None:
    """Same top-k ids in the same order, except where two candidates tie within TOL: another CPU's kernels may
    order a near-tie the other way (or swap the k-th id with the (k+1)-th), which is not a scoring error."""
    assert max_gap(got.topk_logprobs_T_K, want.topk_logprobs_T_K) < TOL
    for t, k in (got.topk_ids_T_K != want.topk_ids_T_K).nonzero().tolist():
        id_, value = int(got.topk_ids_T_K[t, k]), float(got.topk_logprobs_T_K[t, k])
        in_want = (want.topk_ids_T_K[t] == id_).nonzero()
        last = want.topk_ids_T_K.shape[1] - 1
        if len(in_want):  # reordered: its value where the other engine put it must be the same
            assert abs(float(want.topk_logprobs_T_K[t, int(in_want[0])]) - value) < TOL, (t, k)
        else:  # swapped in from just outside the other engine's top-k: only at the boundary, at a tie
            assert k == last and abs(float(want.topk_logprobs_T_K[t, last]) - value) < TOL, (t, k)


def models_on(server) -> list[str]:
    key = {"Authorization": f"Bearer {server.api_key}"}  # every server the fleet starts asks for its key
    return [m["id"] for m in httpx.get(f"{server.url}/v1/models", headers=key, timeout=30).json()["data"]]


def test_generation_gives_exact_ids_and_sampling_logprobs(vllm_servers, hf_engine, smol_tokenizer, smol_prompt):
    engine = vllm_servers["scorer"].engine(tokenizer=smol_tokenizer)
    prompts = [smol_prompt(q) for q in ("Tell me a short story about a cat.", "Name three colours.",
                                        "What is the capital of France?", "Write a haiku about rain.")]
    settings = [SamplingParams(temperature=0.7, top_p=1.0, max_tokens=24, seed=1, top_logprobs=3),
                SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=2),
                SamplingParams(temperature=0.0, max_tokens=24),
                SamplingParams(temperature=1.3, max_tokens=24, seed=4)]

    async def run():
        entry = await engine.connect()
        await engine.check_logprobs_mode()  # the server reports tempered log-probs
        results = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, settings)))  # one batch
        again = await engine.generate(prompts[0], settings[0])
        return entry, results, again

    entry, results, again = asyncio.run(run())
    assert engine.max_context == entry["max_model_len"] == 2048
    for prompt, params, g in zip(prompts, settings, results):
        assert g.policy_version == 0 and g.prompt_tokens == len(prompt)
        assert len(g.token_ids) == len(g.logprobs) > 0
        decoded = smol_tokenizer.decode(g.token_ids)
        assert decoded.startswith(g.text)  # the text is the decoded ids (EOS itself is not text)
        if g.finish_reason == "stop":
            assert g.token_ids[-1] == EOS and decoded == g.text + "<|im_end|>"
        else:
            assert g.finish_reason == "length" and len(g.token_ids) == params.max_tokens and decoded == g.text
        expected = reference_logprobs(hf_engine.model, prompt, g.token_ids, params.temperature, params.top_p)
        assert max_gap(g.logprobs, expected) < TOL
    # Same seed, same tokens; log-probs only up to batch-dependent float rounding (the first ran in a batch of 4).
    assert again.token_ids == results[0].token_ids and again.logprobs == pytest.approx(results[0].logprobs, abs=1e-4)
    top = results[0].top_logprobs
    assert top is not None and all(len(alts) == 3 for alts in top)
    for t, alts in enumerate(top):
        values = [v for _, v in alts]
        assert values == sorted(values, reverse=True)
        assert results[0].logprobs[t] <= values[0] + 1e-6  # nothing beats the best alternative


def test_stop_strings_eos_and_streaming(vllm_servers, smol_tokenizer, smol_prompt):
    engine = vllm_servers["scorer"].engine(tokenizer=smol_tokenizer)
    story = smol_prompt("Tell me a short story about a cat.")
    greedy = SamplingParams(temperature=0.0, max_tokens=40)

    async def run():
        full = await engine.generate(story, greedy)
        stop = full.text.split()[4]  # a word from the middle of the answer
        cut = await engine.generate(story, SamplingParams(temperature=0.0, max_tokens=40, stop=(stop,)))
        hi = await engine.generate(smol_prompt("Say hi."), SamplingParams(temperature=0.0, max_tokens=80))
        sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30, seed=11, stop=("\n",), top_logprobs=2)
        plain = await engine.generate(story, sampled)
        events = [e async for e in engine.generate_stream(story, sampled)]
        return full, stop, cut, hi, plain, events

    full, stop, cut, hi, plain, events = asyncio.run(run())
    # A stop string cuts the text before it; the ids run up to the token that completed it.
    assert cut.finish_reason == "stop" and full.text.startswith(cut.text + stop)
    assert stop not in cut.text and stop in smol_tokenizer.decode(cut.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    # EOS ends generation, stays the last id and is not in the text.
    assert hi.finish_reason == "stop" and hi.token_ids[-1] == EOS and "<|im_end|>" not in hi.text
    # Streaming yields the same completion, token by token.
    *tokens, final = events
    assert final.token_ids == plain.token_ids == [e.token_id for e in tokens]
    assert final.logprobs == pytest.approx(plain.logprobs, abs=1e-4) and [e.logprob for e in tokens] == final.logprobs
    assert final.text == plain.text == "".join(e.text_delta for e in tokens)
    assert final.top_logprobs == [e.top_logprobs for e in tokens] and final.finish_reason == plain.finish_reason


def test_teacher_scoring_matches_the_embedded_engine(vllm_servers, hf_engine, smol_tokenizer, smol_prompt):
    """Top-k scoring on the frozen scorer (one prompt_logprobs probe, exact per-position requests where needed)
    and on the LoRA-enabled policy server (per-position requests only) agree with HFEngine.score."""
    scorer = vllm_servers["scorer"].engine(tokenizer=smol_tokenizer)
    policy = vllm_servers["policy"].engine(tokenizer=smol_tokenizer)
    prompt = smol_prompt("Explain why the sky is blue.\n\n[user's hint / instruction]\nMention Rayleigh scattering.")

    async def run():
        g = await scorer.generate(smol_prompt("Explain why the sky is blue."),
                                  SamplingParams(temperature=0.6, max_tokens=12, seed=3))
        T = len(g.token_ids)
        student = await hf_engine.score([ScoreRequest(smol_prompt("Explain why the sky is blue."), g.token_ids,
                                                      top_k=4, temperature=0.6)])
        # The student's top-4 plus one unlikely id per position: the latter is never in the probe's top-k.
        at_ids_T_K = torch.cat([student[0].topk_ids_T_K, torch.full((T, 1), 40000)], dim=1)
        out = {}
        for temperature in (1.0, 0.6):
            request = ScoreRequest(prompt, g.token_ids, top_k=4, temperature=temperature, at_ids_T_K=at_ids_T_K)
            (out[temperature, "hf"],) = await hf_engine.score([request])
            before = scorer.stats["score_position"]
            (out[temperature, "scorer"],) = await scorer.score([request])
            out[temperature, "positions"] = scorer.stats["score_position"] - before
        request = ScoreRequest(prompt, g.token_ids, top_k=4, temperature=0.6, at_ids_T_K=at_ids_T_K[:, :4])
        (out["policy"],) = await policy.score([request])
        return T, out

    T, out = asyncio.run(run())
    for key in [(1.0, "scorer"), (0.6, "scorer"), "policy"]:
        got, want = out[key], out[(0.6, "hf") if key == "policy" else (key[0], "hf")]
        assert_same_topk(got, want)
        assert max_gap(got.logprobs_T, want.logprobs_T) < TOL
        width = got.at_ids_logprobs_T_K.shape[1]
        assert max_gap(got.at_ids_logprobs_T_K, want.at_ids_logprobs_T_K[:, :width]) < TOL
        assert got.policy_version == 0
    # The unlikely id is outside every probe, so each position needed its one exact request.
    assert out[1.0, "positions"] == out[0.6, "positions"] == T
    assert scorer.stats["score_probe"] == 2 and policy.stats["score_probe"] == 0


def _random_adapter(hf_model, folder, seed: int):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(hf_model),
                                LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # B starts at zero; make the adapter change the model
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(str(folder))
    return peft_model.eval()


def test_lora_publication_switches_versions_and_unloads_old_adapters(vllm_servers, hf_engine, smol_tokenizer,
                                                                    smol_prompt, tmp_path):
    server = vllm_servers["policy"]
    engine = server.engine(tokenizer=smol_tokenizer)
    publisher = LoRAPublisher(engine, tmp_path / "adapters")
    first = _random_adapter(hf_engine.model, tmp_path / "first", seed=1)
    second = _random_adapter(hf_engine.model, tmp_path / "second", seed=2)
    prompt = smol_prompt("Say hi.")
    sampled = SamplingParams(temperature=0.7, max_tokens=16, seed=5)

    async def run():
        on_base = await engine.generate(prompt, sampled)
        v1 = await publisher.publish(tmp_path / "first")
        on_v1 = await engine.generate(prompt, sampled)
        listed_v1 = models_on(server)
        with engine.hold("policy-v1"):  # a stale sample still needs v1
            v2 = await publisher.publish(tmp_path / "second")
            on_v2 = await engine.generate(prompt, sampled)
            await asyncio.sleep(0.2)
            listed_while_held = models_on(server)
        await publisher.wait_retired()
        return on_base, v1, on_v1, listed_v1, v2, on_v2, listed_while_held, models_on(server)

    on_base, v1, on_v1, listed_v1, v2, on_v2, listed_while_held, listed_after = asyncio.run(run())
    assert (v1, v2) == (1, 2) and engine.policy_version == 2
    assert (on_base.policy_version, on_v1.policy_version, on_v2.policy_version) == (0, 1, 2)
    # Each version serves exactly the weights published for it: its log-probs are those of that PEFT model,
    # and clearly not those of the version before (greedy text alone can coincide across small adapters).
    served = [(on_base, hf_engine.model, None), (on_v1, first, hf_engine.model), (on_v2, second, first)]
    for generation, model, previous in served:
        assert max_gap(generation.logprobs, reference_logprobs(model, prompt, generation.token_ids, 0.7, 1.0)) < TOL
        if previous is not None:
            assert max_gap(generation.logprobs,
                           reference_logprobs(previous, prompt, generation.token_ids, 0.7, 1.0)) > 50 * TOL
    assert "policy-v1" in listed_v1
    assert {"policy-v1", "policy-v2"} <= set(listed_while_held)  # held: not unloaded yet
    assert "policy-v1" not in listed_after and "policy-v2" in listed_after
    assert publisher.unloaded == ["policy-v1"] and not (tmp_path / "adapters" / "policy-v1").exists()


def test_two_users_adapters_are_served_side_by_side_from_one_server(vllm_servers, hf_engine, smol_tokenizer,
                                                                   smol_prompt, tmp_path):
    """Per-user policies on vLLM: each user's newest adapter version under its own name, requests of both users
    and of the base model in one batch, each answer written by its own user's weights and carrying that version
    (the base model's too: a request without an adapter in a batch with adapter requests gets wrong log-probs from
    vLLM's CPU kernels unless it runs through a zero adapter); republishing one user's adapter retires only that
    user's older version."""
    from peft import get_peft_model_state_dict

    server = vllm_servers["policy"]
    engine = server.engine(tokenizer=smol_tokenizer)
    users = UserAdapterPublisher(engine, tmp_path / "users")
    ann = _random_adapter(hf_engine.model, tmp_path / "ann", seed=3)
    bo = _random_adapter(hf_engine.model, tmp_path / "bo", seed=4)
    bo_later = _random_adapter(hf_engine.model, tmp_path / "bo-later", seed=5)
    scaling = 16 / 8  # lora_alpha / r of _random_adapter
    prompt = smol_prompt("Name a colour.")
    sampled = SamplingParams(temperature=0.7, max_tokens=16, seed=11)

    def as_user(name):
        return SamplingParams(temperature=0.7, max_tokens=16, seed=11, adapter=name)

    async def run():
        assert await users.publish("k_ann", get_peft_model_state_dict(ann), scaling) == 1
        assert await users.publish("k_bo", get_peft_model_state_dict(bo), scaling, version=7) == 7
        together = await asyncio.gather(engine.generate(prompt, sampled), engine.generate(prompt, as_user("k_ann")),
                                        engine.generate(prompt, as_user("k_bo")))
        assert await users.publish("k_bo", get_peft_model_state_dict(bo_later), scaling, version=9) == 9
        bo_after, ann_after = await asyncio.gather(engine.generate(prompt, as_user("k_bo")),
                                                   engine.generate(prompt, as_user("k_ann")))
        await users.publishers["k_bo"].wait_retired()
        with pytest.raises(EngineError, match="no adapter named"):
            await engine.generate(prompt, as_user("k_nobody"))
        return together, bo_after, ann_after, models_on(server)

    (on_base, on_ann, on_bo), bo_after, ann_after, listed = asyncio.run(run())
    assert [g.policy_version for g in (on_base, on_ann, on_bo, bo_after, ann_after)] == [0, 1, 7, 9, 1]
    assert engine.policy_version == 0 and engine.adapter_version("k_ann") == 1
    for generation, model, other in [(on_base, hf_engine.model, ann), (on_ann, ann, bo), (on_bo, bo, ann),
                                      (bo_after, bo_later, bo), (ann_after, ann, bo_later)]:
        assert max_gap(generation.logprobs, reference_logprobs(model, prompt, generation.token_ids, 0.7, 1.0)) < TOL
        assert max_gap(generation.logprobs,
                       reference_logprobs(other, prompt, generation.token_ids, 0.7, 1.0)) > 50 * TOL
    assert {"k_ann-v1", "k_bo-v9", "base-v0"} <= set(listed) and "k_bo-v7" not in listed
    assert engine.route.model == "base-v0"  # the base model's rows run through a zero adapter (vllm_publish)
    assert users.publishers["k_bo"].unloaded == ["k_bo-v7"] and users.publishers["k_ann"].unloaded == []


def test_checkpoint_publication_reloads_full_weights(vllm_servers, hf_engine, smol_dir, smol_tokenizer,
                                                     smol_prompt, tmp_path):
    engine = vllm_servers["scorer"].engine(tokenizer=smol_tokenizer)
    publisher = CheckpointPublisher(engine, tmp_path / "checkpoints", smol_dir)
    tuned = copy.deepcopy(hf_engine.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if ".layers.0.mlp." in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    prompt = smol_prompt("Say hi.")
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    sampled = SamplingParams(temperature=0.7, max_tokens=16, seed=5)

    async def run():
        base = await engine.generate(prompt, greedy)
        running = asyncio.ensure_future(engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=64)))
        await asyncio.sleep(0.3)
        try:
            version = await publisher.publish(tuned.state_dict())
            finished_during = await running
            tuned_sampled = await engine.generate(prompt, sampled)
        finally:
            await publisher.publish(smol_dir)  # the scorer is shared: put the base weights back
        restored = await engine.generate(prompt, greedy)
        return base, finished_during, version, tuned_sampled, restored

    base, finished_during, version, tuned_sampled, restored = asyncio.run(run())
    assert version == 1 and finished_during.policy_version == 0  # the running request finished on old weights
    assert tuned_sampled.policy_version == 1
    # The reloaded weights are the tuned ones, not the base ones.
    expected = reference_logprobs(tuned, prompt, tuned_sampled.token_ids, 0.7, 1.0)
    assert max_gap(tuned_sampled.logprobs, expected) < TOL
    base_logprobs = reference_logprobs(hf_engine.model, prompt, tuned_sampled.token_ids, 0.7, 1.0)
    assert max_gap(tuned_sampled.logprobs, base_logprobs) > 50 * TOL
    assert restored.token_ids == base.token_ids and restored.policy_version == 2
    assert (tmp_path / "checkpoints" / "policy-v1" / "model.safetensors").is_file()
