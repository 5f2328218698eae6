"""Answers to the gate's probes and the log-probabilities the KL needs, batched by prompt length.

``probe_answers`` answers a list of prompts with a KV cache, one left-padded batch per group of similar lengths
(``length_buckets``; a prompt repeated in a batch is prefilled once) from which each row leaves as soon as its
answer ends, and returns the model's log-softmax at
every answer position from the generation's own logits. A row given uniforms (``sampling_uniforms``) is sampled
instead, at ``temperature``, by inverse transform: its token at answer position t is the first whose cumulative
probability reaches its t-th uniform. Two models given the same uniforms draw coupled answers (the same tokens
wherever their distributions barely differ), so a comparison of the reference's sampled answers with a candidate's
measures the models, not the dice. Scoring given answers under another model (the reference) is
``clawloop.gate.scoring``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from clawloop.engines.hf import cache_kwargs, trim_padding


def length_buckets(lengths: Sequence[int], *, ratio: float = 2.0, slack: int = 32) -> list[list[int]]:
    """Indices of ``lengths`` grouped for batching: sorted by length, a new group starts where a length exceeds
    ``ratio`` × the group's shortest + ``slack``. One batch padded to its longest prompt would make twenty
    40-token probes pay for a 200-token recent prompt (measured on the CPU default: 46 s for one batch against 32 s
    for two); a batch per prompt would pay the per-token decoding overhead once per prompt."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= ratio * lengths[groups[-1][0]] + slack:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def sampling_uniforms(key: str, index: int, tokens: int) -> torch.Tensor:
    """The uniforms of the ``index``-th sampled answer to the prompt named ``key``, one per answer token: the same
    on every call, whatever else is in the batch, so every model asked that prompt draws with the same dice."""
    digest = hashlib.blake2b(f"{key}\0{index}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2 ** 63 - 1))
    return torch.rand(tokens, generator=generator, dtype=torch.float64)


@torch.no_grad()
def probe_answers(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int | Sequence[int],
                   eos_ids: list[int], *,
                   batches: Callable[[Sequence[int]], list[list[int]]] = length_buckets,
                   uniforms: Sequence[torch.Tensor | None] | None = None, temperature: float = 1.0,
                   done: Sequence[Callable[[list[int]], bool] | None] | None = None,
                   sampled_logprobs: list[list[float]] | None = None,
                   ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of ``prompts`` (one left-padded batch with a KV cache per group of ``batches``, by
    default ``length_buckets``, decoded only for the rows still answering), each cut before its first end-of-turn
    token or after ``max_tokens`` (one cap for all, or one per prompt), and the
    model's log-softmax ``[T, V]`` at each answer position (read from the generation's own logits, so no second
    forward is needed). A prompt whose entry in ``uniforms`` is a tensor (``sampling_uniforms``, at least its cap
    long) is sampled at ``temperature`` instead, and its log-softmax is not kept (an empty ``[0, V]``): the KL is
    measured on greedy answers only, and keeping ``[T, V]`` rows for many sampled answers would cost more memory
    than the check's model. A prompt whose entry in ``done`` is a function ends its answer as soon as that function
    says the tokens so far settle it (a knowledge probe's answer once it names the fact). ``sampled_logprobs``, when
    given, receives one list per prompt: a sampled answer's tokens' log-probs at ``temperature`` (the sampling
    distribution's), then, where it ended by sampling an end-of-turn token, that token's (so one more than the
    answer has tokens); empty for a greedy answer."""
    caps = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else [int(c) for c in max_tokens]
    dice = list(uniforms) if uniforms is not None else [None] * len(prompts)
    if any(u is not None and len(u) < cap for u, cap in zip(dice, caps)):
        raise ValueError("a sampled prompt needs one uniform per answer token it may write (its cap)")
    if any(u is not None for u in dice) and not temperature > 0:
        raise ValueError(f"sampling needs a temperature > 0, got {temperature}")
    settled = list(done) if done is not None else [None] * len(prompts)
    answers: list[list[int]] = [[] for _ in prompts]
    logprobs: list[torch.Tensor] = [torch.zeros(0) for _ in prompts]
    chosen: list[list[float]] = [[] for _ in prompts]
    for group in batches([len(p) for p in prompts]):
        group_answers, group_logprobs, group_chosen = _decode_batch(
            model, [prompts[i] for i in group], [caps[i] for i in group], eos_ids, [dice[i] for i in group],
            temperature, [settled[i] for i in group])
        for i, a, lp, c in zip(group, group_answers, group_logprobs, group_chosen):
            answers[i], logprobs[i], chosen[i] = a, lp, c
    if sampled_logprobs is not None:
        sampled_logprobs[:] = chosen
    return answers, logprobs


def _decode_batch(model: torch.nn.Module, prompts: list[list[int]], caps: list[int], eos_ids: list[int],
                  uniforms: list[torch.Tensor | None], temperature: float,
                  done: list[Callable[[list[int]], bool] | None],
                  ) -> tuple[list[list[int]], list[torch.Tensor], list[list[float]]]:
    """One left-padded prefill, then one forward per token for the rows still answering: a row that wrote an
    end-of-turn token (or its cap of tokens) leaves the batch and its KV cache at once, and leading cache columns
    that are padding for every row left are dropped. On a CPU a decoding step costs nearly the same for 8 rows as
    for 28 (the weights are read once per step either way), so probes with different caps share one batch rather
    than each cap paying for its own steps; rows leaving early save the rest."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    eos = set(eos_ids)
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    pad = eos_ids[0] if eos_ids else 0
    # A prompt asked several times (a knowledge probe's sampled answers) is prefilled once and its KV cache
    # repeated: 136 knowledge rows of ~41 prompt tokens took 8 s of prefill, their 17 prompts 1 s (2 CPU threads).
    distinct: dict[tuple[int, ...], int] = {}
    row_of_B = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
    unique = [list(p) for p in distinct]
    ids_U_L = torch.tensor([[pad] * (width - len(p)) + p for p in unique], dtype=torch.long, device=device)
    mask_U_L = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in unique], dtype=torch.long,
                            device=device)
    pos_U_L = (mask_U_L.cumsum(dim=1) - 1).clamp(min=0)
    cache = DynamicCache()
    answers: list[list[int]] = [[] for _ in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    chosen: list[list[float]] = [[] for _ in prompts]  # a sampled answer's log-probs at the temperature
    live = list(range(len(prompts)))  # prompt index of each row of the running batch
    logits_U_V = model(input_ids=ids_U_L, attention_mask=mask_U_L, position_ids=pos_U_L, logits_to_keep=1,
                       **cache_kwargs(model, cache)).logits[:, -1, :]
    if len(unique) < len(prompts):
        repeat_B = torch.tensor(row_of_B, dtype=torch.long, device=device)
        cache.batch_select_indices(repeat_B)
        logits_B_V, mask_B_L = logits_U_V[repeat_B], mask_U_L[repeat_B]
    else:
        logits_B_V, mask_B_L = logits_U_V, mask_U_L
    pos_B = torch.tensor(lengths, dtype=torch.long, device=device)
    for _ in range(max(caps, default=0)):
        logprobs_B_V = torch.log_softmax(logits_B_V.float(), dim=-1)
        next_B = logprobs_B_V.argmax(dim=-1)
        sampled = [b for b, i in enumerate(live) if uniforms[i] is not None]
        sampled_lp: dict[int, float] = {}
        if sampled:
            scaled_S_V = logits_B_V[sampled].float() / temperature
            tokens_S = _inverse_transform(scaled_S_V, [uniforms[live[b]][len(answers[live[b]])] for b in sampled])
            next_B[sampled] = tokens_S
            lp_S = torch.log_softmax(scaled_S_V, dim=-1).gather(1, tokens_S[:, None]).squeeze(1)
            sampled_lp = dict(zip(sampled, lp_S.tolist()))
        keep = []
        for b, (i, token) in enumerate(zip(live, next_B.tolist())):
            if token in eos or len(answers[i]) >= caps[i]:
                if token in eos and b in sampled_lp and len(answers[i]) < caps[i]:
                    chosen[i].append(sampled_lp[b])  # the end it sampled: one log-prob more than tokens
                continue
            answers[i].append(token)
            if uniforms[i] is None:
                rows[i].append(logprobs_B_V[b])
            else:
                chosen[i].append(sampled_lp[b])
            if len(answers[i]) < caps[i] and not (done[i] is not None and done[i](answers[i])):
                keep.append(b)
        if not keep:
            break
        if len(keep) < len(live):
            keep_B = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(keep_B)
            mask_B_L, pos_B, next_B = mask_B_L[keep_B], pos_B[keep_B], next_B[keep_B]
            live = [live[b] for b in keep]
            mask_B_L = trim_padding(cache, mask_B_L)
        mask_B_L = torch.nn.functional.pad(mask_B_L, (0, 1), value=1)
        logits_B_V = model(input_ids=next_B[:, None], attention_mask=mask_B_L, position_ids=pos_B[:, None],
                           **cache_kwargs(model, cache)).logits[:, -1, :]
        pos_B = pos_B + 1
    vocab = int(logits_B_V.shape[-1])
    logprobs = [torch.stack(r) if r else torch.zeros((0, vocab)) for r in rows]
    return answers, logprobs, chosen


def _inverse_transform(logits_S_V: torch.Tensor, uniforms: list[torch.Tensor]) -> torch.Tensor:
    """Per row, the first token whose cumulative probability reaches the row's uniform (scaled by the row's total,
    so that a float sum just under 1 never runs past the vocabulary)."""
    cdf_S_V = torch.softmax(logits_S_V, dim=-1).double().cumsum(dim=-1)
    u_S = torch.stack(uniforms).to(cdf_S_V.device) * cdf_S_V[:, -1]
    return torch.searchsorted(cdf_S_V, u_S[:, None]).squeeze(1).clamp(max=cdf_S_V.shape[-1] - 1)
