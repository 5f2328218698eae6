"""Random PEFT-keyed LoRA adapters for the tiny model, and the model with one merged: what adapter slots are
checked against."""

import copy

import torch

from clawloop.engines.multi_lora import LORA_TARGETS as TARGETS
from clawloop.engines.multi_lora import PEFT_PREFIX


def random_adapter(model, rank: int, seed: int, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """A rank-``rank`` adapter on every target projection of ``model``, keyed as a PEFT adapter file."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in TARGETS:
            out_f, in_f = module.weight.shape
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * scale
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * scale
    return out


@torch.no_grad()
def merged(model, adapter: dict[str, torch.Tensor], scaling: float):
    """A copy of ``model`` with ``adapter`` merged into its weights."""
    out = copy.deepcopy(model)
    for key, a in adapter.items():
        if key.endswith(".lora_A.weight"):
            b = adapter[key.replace("lora_A", "lora_B")]
            out.get_submodule(key[len(PEFT_PREFIX):-len(".lora_A.weight")]).weight += scaling * (b @ a)
    return out
