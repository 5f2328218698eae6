"""Scoring given answers under a model: the log-probabilities the gate's KL and preference reading need.

``answer_logprobs`` returns the model's log-softmax ``[T, V]`` at the positions that predict each answer token,
``answer_logprob_sums`` each answer's summed log-probability (the preference check's implicit reward). Without
kept prompt states each runs one right-padded forward per ``length_buckets`` group of whole (prompt + answer)
lengths; with them, rows are grouped by answer length and the forward runs over the answers alone.

The gate scores with one model again and again: the starting weights, which never change, reading new answers
to the same prompts (its 20 shipped probes every check; a run's recent prompts for as long as they stay recent).
``PromptStates`` keeps, per prompt, that model's KV cache and last hidden state, so a forward runs over the
answers alone, attending to the kept prompt: the prompt tokens are most of what a probe's forward reads (a recent
prompt's closing exchanges run to a few hundred tokens, its answer to 64). Kept states are valid only for the
model that made them, so a caller that scores with a model whose weights change passes none. They are bounded by
their prompt tokens, also within a call: a prompt is kept only where it fits beside the prompts the call uses,
the least recently used others dropped first, and a prompt that does not fit is scored as without states. Both
ways compute the same values up to float rounding (another batch make-up and attention length: within 1e-4 in a
float32 log-probability, tested; the trainer's reference is float32, and in bfloat16 the rounding is coarser).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from clawloop.engines.head import logit_softcap, soft_capped
from clawloop.engines.hf import cache_kwargs
from clawloop.gate.generation import length_buckets


@dataclass
class _PromptState:
    keys_1_K_L_D: list[torch.Tensor]
    """Per layer, the prompt's attention keys (K KV heads, L prompt tokens, D the head size)."""
    values_1_K_L_D: list[torch.Tensor]
    last_hidden_H: torch.Tensor
    """The final hidden state at the prompt's last position: what predicts an answer's first token."""


