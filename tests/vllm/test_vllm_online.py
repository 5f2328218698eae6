"""A full online step with every model role on real vLLM servers: the policy served by vLLM (LoRA), the judge
and the teacher on the frozen vLLM server, the trainer in the API process publishing its adapter to vLLM.

The judge is SmolLM2-135M itself, which rarely writes a vote in the expected format on its own; vLLM's
structured outputs (``judge_extra_body``) hold it to the format, so every vote parses and the loop runs through.
What the votes say is not the point here (benchmarks/judge_accuracy.py measures that), only that they come
from the vLLM judge and flow into a trained, published policy.
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
import torch

from clawloop.runtime import build_runtime
from clawloop.sim.demo import wait_for_training
from clawloop.store import Store

pytestmark = [pytest.mark.vllm, pytest.mark.real_model, pytest.mark.timeout(1800)]

# A vote: the boxed score, then (for hint votes) the hint between its markers; max_tokens bounds its length.
# No counted repeats ({m,n}): vLLM compiles the pattern under a 5 s limit, and they blow it up on a busy CPU.
JUDGE_REGEX = r"\\boxed\{(1|-1)\}( \[HINT_START\][A-Za-z ,.']+\[HINT_END\])?"
ADMIN_KEY = "vllm-online-admin-key-5f2c"
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?",
             "What is two plus two?"]


def wait_for(predicate, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def chat(http: httpx.Client, session: str, messages: list[dict]) -> dict:
    response = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                         json={"model": "clawloop", "messages": messages, "temperature": 1.0, "max_tokens": 16})
    response.raise_for_status()
    return response.json()


def served_gap(model: torch.nn.Module, turn) -> float:
    """Largest gap between the log-probs vLLM served for a turn's answer and ``model``'s."""
    with torch.no_grad():
        ids = torch.tensor([turn.prompt_ids + turn.response_ids])
        logits = model(input_ids=ids).logits[0, len(turn.prompt_ids) - 1:-1].float()
        ours = torch.log_softmax(logits, -1).gather(1, torch.tensor(turn.response_ids)[:, None])[:, 0]
    return (ours - torch.tensor(turn.logprobs)).abs().max().item()


def test_one_online_step_with_policy_judge_and_teacher_on_vllm(vllm_fleet, tmp_path):
    torch.set_num_threads(2)
    fleet, fleet_config = vllm_fleet
    # A small step: at lr 1e-3 one step of SmolLM2 on two samples often loses facts the gate's knowledge probes ask
    # for and is rejected (docs/publication-gate.md), and this test needs a published version to check vLLM serves it.
    config = fleet_config.replace(
        run_dir=str(tmp_path / "run"), port=0, method="hybrid", rollout_batch_size=2, lr=1e-4, prm_m=1,
        judge_max_tokens=96, judge_retries=1, judge_timeout_s=300.0,
        judge_extra_body={"structured_outputs": {"regex": JUDGE_REGEX}}, checkpoint_every=1000, num_threads=2,
        device="cpu", admin_key=ADMIN_KEY)
    assert config.judge_url == fleet_config.teacher_url + "/v1"  # the judge falls to the frozen vLLM server
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    engine = runtime.server.engine
    assert type(engine).__name__ == "VLLMEngine" and engine.base_url == config.policy_url
    with runtime:
        with httpx.Client(base_url=runtime.server.base_url, timeout=600) as http:
            served_versions = []
            for i, question in enumerate(QUESTIONS):
                messages = [{"role": "user", "content": question}]
                first = chat(http, f"s{i}", messages)
                answer = first["choices"][0]["message"]["content"] or ""
                served_versions.append(first["clawloop"]["policy_version"])
                reply = "Thanks, that is right." if i % 2 else "That is too long. Answer in one short sentence."
                chat(http, f"s{i}", messages + [{"role": "assistant", "content": answer},
                                                {"role": "user", "content": reply}])
                http.post(f"/v1/sessions/s{i}/end").raise_for_status()

            # Training runs while sessions go on: a later session may already be served by a trained version.
            assert served_versions[0] == 0 and served_versions == sorted(served_versions)
            trainer = runtime.trainer
            wait_for(lambda: trainer.step >= 1, 1200, "one optimizer step")
            # The sessions may yield more than one batch: let every step they make land and be published, so
            # the weights compared below are the ones vLLM serves.
            assert wait_for_training(runtime, 1200), "the trainer never caught up with the sessions"
            assert engine.policy_version >= 1
            key = {"Authorization": f"Bearer {fleet.policy.api_key}"}  # the fleet's servers ask for their key
            adapters = [m["id"] for m in http.get(f"{config.policy_url}/v1/models", headers=key).json()["data"]]
            assert f"clawloop-v{engine.policy_version}" in adapters  # the adapter was hot-loaded by vLLM

            after = chat(http, "after", [{"role": "user", "content": "Name a colour."}])
            version = after["clawloop"]["policy_version"]
            assert version == engine.policy_version
            turn = runtime.server.store.get_turn(after["clawloop"]["turn_id"])
            # vLLM served the trained adapter: its log-probs are the trainer's (LoRA on the same base). Read with the
            # trainer paused: between steps it works ahead on the reference, with the adapter off.
            model = trainer.core.models.policy
            assert trainer.call_paused(lambda: served_gap(model, turn)) < 5e-3

            # Rollback over the admin route: vLLM serves the kept version at once (v0: the base model), then the
            # latest again (its adapter was unloaded meanwhile and is loaded again).
            latest = engine.policy_version
            for target in (0, latest):
                done = http.post("/v1/admin/rollback", json={"version": target},
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                assert done.status_code == 200, done.text
                again = chat(http, f"rollback-{target}", [{"role": "user", "content": "Name a colour."}])
                assert again["clawloop"]["policy_version"] == target == engine.policy_version
                turn = runtime.server.store.get_turn(again["clawloop"]["turn_id"])

                def gap(turn=turn, target=target) -> float:  # the trainer holds the rolled-back weights too
                    with model.disable_adapter() if target == 0 else contextlib.nullcontext():
                        return served_gap(model, turn)

                assert trainer.call_paused(gap) < 5e-3

    store = Store(tmp_path / "run" / "store.sqlite")
    try:
        steps = store.steps()
        assert steps[0]["step"] == 1
        # The first step the publication gate accepted was served as version 1 (a rejected one keeps version 0).
        accepted = [s for s in steps if s["metrics"].get("gate_accepted") == 1.0]
        assert accepted and accepted[0]["policy_version"] == 1, steps
        assert all(s["policy_version"] == 0 for s in steps if s["step"] < accepted[0]["step"])
        trained = store.samples("consumed")
        assert trained, "no sample was trained"
        for sample in trained:
            votes = store.votes(sample.turn_id)
            assert votes and all("\\boxed{" in v.raw_text and "rule" not in v.raw_text for v in votes)
            if sample.hints:  # distilled: the teacher's top-k came from the vLLM teacher's prompt log-probs
                assert sample.targets is not None
    finally:
        store.close()


def test_two_users_on_vllm_each_served_their_own_policy(vllm_fleet, tmp_path):
    """Per-user policies with the policy on vLLM: a user's conversations train that user's adapter, which vLLM
    then serves to that user alone (``k_…-v<N>``), while the other user is served the base model."""
    from clawloop.api.auth import owner_of

    torch.set_num_threads(2)
    fleet, fleet_config = vllm_fleet
    keys = ["vllm-user-a-7c1d", "vllm-user-b-0e93"]
    config = fleet_config.replace(
        run_dir=str(tmp_path / "run"), port=0, method="rl", judge_backend="rules", rollout_batch_size=2, lr=1e-4,
        prm_m=1, gate=False, checkpoint_every=1000, num_threads=2, device="cpu", api_keys=keys,
        policy_scope="per_user", batch_wait_s=0.0, idle_train_s=0.0)
    a, b = (owner_of(k) for k in keys)
    runtime = build_runtime(config, pipeline_poll_s=0.2, trainer_poll_s=0.2, console=None)
    engine = runtime.server.engine
    with runtime:
        url = runtime.server.base_url
        with httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {keys[0]}"}) as user_a, \
                httpx.Client(base_url=url, timeout=600, headers={"Authorization": f"Bearer {keys[1]}"}) as user_b:
            for i, question in enumerate(QUESTIONS[:2]):
                messages = [{"role": "user", "content": question}]
                answer = chat(user_a, f"a{i}", messages)["choices"][0]["message"]["content"] or ""
                reply = "Thanks, that is right." if i % 2 else "That is too long. Answer in one short sentence."
                chat(user_a, f"a{i}", messages + [{"role": "assistant", "content": answer},
                                                  {"role": "user", "content": reply}])
                user_a.post(f"/v1/sessions/a{i}/end").raise_for_status()
            wait_for(lambda: engine.adapter_version(a) is not None, 1200, "user A's adapter on vLLM")
            version = engine.adapter_version(a)
            key = {"Authorization": f"Bearer {fleet.policy.api_key}"}  # the fleet's servers ask for their key
            served = httpx.get(f"{config.policy_url}/v1/models", headers=key)
            assert f"{a}-v{version}" in [m["id"] for m in served.json()["data"]]

            mine = chat(user_a, "a-after", [{"role": "user", "content": "Name a colour."}])
            theirs = chat(user_b, "b-after", [{"role": "user", "content": "Name a colour."}])
            assert mine["clawloop"]["policy_version"] == version and theirs["clawloop"]["policy_version"] == 0
            assert engine.adapter_version(b) is None
            model = runtime.trainer.policies.models.policy  # holds user A's adapter: the last one trained
            store = runtime.server.store

            def gaps() -> tuple[float, float]:
                mine = served_gap(model, latest_turn(store, a))
                with model.disable_adapter():
                    return mine, served_gap(model, latest_turn(store, b))

            assert max(runtime.trainer.call_paused(gaps)) < 5e-3


def latest_turn(store: Store, owner: str):
    """``owner``'s newest stored turn (per-user turn ids in responses are masked; the store has the real ones)."""
    with store.db.read() as db:
        row = db.execute("SELECT id FROM turns WHERE owner=? ORDER BY id DESC LIMIT 1", (owner,)).fetchone()
    return store.get_turn(int(row["id"]))
