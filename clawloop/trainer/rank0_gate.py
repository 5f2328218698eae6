"""How the publication gate sees a ``torchrun`` candidate: rank 0 checks an unsharded copy of it.

A sharded model cannot answer the gate's probes on one rank, so rank 0 keeps a plain copy of the policy
(``load_train_models`` on its own device, never sharded) and loads each candidate's weights into it, the weights
the loop has gathered on rank 0 anyway (to keep and publish them). ``clawloop.gate`` then checks that copy exactly
as the in-process trainer checks its own model (``parallel.LocalGateView``), against the same reference: with
LoRA the copy with its adapter switched off, with full fine-tuning the frozen starting copy (kept for
the gate by default, ``gate_fixed_reference``, and for ``kl_coef > 0``), else the last accepted weights. The price:
another copy of the model on rank 0 (two with full fine-tuning and its frozen copy).
"""

from __future__ import annotations

import dataclasses

import torch

from clawloop.config import Config
from clawloop.gate.gate import GateResult, PublicationGate
from clawloop.trainer.model import (TrainModels, gate_candidate, gate_reference, load_train_models,
                                   load_trainable_state_dict)


class Rank0GateView:
    def __init__(self, config: Config, device: torch.device):
        self.copy: TrainModels = load_train_models(dataclasses.replace(config, device=str(device)))
        self.kl_to = "reference" if self.copy.lora or self.copy.reference is not None else "last_accepted"

    def check(self, gate: PublicationGate, candidate: dict[str, torch.Tensor] | None,
              accepted: dict[str, torch.Tensor] | None) -> GateResult:
        if candidate is None:
            raise RuntimeError("the candidate's weights were not gathered on this rank")
        load_trainable_state_dict(self.copy, candidate)
        return gate.check(lambda: gate_candidate(self.copy), lambda: gate_reference(self.copy, accepted),
                          kl_to=self.kl_to)

    def prepare(self, gate: PublicationGate) -> bool:
        if self.kl_to != "reference":
            return False
        return gate.prepare(lambda: gate_reference(self.copy, None))
