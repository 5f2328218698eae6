"""Where a training step's forwards and backwards run: the seam between the one ``train_step`` and the parallelism.

``trainer.step.train_step`` and the old-policy pass (``trainer.old_policy``) are written once, against a runner:

* ``shard(n)``: the indices of the batch's samples this process trains (all of them, or every ``world``-th);
* ``rounds(k)``: how many micro-batches every process runs this step (its own ``k``, or the largest ``k`` of any
  rank, since FSDP's collectives need every rank to run the same number of forwards and backwards);
* ``forward(model, group)``: one micro-batch forward, returning a ``ResponseLogits``: each sample's raw
  logits ``[T_i, V]`` at the positions predicting its response, ``add_loss`` for each sample's loss and
  ``backward`` once the micro-batch is done;
* ``gather(obj)``: every process's ``obj`` (rank order), so rank 0 can report the whole batch.

Two runners:

* ``LocalRunner`` (one process; the embedded and offline trainers). The decoder runs once per micro-batch and
  its final hidden states are cut from the graph (a leaf); each sample then gets its output-layer logits on
  its own and back-propagates its loss into the leaf at once, so at most one sample's ``[T, V]`` logits exist at
  a time; ``backward`` runs the decoder's backward once with the accumulated hidden-state gradient. A long
  micro-batch may recompute its decoder activations in the backward (``trainer.recompute``).
* ``FSDPRunner`` (``trainer.fsdp``, one per rank of a ``torchrun`` job). The root module runs the forward (so
  FSDP's hooks gather the embedding and output head) with ``logits_to_keep`` cut to the response region; the
  micro-batch's losses are summed and back-propagated together in ``backward``.

Both compute the same numbers for the same sample: the logits of a position do not depend on how the forward
was split, and the step divides every loss by the whole batch's size on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch

from clawloop.engines.head import logit_softcap, soft_capped
from clawloop.trainer.batch import TrainItem, collate
from clawloop.trainer.recompute import checkpointed_layers, wants_checkpointing


class ResponseLogits(Protocol):
    recomputed: bool
    """Whether this forward's activations are recomputed in the backward (gradient checkpointing)."""

    def samples(self) -> Iterator[tuple[TrainItem, torch.Tensor]]:
        """Each sample of the micro-batch with its logits ``[T_i, V]`` (computed on demand where possible)."""
        ...

    def add_loss(self, loss: torch.Tensor) -> None:
        """One sample's share of the batch loss (already divided by the batch size)."""
        ...

    def backward(self) -> None:
        """Finish the micro-batch's backward (after every sample's ``add_loss``)."""
        ...


class Runner(Protocol):
    rank: int
    world: int
    device: torch.device

    def shard(self, n: int) -> list[int]: ...

    def rounds(self, micro_batches: int) -> int: ...

    def forward(self, model: torch.nn.Module, group: list[TrainItem], *,
                checkpointing: str = "off") -> ResponseLogits:
        """``checkpointing``: the ``gradient_checkpointing`` setting (on, off, auto), for runners that can."""
        ...

    def gather(self, obj: Any) -> list[Any]: ...


class _LeafForward:
    """One micro-batch through the decoder, its hidden states cut from the graph (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, group: list[TrainItem], device: torch.device, checkpointing: str):
        self.group = group
        self.head = model.get_output_embeddings()
        self.softcap = logit_softcap(model)
        decoder = model.get_decoder()
        mb = collate(group, device)
        self.recomputed = torch.is_grad_enabled() and wants_checkpointing(checkpointing, mb.input_ids_B_L.numel())
        with checkpointed_layers(decoder, self.recomputed):
            out = decoder(input_ids=mb.input_ids_B_L, attention_mask=mb.attention_mask_B_L, use_cache=False)
        self.hidden_B_L_H = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # Cut the graph here: each sample's head + loss runs (and is freed) on its own.
        self.leaf_B_L_H = self.hidden_B_L_H.detach().requires_grad_(True) if self.hidden_B_L_H.requires_grad \
            else self.hidden_B_L_H

    def samples(self) -> Iterator[tuple[TrainItem, torch.Tensor]]:
        for i, item in enumerate(self.group):
            p, t = item.prompt_len, item.response_len
            # Position p - 1 + t predicts token t.
            yield item, soft_capped(self.head(self.leaf_B_L_H[i, p - 1:p - 1 + t]), self.softcap)

    def add_loss(self, loss: torch.Tensor) -> None:
        if loss.requires_grad:  # a sample with no active term has a constant 0 loss
            loss.backward()

    def backward(self) -> None:
        if self.leaf_B_L_H is not self.hidden_B_L_H and self.leaf_B_L_H.grad is not None:
            self.hidden_B_L_H.backward(self.leaf_B_L_H.grad)
        del self.hidden_B_L_H, self.leaf_B_L_H


class LocalRunner:
    """Every sample in this process (see the module docstring)."""

    rank = 0
    world = 1

    def __init__(self, device: torch.device):
        self.device = device

    def shard(self, n: int) -> list[int]:
        return list(range(n))

    def rounds(self, micro_batches: int) -> int:
        return micro_batches

    def forward(self, model: torch.nn.Module, group: list[TrainItem], *, checkpointing: str = "off") -> _LeafForward:
        return _LeafForward(model, group, self.device, checkpointing)

    def gather(self, obj: Any) -> list[Any]:
        return [obj]


def scalar(x: Any) -> float:
    """A Python float from a tensor, a sharded ``DTensor`` (its full value) or a number."""
    if hasattr(x, "full_tensor"):
        x = x.full_tensor()
    return float(x)
