"""``clawloop openclaw`` (serve + OpenClaw's config, keys and launcher, in one command) and ``clawloop
openclaw-end`` (end the clawloop session of an OpenClaw conversation), through the real command, real HTTP and
real files. The server runs the tiny model with its position limit raised to 8192 (rotary positions: any length
is valid), since OpenClaw's lean prompt (~2,900 tokens) does not fit the tiny model's 2,048. The real OpenClaw
runs these commands in tests/openclaw (make test-openclaw)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from clawloop.cli import main
from clawloop.engines.model_files import tiny_model_dir
from clawloop.openclaw_launch import openclaw_session_of

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "openclaw" / "runA.json.gz"  # real OpenClaw 2026.9.6 requests (session ocl-A)
START_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def tiny_8k(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("model") / "tiny-8k"
    shutil.copytree(tiny_model_dir(), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """The caller's environment without clawloop or OpenClaw settings, so the test decides them all."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("CLAWLOOP_", "OPENCLAW_"))}


@dataclass
class Up:
    """A running ``clawloop openclaw`` and what it printed."""

    proc: subprocess.Popen
    url: str
    run_dir: Path
    folder: Path
    printed: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_openclaw(model: Path, run_dir: Path, *extra: str, port: int | None = None) -> Up:
    port = port or free_port()
    out_path = run_dir.parent / f"up-{port}.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "clawloop.cli", "openclaw", "--model", str(model),
                                 "--port", str(port), "--run-dir", str(run_dir), "--num-threads", "2", *extra],
                                stdout=out, stderr=subprocess.STDOUT, cwd=run_dir.parent, env=clean_env())
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Dashboard:" not in out_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"clawloop openclaw did not come up:\n{out_path.read_text()[-4000:]}")
        time.sleep(0.3)
    time.sleep(0.3)  # the rest of the text follows the line in the same print
    return Up(proc, f"http://127.0.0.1:{port}", run_dir, run_dir / "openclaw", out_path.read_text())