class PromptStates:
    """One model's KV cache and last hidden state per prompt, kept between calls, at most ``max_tokens`` prompt
    tokens in all at any time (least recently used dropped first); ``max_tokens = 0`` keeps nothing. Not
    thread-safe: its gate's training thread owns it (per-user trainers, which share one, take turns)."""

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = int(max_tokens)
        self._states: OrderedDict[tuple[int, ...], _PromptState] = OrderedDict()
        self.prefilled = 0
        """Prompts prefilled so far (each once while it stays kept)."""

    @property
    def tokens(self) -> int:
        """Prompt tokens kept now."""
        return sum(len(key) for key in self._states)

    def clear(self) -> None:
        """Drop every kept state (a forgotten user's prompts may be among them; the rest are made again on use)."""
        self._states.clear()

    @property
    def nbytes(self) -> int:
        """Memory the kept states take."""
        return sum(t.numel() * t.element_size() for s in self._states.values()
                   for t in (*s.keys_1_K_L_D, *s.values_1_K_L_D, s.last_hidden_H))

    def _admit(self, wanted: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
        """The prompts of ``wanted`` that will be scored from kept states: those kept already, then new ones in
        order while they fit in the budget beside them; the least recently used prompts this call does not use are
        dropped to make that room."""
        wanted = list(dict.fromkeys(wanted))
        use = [p for p in wanted if p in self._states]
        room = self.max_tokens - sum(len(p) for p in use)
        for p in wanted:
            if p not in self._states and len(p) <= room:
                use.append(p)
                room -= len(p)
        chosen = set(use)
        needed = self.max_tokens - room  # every chosen prompt's tokens
        others = self.tokens - sum(len(p) for p in use if p in self._states)
        for p in list(self._states):  # least recently used first
            if needed + others <= self.max_tokens:
                break
            if p not in chosen:
                del self._states[p]
                others -= len(p)
        return chosen

    @torch.no_grad()
    def _fill(self, model: torch.nn.Module, prompts: list[tuple[int, ...]]) -> None:
        """Prefill the prompts not kept yet, one left-padded batch per length group."""
        missing = list(dict.fromkeys(p for p in prompts if p not in self._states))
        decoder = model.get_decoder()
        device = next(model.parameters()).device
        from transformers import DynamicCache

        for group in length_buckets([len(p) for p in missing]):
            rows = [missing[i] for i in group]
            width = max(len(p) for p in rows)
            ids_B_L = torch.tensor([[0] * (width - len(p)) + list(p) for p in rows], dtype=torch.long, device=device)
            mask_B_L = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], dtype=torch.long,
                                    device=device)
            pos_B_L = (mask_B_L.cumsum(dim=1) - 1).clamp(min=0)
            cache = DynamicCache()
            hidden_B_L_H = decoder(input_ids=ids_B_L, attention_mask=mask_B_L, position_ids=pos_B_L,
                                   **cache_kwargs(decoder, cache))[0]
            for b, p in enumerate(rows):
                start = width - len(p)
                # Copies, so that the batch's tensors are freed with the batch.
                self._states[p] = _PromptState(
                    keys_1_K_L_D=[layer.keys[b:b + 1, :, start:, :].clone() for layer in cache.layers],
                    values_1_K_L_D=[layer.values[b:b + 1, :, start:, :].clone() for layer in cache.layers],
                    last_hidden_H=hidden_B_L_H[b, -1].clone())
            self.prefilled += len(rows)

    @torch.no_grad()
    def answer_logprobs(self, model: torch.nn.Module, prompts: list[list[int]],
                        answers: list[list[int]]) -> list[torch.Tensor]:
        """As the module's ``answer_logprobs``, the prompts' states kept (made where missing) and each forward run
        over the answers only; prompts that do not fit in ``max_tokens`` are scored without."""
        prompt_ids = [tuple(p) for p in prompts]
        use = self._admit([prompt_ids[i] for i in range(len(prompts)) if answers[i]])
        kept = [i for i in range(len(prompts)) if answers[i] and prompt_ids[i] in use]
        self._fill(model, [prompt_ids[i] for i in kept])
        for i in kept:
            self._states.move_to_end(prompt_ids[i])
        head = model.get_output_embeddings()
        # An empty answer needs no forward; its rows are empty as the plain forward's would be.
        out: list[torch.Tensor] = [torch.zeros((0, head.weight.shape[0]), device=head.weight.device)
                                   for _ in prompts]
        for group in self._batches([len(prompt_ids[i]) for i in kept], [len(answers[i]) for i in kept]):
            rows = [kept[j] for j in group]
            for i, lp in zip(rows, self._from_states(model, [self._states[prompt_ids[i]] for i in rows],
                                                     [len(prompt_ids[i]) for i in rows],
                                                     [answers[i] for i in rows])):
                out[i] = lp
        done = set(kept)
        rest = [i for i in range(len(prompts)) if i not in done and answers[i]]
        for i, lp in zip(rest, _plain_logprobs(model, [prompts[i] for i in rest], [answers[i] for i in rest])):
            out[i] = lp
        return out

    def _batches(self, prompt_lengths: list[int], answer_lengths: list[int]) -> list[list[int]]:
        """Indices grouped for ``_from_states``: by answer length (``length_buckets``: a row's cost is its
        group's longest answer, so a 5-token answer must not pay for a 64-token one), then, by prompt length, into
        batches whose padded copy of their kept caches (rows × longest prompt) is at most the budget's size or
        one prompt's, so the copy stays within what the kept states themselves may take."""
        cap = max([self.max_tokens, *prompt_lengths])
        batches: list[list[int]] = []
        for group in length_buckets(answer_lengths):
            start = len(batches)
            for i in sorted(group, key=lambda i: prompt_lengths[i]):
                if len(batches) > start and (len(batches[-1]) + 1) * prompt_lengths[i] <= cap:
                    batches[-1].append(i)
                else:
                    batches.append([i])
        return batches

    def _from_states(self, model: torch.nn.Module, states: list[_PromptState], prompt_lengths: list[int],
                     answers: list[list[int]]) -> list[torch.Tensor]:
        """One batch: the kept prompt caches left-padded to the longest, the answers (but their last token, which
        predicts nothing asked for) right-padded after them."""
        from transformers import DynamicCache

        device = next(model.parameters()).device
        head = model.get_output_embeddings()
        width = max(prompt_lengths)
        steps = max(len(a) for a in answers) - 1
        hidden_B_T_H = None
        if steps > 0:
            cache = DynamicCache()
            pad = [(0, 0, width - n, 0) for n in prompt_lengths]  # left, along the prompt tokens
            for layer in range(len(states[0].keys_1_K_L_D)):
                cache.update(torch.cat([torch.nn.functional.pad(s.keys_1_K_L_D[layer], p)
                                        for s, p in zip(states, pad)]),
                             torch.cat([torch.nn.functional.pad(s.values_1_K_L_D[layer], p)
                                        for s, p in zip(states, pad)]),
                             layer)
            ids_B_T = torch.zeros((len(answers), steps), dtype=torch.long, device=device)
            answer_mask_B_T = torch.zeros((len(answers), steps), dtype=torch.long, device=device)
            for b, a in enumerate(answers):
                ids_B_T[b, :len(a) - 1] = torch.tensor(a[:-1], dtype=torch.long)
                answer_mask_B_T[b, :len(a) - 1] = 1
            prompt_mask_B_L = torch.tensor([[0] * (width - n) + [1] * n for n in prompt_lengths], dtype=torch.long,
                                           device=device)
            pos_B_T = (torch.tensor(prompt_lengths, dtype=torch.long, device=device)[:, None]
                       + torch.arange(steps, device=device))
            decoder = model.get_decoder()
            hidden_B_T_H = decoder(input_ids=ids_B_T, attention_mask=torch.cat([prompt_mask_B_L, answer_mask_B_T], 1),
                                   position_ids=pos_B_T, **cache_kwargs(decoder, cache))[0]
        out = []
        for b, (s, a) in enumerate(zip(states, answers)):
            rows_T_H = s.last_hidden_H[None]
            if hidden_B_T_H is not None and len(a) > 1:
                rows_T_H = torch.cat([rows_T_H, hidden_B_T_H[b, :len(a) - 1]])
            out.append(torch.log_softmax(soft_capped(head(rows_T_H).float(), logit_softcap(model)), dim=-1))
        return out


