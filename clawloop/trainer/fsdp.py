"""FSDP2 for the ``torchrun`` trainer: joining the process group, sharding the models, the ``FSDPRunner`` that
runs ``trainer.step.train_step`` on each rank, and the state-dict collectives of publication, checkpoints and
resume.

* ``torch.distributed`` with gloo on CPU, nccl on GPU (one device per local rank). FSDP2 ``fully_shard`` is
  applied to each decoder layer and to the root module; the optimizer is built on the sharded parameters. LoRA
  is sharded the same way: FSDP2 shards every parameter on its own (a ``DTensor`` each, no flat parameter),
  all-gathers a unit's frozen base weights and trainable adapter matrices together and reduce-scatters only
  the gradients that exist, so a unit may mix both.
* ``FSDPRunner``: sample ``i`` of a batch trains on rank ``i mod world``. Logits come from the root module's
  forward (so FSDP's hooks gather the embedding and output head), with ``logits_to_keep`` cutting them to the
  micro-batch's response region; prompt logits are never materialised. Each sample's loss is divided by the
  *global* batch size, so the sum over ranks of each rank's partial loss equals the single-process batch
  mean; FSDP averages gradients over ranks, so each rank back-propagates its partial loss times the world
  size, and the reduced gradient is the gradient of that batch mean. A rank with fewer micro-batches than
  another runs one-token dummy forwards (loss multiplied by 0), so every rank runs the same collectives.
* State dicts are gathered full and CPU-offloaded on rank 0 (``torch.distributed.checkpoint.state_dict``), so
  nothing written depends on the world size; the optimizer state is re-keyed by parameter index, as the
  single-process ``optimizer.state_dict()`` keys it. Loading goes the other way (``broadcast_from_rank0``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from clawloop.trainer.batch import TrainItem, collate
from clawloop.trainer.model import TrainModels


# ---- process group -------------------------------------------------------------------------------------------
def init_distributed() -> tuple[int, int, torch.device]:
    """Join (or, under plain ``python``, create a one-process) group. Returns (rank, world size, device)."""
    if "WORLD_SIZE" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"})
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size(), device


def _shard(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_model(models: TrainModels, device: torch.device) -> None:
    """FSDP2 on every decoder layer and the root (gradients averaged over ranks, FSDP's default), for the
    policy and, with full fine-tuning and ``kl_coef > 0``, for the frozen reference copy.

    With LoRA the root is the underlying causal LM (LoRA layers injected), not the peft wrapper: every forward
    here calls that module, so its FSDP hooks run; the wrapper's ``parameters()`` are the same (now sharded)
    tensors, which is what the optimizer and the state-dict helpers see."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    models.causal_lm.to(device)
    _shard(models.causal_lm, mesh)
    if models.reference is not None:
        models.reference.to(device)
        _shard(models.reference, mesh)


# ---- state dicts (collectives: every rank calls them; rank 0 gets the tensors) ------------------------
def _options(**kw: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def _peft_key_map(models: TrainModels) -> dict[str, str]:
    """PEFT adapter key (as ``get_peft_model_state_dict`` and adapter folders name it) -> the parameter's
    name in the peft model (the name ``torch.distributed.checkpoint`` uses), from peft's own renaming."""
    from peft import get_peft_model_state_dict

    names = [n for n, p in models.policy.named_parameters() if p.requires_grad]
    probe = {n: torch.zeros(1) for n in names}
    name_of = {id(t): n for n, t in probe.items()}
    return {k: name_of[id(v)] for k, v in get_peft_model_state_dict(models.policy, state_dict=probe).items()}


def gather_weights(models: TrainModels) -> dict[str, torch.Tensor] | None:
    """What a checkpoint holds and what is published: the full state dict (keys of the causal LM's
    ``state_dict``) or, with LoRA, the adapter (PEFT keys, as ``trainable_state_dict``). Rank 0 gets it on the
    CPU; other ranks get None."""
    if not models.lora:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(models.causal_lm, options=_options(cpu_offload=True))
        return state if dist.get_rank() == 0 else None
    # The adapter only: gather the trainable parameters one by one (the frozen base is never moved).
    gathered: dict[str, torch.Tensor] = {}
    for name, param in models.policy.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            if dist.get_rank() == 0:
                gathered[name] = full.detach().cpu().clone()
    if dist.get_rank() != 0:
        return None
    key_map = _peft_key_map(models)
    return {peft_key: gathered[name] for peft_key, name in key_map.items()}


def _optimizer_names(models: TrainModels, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's own order: index ``i`` of ``optimizer.state_dict()``."""
    name_of = {id(p): n for n, p in models.policy.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def gather_optimizer(models: TrainModels, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
    """The AdamW state as the single-process ``optimizer.state_dict()`` has it (keyed by parameter index,
    full tensors), on rank 0; None elsewhere."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(models.policy, optimizer, options=_options(cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    index = {name: i for i, name in enumerate(_optimizer_names(models, optimizer))}
    groups = []
    for group in named["param_groups"]:
        groups.append({**group, "params": [index[name] for name in group["params"]]})
    return {"state": {index[name]: value for name, value in named["state"].items()}, "param_groups": groups}


def _named_optimizer_state(saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of ``gather_optimizer``'s re-keying: parameter index -> parameter name."""
    count = sum(len(g["params"]) for g in saved["param_groups"])
    if count != len(names):
        raise RuntimeError(f"the checkpoint's optimizer holds {count} parameters, this model trains {len(names)}")
    groups = [{**g, "params": [names[int(i)] for i in g["params"]]} for g in saved["param_groups"]]
    return {"state": {names[int(i)]: v for i, v in saved["state"].items()}, "param_groups": groups}


def checkpoint_weights_by_name(models: TrainModels, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights keyed as ``set_model_state_dict`` wants them, checked against this model."""
    if models.lora:
        key_map = _peft_key_map(models)
        unknown = [k for k in weights if k not in key_map]
        missing = [k for k in key_map if k not in weights]
        if unknown or missing:
            raise RuntimeError(f"checkpoint adapter does not match this model: unknown {unknown[:5]}, "
                               f"missing {missing[:5]}")
        return {key_map[k]: v for k, v in weights.items()}
    expected = set(models.causal_lm.state_dict().keys())
    tied = bool(getattr(models.causal_lm.config, "tie_word_embeddings", False))
    # Tied output weights may be stored once; anything else missing means a different architecture.
    missing = [k for k in expected - set(weights) if not (tied and k.endswith("lm_head.weight"))]
    unexpected = [k for k in weights if k not in expected]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not match the model: missing {missing[:5]}, unexpected "
                           f"{unexpected[:5]}")
    return dict(weights)


def load_checkpoint_state(models: TrainModels, optimizer: torch.optim.Optimizer,
                          weights: dict[str, torch.Tensor] | None, optimizer_state: dict[str, Any] | None,
                          has_optimizer: bool, learning_rate: float) -> None:
    """Every rank calls this; rank 0 passes the checkpoint's weights (checked, keyed by parameter name) and
    optimizer state (index-keyed), the others None. Afterwards every rank holds its shards of both."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    rank0 = dist.get_rank() == 0
    # Separate calls: ``set_state_dict`` takes an empty model dict (the other ranks') as "optimizer only".
    set_model_state_dict(models.policy, weights if rank0 else {},
                         options=_options(broadcast_from_rank0=True, strict=False))
    if has_optimizer:
        named = _named_optimizer_state(optimizer_state, _optimizer_names(models, optimizer)) if rank0 else {}
        set_optimizer_state_dict(models.policy, optimizer, named, options=_options(broadcast_from_rank0=True))
    for group in optimizer.param_groups:  # the configured lr wins over the saved one
        group["lr"] = learning_rate


# ---- the runner ---------------------------------------------------------------------------------------------
class _RootForward:
    """One micro-batch through the root module (FSDP's hooks run), its losses summed for one backward."""

    recomputed = False

    def __init__(self, model: torch.nn.Module, group: list[TrainItem], device: torch.device, world: int):
        self.group, self.world = group, world
        if not group:  # a dummy forward keeps this rank's collectives in step with the others
            one_B_L = torch.zeros((1, 1), dtype=torch.long, device=device)
            self.logits = model(input_ids=one_B_L, attention_mask=torch.ones_like(one_B_L), use_cache=False,
                                logits_to_keep=1).logits
            self.per: list[torch.Tensor] = []
        else:
            mb = collate(group, device)
            first = min(mb.prompt_lens) - 1  # the first position that predicts a response token
            keep = int(mb.input_ids_B_L.shape[1]) - first
            self.logits = model(input_ids=mb.input_ids_B_L, attention_mask=mb.attention_mask_B_L, use_cache=False,
                                logits_to_keep=keep).logits
            self.per = [self.logits[i, p - 1 - first:p - 1 - first + t]
                        for i, (p, t) in enumerate(zip(mb.prompt_lens, mb.response_lens))]
        self.total = self.logits.sum() * 0.0 if self.logits.requires_grad else None

    def samples(self) -> Iterator[tuple[TrainItem, torch.Tensor]]:
        return iter(list(zip(self.group, self.per)))

    def add_loss(self, loss: torch.Tensor) -> None:
        self.total = self.total + loss

    def backward(self) -> None:
        if self.total is not None:
            # FSDP averages gradients over ranks (a plain sum needs PREMUL_SUM, which gloo lacks): scaling by the
            # world size turns that average back into the sum of the ranks' partial losses.
            (self.total * self.world).backward()
        del self.logits, self.per, self.total


class FSDPRunner:
    """This rank's part of a step (see the module docstring); every rank must call the same methods."""

    def __init__(self, device: torch.device):
        self.rank, self.world, self.device = dist.get_rank(), dist.get_world_size(), device

    def shard(self, n: int) -> list[int]:
        return list(range(self.rank, n, self.world))

    def rounds(self, micro_batches: int) -> int:
        count = torch.tensor([micro_batches], dtype=torch.long, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        return int(count.item())

    def forward(self, model: torch.nn.Module, group: list[TrainItem], *, checkpointing: str = "off") -> _RootForward:
        # Activation recomputation is not combined with FSDP's units here: ``checkpointing`` is ignored.
        return _RootForward(model, group, self.device, self.world)

    def gather(self, obj: Any) -> list[Any]:
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, obj)
        return parts
