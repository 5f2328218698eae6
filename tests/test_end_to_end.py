"""The whole loop on the tiny model: conversations over the live HTTP API are judged, become samples, train the
policy, and the answers served afterwards come from the new weights; a kill -9 during training loses nothing.

The judge is scripted (a real OpenAI-compatible HTTP server whose votes follow the user's reply); the policy,
teacher, store, API and trainer are the real ones.
"""

from __future__ import annotations

import gc
import inspect
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import httpx
import pytest
import torch

from clawloop.engines.model_files import load_model
from clawloop.judge.scripted import ScriptedJudgeServer
from clawloop.store import Store, TurnState
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.metrics import read_metrics

from e2e_support import QUESTIONS, build_server, chat, conversation, e2e_config, judge

HERE = Path(__file__).parent


def wait_for(predicate, timeout_s=240.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@torch.no_grad()
def logprobs_of(model, prompt_ids, response_ids, temperature=1.0):
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response_ids)[:, None])[:, 0]


def test_conversations_train_the_served_policy(tmp_path, tiny_model_path):
    torch.set_num_threads(2)
    with ScriptedJudgeServer(judge) as judge_server:
        config = e2e_config(str(tmp_path / "run"), judge_server.url)
        server, pipeline, trainer = build_server(config)
        server.start()
        try:
            with httpx.Client(base_url=server.base_url, timeout=120) as http:
                judged = [conversation(http, f"c{i}", QUESTIONS[i], corrected=i % 2 == 0) for i in range(4)]
                wait_for(lambda: trainer.step >= 2, what="two optimizer steps")
                assert server.engine.policy_version == 2 and trainer.policy_version == 2

                out = chat(http, "after", [{"role": "user", "content": "Tell me a joke."}])
                assert out["clawloop"]["policy_version"] == 2
                metrics_text = http.get("/metrics").text
                assert "clawloop_policy_version 2" in metrics_text
                status = http.get("/v1/status").json()
                assert status["policy_version"] == 2 and status["last_step"]["step"] == 2
                turn = server.store.get_turn(out["clawloop"]["turn_id"])
                assert turn.policy_version == 2
                served_T = torch.tensor(turn.logprobs)
                # Under the starting weights the served tokens have other log-probs; under the trained ones the
                # same (up to incremental-decoding rounding).
                start = load_model(tiny_model_path, device="cpu")
                assert (logprobs_of(start, turn.prompt_ids, turn.response_ids) - served_T).abs().max() > 1e-3
                # Read with the trainer paused: between steps it works ahead on the reference, with the adapter off.
                trained_T = trainer.call_paused(
                    lambda: logprobs_of(trainer.core.models.policy, turn.prompt_ids, turn.response_ids))
                torch.testing.assert_close(trained_T, served_T, atol=2e-3, rtol=1e-3)
        finally:
            server.stop()

    store = Store(Path(config.run_dir) / "store.sqlite")
    steps = store.steps()
    assert [s["step"] for s in steps] == [1, 2] and [s["policy_version"] for s in steps] == [1, 2]
    assert sorted(t for s in steps for t in s["turn_ids"]) == sorted(judged)
    kinds = {s.turn_id: s.kind for s in store.samples()}
    assert sorted(kinds.values()) == ["rl", "rl", "rl+opd", "rl+opd"]  # corrections carry hints
    for tid in judged:
        assert store.get_turn(tid).state == TurnState.CONSUMED
        assert {v.kind for v in store.votes(tid)} == {"eval", "hint"}
    assert [m["step"] for m in read_metrics(config.run_dir)] == [1, 2]
    assert ckpt.load_latest(config.run_dir).step == 2


def test_a_stopped_server_lets_go_of_its_weights(tmp_path):
    """``clawloop eval`` builds one server per cell in one process: a stopped server must not keep its models,
    their double-buffered copies or the optimizer alive (web frameworks keep route handlers, and through them the
    services, after the app is gone), or every cell adds gigabytes until the machine runs out of memory."""
    torch.set_num_threads(2)
    with ScriptedJudgeServer(judge) as judge_server:
        config = e2e_config(str(tmp_path / "run"), judge_server.url, kl_coef=0.1)
        server, pipeline, trainer = build_server(config)
        server.start()
        try:
            with httpx.Client(base_url=server.base_url, timeout=120) as http:
                for i in range(2):
                    conversation(http, f"c{i}", QUESTIONS[i], corrected=True)
                wait_for(lambda: trainer.step >= 1 and server.engine.policy_version >= 1, what="one published step")
            heavy = [server.engine.model, trainer.core.models.policy, trainer.core.models.causal_lm,
                     trainer.core.optimizer, *(e.model for e in server.parts.owned_engines)]
            if trainer.core.models.reference is not None:
                heavy.append(trainer.core.models.reference)
            refs = [weakref.ref(obj) for obj in heavy]
            del heavy
        finally:
            server.stop()
    del server, pipeline, trainer
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert not alive, f"still alive after the server stopped: {alive}"