@torch.no_grad()
def answer_logprobs(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]], *,
                    states: PromptStates | None = None) -> list[torch.Tensor]:
    """Log-softmax ``[T, V]`` at the positions that predict each answer token (a right-padded forward per
    ``length_buckets`` group; with ``states``, kept for ``model``, over the answers alone)."""
    if states is not None and states.max_tokens > 0:
        return states.answer_logprobs(model, prompts, answers)
    return _plain_logprobs(model, prompts, answers)


@torch.no_grad()
def answer_logprob_sums(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]], *,
                        states: PromptStates | None = None) -> list[float]:
    """Each answer's summed log-probability given its prompt (``answer_logprobs`` gathered at the answer's own
    tokens, one length group at a time, so no ``[T, V]`` row outlives its group)."""
    out = [0.0 for _ in prompts]
    # After kept states a row costs its answer alone, so its group is its answer length's (as the states batch it).
    kept = states is not None and states.max_tokens > 0
    for group in length_buckets([len(a) if kept else len(p) + len(a) for p, a in zip(prompts, answers)]):
        rows = answer_logprobs(model, [prompts[i] for i in group], [answers[i] for i in group], states=states)
        for i, lp_T_V in zip(group, rows):
            out[i] = summed_logprob(lp_T_V, answers[i])
    return out


def summed_logprob(logprobs_T_V: torch.Tensor, ids: Sequence[int]) -> float:
    """An answer's summed log-probability from its ``[T, V]`` log-softmax rows (on whatever device they are)."""
    if not ids:
        return 0.0
    index_T = torch.tensor(list(ids), dtype=torch.long, device=logprobs_T_V.device)
    return float(logprobs_T_V.gather(1, index_T.view(-1, 1)).sum())


def _plain_logprobs(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = [torch.zeros(0) for _ in prompts]
    for group in length_buckets([len(p) + len(a) for p, a in zip(prompts, answers)]):
        for i, lp in zip(group, _plain_batch(model, [prompts[i] for i in group], [answers[i] for i in group])):
            out[i] = lp
    return out


def _plain_batch(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    seqs = [p + a for p, a in zip(prompts, answers)]
    width = max(len(x) for x in seqs)
    ids_B_L = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    mask_B_L = torch.zeros((len(seqs), width), dtype=torch.long, device=device)
    for i, x in enumerate(seqs):
        ids_B_L[i, :len(x)] = torch.tensor(x, dtype=torch.long)
        mask_B_L[i, :len(x)] = 1
    hidden_B_L_H = model.get_decoder()(input_ids=ids_B_L, attention_mask=mask_B_L, use_cache=False)[0]
    head = model.get_output_embeddings()
    out = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        logits_T_V = soft_capped(head(hidden_B_L_H[i, len(p) - 1:len(p) - 1 + len(a)]).float(), logit_softcap(model))
        out.append(torch.log_softmax(logits_T_V, dim=-1))
    return out
