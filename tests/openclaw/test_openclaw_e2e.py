"""The real OpenClaw 2026.9.6, stock (no session headers), against ``clawloop serve`` on the tiny model: the config
comes from ``clawloop openclaw-config``, conversations are ``openclaw agent --local`` turns, and what clawloop
stored, paired, judged and trained is read back from its status and its store."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clawloop.openclaw_format import housekeeping_kind, is_ephemeral

pytestmark = pytest.mark.openclaw

ROOT = Path(__file__).resolve().parents[2]

LEAN_TURNS = ["What is the capital of France?", "Too long, answer in one sentence.", "Thanks, that's all."]
TOOLS_TURNS = ["Name three primary colors.", "Wrong, answer in one word.", "Thanks, that's all."]


def generate_config(url: str, out: Path, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "clawloop.cli", "openclaw-config", "--url", url,
                           "--max-tokens", "32", "--out", str(out), *extra], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def stored_turns(run_dir: Path) -> list[dict]:
    db = sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        rows = db.execute("SELECT id, session_id, turn_index, state, messages, next_state FROM turns ORDER BY id")
        return [{**dict(r), "messages": json.loads(r["messages"]),
                 "next_state": json.loads(r["next_state"]) if r["next_state"] else None} for r in rows]
    finally:
        db.close()


def first_user_text(turn: dict) -> str:
    return next(m["content"] for m in turn["messages"] if m["role"] == "user")


@pytest.mark.timeout(900)
def test_stock_openclaw_conversations_are_sessions_that_train(openclaw, served_tiny, tmp_path):
    lean_path = tmp_path / "lean.json"
    lean = generate_config(served_tiny.url, lean_path)
    model = lean["models"]["providers"]["clawloop"]["models"][0]
    assert model["contextWindow"] == 8192 and model["maxTokens"] == 32
    assert lean["models"]["providers"]["clawloop"]["baseUrl"] == served_tiny.url + "/v1"

    # OpenClaw's default tools (they add the internal-context message), and compaction forced on every turn so
    # OpenClaw's housekeeping requests (compaction summaries, memory flush) happen within three turns.
    tools = json.loads(json.dumps(lean))
    del tools["tools"]
    tools["agents"]["defaults"]["compaction"] = {"maxActiveTranscriptBytes": 3000,
                                                 "memoryFlush": {"forceFlushTranscriptBytes": 2000}}
    tools_path = tmp_path / "tools.json"
    tools_path.write_text(json.dumps(tools, indent=2))

    for path in (lean_path, tools_path):  # OpenClaw itself accepts both configs
        proc = openclaw.run(path, "config", "validate", "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout)["valid"] is True, proc.stdout + proc.stderr

    for text in LEAN_TURNS:
        out = openclaw.agent_turn(lean_path, "ocl-lean", text)
        assert out["meta"]["agentMeta"]["usage"]["input"] > 1000  # OpenClaw's whole prompt reached the model
    for text in TOOLS_TURNS:
        openclaw.agent_turn(tools_path, "ocl-tools", text)

    turns = stored_turns(served_tiny.run_dir)
    context = f"server log:\n{served_tiny.log_tail()}\nopenclaw:\n" + "\n".join(openclaw.log[-3:])
    # Nothing OpenClaw did for itself was stored: no housekeeping turn, no ephemeral message in a next state.
    assert all(housekeeping_kind(t["messages"]) == "" for t in turns), context
    assert all(not is_ephemeral(m) for t in turns for m in (t["next_state"] or [])), context
    # Housekeeping happened and was served as side turns (the test sent no side request itself).
    metrics = served_tiny.get("/metrics").text
    side = [line for line in metrics.splitlines()
            if line.startswith('clawloop_served_turns_total{stored="false",turn_type="side"}')]
    assert side and float(side[0].split()[-1]) >= 1, metrics
    # The default-tools conversation really carried OpenClaw's internal-context message.
    by_session: dict[str, list[dict]] = {}
    for t in turns:
        by_session.setdefault(t["session_id"], []).append(t)
    assert len(by_session) == 2, ([(t["session_id"], first_user_text(t)[:80]) for t in turns], context)
    lean_turns, tools_turns = sorted(by_session.values(), key=lambda ts: ts[0]["id"])
    assert any(is_ephemeral(t["messages"][-1]) for t in tools_turns)
    for conv, texts in ((lean_turns, LEAN_TURNS), (tools_turns, TOOLS_TURNS)):
        assert [t["turn_index"] for t in conv] == list(range(len(conv))) and len(conv) >= 3
        users = [t["messages"][-1 if not is_ephemeral(t["messages"][-1]) else -2]["content"] for t in conv]
        assert all(x in u for u, x in zip(users, texts)), users  # the first one has OpenClaw's Runtime line
        # Each turn's next state is the user's following message (OpenClaw's timestamp envelope included).
        for turn, nxt in zip(conv[:2], texts[1:]):
            assert turn["next_state"] and turn["next_state"][-1]["content"].endswith(nxt), turn["next_state"]

    # The rules judge reads the feedback; two samples make an optimizer step.
    deadline = time.monotonic() + 300
    status = served_tiny.get("/v1/status").json()
    while status["last_step"] is None and time.monotonic() < deadline:
        time.sleep(2)
        status = served_tiny.get("/v1/status").json()
    assert sum(status["samples_by_state"].values()) >= 2, (status, context)
    assert status["last_step"] is not None and status["last_step"]["step"] >= 1, (status, context)


@pytest.mark.timeout(600)
def test_openclaw_with_the_clawloop_plugin_names_its_sessions(openclaw, served_tiny, tmp_path):
    """With integrations/openclaw/plugin loaded, every request carries OpenClaw's own session id: the turns are
    stored under it (stock OpenClaw's would get a generated sess_... id)."""
    path = tmp_path / "plugin.json"
    config = generate_config(served_tiny.url, path, "--plugin", str(ROOT / "integrations" / "openclaw" / "plugin"))
    assert config["plugins"]["entries"]["clawloop"]["enabled"] is True
    for text in LEAN_TURNS[:2]:
        openclaw.agent_turn(path, "ocl-plugin", text)
    turns = [t for t in stored_turns(served_tiny.run_dir) if t["session_id"] == "ocl-plugin"]
    assert [t["turn_index"] for t in turns] == [0, 1], served_tiny.log_tail()
    assert turns[0]["next_state"][-1]["content"].endswith(LEAN_TURNS[1])
