"""A streamed request on a full disk says what a non-streamed one says: 503-class ``storage_unavailable``, not an
internal error. The disk is filled as in test_disk_full.py (a real tmpfs where it can be mounted, injected
SQLite failures elsewhere)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.security.test_disk_full import MODE, disk  # noqa: F401 - the full-disk fixture, shared

GEN = {"model": "clawloop", "max_tokens": 3, "temperature": 0.0}
LONG_TEXT = "tell me about lighthouses and the sea " * 60  # each stored turn grows the database


def _events(response: httpx.Response) -> list:
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    return [payload if payload == "[DONE]" else json.loads(payload) for payload in data]


@pytest.mark.parametrize("mode", [MODE])
def test_a_stream_that_cannot_store_its_turn_reports_storage_unavailable(make_server, disk, mode):  # noqa: F811
    srv = make_server(run_dir=disk.root / "run")
    disk.watch_store(srv.store)
    body = {**GEN, "messages": [{"role": "user", "content": LONG_TEXT}]}
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        disk.fill()
        plain = c.post("/v1/chat/completions", json=body)
        assert plain.status_code == 503
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200  # the headers went out before the turn could be stored
            events = _events(r)
        assert events[-1] == "[DONE]"
        errors = [e["error"] for e in events[:-1] if "error" in e]
        assert errors == [plain.json()["error"]]  # the same code, type and message as without streaming
        assert errors[0]["code"] == "storage_unavailable" and errors[0]["type"] == "server_error"
        assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events[:-1])
        disk.free()
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = _events(r)
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert len(srv.store.turns()) == 2  # the first request and the last; nothing of the failed ones
