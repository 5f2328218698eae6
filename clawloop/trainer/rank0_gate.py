"""The publication gate for the ``torchrun`` trainer: rank 0 checks an unsharded copy of each candidate.

A sharded model cannot answer the gate's probes on one rank, so rank 0 keeps a plain copy of the policy
(``load_train_models`` on its own device, never sharded) and loads each candidate's weights into it, the weights
rank 0 has gathered for publication anyway. ``clawloop.gate`` then checks that copy exactly as the in-process
trainer checks its own model, against the same reference: with LoRA the copy with its adapter switched off, with
full fine-tuning the frozen starting copy kept for ``kl_coef > 0``, else the last accepted weights.

The last accepted weights and optimizer state (as ``fsdp.gather_weights`` / ``gather_optimizer`` give them) stay
on rank 0's CPU; after a rejection every rank loads them back (``fsdp.load_checkpoint_state``), so training goes
on from the accepted version, as in the in-process trainer. The price: another copy of the model on rank 0 (two
with full fine-tuning and the KL reference), and the optimizer state gathered at each acceptance.

Recent prompts come from a local store; the API's trainer routes do not serve them, so a trainer leasing from an
API probes with the shipped prompts only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from clawloop.config import Config
from clawloop.gate.gate import GateResult, PublicationGate
from clawloop.trainer.model import gate_reference, load_train_models, load_trainable_state_dict


class Rank0Gate:
    def __init__(self, config: Config, store: Any, device: torch.device):
        from clawloop.engines.model_files import load_tokenizer

        self.copy = load_train_models(dataclasses.replace(config, device=str(device)))
        recent = getattr(store, "recent_prompts", None)  # a local store has them; the API's routes do not
        self.gate = PublicationGate(
            load_tokenizer(self.copy.model_dir), min_guard_pass=config.gate_min_guard_pass,
            max_kl=config.gate_max_kl, probe_tokens=config.gate_probe_tokens,
            recent_prompts=(lambda: recent(config.gate_recent_prompts)) if recent is not None else None)
        self.every = int(config.gate_every)
        self.steps_since_check = 0
        self.accepted_weights: dict[str, torch.Tensor] | None = None
        self.accepted_optimizer: dict[str, Any] | None = None
        self.kl_to = "reference" if self.copy.lora or self.copy.reference is not None else "last_accepted"

    def remember(self, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
        """The weights and optimizer state of the version now accepted: rank 0's gathered CPU copies, which
        nothing changes afterwards (publication only writes them), so they are kept as they are."""
        self.accepted_weights = dict(weights)
        self.accepted_optimizer = optimizer_state

    def due(self) -> bool:
        """Count a trained step; True when it is a step the gate checks (every ``gate_every``)."""
        self.steps_since_check += 1
        if self.steps_since_check < self.every:
            return False
        self.steps_since_check = 0
        return True

    def check(self, weights: dict[str, torch.Tensor]) -> GateResult:
        load_trainable_state_dict(self.copy, weights)
        return self.gate.check(self.copy.causal_lm, lambda: gate_reference(self.copy, self.accepted_weights),
                               kl_to=self.kl_to)
