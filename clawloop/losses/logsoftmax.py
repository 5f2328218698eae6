"""log softmax(logits / τ) gathered at a few ids per position, memory-bounded: the only code that touches [T, V].

Every current log-prob the objectives need comes from ONE log-softmax per position, computed block by block over
positions inside a custom autograd Function: the forward gathers the N ids each objective needs and keeps nothing
[T, V]-sized; the backward recomputes each block's softmax and writes the gradient straight into a single [T, V]
buffer. Peak extra memory is one [T, V] gradient plus one block (about 1.1x a float32 [T, V] tensor at
V = 151,936; benchmarks/losses.py), never a copy of the logits per top-k column. Computed in float32 (float64 for
float64 logits) whatever the logits' dtype. Logits must be finite.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Elements of one [chunk, V] working block in the chunked log-softmax (16 MB in float32): small enough for the
# allocator to reuse the same memory block after block instead of mapping fresh pages each time.
CHUNK_ELEMENTS = 1 << 22


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_tokens(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        return chunk_tokens
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _scaled_block(block: Tensor, inv_temperature: float, cdtype: torch.dtype) -> Tensor:
    """logits/τ for one [chunk, V] block in the compute dtype; the block itself (no copy) when nothing changes.

    Never modified in place by the callers, so returning the caller's own rows is safe.
    """
    if block.dtype != cdtype:
        block = block.to(cdtype)
        return block.mul_(inv_temperature) if inv_temperature != 1.0 else block
    return block * inv_temperature if inv_temperature != 1.0 else block


class _LogSoftmaxGather(torch.autograd.Function):
    """ℓ[t, n] = log softmax(logits[t] / τ)[ids[t, n]], and optionally the entropy H[t] of softmax(logits[t] / τ).

    Forward and backward walk over blocks of positions with the fused log_softmax / softmax kernels, so only a
    [chunk, V] block is ever materialised besides the [T, V] gradient the caller needs anyway. The backward
    recomputes the block's softmax instead of keeping anything [T, V] alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits_T_V: Tensor, ids_T_N: Tensor, inv_temperature: float, chunk: int,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        T = logits_T_V.shape[0]
        cdtype = _compute_dtype(logits_T_V.dtype)
        picked_T_N = torch.empty(ids_T_N.shape, dtype=cdtype, device=logits_T_V.device)
        entropy_T = torch.zeros(T, dtype=cdtype, device=logits_T_V.device)
        for start in range(0, T, chunk):
            stop = min(T, start + chunk)
            logp = torch.log_softmax(_scaled_block(logits_T_V[start:stop], inv_temperature, cdtype), dim=-1)
            picked_T_N[start:stop] = logp.gather(1, ids_T_N[start:stop])
            if with_entropy:
                p_log_p = torch.exp(logp).mul_(logp)
                entropy_T[start:stop] = -p_log_p.sum(-1)
                del p_log_p
            del logp
        ctx.save_for_backward(logits_T_V, ids_T_N, entropy_T)
        ctx.inv_temperature = inv_temperature
        ctx.chunk = chunk
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return picked_T_N, entropy_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_picked_T_N: Tensor | None, grad_entropy_T: Tensor | None):
        logits_T_V, ids_T_N, entropy_T = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_picked_T_N is None and grad_entropy_T is None):
            return None, None, None, None, None
        T = logits_T_V.shape[0]
        cdtype = entropy_T.dtype
        inv_t = ctx.inv_temperature
        if grad_picked_T_N is None:
            grad_picked_T_N = torch.zeros(ids_T_N.shape, dtype=cdtype, device=logits_T_V.device)
        # d/dlogits = (1/τ)·d/dx with x = logits/τ, folded into the per-row coefficients.
        scaled_picked_T_N = grad_picked_T_N.to(cdtype) * inv_t
        neg_total_T_1 = -scaled_picked_T_N.sum(-1, keepdim=True)
        use_entropy = ctx.with_entropy and grad_entropy_T is not None
        if use_entropy:
            scaled_entropy_T_1 = grad_entropy_T.to(cdtype).unsqueeze(-1) * inv_t
        grad_T_V = torch.empty(logits_T_V.shape, dtype=logits_T_V.dtype, device=logits_T_V.device)
        direct = grad_T_V.dtype == cdtype
        for start in range(0, T, ctx.chunk):
            stop = min(T, start + ctx.chunk)
            x = _scaled_block(logits_T_V[start:stop], inv_t, cdtype)
            out = grad_T_V[start:stop]
            # dℓ[n]/dx_v = 1[v = id_n] − p_v  ;  dH/dx_v = −p_v (log p_v + H)
            if use_entropy:
                logp = torch.log_softmax(x, dim=-1)
                p = torch.exp(logp)
                coef = logp.add_(entropy_T[start:stop, None]).mul_(scaled_entropy_T_1[start:stop])
                coef.sub_(neg_total_T_1[start:stop])
                g = p.mul_(coef).neg_()
                del logp, coef
            else:
                p = torch.softmax(x, dim=-1)
                if direct:
                    torch.mul(p, neg_total_T_1[start:stop], out=out)
                    g = out
                else:
                    g = p.mul_(neg_total_T_1[start:stop])
            g.scatter_add_(1, ids_T_N[start:stop], scaled_picked_T_N[start:stop].to(g.dtype))
            if g is not out:
                out.copy_(g)
            del x, p, g
        return grad_T_V, None, None, None, None


def logprobs_and_entropy(
    logits_T_V: Tensor,
    ids_T_N: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """log softmax(logits/τ) at ``ids`` ([T] or [T, N] long) and the full-vocabulary entropy H[T].

    Computed in float32 (float64 for float64 logits) whatever the logits' dtype; memory-bounded as described in
    the module docstring. With ``with_entropy=False`` the entropy is all zeros and carries no gradient.
    """
    if logits_T_V.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits_T_V.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    squeeze = ids_T_N.dim() == 1
    ids = ids_T_N[:, None] if squeeze else ids_T_N
    if ids.shape[0] != logits_T_V.shape[0]:
        raise ValueError(f"ids have {ids.shape[0]} positions but logits have {logits_T_V.shape[0]}")
    ids = ids.to(device=logits_T_V.device, dtype=torch.long)
    chunk = _chunk_tokens(logits_T_V.shape[1], chunk_tokens)
    picked, entropy_T = _LogSoftmaxGather.apply(logits_T_V, ids, 1.0 / temperature, chunk, with_entropy)
    return (picked[:, 0] if squeeze else picked), entropy_T


def logprobs_at(logits_T_V: Tensor, ids_T_N: Tensor, temperature: float = 1.0, *,
                chunk_tokens: int | None = None) -> Tensor:
    """log softmax(logits/τ) gathered at ``ids`` ([T] -> [T], [T, N] -> [T, N]), memory-bounded."""
    return logprobs_and_entropy(logits_T_V, ids_T_N, temperature, with_entropy=False, chunk_tokens=chunk_tokens)[0]