def recorded_first_request() -> dict:
    return json.loads(gzip.open(RECORDED).read())["requests"][0]["body"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_an_openclaw_config_clawloop_did_not_write_is_never_replaced(tmp_path, capsys):
    folder = tmp_path / "my-openclaw"
    folder.mkdir()
    mine = '{ // my own OpenClaw settings\n  gateway: { port: 18789 } }\n'
    (folder / "openclaw.json").write_text(mine)
    code = main(["openclaw", "--model", "tiny", "--run-dir", str(tmp_path / "run"), "--openclaw-dir", str(folder),
                 "--port", str(free_port())])
    assert code == 2
    err = capsys.readouterr().err
    assert "was not written by clawloop" in err and "--openclaw-dir" in err
    assert (folder / "openclaw.json").read_text() == mine
    assert sorted(p.name for p in folder.iterdir()) == ["openclaw.json"]  # no key, no launcher written there


def test_the_session_id_openclaw_writes_into_a_conversation_is_read_back():
    assert openclaw_session_of(recorded_first_request()["messages"]) == "ocl-A"
    assert openclaw_session_of([{"role": "user", "content": "What is sessionId=x?"}]) == ""


@pytest.mark.timeout(600)
def test_one_command_serves_and_writes_openclaws_config_keys_and_launcher(tiny_8k, tmp_path):
    fake_openclaw = tmp_path / "fake-openclaw"  # stands in for OpenClaw: shows what the launcher gives it
    fake_openclaw.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in "
        "('OPENCLAW_STATE_DIR', 'OPENCLAW_CONFIG_PATH', 'CLAWLOOP_API_KEY')}}))\n")
    fake_openclaw.chmod(0o755)
    run_dir = tmp_path / "run"
    up = start_openclaw(tiny_8k, run_dir, "--openclaw-bin", str(fake_openclaw))
    try:
        folder = up.folder
        api_key = (folder / "clawloop-api-key").read_text().strip()
        admin_key = (folder / "clawloop-admin-key").read_text().strip()
        for name in ("clawloop-api-key", "clawloop-admin-key"):
            assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
        assert api_key and admin_key and api_key != admin_key
        # What the user runs next, with the dashboard's key.
        assert "run/openclaw/bin/openclaw agent --local --session-id my-chat" in up.printed
        assert "openclaw-end my-chat --run-dir run" in up.printed
        assert f"{up.url}/dashboard/" in up.printed and admin_key in up.printed

        # OpenClaw's config, from the served limits; the key is a reference, never the key itself.
        config = json.loads((folder / "openclaw.json").read_text())
        provider = config["models"]["providers"]["clawloop"]
        assert provider["baseUrl"] == up.url + "/v1" and provider["apiKey"] == "${CLAWLOOP_API_KEY}"
        assert provider["models"][0]["contextWindow"] == 8192

        # The server holds both keys: chat needs the user key, the dashboard's data the admin key.
        assert httpx.get(up.url + "/v1/models").status_code == 401
        assert httpx.get(up.url + "/v1/models", headers=bearer(api_key)).status_code == 200
        assert httpx.get(up.url + "/dashboard/api/overview", headers=bearer(api_key)).status_code in (401, 403)
        assert httpx.get(up.url + "/dashboard/api/overview", headers=bearer(admin_key)).status_code == 200

        # The launcher gives OpenClaw its folder and the user key, from any shell, whatever that shell exports.
        env = dict(clean_env(), CLAWLOOP_API_KEY="some-other-key")
        shown = subprocess.run(["nice", str(folder / "bin" / "openclaw"), "agent", "-m", "Hi there"], env=env,
                               capture_output=True, text=True, timeout=60, cwd="/")
        assert shown.returncode == 0, shown.stderr
        seen = json.loads(shown.stdout)
        assert seen["argv"] == ["agent", "-m", "Hi there"]
        assert seen["env"] == {"OPENCLAW_STATE_DIR": str(folder.resolve()),
                               "OPENCLAW_CONFIG_PATH": str(folder.resolve() / "openclaw.json"),
                               "CLAWLOOP_API_KEY": api_key}
    finally:
        up.stop()
    assert up.proc.returncode == 0

    # Started again: the same keys, the config rewritten in place.
    again = start_openclaw(tiny_8k, run_dir, "--openclaw-bin", str(fake_openclaw))
    try:
        assert (folder / "clawloop-api-key").read_text().strip() == api_key
        assert admin_key in again.printed
        assert httpx.get(again.url + "/v1/models", headers=bearer(api_key)).status_code == 200
    finally:
        again.stop()

    # Edited by hand since: left alone, and start-up says so.
    (folder / "openclaw.json").write_text((folder / "openclaw.json").read_text().replace("600", "900"))
    refused = subprocess.run([sys.executable, "-m", "clawloop.cli", "openclaw", "--model", str(tiny_8k),
                              "--run-dir", str(run_dir), "--port", str(free_port())], env=clean_env(),
                             capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert refused.returncode == 2 and "was not written by clawloop" in refused.stderr
    assert '"timeoutSeconds": 900' in (folder / "openclaw.json").read_text()


@pytest.mark.timeout(600)
def test_openclaw_end_ends_the_session_of_an_openclaw_conversation(tiny_8k, tmp_path, capsys, monkeypatch):
    for name in list(os.environ):
        if name.startswith("CLAWLOOP_"):
            monkeypatch.delenv(name)
    run_dir = tmp_path / "run"
    up = start_openclaw(tiny_8k, run_dir)
    try:
        api_key = (up.folder / "clawloop-api-key").read_text().strip()
        # OpenClaw's real first request of its session ocl-A (stock OpenClaw sends no session header).
        body = {**recorded_first_request(), "stream": False, "max_completion_tokens": 8}
        r = httpx.post(up.url + "/v1/chat/completions", json=body, headers=bearer(api_key), timeout=300)
        assert r.status_code == 200, r.text
        session = r.json()["clawloop"]["session_id"]
        assert httpx.get(up.url + "/v1/status", headers=bearer(api_key)).json()["live_sessions"] == 1

        assert main(["openclaw-end", "ocl-A", "--run-dir", str(run_dir)]) == 0
        assert session in capsys.readouterr().out
        status = httpx.get(up.url + "/v1/status", headers=bearer(api_key)).json()
        assert status["live_sessions"] == 0 and status["drop_reasons"] == {"no_next_state": 1}

        assert main(["openclaw-end", "ocl-A", "--run-dir", str(run_dir)]) == 0
        assert "had ended already" in capsys.readouterr().out
        # OpenClaw's next message in that conversation starts a new clawloop session; ending it again finds it.
        answer = r.json()["choices"][0]["message"]
        later = {**body, "messages": [*body["messages"], {"role": "assistant", "content": answer["content"]},
                                      {"role": "user", "content": "[Mon 2026-11-23 20:10 UTC] And Italy?"}]}
        r = httpx.post(up.url + "/v1/chat/completions", json=later, headers=bearer(api_key), timeout=300)
        assert r.status_code == 200 and r.json()["clawloop"]["session_id"] != session, r.text
        assert main(["openclaw-end", "ocl-A", "--run-dir", str(run_dir)]) == 0
        assert r.json()["clawloop"]["session_id"] in capsys.readouterr().out
        assert main(["openclaw-end", "no-such-chat", "--run-dir", str(run_dir)]) == 2
        assert "no conversation of OpenClaw session 'no-such-chat'" in capsys.readouterr().err
    finally:
        up.stop()
