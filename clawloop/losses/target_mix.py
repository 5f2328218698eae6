"""Which model the distillation target follows at each response position (``opd_target``).

The OPD branch's target is the teacher: the frozen model reading the prompt with the hint appended. On a small
model that hint carries the preference and also the model's confusion about it, everywhere in the answer: under
'Begin every answer with "In short,"' SmolLM2-135M gets 10 of 17 simple facts wrong, under "Answer in one
sentence" 2–4 (docs/publication-gate.md, "What the knowledge probes found"). A student pulled toward that
teacher at every position forgets what the teacher forgets. The preference itself lives at few positions: where
the answer opens and where it stops. So the target can be mixed per position from two rows of the same teacher,
the hinted one (q_h, the prompt with the hint) and the plain one (q_r, the stored prompt without it), both
scoring the same response:

* ``hinted`` — q_h everywhere (the original method);
* ``end`` — q_h where its most likely token ends the answer, q_r elsewhere: the preference changes where to
  stop, and nothing else;
* ``opening_end`` — ``end``, and also q_h at the opening: every position before the first one where q_h's and
  q_r's most likely tokens agree (for "In short," the first tokens, until both go on with the same answer).

Decoding the model greedily under each rule (the table in docs/publication-gate.md) bounds what a student can
reach: ``end`` follows ``brief`` on 8 of 8 held-out questions and keeps 17 of 17 facts (q_h: 13);
``opening_end`` follows ``inshort`` on 6 of 8 and keeps 15 (q_h: 7).

The rule reads each candidate's own q_h, so with several hint candidates each gets its own mix. Everything the
objective reads from a candidate (its top-K ids, their log-probs, its log-probs at the student's top-k ids) is
taken from the same row per position, so a position's target is always one whole distribution.
"""

from __future__ import annotations

import torch

from clawloop.losses.presets import OPD_TARGETS


def mixes(target: str, hinted: bool) -> bool:
    """Whether ``target`` mixes a sample's rows: a mixed target on a sample with hint candidates (an un-hinted
    sample's one row is the un-hinted prompt's already)."""
    return target != "hinted" and hinted


def hinted_positions(hinted_top_C_T: torch.Tensor, plain_top_T: torch.Tensor, end_ids: torch.Tensor,
                     target: str) -> torch.Tensor:
    """[C, T] bool: where candidate c's target is its hinted row. ``hinted_top_C_T`` is each candidate's most likely
    id per position, ``plain_top_T`` the un-hinted row's, ``end_ids`` the ids that end an answer."""
    if target not in OPD_TARGETS:
        raise ValueError(f"unknown opd_target {target!r}; expected one of {OPD_TARGETS}")
    if target == "hinted":
        return torch.ones_like(hinted_top_C_T, dtype=torch.bool)
    ends_C_T = torch.isin(hinted_top_C_T, end_ids.to(hinted_top_C_T.device))
    if target == "end":
        return ends_C_T
    agree_C_T = hinted_top_C_T == plain_top_T.unsqueeze(0)
    opening_C_T = torch.cumsum(agree_C_T.to(torch.int32), dim=-1) == 0  # before the first agreement
    return opening_C_T | ends_C_T


def mix_rows(hinted_C_T_K: torch.Tensor, plain_T_K: torch.Tensor, use_hinted_C_T: torch.Tensor) -> torch.Tensor:
    """Per candidate and position, the hinted row where ``use_hinted_C_T``, else the plain one."""
    return torch.where(use_hinted_C_T.unsqueeze(-1), hinted_C_T_K, plain_T_K.unsqueeze(0).expand_as(hinted_C_T_K))
