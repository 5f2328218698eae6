"""Many LoRA adapters on one base model, served in one batch: each row of a batch gets its own adapter's delta.

For a target linear layer with base weight ``W``, row ``b`` of a batch computes

    y_b = W x_b + B_{a(b)} (A_{a(b)} x_b)

where ``a(b)`` is the adapter slot of row ``b`` and ``B`` already carries the adapter's scaling (``alpha / r``, or
``alpha / sqrt(r)`` with rsLoRA). Slot 0 is the base model itself: its ``A`` and ``B`` are zero.

Design choices:

* **Nothing is merged per request.** Every target layer keeps ``N`` slots, ``A_N_R_I`` and ``B_N_O_R`` (rank ``R``
  the largest allowed; a smaller rank is padded with zeros, which add nothing). For a mixed batch, each layer
  stacks the adapters its rows use (``D`` of them) along the rank, once for as long as the batch uses the same
  ones and none is reloaded, multiplies by their ``A`` at once, zeroes the columns that are not the row's own adapter's,
  and multiplies by their ``B``: two matmuls per layer, so rows of different users share one pass over the base
  weights. A CPU decoding step is bound by the weights it reads, and this reads each adapter in use once per
  step: the base model plus ``D`` adapters. Gathering each row's own pair (``A[slot_B]``, then two batched
  matmuls) copied an adapter per row and layer at every step; a loop over the adapters present paid a pair of
  small matmuls per adapter and layer; both were slower (``benchmarks/multi_lora.py``, docs/multi-adapter.md).
* **One adapter for the whole batch is the common case** and takes a plain matmul with that slot's pair (no
  gather); a batch of base rows only skips the delta.
* **Slots are bounded** (``max_adapters``): loading into a full set evicts the adapter used least recently, never
  one the current batch uses.
* The rows are set around a forward (``MultiLoRA.rows``); the layers read them from one shared holder, so the
  model's own forward code is unchanged.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

PEFT_PREFIX = "base_model.model."
"""How a PEFT adapter file names a layer: ``base_model.model.<module>.lora_A.weight``."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections the engine gives adapter slots to by default: those the trainer adapts by default (the config's
``lora_target_modules``; the config does not import torch-level modules, so the list is written there too)."""


def plain_lora_scaling(adapter_config: Mapping[str, object]) -> float | None:
    """``lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA) for a PEFT ``adapter_config.json`` whose adapter is plain
    LoRA, so that ``W + scaling · B A`` is all it does; None for DoRA, per-layer ranks or alphas, transposed
    weights or extra trained modules, which that formula does not cover."""
    if any(adapter_config.get(k) for k in ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern",
                                            "modules_to_save")):
        return None
    r, alpha = int(adapter_config["r"]), float(adapter_config["lora_alpha"])  # type: ignore[arg-type]
    return alpha / math.sqrt(r) if adapter_config.get("use_rslora") else alpha / r


class _Rows:
    """The adapters of the forward in progress, set by ``MultiLoRA.rows``."""

    def __init__(self) -> None:
        self.single: int | None = None
        """The one slot every row uses, when they all use the same one (0: the base)."""
        self.slots: list[int] = []
        """For a mixed batch: the adapter slots its rows use (not the base's), in the order of ``mask_B_K``."""
        self.mask_B_K: torch.Tensor | None = None
        """For a mixed batch: 1 where column ``k`` of its slots' stacked ranks (``K = len(slots) x R``) belongs to
        row ``b``'s slot."""
        self.epoch = 0
        """Counts adapter loads and evictions: a layer's stack of a batch's adapters is kept while the batch uses
        the same slots and no slot changed (decoding steps of one batch reuse it)."""


class RowLoRALinear(torch.nn.Module):
    """A linear layer with a LoRA delta per row, read from the adapter slots (module docstring)."""

    def __init__(self, base: torch.nn.Linear, rows: _Rows, slots: int, rank: int):
        super().__init__()
        self.base = base
        self.rows = rows
        self.rank = rank
        self._stack: tuple[tuple[tuple[int, ...], int], torch.Tensor, torch.Tensor] | None = None
        w = base.weight
        # Each slot's pair is contiguous, in nn.Linear's layout ([out, in]), so that F.linear reads it as it is.
        self.register_buffer("A_N_R_I", torch.zeros(slots, rank, w.shape[1], dtype=w.dtype, device=w.device),
                             persistent=False)
        self.register_buffer("B_N_O_R", torch.zeros(slots, w.shape[0], rank, dtype=w.dtype, device=w.device),
                             persistent=False)

    def slot_pair(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s ``A`` (``[R, I]``) and scaled ``B`` (``[O, R]``), as views."""
        return self.A_N_R_I[slot], self.B_N_O_R[slot]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        single, mask_B_K = self.rows.single, self.rows.mask_B_K
        if single is not None:
            if single == 0:
                return y
            a_R_I, b_O_R = self.slot_pair(single)
            return y + F.linear(F.linear(x, a_R_I), b_O_R)
        if mask_B_K is None:
            return y
        key = (tuple(self.rows.slots), self.rows.epoch)
        if self._stack is None or self._stack[0] != key:
            pairs = [self.slot_pair(slot) for slot in self.rows.slots]
            self._stack = (key, torch.cat([a for a, _ in pairs]), torch.cat([b for _, b in pairs], 1))
        _, a_K_I, b_O_K = self._stack
        # The batch's adapters' A at once, each row keeping only its own adapter's columns, then their B: two
        # matmuls, nothing gathered per row.
        xa = F.linear(x, a_K_I) * (mask_B_K if x.dim() == 2 else mask_B_K.unsqueeze(1))
        return y + F.linear(xa, b_O_K)


class MultiLoRA:
    """Adapter slots on ``model``'s target linear layers (``target_modules``: names their module paths end with),
    installed in place. ``load`` puts an adapter in a slot, ``rows`` runs forwards with an adapter per row."""

    def __init__(self, model: torch.nn.Module, target_modules: Sequence[str], *, max_adapters: int = 16,
                 max_rank: int = 16):
        if max_adapters < 1 or max_rank < 1:
            raise ValueError("max_adapters and max_rank must be at least 1")
        self.model = model
        self.max_rank = int(max_rank)
        self.max_adapters = int(max_adapters)
        self._rows = _Rows()
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.layers: dict[str, RowLoRALinear] = {}
        targets = tuple(target_modules)
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear) and name.split(".")[-1] in targets:
                parent_name, _, child = name.rpartition(".")
                layer = RowLoRALinear(module, self._rows, self.max_adapters + 1, self.max_rank)
                setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
                self.layers[name] = layer
        if not self.layers:
            raise ValueError(f"no linear layer of the model is named one of {list(targets)}")

    @property
    def loaded(self) -> list[str]:
        """Adapter names in their slots, least recently used first."""
        return list(self._slot_of)

    @torch.no_grad()
    def load(self, name: str, adapter: Mapping[str, torch.Tensor], scaling: float, *,
             pinned: Sequence[str] = ()) -> int:
        """Put ``adapter`` (PEFT keys, ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``) in a slot
        under ``name``, replacing an adapter of that name; evicts the least recently used adapter not in
        ``pinned`` when every slot is taken. Returns the slot. Refuses an adapter of a layer the slots do not
        cover, or of a rank above ``max_rank``, before changing anything."""
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, a_R_I in adapter.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len(PEFT_PREFIX):-len(".lora_A.weight")] if key.startswith(PEFT_PREFIX) else \
                key[:-len(".lora_A.weight")]
            if module not in self.layers:
                raise KeyError(f"adapter {name!r} adapts {module!r}, which has no adapter slots")
            b_O_R = adapter[key.replace(".lora_A.weight", ".lora_B.weight")]
            if a_R_I.shape[0] > self.max_rank:
                raise ValueError(f"adapter {name!r} has rank {a_R_I.shape[0]}, above max_rank {self.max_rank}")
            pairs[module] = (a_R_I, b_O_R)
        slot = self._slot_of.pop(name, None)
        if slot is None:
            slot = self._free_slot(pinned)
        for module, layer in self.layers.items():
            a_slot, b_slot = layer.slot_pair(slot)
            a_slot.zero_()
            b_slot.zero_()
            if module in pairs:
                a_R_I, b_O_R = pairs[module]
                r = a_R_I.shape[0]
                a_slot[:r] = a_R_I.to(a_slot.dtype)
                b_slot[:, :r] = b_O_R.to(b_slot.dtype) * scaling
        self._slot_of[name] = slot
        self._rows.epoch += 1
        return slot

    def load_folder(self, name: str, adapter_dir: str | Path, *, pinned: Sequence[str] = ()) -> int:
        """``load`` from a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), the form
        the trainer writes a LoRA version in. Plain LoRA only: DoRA, per-layer ranks or alphas and extra trained
        modules are refused."""
        from safetensors.torch import load_file

        adapter_dir = Path(adapter_dir)
        scaling = plain_lora_scaling(json.loads((adapter_dir / "adapter_config.json").read_text()))
        if scaling is None:
            raise ValueError(f"{adapter_dir}: only plain LoRA adapters can share a batch (no DoRA, per-layer ranks "
                             "or alphas, or extra trained modules)")
        return self.load(name, load_file(str(adapter_dir / "adapter_model.safetensors")), scaling, pinned=pinned)

    def evict(self, name: str) -> None:
        """Free ``name``'s slot (zeroed, so a stale slot number can never serve its weights)."""
        slot = self._slot_of.pop(name)
        for layer in self.layers.values():
            for part in layer.slot_pair(slot):
                part.zero_()
        self._rows.epoch += 1

    def _free_slot(self, pinned: Sequence[str]) -> int:
        used = set(self._slot_of.values())
        free = [s for s in range(1, self.max_adapters + 1) if s not in used]
        if free:
            return free[0]
        victim = next((n for n in self._slot_of if n not in pinned), None)
        if victim is None:
            raise RuntimeError(f"all {self.max_adapters} adapter slots hold adapters in use")
        slot = self._slot_of[victim]
        self.evict(victim)
        return slot

    @contextmanager
    def rows(self, names: Sequence[str | None]) -> Iterator[None]:
        """Forwards inside run row ``b`` with adapter ``names[b]`` (None: the base model). Every name must be
        loaded; using one makes it the most recently used."""
        missing = sorted({n for n in names if n is not None and n not in self._slot_of})
        if missing:
            raise KeyError(f"adapters not loaded: {missing}")
        slots = []
        for n in names:
            if n is not None:
                self._slot_of.move_to_end(n)
            slots.append(0 if n is None else self._slot_of[n])
        layer = next(iter(self.layers.values()))
        if len(set(slots)) == 1:
            self._rows.single = slots[0]
        else:
            used = sorted(set(slots) - {0})
            r = self.max_rank
            mask_B_K = torch.zeros(len(slots), len(used) * r, dtype=layer.A_N_R_I.dtype, device=layer.A_N_R_I.device)
            for b, slot in enumerate(slots):
                if slot:
                    at = used.index(slot) * r
                    mask_B_K[b, at:at + r] = 1
            self._rows.slots, self._rows.mask_B_K = used, mask_B_K
        try:
            yield
        finally:
            self._rows.single, self._rows.slots, self._rows.mask_B_K = None, [], None
