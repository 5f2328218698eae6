"""Remote trainers against a live API process: leases over HTTP, the admin key, and a trainer killed mid-lease
whose batch returns to the queue and is trained exactly once by the next trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import torch

from clawloop.config import Config
from clawloop.engines.model_files import load_model, load_tokenizer
from clawloop.serve import Server
from clawloop.store import TurnState
from clawloop.trainer.remote import LeaseLost, RemoteStore
from tests.trainer.trainer_helpers import add_sample

ROOT = Path(__file__).resolve().parents[1]
ADMIN_KEY = "trainer-admin-key-7f3a"

LEASE_AND_HANG = textwrap.dedent("""
    import sys, time
    from clawloop.trainer.remote import RemoteStore
    store = RemoteStore(sys.argv[1], sys.argv[2])
    lease_id, samples = store.lease_samples(3, lease_s=float(sys.argv[3]), min_n=3)
    print(lease_id, *[s.turn_id for s in samples], flush=True)
    time.sleep(600)  # "training": killed before it commits
""")


@pytest.fixture
def server(tiny_model_path, tmp_path):
    torch.set_num_threads(2)
    config = Config.from_dict(dict(model=str(tiny_model_path), device="cpu", run_dir=str(tmp_path / "api"),
                                   admin_key=ADMIN_KEY, port=0, train=False, rollout_batch_size=3,
                                   micro_batch_size=3, num_threads=1))
    srv = Server(config)
    srv.build()
    model = load_model(tiny_model_path, device="cpu")
    tokenizer = load_tokenizer(tiny_model_path)
    for i in range(3):
        add_sample(srv.store, model, tokenizer, i, reward=1.0 if i % 2 == 0 else -1.0,
                   hints=["Answer briefly."] if i == 0 else ())
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def test_trainer_routes_need_the_admin_key(server):
    url = server.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic " + ADMIN_KEY}):
        r = httpx.post(f"{url}/v1/trainer/lease", json={"n": 3}, headers=headers)
        assert r.status_code == 401, headers
        assert httpx.post(f"{url}/v1/trainer/weights", json={"path": "/"}, headers=headers).status_code == 401
    assert server.store.count_samples() == {"ready": 3}  # nothing was leased by the refused calls
    store = RemoteStore(url, ADMIN_KEY)
    assert store.state() == {"step": 0, "policy_version": 0, "waiting": 3}
    lease_id, samples = store.lease_samples(3, lease_s=60, min_n=3)
    assert len(samples) == 3 and server.store.count_samples() == {"leased": 3}
    turn = store.get_turn(samples[0].turn_id)
    assert turn.response_ids == server.store.get_turn(samples[0].turn_id).response_ids
    hinted = [s for s in samples if s.hints]
    assert hinted and hinted[0].targets is not None
    want = server.store.samples()[0].targets
    for key, value in want.items():
        assert torch.equal(hinted[0].targets[key], value)
    assert store.heartbeat(lease_id, 60) == 3
    assert store.release_lease(lease_id) == 3
    with pytest.raises(LeaseLost):
        store.heartbeat(lease_id, 60)
    assert server.store.count_samples() == {"ready": 3}


@pytest.mark.timeout(240)
def test_killed_trainer_batch_is_trained_once_by_the_next(server, tiny_model_path, tmp_path):
    url = server.base_url
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    lease_s = 3.0
    doomed = subprocess.Popen([sys.executable, "-c", LEASE_AND_HANG, url, ADMIN_KEY, str(lease_s)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = doomed.stdout.readline().split()
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(30)
    lost_lease, leased_ids = line[0], sorted(int(x) for x in line[1:])
    assert len(leased_ids) == 3
    assert server.store.count_samples() == {"leased": 3}

    # While the dead trainer's lease runs, nobody else gets its samples.
    probe = RemoteStore(url, ADMIN_KEY)
    _, none = probe.lease_samples(3, lease_s=60, min_n=1)
    assert none == []
    deadline = time.time() + lease_s + 0.5
    while time.time() < deadline:
        time.sleep(0.1)

    trainer = subprocess.run(
        [sys.executable, "-m", "clawloop.trainer.distributed", "--api", url, "--admin-key", ADMIN_KEY,
         "--max-steps", "1", "--poll-s", "0.2", "--lease-s", "120",
         "--set", f"model={tiny_model_path}", "--set", "device=cpu", "--set", f"run_dir={tmp_path / 'trainer'}",
         "--set", "rollout_batch_size=3", "--set", "micro_batch_size=3", "--set", "num_threads=1",
         # The gate runs (rank 0); the tiny random model's word salad is not asked to pass the guard.
         "--set", "gate_min_guard_pass=0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert trainer.returncode == 0, trainer.stderr[-4000:]

    store = server.store
    steps = store.steps()
    assert len(steps) == 1 and steps[0]["step"] == 1
    assert sorted(steps[0]["turn_ids"]) == leased_ids
    assert store.count_samples() == {"consumed": 3}
    assert {s.consumed_step for s in store.samples()} == {1}
    assert store.count_turns().get(TurnState.CONSUMED) == 3
    # The trainer reported its weights: the API's engine serves version 1, which the step row records.
    assert server.engine.policy_version == 1 == steps[0]["policy_version"]
    # The dead trainer's lease is gone for good: acknowledging it now is refused, nothing changes.
    with pytest.raises(LeaseLost):
        probe.commit_step(lost_lease, 2, 1, {}, leased_ids)
    assert len(store.steps()) == 1 and store.count_samples() == {"consumed": 3}


def test_without_admin_key_routes_answer_only_on_loopback(tmp_path):
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from clawloop.api.errors import install_error_handlers
    from clawloop.api.trainer_routes import mount_trainer_routes
    from clawloop.store import Store
    from clawloop.trainer.publish import LocalVersion

    store = Store(tmp_path / "store.sqlite")
    for host, status in (("0.0.0.0", 403), ("10.1.2.3", 403), ("127.0.0.1", 200), ("::1", 200)):
        app = FastAPI()
        install_error_handlers(app)
        config = Config.from_dict(dict(host=host, admin_key=""))
        mount_trainer_routes(app, store, LocalVersion(), config)
        # Called from a loopback peer: the bind address decides (other peers are refused in tests/security).
        with TestClient(app, base_url="http://127.0.0.1", client=("127.0.0.1", 50000)) as client:
            assert client.get("/v1/trainer/state").status_code == status, host
            assert client.post("/v1/trainer/lease", json={"n": 1}).status_code == status, host
    store.close()


class LoseFirstLeaseAnswer(httpx.HTTPTransport):
    """The server leases, then the answer is lost on the way back (a read timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if request.url.path == "/v1/trainer/lease" and not self.lost:
            self.lost += 1
            response.read()
            raise httpx.ReadTimeout("the answer was lost", request=request)
        return response


def test_a_lease_retried_after_its_answer_was_lost_gets_the_samples_the_first_try_leased(server):
    transport = LoseFirstLeaseAnswer()
    trainer = RemoteStore(server.base_url, ADMIN_KEY, backoff_s=0.01, transport=transport)
    lease_id, samples = trainer.lease_samples(3, lease_s=600, min_n=3)
    assert transport.lost == 1 and len(samples) == 3  # not an empty second lease while the first holds all three
    assert server.store.count_samples() == {"leased": 3}
    trainer.commit_step(lease_id, 1, 0, {"loss": 0.5}, [s.turn_id for s in samples])
    assert server.store.count_samples() == {"consumed": 3}


def test_heartbeat_keeps_a_lease_past_its_first_expiry(server):
    trainer = RemoteStore(server.base_url, ADMIN_KEY)
    other = RemoteStore(server.base_url, ADMIN_KEY)
    lease_id, samples = trainer.lease_samples(3, lease_s=1.0, min_n=3)
    assert len(samples) == 3
    assert trainer.heartbeat(lease_id, 120) == 3
    deadline = time.time() + 1.5
    while time.time() < deadline:
        time.sleep(0.1)
    assert other.lease_samples(3, lease_s=60, min_n=1)[1] == []  # still held: the heartbeat extended it
    trainer.commit_step(lease_id, 1, 0, {"loss": 0.5}, [s.turn_id for s in samples])
    assert server.store.count_samples() == {"consumed": 3}
    assert server.store.steps()[0]["metrics"] == {"loss": 0.5}


def test_reported_lora_adapter_is_merged_into_the_embedded_engine(server, tiny_model_path, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = load_model(tiny_model_path, device="cpu")
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)  # a trained adapter (B starts at zero, which would change nothing)
    peft_model.save_pretrained(tmp_path / "adapter")
    merged = peft_model.merge_and_unload().state_dict()

    trainer = RemoteStore(server.base_url, ADMIN_KEY)
    assert trainer.report_weights(str(tmp_path / "adapter"), version=5, kind="lora") == 5
    assert server.engine.policy_version == 5
    served = server.engine.model.state_dict()
    key = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(served[key], merged[key])
    assert not torch.equal(served[key], load_model(tiny_model_path, device="cpu").state_dict()[key])
    with pytest.raises(httpx.HTTPStatusError):
        trainer.report_weights(str(tmp_path / "missing"), version=6)
    assert server.engine.policy_version == 5


def test_remote_trainer_mode_trains_real_conversations_in_another_process(tiny_model_path, tmp_path):
    """trainer = "remote": the API process serves and judges; a trainer process leases, trains and reports."""
    from clawloop.runtime import build_runtime
    from tests.e2e_support import QUESTIONS, conversation

    torch.set_num_threads(2)
    config = Config.load(env={}, model=str(tiny_model_path), device="cpu", run_dir=str(tmp_path / "api"),
                         admin_key=ADMIN_KEY, port=0, trainer="remote", judge_backend="rules", prm_m=1,
                         rollout_batch_size=2, micro_batch_size=2, default_max_tokens=8, num_threads=1)
    runtime = build_runtime(config, pipeline_poll_s=0.2, console=None)
    assert runtime.trainer is None  # nothing trains in the API process
    with runtime:
        url = runtime.server.base_url
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(2):
                conversation(http, f"c{i}", QUESTIONS[i], corrected=i == 0)
        store = runtime.server.store
        deadline = time.time() + 120
        while store.ready_count() < 2:
            assert time.time() < deadline, f"samples not judged in time: {store.count_turns()}"
            time.sleep(0.2)
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CLAWLOOP_ADMIN_KEY=ADMIN_KEY)
        trainer = subprocess.run(
            [sys.executable, "-m", "clawloop.trainer.distributed", "--api", url, "--max-steps", "1",
             "--poll-s", "0.2", "--set", f"model={tiny_model_path}", "--set", "device=cpu",
             "--set", f"run_dir={tmp_path / 'trainer'}", "--set", "rollout_batch_size=2",
             "--set", "micro_batch_size=2", "--set", "num_threads=1", "--set", "trainer=remote",
             "--set", "gate_min_guard_pass=0"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert trainer.returncode == 0, trainer.stderr[-4000:]
        assert store.count_samples() == {"consumed": 2}
        assert runtime.server.engine.policy_version == 1 == store.steps()[0]["policy_version"]
        with httpx.Client(base_url=url, timeout=120) as http:
            out = http.post("/v1/chat/completions", json={"model": "clawloop", "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert out["clawloop"]["policy_version"] == 1


def test_the_teacher_scores_a_step_trained_on_are_kept_with_its_samples(server):
    """A remote trainer's commit carries the teacher scores each sample trained on; the store keeps them as the
    sample's targets (the dashboard's per-token view, and reuse at the same ids), bit for bit. Malformed scores are
    the client's error and commit nothing."""
    trainer = RemoteStore(server.base_url, ADMIN_KEY)
    lease_id, samples = trainer.lease_samples(2, min_n=2)
    first = samples[0].turn_id
    scores = {"student_ids_T_K": torch.arange(12, dtype=torch.int64).reshape(3, 4),
              "teacher_at_student_C_T_K": -torch.rand(1, 3, 4)}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        bad = client.post("/v1/trainer/commit", json={"lease_id": lease_id, "step": 1, "policy_version": 0,
                                                       "turn_ids": [first], "scores": {str(first): "not base64"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "scores"
    assert server.store.count_samples().get("consumed", 0) == 0
    trainer.commit_step(lease_id, 1, 0, {"loss": 0.5}, [s.turn_id for s in samples], {first: scores})
    kept = server.store.get_sample(first).targets
    assert set(kept) == set(scores) and all(torch.equal(kept[k], v) for k, v in scores.items())


def test_a_commit_or_version_sent_again_after_its_answer_was_lost_stands(server):
    """A remote trainer retries a POST whose answer never came (a timeout, a reset). The server may have written
    it: the same commit again is acknowledged, not reported as a lost lease (the trainer would then keep its step
    number and collide with the step it already recorded), and the same version record again is no error."""
    trainer = RemoteStore(server.base_url, ADMIN_KEY)
    lease_id, samples = trainer.lease_samples(2, min_n=2)
    turn_ids = [s.turn_id for s in samples]
    body = {"lease_id": lease_id, "step": 1, "policy_version": 0, "metrics": {"loss": 0.5}, "turn_ids": turn_ids}
    version = {"version": 1, "step": 1, "status": "accepted", "evidence": {"guard_pass": 1.0}}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as client:
        assert client.post("/v1/trainer/commit", json=body).status_code == 200
        again = client.post("/v1/trainer/commit", json=body)
        assert again.status_code == 200, again.text
        assert client.post("/v1/trainer/versions", json=version).status_code == 200
        assert client.post("/v1/trainer/versions", json=version).status_code == 200
        other = client.post("/v1/trainer/versions", json={**version, "step": 2})
        assert other.status_code >= 400  # one number, one set of weights
        # A commit naming the same samples under another step is not the same commit.
        moved = client.post("/v1/trainer/commit", json={**body, "step": 2})
        assert moved.status_code == 409 and moved.json()["error"]["code"] == "lease_lost"
    assert [s["step"] for s in server.store.steps()] == [1]
    assert {server.store.get_sample(t).consumed_step for t in turn_ids} == {1}
    # The next batch commits as step 2: nothing was left behind to collide with.
    lease_id, samples = trainer.lease_samples(1, min_n=1)
    trainer.commit_step(lease_id, 2, 0, {"loss": 0.4}, [s.turn_id for s in samples])
    assert [s["step"] for s in server.store.steps()] == [1, 2]
