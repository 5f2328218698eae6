"""Adapter slots on one base model: every row of a mixed batch computes what the model with that row's adapter
merged computes, slots are reused by recency without ever serving an evicted adapter, and the trainer's PEFT
adapter folders load as they are."""

import copy

import pytest
import torch

from clawloop.engines.model_files import load_model
from clawloop.engines.multi_lora import MultiLoRA
from tests.engines.adapters import TARGETS, merged, random_adapter


@pytest.fixture
def base(tiny_model_path):
    torch.manual_seed(0)
    return load_model(tiny_model_path, device="cpu").eval()


@torch.no_grad()
def test_each_row_of_a_mixed_batch_equals_its_adapter_merged(base):
    adapters = {"ann": (random_adapter(base, 4, 1), 2.0), "bo": (random_adapter(base, 8, 2), 0.5),
                "cy": (random_adapter(base, 8, 3), 1.0)}
    served = MultiLoRA(copy.deepcopy(base), TARGETS, max_adapters=3, max_rank=8)
    for name, (adapter, scaling) in adapters.items():
        served.load(name, adapter, scaling)
    ids_B_L = torch.randint(3, 200, (5, 9))
    rows = ["ann", "bo", None, "cy", "ann"]
    with served.rows(rows):
        logits_B_L_V = served.model(input_ids=ids_B_L).logits
    for b, name in enumerate(rows):
        alone = base if name is None else merged(base, *adapters[name])
        expected = alone(input_ids=ids_B_L[b:b + 1]).logits[0]
        torch.testing.assert_close(logits_B_L_V[b], expected, atol=1e-4, rtol=1e-4)
    assert (logits_B_L_V[1] - logits_B_L_V[0]).abs().max() > 1e-2  # the adapters do differ
    with served.rows(["cy", None, "bo"]):  # the next batch's adapters, not the last one's
        again = served.model(input_ids=ids_B_L[:3]).logits
    for b, name in enumerate(["cy", None, "bo"]):
        alone = base if name is None else merged(base, *adapters[name])
        torch.testing.assert_close(again[b], alone(input_ids=ids_B_L[b:b + 1]).logits[0], atol=1e-4, rtol=1e-4)
    with served.rows(["bo"] * 3):  # one adapter for the whole batch takes the plain path
        torch.testing.assert_close(served.model(input_ids=ids_B_L[:3]).logits,
                                   merged(base, *adapters["bo"])(input_ids=ids_B_L[:3]).logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(served.model(input_ids=ids_B_L).logits, base(input_ids=ids_B_L).logits)  # no rows set


@torch.no_grad()
def test_slots_are_reused_least_recently_used_first_and_an_evicted_adapter_is_never_served(base):
    served = MultiLoRA(copy.deepcopy(base), TARGETS, max_adapters=2, max_rank=4)
    served.load("ann", random_adapter(base, 4, 1), 1.0)
    served.load("bo", random_adapter(base, 4, 2), 1.0)
    with served.rows(["ann"]):
        pass  # "bo" is now the least recently used
    served.load("cy", random_adapter(base, 4, 3), 1.0)
    assert served.loaded == ["ann", "cy"]
    with pytest.raises(KeyError, match="bo"):
        with served.rows(["bo"]):
            pass
    with pytest.raises(RuntimeError, match="in use"):
        served.load("dee", random_adapter(base, 4, 4), 1.0, pinned=["ann", "cy"])
    with pytest.raises(ValueError, match="rank 8"):
        served.load("wide", random_adapter(base, 8, 5), 1.0)
    assert served.loaded == ["ann", "cy"]  # a refused load changes nothing
    served.evict("ann")
    ids = torch.randint(3, 200, (1, 6))
    with served.rows(["cy"]):
        cy = served.model(input_ids=ids).logits
    torch.testing.assert_close(cy, merged(base, random_adapter(base, 4, 3), 1.0)(input_ids=ids).logits,
                               atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_a_peft_adapter_folder_serves_what_peft_computes(base, tmp_path):
    from peft import LoraConfig, get_peft_model

    trained = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    for name, p in trained.named_parameters():
        if "lora_B" in name:
            p.normal_(0.0, 0.2)
    trained.save_pretrained(tmp_path / "adapter")
    ids = torch.randint(3, 200, (2, 7))
    expected = trained(input_ids=ids).logits
    served = MultiLoRA(copy.deepcopy(base), TARGETS, max_adapters=2, max_rank=16)
    served.load_folder("k_ann", tmp_path / "adapter")
    with served.rows(["k_ann", None]):
        out = served.model(input_ids=ids).logits
    torch.testing.assert_close(out[0], expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], base(input_ids=ids[1:]).logits[0], atol=1e-4, rtol=1e-4)
