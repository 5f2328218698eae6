"""Publication: after a step the serving engine runs the trained weights under a new policy version; LoRA is
merged into plain base weights without touching the training model."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from clawloop.engines.base import ScoreRequest
from clawloop.engines.hf import HFEngine
from clawloop.store import Store
from clawloop.trainer.core import Trainer
from clawloop.trainer.publish import merged_state_dict

from trainer_helpers import HINTS, add_sample, logprob_table, render


@pytest.fixture
def engine(tiny_model_path):
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=4)
    yield engine
    engine.close_sync()


def _score(engine, prompt, response):
    (result,) = asyncio.run(engine.score([ScoreRequest(prompt_ids=prompt, response_ids=response, top_k=4,
                                                       temperature=0.6)]))
    return result


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_step_publishes_new_weights_under_a_new_version(make_config, base_model, tiny_tokenizer, tmp_path,
                                                          engine, lora):
    config = make_config(method="hybrid", lora=lora, lr=1e-2 if lora else 1e-3)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0)
    probe_prompt = render(tiny_tokenizer, [{"role": "user", "content": "Tell me a joke."}])
    probe_response = list(tiny_tokenizer("Why did the chicken cross?", add_special_tokens=False)["input_ids"])
    before = _score(engine, probe_prompt, probe_response)
    assert before.policy_version == 0

    trainer = Trainer(config, store, engine, console=None)
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert engine.policy_version == 1 and metrics["policy_version"] == 1 and metrics["published"] == 1.0
    assert store.steps()[0]["policy_version"] == 1

    after = _score(engine, probe_prompt, probe_response)
    assert after.policy_version == 1
    assert (after.logprobs_T - before.logprobs_T).abs().max() > 1e-3  # served outputs changed
    # ... to exactly what the trainer's model now says.
    expected = logprob_table(trainer.models.policy, probe_prompt, probe_response, 0.6)
    expected_T = expected.gather(1, torch.tensor(probe_response)[:, None])[:, 0]
    torch.testing.assert_close(after.logprobs_T, expected_T, atol=1e-4, rtol=1e-4)


def _lora_trainer_after_a_step(make_config, base_model, tiny_tokenizer, tmp_path) -> Trainer:
    config = make_config(method="rl", lora=True, lr=1e-2)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0)
    trainer = Trainer(config, store, console=None)
    trainer.run_batch(*store.lease_samples(2))
    return trainer


def test_lora_merge_equals_peft_merge_and_leaves_the_adapter_alone(make_config, base_model, tiny_tokenizer,
                                                                   tmp_path):
    trainer = _lora_trainer_after_a_step(make_config, base_model, tiny_tokenizer, tmp_path)
    adapter_before = {n: p.detach().clone() for n, p in trainer.models.policy.named_parameters() if "lora_" in n}

    merged = merged_state_dict(trainer.models)
    reference = copy.deepcopy(trainer.models.policy).merge_and_unload().state_dict()
    assert set(merged) == set(base_model.state_dict())  # plain base architecture keys
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, atol=1e-6, rtol=1e-6)
    changed = [k for k in merged if not torch.equal(merged[k], base_model.state_dict()[k])]
    assert changed and all(k.split(".")[-2].endswith("proj") for k in changed)
    # The training model still carries its unmerged adapter.
    for n, p in trainer.models.policy.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, adapter_before[n])
    assert any("base_layer" in k for k in trainer.models.causal_lm.state_dict())


def test_the_gate_checks_the_lora_candidate_merged_and_leaves_training_untouched(make_config, base_model,
                                                                                  tiny_tokenizer, tmp_path):
    """The gate decodes a LoRA candidate with its adapter merged into the base layers (what the engine serves, and
    faster): the same outputs as the adapter's own forward, and afterwards the base weights are the very same
    tensors, bit for bit, the adapter is on again and its reference (adapter off) is the starting model."""
    from clawloop.trainer.model import gate_candidate, gate_reference

    trainer = _lora_trainer_after_a_step(make_config, base_model, tiny_tokenizer, tmp_path)
    models = trainer.models
    ids = torch.tensor([render(tiny_tokenizer, [{"role": "user", "content": "Tell me a joke."}])])
    with torch.no_grad():
        unmerged = models.causal_lm(input_ids=ids).logits
        bases = {n: (p, p.data_ptr(), p.detach().clone()) for n, p in models.causal_lm.named_parameters()
                 if "base_layer" in n}
        with gate_candidate(models) as candidate:
            merged = candidate(input_ids=ids).logits
            assert any(not torch.equal(p, kept) for p, _, kept in bases.values())  # the merged weights are in place
        assert all(p.data_ptr() == ptr and torch.equal(p, kept) for p, ptr, kept in bases.values())
        try:  # an error during the check puts them back too
            with gate_candidate(models):
                raise RuntimeError("out of memory")
        except RuntimeError:
            pass
        assert all(p.data_ptr() == ptr and torch.equal(p, kept) for p, ptr, kept in bases.values())
        assert torch.equal(models.causal_lm(input_ids=ids).logits, unmerged)  # adapter on again
        with gate_reference(models, None) as reference:
            torch.testing.assert_close(reference(input_ids=ids).logits, base_model(input_ids=ids).logits)
    torch.testing.assert_close(merged, unmerged, atol=1e-4, rtol=1e-4)
    assert (merged - base_model(input_ids=ids).logits).abs().max() > 1e-3  # the candidate is not the base


def test_what_each_kind_of_engine_receives(make_config, tmp_path):
    """Merged base weights by default; the PEFT model itself for an adapter-hot-loading (vLLM LoRA) engine; an
    explicit version only to engines that take one."""
    from clawloop.engines.vllm_publish import LoRAPublisher
    from clawloop.trainer.model import load_train_models
    from clawloop.trainer.publish import publish_weights

    class Recorder:
        takes_adapters = False  # the PublishingEngine contract's capability (merged weights)

        def __init__(self, publisher=None, takes_version=True):
            self.publisher, self.calls, self.policy_version = publisher, [], 0
            if not takes_version:
                self.publish_sync = self._plain

        def publish_sync(self, weights, timeout_s=None, **kwargs):
            self.calls.append((weights, kwargs))
            self.policy_version = kwargs.get("version", self.policy_version + 1)
            return self.policy_version

        def _plain(self, weights):
            self.calls.append((weights, {}))
            self.policy_version += 1
            return self.policy_version

    lora = load_train_models(make_config(lora=True))
    plain = Recorder()
    assert publish_weights(plain, lora) == 1
    weights, kwargs = plain.calls[0]
    assert isinstance(weights, dict) and not any("lora_" in k for k in weights) and kwargs == {}
    assert publish_weights(plain, lora, version=7) == 7 and plain.calls[1][1] == {"version": 7}

    hot = Recorder(publisher=LoRAPublisher.__new__(LoRAPublisher))
    hot.takes_adapters = True  # what a vLLM engine with a LoRA publisher declares (checked below)
    publish_weights(hot, lora)
    assert hot.calls[0][0] is lora.policy  # the adapter model, saved by the publisher

    old_style = Recorder(takes_version=False)
    assert publish_weights(old_style, lora, version=7) == 1  # cannot be told a version: counts on


def test_engines_declare_whether_they_take_adapters():
    """Publication capabilities are engine attributes: only a vLLM engine with a LoRA publisher takes the adapter
    itself; the embedded engine, a checkpoint-publishing vLLM engine and the offline stand-in take merged weights."""
    from clawloop.engines.hf import HFEngine
    from clawloop.engines.vllm import VLLMEngine
    from clawloop.engines.vllm_publish import CheckpointPublisher, LoRAPublisher
    from clawloop.trainer.publish import LocalVersion, takes_adapters

    engine = VLLMEngine("http://127.0.0.1:9", "base", max_context=64)
    assert not takes_adapters(engine)  # no publisher yet
    engine.publisher = LoRAPublisher.__new__(LoRAPublisher)
    assert takes_adapters(engine)
    engine.publisher = CheckpointPublisher.__new__(CheckpointPublisher)
    assert not takes_adapters(engine)
    assert HFEngine.takes_adapters is False and not takes_adapters(LocalVersion())


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft probing transformers
@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_an_adapter_folder_merges_into_the_weights_peft_merges_to(tiny_model_path, tmp_path, rslora):
    """A ``torchrun`` trainer's adapter folder is merged for the embedded engine straight from the base model's
    files; the result is peft's own merge (``merge_and_unload``) of the same folder."""
    from peft import LoraConfig, get_peft_model

    from clawloop.engines.model_files import load_model
    from clawloop.trainer.publish import merge_adapter_with_peft, merge_adapter_folder

    torch.manual_seed(0)
    policy = get_peft_model(load_model(tiny_model_path, device="cpu"),
                            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                       use_rslora=rslora))
    for name, param in policy.named_parameters():
        if "lora_B" in name:  # B starts at zero: move it so the delta is not
            param.data.normal_(0, 0.05)
    policy.save_pretrained(str(tmp_path / "adapter"))

    direct = merge_adapter_folder(tmp_path / "adapter", tiny_model_path)
    by_peft = merge_adapter_with_peft(tmp_path / "adapter", tiny_model_path)
    assert set(direct) == set(by_peft)
    for key, value in by_peft.items():
        torch.testing.assert_close(direct[key], value, atol=1e-6, rtol=0, msg=key)
    moved = [k for k in by_peft if not torch.equal(direct[k], load_model(tiny_model_path).state_dict()[k])]
    assert moved and all(any(m in k for m in ("q_proj", "v_proj", "down_proj")) for k in moved)