def test_kill_9_during_training_then_resume_trains_every_sample_once(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    port_file = tmp_path / "url"

    def launch(judge_url, resume):
        port_file.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / "e2e_crash_worker.py"), str(run_dir), judge_url, str(port_file)]
        proc = subprocess.Popen(cmd + (["--resume"] if resume else []), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        deadline = time.monotonic() + 240
        while not (port_file.exists() and port_file.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(proc.stderr.read().decode()[-3000:])
            time.sleep(0.05)
        return proc, port_file.read_text()

    with ScriptedJudgeServer(judge) as judge_server:
        first, url = launch(judge_server.url, resume=False)
        store = Store(run_dir / "store.sqlite")
        try:
            with httpx.Client(base_url=url, timeout=120) as http:
                judged = [conversation(http, f"c{i}", QUESTIONS[i], corrected=i % 3 == 0) for i in range(10)]
            deadline = time.monotonic() + 240
            killed = False
            while time.monotonic() < deadline and first.poll() is None:
                last = store.last_step()
                if last and last[0] >= 3 and store.count_samples().get(TurnState.LEASED, 0):
                    first.send_signal(signal.SIGKILL)  # a step is in flight
                    killed = True
                    break
                time.sleep(0.01)
            first.wait(60)
        finally:
            if first.poll() is None:
                first.kill()
        assert killed and first.returncode == -signal.SIGKILL, first.stderr.read().decode()[-3000:]

        checkpoint_step = ckpt.load_latest(run_dir).step
        lost_steps = [s for s in store.steps() if s["step"] > checkpoint_step]
        lost = [t for s in lost_steps for t in s["turn_ids"]]
        assert store.count_samples().get(TurnState.LEASED, 0) > 0  # died mid-step

        second, url = launch(judge_server.url, resume=True)
        try:
            def all_trained():
                turns = store.count_turns()
                pending = sum(turns.get(s, 0) for s in (TurnState.AWAITING_NEXT, TurnState.JUDGEABLE,
                                                         TurnState.JUDGING, TurnState.READY, TurnState.LEASED))
                return pending == 0

            wait_for(all_trained, what="every sample to be trained after the restart")
            (run_dir / "stop").write_text("")
            out, err = second.communicate(timeout=180)
        finally:
            if second.poll() is None:
                second.kill()
        assert second.returncode == 0, err.decode()[-3000:]
        assert f"'step': {checkpoint_step}, 'requeued': {len(lost)}" in out.decode(), out.decode()

    steps = store.steps()
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))  # no number reused, none skipped
    # The lost steps keep their rows, marked requeued; the others hold every sample once.
    assert [(s["step"], s["turn_ids"]) for s in steps if s["requeued"]] == \
        [(s["step"], s["turn_ids"]) for s in lost_steps]
    trained = [t for s in steps if not s["requeued"] for t in s["turn_ids"]]
    samples = {s.turn_id for s in store.samples()}
    assert len(trained) == len(set(trained))  # nothing trained twice
    assert set(trained) == samples == set(judged)  # nothing skipped
    assert store.count_samples() == {TurnState.CONSUMED: len(judged)}
    versions = [s["policy_version"] for s in steps]
    from clawloop.engines.hf import HFEngine

    if "version" not in inspect.signature(HFEngine.publish_sync).parameters:
        pytest.xfail("HFEngine.publish_sync takes no version=: the resumed engine restarts its version count "
                     f"(step versions {versions})")
    # Along the lineage of the served weights (the lost steps aside) versions never go back across the restart, and
    # each step the publication gate accepted, lost or not, got a number of its own. (A step the gate rejected
    # keeps the version it trained from: the tiny random model can fail the probes.)
    lineage = [s["policy_version"] for s in steps if not s["requeued"]]
    assert lineage == sorted(lineage), steps
    published = [s["policy_version"] for s in steps if s["metrics"].get("gate_accepted", 0.0) == 1.0]
    assert published == sorted(set(published)), steps
    assert published and published[-1] == max(versions), steps
