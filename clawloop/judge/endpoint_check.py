"""Start-up's look at the judge endpoint (``judge_url``): stop on settings that cannot work, warn on the rest.

A wrong key or a wrong path never heals, and without this check every turn would end as ``judge_failed`` with
nothing said at start. A judge that is slow, down or overloaded may come back, and the pipeline retries each
vote, so serving starts anyway with a warning. Concretely, ``check_judge_endpoint``:

* asks ``GET …/models`` (what the HTTP judge client asks when ``judge_model`` is empty; free, no tokens);
* 401 / 403 → ``JudgeEndpointError`` naming ``judge_api_key``;
* 404 → the path may be wrong, or the endpoint may just not list models: one chat request settles it (404 again
  → ``JudgeEndpointError`` naming ``judge_url``);
* a ``judge_model`` the listing does not name → one chat request with one token (404 → ``JudgeEndpointError``
  naming ``judge_model``; some endpoints list fewer models than they serve);
* a timeout, a refused connection, 5xx or anything else → a warning, and start-up goes on.

The messages name each setting with its command-line flag and environment variable.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from clawloop.config import Config
from clawloop.judge.client import HTTPJudgeClient

log = logging.getLogger(__name__)

MAX_CHECK_S = 10.0
"""A slow judge must not hold start-up longer than this (each request of the check)."""


class JudgeEndpointError(RuntimeError):
    """The judge endpoint answered in a way no retry will change. The message is one paragraph naming the setting
    to fix."""


def setting(name: str) -> str:
    """``name`` with the flag and the environment variable that set it."""
    return f"{name} (--{name.replace('_', '-')}, CLAWLOOP_{name.upper()})"


def check_judge_endpoint(config: Config, *, timeout_s: float | None = None) -> None:
    """Check ``config.judge_url`` once; raise ``JudgeEndpointError`` or return (module docstring)."""
    client = HTTPJudgeClient(config.judge_url, config.judge_model, config.judge_api_key)  # for its URLs only
    headers = {"Authorization": f"Bearer {config.judge_api_key}"} if config.judge_api_key else {}
    limit = min(float(config.judge_timeout_s), MAX_CHECK_S) if timeout_s is None else timeout_s
    with httpx.Client(headers=headers, timeout=limit) as http:
        listed = request(http, "GET", client.models_url)
        if listed is None:
            return
        if listed.status_code in (401, 403):
            raise refused(config, client.models_url, listed)
        if listed.status_code == 404:
            chat = request(http, "POST", client.chat_url, json={})
            if chat is not None and chat.status_code in (401, 403):
                raise refused(config, client.chat_url, chat)
            if chat is not None and chat.status_code == 404:
                raise JudgeEndpointError(
                    f"The judge endpoint has no OpenAI-compatible API at {config.judge_url}: {client.models_url} "
                    f"and {client.chat_url} both answer 404 Not Found. Set {setting('judge_url')} to the "
                    "endpoint's base URL, the part before /chat/completions (it usually ends in /v1).")
            log.warning("clawloop judge: %s answers 404 (the endpoint does not list its models); judging goes on "
                        "at %s", client.models_url, client.chat_url)
            return
        if listed.status_code != 200:
            log.warning("clawloop judge: %s answered HTTP %s at start; serving starts anyway and each vote is "
                        "retried (judge_retries)", client.models_url, listed.status_code)
            return
        if config.judge_model and config.judge_model not in model_ids(listed):
            check_model(http, config, client.chat_url)


def check_model(http: httpx.Client, config: Config, chat_url: str) -> None:
    """The listing lacks ``judge_model``: one chat request with one token says whether it is served."""
    body = {"model": config.judge_model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    chat = request(http, "POST", chat_url, json=body)
    if chat is not None and chat.status_code in (401, 403):
        raise refused(config, chat_url, chat)
    if chat is not None and chat.status_code == 404:
        raise JudgeEndpointError(
            f"The judge endpoint {config.judge_url} does not serve the model {config.judge_model!r} (HTTP 404 from "
            f"{chat_url}). Set {setting('judge_model')} to a model it lists at GET …/models, or leave it empty to "
            "use the endpoint's first model.")


def request(http: httpx.Client, method: str, url: str, **kwargs: Any) -> httpx.Response | None:
    """The response, or None (with a warning) when the endpoint cannot be reached now."""
    try:
        return http.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        log.warning("clawloop judge: the judge endpoint %s cannot be reached at start (%s: %s); serving starts "
                    "anyway and each vote is retried (judge_retries)", url, type(exc).__name__, exc)
        return None


def refused(config: Config, url: str, response: httpx.Response) -> JudgeEndpointError:
    key = "no key was sent" if not config.judge_api_key else "the key sent was refused"
    return JudgeEndpointError(
        f"The judge endpoint refused clawloop: {url} answered HTTP {response.status_code} ({key}). Set "
        f"{setting('judge_api_key')} to a key this endpoint accepts, and check that {setting('judge_url')} "
        "points at the endpoint the key belongs to.")


def model_ids(response: httpx.Response) -> set[str]:
    """The model ids of an OpenAI ``/models`` listing (empty when the body is not one)."""
    try:
        data = response.json().get("data") or []
        return {str(m["id"]) for m in data if isinstance(m, dict) and "id" in m}
    except (ValueError, AttributeError, TypeError):
        return set()
