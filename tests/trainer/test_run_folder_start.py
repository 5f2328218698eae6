"""``clawloop serve`` on a run folder that already holds training, as a real subprocess.

The folder comes from real optimizer steps of the tiny model (checkpoints step_1 and step_2, versions v0..v2, the
store). Then:

* without ``--resume`` or ``--fresh`` the start is refused with a paragraph that names both flags;
* ``--fresh`` moves checkpoints/ and versions/ to archive/<date-time>/ and serves;
* ``--resume`` skips a checkpoint cut short, says which and which it used, and serves;
* a damaged folder (every checkpoint cut short, the store cut short, the checkpoint's version cut short, a folder
  that cannot be written) stops start-up with exit status 2 and one paragraph naming the file and what to do,
  no traceback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawloop.serve import free_port
from clawloop.store import Store
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer import versions as history

from trainer_helpers import train_steps

START_TIMEOUT_S = 240


def checkpoint_names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt.checkpoints_dir(run_dir).glob("step_*"))


def cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture
def trained_run(make_config, base_model, tiny_tokenizer) -> Path:
    """A run folder after two committed, checkpointed and published steps (full fine-tuning, gate off)."""
    config = make_config(method="rl", checkpoint_every=1)
    run_dir = Path(config.run_dir)
    store = Store(run_dir / "store.sqlite")
    train_steps(config, store, base_model, tiny_tokenizer).close()
    store.close()
    assert checkpoint_names(run_dir) == ["step_1", "step_2"]
    assert history.list_versions(run_dir) == [0, 1, 2]
    return run_dir


def serve(run_dir: Path, *flags: str, tiny_model_path: Path, as_reader_only: bool = False) -> tuple[int | None, str]:
    """Start ``clawloop serve`` on ``run_dir``. Returns (exit status, output) once it exits, or (None, output) once
    it answers /healthz (it is then stopped with SIGINT)."""
    port = free_port()
    cmd = [sys.executable, "-m", "clawloop.cli", "serve", "--model", str(tiny_model_path), "--device", "cpu",
           "--port", str(port), "--run-dir", str(run_dir), "--num-threads", "1", "--gate-probe-tokens", "4",
           "--log-level", "warning", *flags]
    if as_reader_only:  # root writes anywhere; without CAP_DAC_OVERRIDE it meets permission bits like anyone
        cmd = ["setpriv", "--inh-caps=-dac_override", "--bounding-set=-dac_override", "--", *cmd]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    serving = False
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                serving = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                pass
            if serving:
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert serving or proc.returncode is not None, "clawloop serve neither started nor stopped"
    return (None if serving else proc.returncode), output.decode(errors="replace")


def assert_refused(status: int | None, output: str, *named: str) -> None:
    assert status == 2, f"expected a refusal (exit 2), got {status}:\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    for text in named:
        assert text in output, f"{text!r} not in:\n{output[-3000:]}"


def test_a_restart_without_resume_is_refused_and_fresh_archives(trained_run, tiny_model_path):
    status, output = serve(trained_run, tiny_model_path=tiny_model_path)
    assert_refused(status, output, str(trained_run), "--resume", "--fresh", "step_2", "v2")
    assert checkpoint_names(trained_run) == ["step_1", "step_2"]  # nothing touched

    status, output = serve(trained_run, "--resume", "--fresh", tiny_model_path=tiny_model_path)
    assert_refused(status, output, "give one")

    status, output = serve(trained_run, "--fresh", tiny_model_path=tiny_model_path)
    assert status is None, output[-3000:]
    (archive,) = (trained_run / "archive").iterdir()
    assert sorted(p.name for p in archive.iterdir()) == ["checkpoints", "versions"]
    assert checkpoint_names(archive) == ["step_1", "step_2"]
    assert history.list_versions(archive) == [0, 1, 2]
    assert history.list_versions(trained_run) == [0]  # the fresh start's own starting weights
    store = Store(trained_run / "store.sqlite")
    assert {v["status"] for v in store.versions()} == {"archived"}
    assert [e["detail"]["archive"] for e in store.events("fresh_start")] == [str(archive)]
    store.close()


def test_resume_skips_a_damaged_checkpoint_and_says_which(trained_run, tiny_model_path):
    cut_short(trained_run / "checkpoints" / "step_2" / "optimizer.pt")
    status, output = serve(trained_run, "--resume", tiny_model_path=tiny_model_path)
    assert status is None, output[-3000:]
    assert "step_2" in output and "optimizer.pt is cut short" in output, output[-3000:]
    assert "resuming from checkpoint step_1" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def _every_checkpoint_cut(run_dir: Path) -> list[str]:
    cut_short(run_dir / "checkpoints" / "step_2" / "optimizer.pt")
    cut_short(run_dir / "checkpoints" / "step_1" / "weights.safetensors")
    return ["--resume"]


def _store_cut(run_dir: Path) -> list[str]:
    cut_short(run_dir / "store.sqlite")
    return ["--resume"]


def _version_cut(run_dir: Path) -> list[str]:
    cut_short(run_dir / "versions" / "v2" / "weights.safetensors")
    return ["--resume"]


DAMAGES = {
    "every checkpoint": (_every_checkpoint_cut, ["step_2: optimizer.pt is cut short",
                                                 "step_1: weights.safetensors is cut short", "--fresh"]),
    "store": (_store_cut, ["store.sqlite", "cannot be read", "backup"]),
    "version": (_version_cut, ["step_2", "version 2", "v2", "weights.safetensors is cut short", "--fresh"]),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_run_folder_stops_start_up_with_a_paragraph(trained_run, tiny_model_path, damage):
    make_damage, named = DAMAGES[damage]
    flags = make_damage(trained_run)
    status, output = serve(trained_run, *flags, tiny_model_path=tiny_model_path)
    assert_refused(status, output, *named)


@pytest.mark.skipif(os.geteuid() == 0 and shutil.which("setpriv") is None,
                    reason="running as root without setpriv: a read-only folder cannot be made")
def test_a_run_folder_that_cannot_be_written_stops_start_up(trained_run, tiny_model_path):
    os.chmod(trained_run, 0o555)
    try:
        status, output = serve(trained_run, "--resume", tiny_model_path=tiny_model_path,
                               as_reader_only=os.geteuid() == 0)
    finally:
        os.chmod(trained_run, 0o755)
    assert_refused(status, output, f"cannot write to {trained_run}", "--run-dir")
