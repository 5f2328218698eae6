"""The sampling distribution of a decode step, shared by every engine-side computation of log-probs.

For a row of logits and settings (temperature T, top_p p):

* T == 0 is greedy: the token is the argmax of the logits and its reported log-prob comes from the plain
  ``log_softmax(logits)`` (temperature 1), the convention of OpenAI-style servers.
* T > 0: ``log_softmax(logits / T)``; then, when p < 1, only the smallest set of most likely tokens whose
  probability reaches p is kept (the top token always is) and the kept mass is renormalised. The token is
  drawn from that distribution (inverse CDF, one uniform number from the request's own ``torch.Generator``
  per token) and its log-prob is read from it,
  so reported log-probs are exactly the behaviour policy's.
"""

from __future__ import annotations

import torch


def sampling_logprobs(
    logits_B_V: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """[B, V] float32 log-probs of the distribution each row samples from (-inf outside the top-p set)."""
    logits_B_V = logits_B_V.float()
    temperature_B = temperature_B.to(logits_B_V)
    scale_B = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
    logprobs_B_V = torch.log_softmax(logits_B_V / scale_B[:, None], dim=-1)
    rows_B = (top_p_B.to(logits_B_V.device) < 1.0) & (temperature_B > 0)
    if bool(rows_B.any()):
        logprobs_B_V[rows_B] = top_p_renormalise(logprobs_B_V[rows_B], top_p_B.to(logits_B_V)[rows_B])
    return logprobs_B_V


def top_p_renormalise(logprobs_N_V: torch.Tensor, top_p_N: torch.Tensor) -> torch.Tensor:
    """Keep the nucleus of each row (mass reaching top_p, at least one token) and renormalise it."""
    sorted_N_V, order_N_V = logprobs_N_V.sort(dim=-1, descending=True)
    probs_N_V = sorted_N_V.exp()
    mass_before_N_V = probs_N_V.cumsum(dim=-1) - probs_N_V
    drop_N_V = mass_before_N_V >= top_p_N[:, None]
    drop_N_V[:, 0] = False
    sorted_N_V = sorted_N_V.masked_fill(drop_N_V, float("-inf"))
    kept_N_V = torch.full_like(logprobs_N_V, float("-inf")).scatter(-1, order_N_V, sorted_N_V)
    return torch.log_softmax(kept_N_V, dim=-1)


def choose_tokens(
    logits_B_V: torch.Tensor,
    logprobs_B_V: torch.Tensor,
    temperatures: list[float],
    generators: list[torch.Generator],
) -> torch.Tensor:
    """[B] int64: argmax for greedy rows; for the others an inverse-CDF draw from ``exp(logprobs)`` using one
    uniform number from the row's own generator (exact, and far cheaper than ``torch.multinomial`` over a
    large vocabulary). A token of probability zero can never be drawn."""
    ids_B = logits_B_V.argmax(dim=-1)
    rows = [b for b, t in enumerate(temperatures) if t > 0]
    if rows:
        device = logprobs_B_V.device
        u_N = torch.stack(
            [torch.rand((), generator=generators[b], device=device, dtype=torch.float64) for b in rows]
        )
        cdf_N_V = logprobs_B_V[rows].double().exp().cumsum(dim=-1)
        picks_N = torch.searchsorted(cdf_N_V, (u_N * cdf_N_V[:, -1])[:, None], right=True)[:, 0]
        ids_B[rows] = picks_N.clamp_max(logprobs_B_V.shape[-1] - 1)
    return ids_B


def top_alternatives(logprobs_V: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely (id, log-prob) pairs, leaving out tokens the distribution cannot produce."""
    if n <= 0:
        return []
    values_N, ids_N = logprobs_V.topk(min(n, logprobs_V.shape[-1]))
    return [(int(i), float(v)) for i, v in zip(ids_N.tolist(), values_N.tolist()) if v != float("-inf")]
