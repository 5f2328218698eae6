"""An OpenClaw configuration generated from what clawloop really serves (``clawloop openclaw-config``).

The context window and the served model name come from a running clawloop server (``GET /v1/models`` reports
``max_model_len``, the engine's real context: the model's position limit, or vLLM's ``max_model_len``) or, with
no server, from the model folder's ``max_position_embeddings``. So the numbers OpenClaw plans with cannot drift
from the model.

Why each agent default (measured with OpenClaw 2026.9.6, see docs/openclaw.md): stock OpenClaw's first prompt is
about 12.9k SmolLM2 tokens (workspace files injected into the system prompt, the skills list, 12 tools), larger
than an 8k context. ``contextInjection: "never"`` and ``skills: []`` drop the workspace files and skills list,
``tools.profile: "minimal"`` keeps three tool-search tools: about 2.9k tokens. ``lean = False`` keeps OpenClaw's
own defaults for models with a large context.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from clawloop.atomic import write_text_atomically

PROVIDER_ID = "clawloop"
LEAN_PROMPT_TOKENS = 2900
"""Size of OpenClaw 2026.9.6's first prompt with the lean defaults (SmolLM2 tokenizer), measured."""
STOCK_PROMPT_TOKENS = 12915
"""Size of its first prompt with OpenClaw's own defaults, measured."""


class OpenClawConfigError(RuntimeError):
    """The limits could not be read, or no useful configuration fits them."""


@dataclass(frozen=True)
class ServedLimits:
    base_url: str
    """Base URL OpenClaw should call, ending in /v1."""
    model_name: str
    context: int
    """Tokens of prompt + completion the server accepts."""


def limits_from_server(url: str, api_key: str = "", timeout_s: float = 10.0) -> ServedLimits:
    """Ask a running clawloop server (``url`` with or without the trailing /v1)."""
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base + "/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise OpenClawConfigError(f"cannot reach {base}/models: {exc}") from None
    if r.status_code != 200:
        raise OpenClawConfigError(f"{base}/models answered {r.status_code}: {r.text[:200]}")
    data = r.json().get("data") or []
    if not data or not data[0].get("max_model_len"):
        raise OpenClawConfigError(f"{base}/models does not report max_model_len (not a clawloop server?)")
    return ServedLimits(base, str(data[0]["id"]), int(data[0]["max_model_len"]))


def limits_from_model(model: str, host: str, port: int, served_model_name: str) -> ServedLimits:
    """Without a server: the context is the model folder's position limit."""
    from clawloop.engines.model_files import resolve_model

    config = json.loads((resolve_model(model) / "config.json").read_text())
    context = int(config.get("max_position_embeddings") or 0)
    if context <= 0:
        raise OpenClawConfigError(f"model {model!r} names no max_position_embeddings; start the server and use --url")
    return ServedLimits(f"http://{host}:{port}/v1", served_model_name, context)


def max_tokens_for(context: int, wanted: int) -> int:
    """Completion budget: what was asked, but never more than a quarter of the context."""
    return max(16, min(wanted, context // 4))


def plugin_dir(path: str) -> Path:
    """The clawloop OpenClaw plugin folder (``integrations/openclaw/plugin`` in the repository), absolute."""
    folder = Path(path).expanduser().resolve()
    if not (folder / "openclaw.plugin.json").is_file():
        raise OpenClawConfigError(f"{folder} is not the clawloop OpenClaw plugin (no openclaw.plugin.json)")
    return folder


def build_config(limits: ServedLimits, max_tokens: int = 512, lean: bool = True,
                 api_key_ref: str = "${CLAWLOOP_API_KEY}", timeout_s: int = 600,
                 plugin: Path | None = None) -> dict[str, Any]:
    """The OpenClaw config (JSON; OpenClaw reads JSON5, so plain JSON works) for one clawloop server. With
    ``plugin`` OpenClaw loads clawloop's plugin from that folder (what ``openclaw plugins install --link`` writes)."""
    room = limits.context - max_tokens_for(limits.context, max_tokens)
    needed = LEAN_PROMPT_TOKENS if lean else STOCK_PROMPT_TOKENS
    if room < needed:
        raise OpenClawConfigError(
            f"the served context ({limits.context} tokens) leaves {room} tokens for OpenClaw's prompt, which "
            f"takes about {needed} tokens{' even with the lean settings' if lean else ''}; serve a model with a "
            f"longer context" + ("" if lean else " or drop --full"))
    model = {"id": limits.model_name, "name": "clawloop policy", "contextWindow": limits.context,
             "maxTokens": max_tokens_for(limits.context, max_tokens)}
    config: dict[str, Any] = {
        "models": {"providers": {PROVIDER_ID: {
            "baseUrl": limits.base_url, "apiKey": api_key_ref, "api": "openai-completions",
            "models": [model], "timeoutSeconds": timeout_s}}},
        "agents": {"defaults": {"model": {"primary": f"{PROVIDER_ID}/{limits.model_name}"}}},
    }
    if lean:
        config["agents"]["defaults"].update({"contextInjection": "never", "skills": []})
        config["tools"] = {"profile": "minimal"}
    if plugin is not None:
        config["plugins"] = {"load": {"paths": [str(plugin)]}, "entries": {PROVIDER_ID: {"enabled": True}}}
    return config


def write_config(config: dict[str, Any], path: Path) -> None:
    """Write atomically: OpenClaw may read the file at any moment, and a half-written config is an invalid one."""
    write_text_atomically(path, json.dumps(config, indent=2) + "\n")
