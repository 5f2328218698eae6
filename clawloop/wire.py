"""The JSON form of a leased sample and its turn, as the trainer routes send it and a remote trainer reads it.

It sits beside the records it encodes (``clawloop.store``) so that both ends, the API's trainer routes and
``clawloop.trainer.remote``, import it from below. Teacher targets travel as base64 safetensors, so their
tensors arrive bit-for-bit as stored.
"""

from __future__ import annotations

import base64
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from clawloop.store import SampleRecord, TurnRecord


def encode_tensors(tensors: dict[str, torch.Tensor] | None) -> str | None:
    if tensors is None:
        return None
    return base64.b64encode(st_save({k: v.contiguous() for k, v in tensors.items()})).decode("ascii")


def decode_tensors(text: str | None) -> dict[str, torch.Tensor] | None:
    if text is None:
        return None
    return st_load(base64.b64decode(text))


def sample_to_json(sample: SampleRecord, turn: TurnRecord) -> dict[str, Any]:
    return {
        "turn_id": sample.turn_id,
        "session_id": turn.session_id,
        "turn_index": turn.turn_index,
        "messages": turn.messages,
        "tools": turn.tools,
        "prompt_ids": list(turn.prompt_ids),
        "response_ids": list(turn.response_ids),
        "logprobs": list(turn.logprobs),
        "temperature": turn.temperature,
        "top_p": turn.top_p,
        "policy_version": turn.policy_version,
        "response_text": turn.response_text,
        "reward": sample.reward,
        "kind": sample.kind,
        "hints": list(sample.hints),
        "teacher_version": sample.teacher_version,
        "info": sample.info,
        "targets": encode_tensors(sample.targets),
    }


def sample_from_json(d: dict[str, Any], lease_id: str = "") -> tuple[SampleRecord, TurnRecord]:
    turn = TurnRecord(session_id=d["session_id"], turn_index=int(d["turn_index"]), messages=d["messages"],
                      tools=d.get("tools"), prompt_ids=[int(x) for x in d["prompt_ids"]],
                      response_ids=[int(x) for x in d["response_ids"]], logprobs=[float(x) for x in d["logprobs"]],
                      temperature=float(d["temperature"]), top_p=float(d["top_p"]),
                      policy_version=int(d["policy_version"]), response_text=d.get("response_text", ""),
                      id=int(d["turn_id"]), state="leased")
    sample = SampleRecord(turn_id=int(d["turn_id"]), reward=float(d["reward"]), kind=d["kind"],
                          hints=list(d["hints"]), targets=decode_tensors(d.get("targets")),
                          teacher_version=int(d.get("teacher_version", 0)), info=dict(d.get("info") or {}),
                          state="leased", lease_id=lease_id)
    return sample, turn
