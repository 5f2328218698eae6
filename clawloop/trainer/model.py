"""The model the trainer updates: full fine-tuning or a LoRA adapter, and the frozen reference.

Choices:

* The trainer keeps its own copy of the policy, separate from the serving engine's, so a request in flight
  keeps the weights it started with; new weights reach serving only through publication.
* Weights train in float32 (AdamW moments on a bf16 copy lose small updates); the serving engine may use any
  dtype it likes.
* LoRA goes through peft with dropout 0 and no bias, so the LoRA path and the full path compute the same
  objective on the same forward; nothing is specialised to either.
* The model stays in eval mode during training: no dropout, so the new-policy forward at the first PPO
  epoch reproduces the old-policy forward exactly (ratio 1), as the objective assumes.
* Reference for the KL term (only when ``kl_coef > 0``): with LoRA, the same model with the adapter switched
  off (no second copy); with full fine-tuning, a frozen copy of the starting weights, which is also kept for the
  retain term's targets (``retain_coef > 0``) and for the publication gate's fixed bar (``gate`` with
  ``gate_fixed_reference``, on by default).
* Logits are computed only at the response positions: the decoder runs over prompt + response, then the
  output head is applied to the hidden states that predict response tokens. Prompt logits are never
  materialised.
* Attention is ``sdpa`` by default (``attn_implementation``): memory linear in the sequence length, forward and
  backward; the reference copy shares the policy's attention kernel (docs/training-memory.md).
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from clawloop.config import Config
from clawloop.engines.model_files import load_model, resolve_device, resolve_model

if TYPE_CHECKING:
    from clawloop.gate.kept_answers import KeptAnswers
    from clawloop.gate.scoring import PromptStates


@dataclass
class TrainModels:
    policy: torch.nn.Module
    """What the optimizer updates: the causal LM (full) or the peft wrapper (LoRA)."""
    causal_lm: torch.nn.Module
    """The underlying causal LM (with LoRA layers injected when ``lora``)."""
    lora: bool
    model_dir: Path
    reference: torch.nn.Module | None = None
    """Frozen copy of the starting weights (full fine-tuning with ``kl_coef > 0``, ``retain_coef > 0`` or the gate's
    fixed reference)."""
    use_reference: bool = False
    retain_targets: Any = None
    """The retain term's targets (``clawloop.trainer.retain.RetainTargets``), built from the starting weights as
    they are needed and shared by every trainer of these models (one per user under per-user policies)."""
    gate_prompt_states: PromptStates | None = None
    """The gate reference's kept prompt states (``clawloop.gate.scoring``), made by the trainer's first gate and
    shared, as the retain targets are, by every trainer of these models: every user's gate reads the same shipped
    probes under the same starting weights (under ``torchrun``, rank 0's unsharded copy of them)."""
    gate_kept_answers: KeptAnswers | None = None
    """The starting weights' answers to the gate's shipped probes kept on disk (``clawloop.gate.kept_answers``),
    opened by the trainer's first gate and shared by the others (``gate_kept_answers``)."""

    @property
    def device(self) -> torch.device:
        return next(self.causal_lm.parameters()).device

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def reference_model(self) -> Iterator[torch.nn.Module]:
        """The model to run for ℓ_ref: the frozen copy, or the LoRA model with its adapter off."""
        if not self.use_reference:
            raise RuntimeError("no reference model (kl_coef is 0)")
        if self.reference is not None:
            yield self.reference
            return
        with self.policy.disable_adapter():  # type: ignore[attr-defined]
            yield self.causal_lm


def load_train_models(config: Config, model_dir: str | Path | None = None) -> TrainModels:
    """Load the policy for training as ``config`` says (``model``, ``lora*``, ``device``, ``kl_coef``)."""
    path = Path(model_dir) if model_dir is not None else resolve_model(config.model)
    device = resolve_device(config.device)
    causal_lm = load_model(path, dtype="float32", device=device, attn_implementation=config.attn_implementation)
    causal_lm.eval()
    causal_lm.config.use_cache = False
    use_reference = config.kl_coef > 0
    reference = None
    if not config.lora:
        # The retain term's targets and the gate's fixed bar come from the starting weights, which full
        # fine-tuning keeps only as this copy.
        if use_reference or config.retain_coef > 0 or (config.gate and config.gate_fixed_reference):
            reference = copy.deepcopy(causal_lm).eval()
            reference.requires_grad_(False)
        causal_lm.requires_grad_(True)
        return TrainModels(policy=causal_lm, causal_lm=causal_lm, lora=False, model_dir=path,
                           reference=reference, use_reference=use_reference)

    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=list(config.lora_target_modules),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    # LoRA's A matrices are random at init: seed them so a run is reproducible.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft probes a deprecated transformers attribute; the warning says nothing about this model.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(config.seed)
        policy = get_peft_model(causal_lm, lora_config)
    policy.eval()
    inner = policy.get_base_model()
    return TrainModels(policy=policy, causal_lm=inner, lora=True, model_dir=path, reference=None,
                       use_reference=use_reference)


def _active_adapter(models: TrainModels) -> str:
    adapter = getattr(models.policy, "active_adapter", "default")
    return adapter[0] if isinstance(adapter, (list, tuple)) else adapter


def _lora_layers(models: TrainModels) -> Iterator[tuple[str, Any]]:
    """The LoRA layers the active adapter adapts, with their names."""
    from peft.tuners.lora import LoraLayer

    adapter = _active_adapter(models)
    for name, module in models.causal_lm.named_modules():
        if isinstance(module, LoraLayer) and adapter in getattr(module, "lora_A", {}):
            yield name, module


@torch.no_grad()
def merged_lora_weights(models: TrainModels) -> Iterator[tuple[str, torch.nn.Module, torch.Tensor]]:
    """For every linear layer the active adapter adapts: the layer's name, its base layer, and ``W + scaling ·
    B @ A`` computed into a new tensor (peft's own delta), the weight the serving engine is handed for it."""
    adapter = _active_adapter(models)
    for name, module in _lora_layers(models):
        base = module.get_base_layer()
        yield name, base, base.weight.detach() + module.get_delta_weight(adapter).to(base.weight.dtype)


@contextlib.contextmanager
def gate_candidate(models: TrainModels) -> Iterator[torch.nn.Module]:
    """The candidate the publication gate checks: the training model. A LoRA model on the CPU is checked with its
    adapter merged into the base layers (``merged_lora_weights``, what the embedded engine is handed) and switched
    off: the adapter's two extra matmuls per layer made the gate's decoding ~20 % slower and its prefill ~30 %
    (SmolLM2-135M, 2 CPU threads). The merged tensors exist only for the duration, a second copy of the adapted
    layers (most of the model's weights), and the original tensors are put back as they were, so training and the
    reference are untouched. On an accelerator, where that copy would cost gigabytes of its memory for a few
    percent of the check's time, and where an adapted layer's weight is tied to another (an adapted output layer
    sharing the input embeddings), the adapter is left as it is."""
    tied = {id(models.causal_lm.get_input_embeddings().weight)}
    if (not models.lora or models.device.type != "cpu"
            or any(id(m.get_base_layer().weight) in tied for _, m in _lora_layers(models))):
        yield models.causal_lm
        return
    swapped: list[tuple[torch.nn.Module, torch.Tensor]] = []
    with models.policy.disable_adapter():  # type: ignore[attr-defined]
        try:
            for _, base, merged in merged_lora_weights(models):
                swapped.append((base, base.weight.data))
                base.weight.data = merged
            yield models.causal_lm
        finally:
            for base, original in swapped:
                base.weight.data = original


@contextlib.contextmanager
def gate_reference(models: TrainModels, accepted_weights: dict[str, torch.Tensor] | None) -> Iterator[torch.nn.Module]:
    """The model the publication gate compares a candidate (``models`` as they are) with: the starting weights
    (LoRA: the adapter switched off; full fine-tuning: the frozen copy), else ``accepted_weights`` (the last
    accepted version's) swapped in for the duration."""
    if models.lora:
        with models.policy.disable_adapter():  # type: ignore[attr-defined]
            yield models.causal_lm
        return
    if models.reference is not None:
        yield models.reference
        return
    if accepted_weights is None:
        raise RuntimeError("no accepted weights to compare the candidate with")
    candidate = trainable_state_dict(models)
    load_trainable_state_dict(models, accepted_weights)
    try:
        yield models.causal_lm
    finally:
        load_trainable_state_dict(models, candidate)


def output_vocab_size(models: TrainModels) -> int:
    """Rows of the output layer: the ids the policy can score (a sharded weight reports its full shape)."""
    return int(models.causal_lm.get_output_embeddings().weight.shape[0])


def trainable_state_dict(models: TrainModels) -> dict[str, torch.Tensor]:
    """What a checkpoint must hold to restore the trained weights: all weights (full) or the adapter (LoRA)."""
    if models.lora:
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(models.policy).items()}
    return {k: v.detach().cpu().clone() for k, v in models.causal_lm.state_dict().items()}


def load_trainable_state_dict(models: TrainModels, state: dict[str, Any]) -> None:
    if models.lora:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(models.policy, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise RuntimeError(f"checkpoint adapter has keys this model lacks: {unexpected[:5]}")
        return
    missing, unexpected = models.causal_lm.load_state_dict(state, strict=False)
    # Tied output weights may be stored once; anything else missing means a different architecture.
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}")
