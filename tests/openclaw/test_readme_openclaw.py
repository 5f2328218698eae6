"""The README's OpenClaw quick start, run as printed there: the commands are read from README.md (each block follows
an ``<!-- openclaw-readme-test: NAME -->`` marker), never re-typed here, so the README and this test cannot drift.

They run in a sandbox: their own HOME (so any ``~/.openclaw`` would be the sandbox's), their own run folder
(``CLAWLOOP_RUN_DIR``, and the README's ``runs/default`` replaced by it in the commands) and a free port
(``CLAWLOOP_PORT``, where the README uses the default 30000). The model cache is the test machine's
(``CLAWLOOP_CACHE``): converting the default model again would only repeat what every other test does.

Stock OpenClaw 2026.9.6 (no plugin) against the default model with the default settings: one conversation of
four turns stays one session, the trainer trains on the samples of its first turns without a full batch, the
publication gate accepts, and the fourth answer comes from the new version. The version an answer came from is
read from the run's store, where the server recorded the same number it sent in that answer's
``X-Policy-Version`` header and ``clawloop.policy_version`` field.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from clawloop.engines.model_files import cache_root

pytestmark = pytest.mark.openclaw

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MARKER = re.compile(r"<!-- openclaw-readme-test: ([\w-]+) -->")
README_RUN_DIR = "runs/default"
UP_TIMEOUT_S = 600
COMMAND_TIMEOUT_S = 400
NEW_VERSION_TIMEOUT_S = 1200


def readme_blocks(text: str) -> dict[str, list[str]]:
    """Each marked block's commands: the indented lines that follow the marker (blank lines skipped)."""
    lines = text.splitlines()
    blocks: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        marker = MARKER.fullmatch(line.strip())
        if not marker:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        commands = []
        while j < len(lines) and lines[j].startswith("    ") and lines[j].strip():
            commands.append(lines[j][4:])
            j += 1
        blocks[marker.group(1)] = commands
    return blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sandbox_env(home: Path, run_dir: Path, port: int) -> dict[str, str]:
    """The caller's environment without its clawloop, OpenClaw or make settings, in the sandbox."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CLAWLOOP_", "OPENCLAW_")) and k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env.update(HOME=str(home), CLAWLOOP_RUN_DIR=str(run_dir), CLAWLOOP_PORT=str(port),
               CLAWLOOP_CACHE=str(cache_root()))
    return env


def in_sandbox(command: str, run_dir: Path) -> str:
    return command.replace(README_RUN_DIR, str(run_dir))


def stored_turns(run_dir: Path) -> list[dict]:
    db = sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in db.execute(
            "SELECT id, session_id, turn_index, state, reason, policy_version FROM turns ORDER BY id")]
    finally:
        db.close()


def gate_events(run_dir: Path) -> list[dict]:
    db = sqlite3.connect(f"file:{run_dir / 'store.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT kind, step, detail FROM events ORDER BY id").fetchall()
    finally:
        db.close()
    return [{"kind": k, "step": s, "reasons": json.loads(d).get("reasons")} for k, s, d in rows]


def stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to the whole command (make and clawloop), as in a terminal."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_readme_marks_the_quick_start():
    blocks = readme_blocks(README.read_text())
    assert set(blocks) == {"up", "conversation", "after-new-version"}, blocks
    assert all(blocks.values()), blocks


@pytest.mark.timeout(UP_TIMEOUT_S + 5 * COMMAND_TIMEOUT_S + NEW_VERSION_TIMEOUT_S)
def test_the_readme_openclaw_quick_start_learns_within_one_conversation(tmp_path):
    blocks = readme_blocks(README.read_text())
    home, run_dir = tmp_path / "home", tmp_path / "run"
    home.mkdir()
    port = free_port()
    env = sandbox_env(home, run_dir, port)
    timings: dict[str, float] = {}
    started = time.monotonic()

    (up_command,) = blocks["up"]
    up_log = tmp_path / "up.log"
    with open(up_log, "w") as log:
        up = subprocess.Popen(["bash", "-c", in_sandbox(up_command, run_dir)], cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # What it prints is what the README tells the user to run next.
        first_turn = in_sandbox(blocks["conversation"][0], run_dir)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while first_turn not in up_log.read_text():
            assert up.poll() is None, f"{up_command!r} exited:\n{up_log.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"{up_command!r} printed no next step:\n{up_log.read_text()[-5000:]}"
            time.sleep(1)
        timings["up"] = time.monotonic() - started
        admin = {"Authorization": "Bearer " + (run_dir / "openclaw" / "clawloop-admin-key").read_text().strip()}

        def context() -> str:
            return (f"timings {timings}\nserver:\n{up_log.read_text()[-4000:]}\ngate: {gate_events(run_dir)}\n"
                    f"turns: {stored_turns(run_dir)}")

        def run_readme(name: str) -> list[subprocess.CompletedProcess]:
            done = []
            for command in blocks[name]:
                t0 = time.monotonic()
                proc = subprocess.run(["bash", "-c", in_sandbox(command, run_dir)], cwd=ROOT, env=env,
                                      capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
                timings[command[-40:]] = round(time.monotonic() - t0, 1)
                assert proc.returncode == 0, f"{command!r} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n" \
                                             f"{proc.stderr[-3000:]}\n{context()}"
                done.append(proc)
            return done

        run_readme("conversation")

        # The user waits for the dashboard to show version 1: here, the run's status, with the printed admin key.
        t0 = time.monotonic()
        status = httpx.get(f"http://127.0.0.1:{port}/v1/status", headers=admin, timeout=30).json()
        while status["policy_version"] < 1:
            assert time.monotonic() - t0 < NEW_VERSION_TIMEOUT_S, f"no new version served:\n{status}\n{context()}"
            time.sleep(5)
            status = httpx.get(f"http://127.0.0.1:{port}/v1/status", headers=admin, timeout=30).json()
        timings["to new version after the conversation"] = round(time.monotonic() - t0, 1)
        timings["to new version from the start"] = round(time.monotonic() - started, 1)

        *_, ended = run_readme("after-new-version")
        assert "ended" in ended.stdout, ended.stdout + ended.stderr

        turns = stored_turns(run_dir)
        # One conversation, one session: every answer paired with the next message of the same session.
        assert len({t["session_id"] for t in turns}) == 1, context()
        assert [t["turn_index"] for t in turns] == list(range(len(turns))) and len(turns) >= 4, context()
        assert all(t["reason"] != "no_next_state" for t in turns[:-1]), context()
        # The first answer came from the starting weights, the last from the new version.
        assert turns[0]["policy_version"] == 0 and turns[-1]["policy_version"] >= 1, context()
        # `clawloop openclaw-end` closed the conversation's last answer at once.
        assert (turns[-1]["state"], turns[-1]["reason"]) == ("dropped", "no_next_state"), context()
        # OpenClaw kept its state in the run's folder, never in ~/.openclaw.
        assert (run_dir / "openclaw" / "openclaw.json").is_file() and not (home / ".openclaw").exists()
        print(f"timings (s): {timings}")
    finally:
        stop(up)