def test_no_step_trains_past_an_accepted_version_whose_publication_failed(make_config, base_model, tiny_tokenizer,
                                                                         tmp_path, engine, monkeypatch):
    """The engine serves the live training weights: a step taken while an accepted version is still unpublished
    would be served under that version's number once publication works. The batch goes back untouched and no step
    is taken until the version is served; then training goes on."""
    from clawloop.trainer.core import PublicationPending

    config = make_config(method="rl", lora=True, lr=1e-2)
    store = Store(tmp_path / "store.sqlite")
    for i in range(4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, engine, console=None)
    publish_sync = engine.publish_sync
    down = {"tries": 2}

    def engine_down_then_up(*args, **kwargs):
        if down["tries"]:
            down["tries"] -= 1
            raise RuntimeError("the engine is restarting")
        return publish_sync(*args, **kwargs)

    monkeypatch.setattr(engine, "publish_sync", engine_down_then_up)
    first = trainer.run_batch(*store.lease_samples(2))
    assert first["published"] == 0.0 and engine.policy_version == 0 and trainer.step == 1
    with pytest.raises(PublicationPending):
        trainer.run_batch(*store.lease_samples(2))  # the retry before it fails too
    assert trainer.step == 1 and store.count_samples() == {"consumed": 2, "ready": 2}  # given back, unweighted
    second = trainer.run_batch(*store.lease_samples(2))  # the retry goes through, then the step
    assert trainer.step == 2 and second["policy_version"] == 2
    assert [(v["version"], v["step"]) for v in store.versions()] == [(1, 1), (2, 2)] and engine.policy_version == 2
