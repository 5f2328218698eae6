"""The distributed trainer (FSDP2 on gloo, 2 processes under torchrun) trains a batch exactly like the
single-process trainer: the same loss, and after the update(s) the same parameters — full fine-tuning, LoRA with
the KL reference and several PPO epochs — and a trainer restarted from its checkpoint continues exactly where the
previous one stopped (weights, AdamW state, step and version counters). The publication gate runs on rank 0:
a candidate it rejects is never published and every rank goes back to the accepted weights; a lost lease stops
no rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from clawloop.serve import free_port
from clawloop.store import Store, TurnState
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.checkpoint import load_latest
from clawloop.trainer.model import load_train_models
from clawloop.trainer.publish import merged_state_dict
from clawloop.trainer.step import make_optimizer, train_step
from tests.trainer.trainer_helpers import add_sample

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _fill(store: Store, base_model, tokenizer) -> None:
    # Hinted and un-hinted samples, mixed rewards; 5 samples so the ranks get unequal shares (3 and 2).
    add_sample(store, base_model, tokenizer, 0, reward=1.0, hints=["Answer in one word."])
    add_sample(store, base_model, tokenizer, 1, reward=-1.0)
    add_sample(store, base_model, tokenizer, 2, reward=1.0)
    add_sample(store, base_model, tokenizer, 3, reward=-1.0, hints=["Be precise.", "Check the units."])
    add_sample(store, base_model, tokenizer, 4, reward=0.0, hints=["Say please."])


@pytest.mark.timeout(150)
def test_two_gloo_ranks_match_single_process(make_config, base_model, tiny_tokenizer, tiny_model_path, tmp_path):
    run_dir = tmp_path / "run"
    store_file = run_dir / "store.sqlite"
    store = Store(store_file)
    _fill(store, base_model, tiny_tokenizer)
    # The step's numbers are compared here; the gate's decisions are tested below.
    settings = dict(rollout_batch_size=5, micro_batch_size=1, lr=1e-2, grad_clip=1.0, gate=False)
    config = make_config(**settings)

    # The single-process reference on the same batch (samples read, not leased: the store stays untouched).
    samples = store.samples(TurnState.READY)
    assert len(samples) == 5
    torch.manual_seed(0)
    models = load_train_models(config)
    optimizer = make_optimizer(models, config)
    items, drops, _ = prepare_items(store, samples, config, 0, None, None)
    assert not drops
    expected = train_step(models, optimizer, items, config)
    expected_weights = merged_state_dict(models)
    store.close()

    args = [str(TORCHRUN), "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "clawloop.trainer.distributed", "--store", str(store_file), "--max-steps", "1", "--poll-s", "0.1"]
    for key, value in dict(model=str(tiny_model_path), device="cpu", run_dir=str(run_dir), num_threads=1,
                           **settings).items():
        args += ["--set", f"{key}={value}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]

    store = Store(store_file)
    steps = store.steps()
    assert [s["step"] for s in steps] == [1]
    assert sorted(steps[0]["turn_ids"]) == sorted(s.turn_id for s in samples)
    assert store.count_samples() == {"consumed": 5}
    got = steps[0]["metrics"]
    assert got["world_size"] == 2.0
    assert got["samples"] == 5.0
    assert got["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-4)
    store.close()

    weights = load_file(str(run_dir / "weights" / "v1" / "model.safetensors"))
    assert set(expected_weights) <= set(weights)
    # AdamW's first update is ~lr·sign(g): the grad-norm check above pins the gradient's scale, this pins its
    # direction. A coordinate whose gradient is ~0 may flip on float-order noise, so a handful (not a layer)
    # is allowed to differ, and by less than a tenth of a step.
    lr = settings["lr"]
    off = total = 0
    for name, want in expected_weights.items():
        diff = (weights[name] - want.float()).abs()
        assert float(diff.max()) < 0.1 * lr, name
        off += int((diff > 1e-5).sum())
        total += diff.numel()
    assert off <= 1e-4 * total, f"{off} of {total} parameters differ"
    # The update really happened (the comparison is not between two untouched copies).
    before = load_train_models(config).causal_lm.state_dict()
    assert any(not torch.allclose(before[k], weights[k]) for k in expected_weights)


def _torchrun(nproc: int) -> list[str]:
    return [str(TORCHRUN), "--nproc_per_node", str(nproc), "--master_port", str(free_port())]


def _run_trainer(launcher: list[str], store_file: Path, run_dir: Path, model_path: Path, settings: dict,
                 max_steps: int) -> subprocess.CompletedProcess:
    """One trainer process group on a local store file (``launcher`` = torchrun with N ranks, or plain python)."""
    args = launcher + ["-m", "clawloop.trainer.distributed", "--store", str(store_file), "--max-steps",
                       str(max_steps), "--poll-s", "0.1"]
    for key, value in dict(model=str(model_path), device="cpu", run_dir=str(run_dir), num_threads=1,
                           **settings).items():
        args += ["--set", f"{key}={value}"]
    return _run_group(args, timeout_s=160)


def _run_group(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run a trainer process group; fail the test when it does not exit 0 within ``timeout_s`` (a hung rank)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    # Own session: on a timeout the whole group goes (torchrun's workers too, not only torchrun).
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"trainer timed out (a rank hung?): {err[-4000:]}")
    assert proc.returncode == 0, err[-4000:]
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _assert_same_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], lr: float) -> None:
    """Parameters after the same update(s), up to float-order noise: every coordinate within a tenth of a step,
    and all but a handful within 1e-5 (see the full fine-tuning test above)."""
    assert set(want) <= set(got)
    off = total = 0
    for name, value in want.items():
        diff = (got[name].float() - value.float()).abs()
        assert float(diff.max()) < 0.1 * lr, name
        off += int((diff > 1e-5).sum())
        total += diff.numel()
    assert off <= 1e-4 * total, f"{off} of {total} parameters differ"


@pytest.mark.timeout(170)
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft, loading the adapter
def test_two_gloo_ranks_lora_with_kl_and_ppo_epochs_match_single_process(make_config, base_model, tiny_tokenizer,
                                                                          tiny_model_path, tmp_path):
    from clawloop.api.trainer_routes import load_weights_folder
    from clawloop.trainer.model import trainable_state_dict

    run_dir = tmp_path / "run"
    store_file = run_dir / "store.sqlite"
    store = Store(store_file)
    _fill(store, base_model, tiny_tokenizer)
    # Without the teacher-support term: LoRA's A matrices get almost no gradient at the second epoch (B starts at
    # 0), so Adam's normalised update there is ±lr by the sign of float noise, and the term's extra gradient tips
    # it. The full fine-tuning equivalence test above runs with the term on.
    settings = dict(rollout_batch_size=5, micro_batch_size=2, lr=1e-2, grad_clip=1.0, gate=False, lora=True,
                    lora_rank=4, lora_alpha=8.0, kl_coef=0.5, steps_per_batch=2, support_coef=0.0)
    config = make_config(**settings)

    samples = store.samples(TurnState.READY)
    models = load_train_models(config)
    optimizer = make_optimizer(models, config)
    items, drops, _ = prepare_items(store, samples, config, 0, None, None)
    assert not drops
    expected = train_step(models, optimizer, items, config)
    expected_adapter = trainable_state_dict(models)
    expected_merged = merged_state_dict(models)
    store.close()

    _run_trainer(_torchrun(2), store_file, run_dir, tiny_model_path, settings, max_steps=1)

    store = Store(store_file)
    steps = store.steps()
    assert [s["step"] for s in steps] == [1] and steps[0]["policy_version"] == 1
    assert store.count_samples() == {"consumed": 5}
    got = steps[0]["metrics"]
    assert got["world_size"] == 2.0 and got["samples"] == 5.0
    # Loss, KL term and gradient norm are the single-process step's (means over both PPO epochs).
    assert expected["ref_kl"] > 0  # the second epoch moved away from the reference
    for key in ("loss", "ref_kl", "grad_norm"):
        assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    store.close()

    # Published as a PEFT adapter folder (what /v1/trainer/weights takes with kind="lora")...
    folder = run_dir / "weights" / "v1"
    assert (folder / "adapter_config.json").is_file()
    adapter = load_file(str(folder / "adapter_model.safetensors"))
    assert set(adapter) == set(expected_adapter)
    _assert_same_update(adapter, expected_adapter, settings["lr"])
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # B moved off zero
    # ... which the API merges into exactly the weights the in-process trainer serves.
    served = load_weights_folder(folder, "lora", tiny_model_path)
    _assert_same_update(served, expected_merged, settings["lr"])
    # The clean exit wrote a checkpoint in the in-process trainer's format: the adapter and AdamW state.
    found = load_latest(run_dir)
    assert found.step == 1 and found.policy_version == 1 and found.state["lora"] is True
    _assert_same_update(found.weights, expected_adapter, settings["lr"])
    # Its AdamW state is keyed as the in-process optimizer keys it (parameter index), with the same moments.
    own = optimizer.state_dict()
    assert [g["params"] for g in found.optimizer["param_groups"]] == [g["params"] for g in own["param_groups"]]
    assert set(found.optimizer["state"]) == set(own["state"])
    for index, state in own["state"].items():
        saved = found.optimizer["state"][index]
        assert float(saved["step"]) == float(state["step"]) == 2.0
        torch.testing.assert_close(saved["exp_avg"], state["exp_avg"], rtol=1e-3, atol=1e-6)


@pytest.mark.timeout(300)
def test_resumed_trainer_continues_weights_optimizer_and_counters(make_config, base_model, tiny_tokenizer,
                                                                  tiny_model_path, tmp_path):
    """One step on 2 ranks (checkpoint every step), then a new 1-rank trainer process trains the next batch:
    the result is the uninterrupted 2-step run's (weights, AdamW moments, KL reference all carried over), and
    step and version continue at 2. Then the store-ahead-of-checkpoint case (a crash between commit and
    checkpoint) resumes to the same result."""
    run_dir = tmp_path / "run"
    store_file = run_dir / "store.sqlite"
    store = Store(store_file)
    for i in range(6):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0,
                   hints=["Answer in one word."] if i in (0, 4) else ())
    # advantage_mode raw and no teacher-support term: this test is about what a resume carries over; with the
    # balanced mode's scaled negatives, or the term's extra pull, more parameters get near-cancelling gradients,
    # whose last bits follow the ranks' summation order (and Adam's normalised update turns them into ±lr).
    settings = dict(rollout_batch_size=3, micro_batch_size=2, lr=1e-2, grad_clip=1.0, gate=False, kl_coef=0.5,
                    checkpoint_every=1, advantage_mode="raw", support_coef=0.0)
    config = make_config(**settings)

    # The uninterrupted run, in process: batches are leased oldest first, 3 at a time.
    samples = store.samples(TurnState.READY)
    models = load_train_models(config)
    optimizer = make_optimizer(models, config)
    first, _, _ = prepare_items(store, samples[:3], config, 0, None, None)
    train_step(models, optimizer, first, config)
    after_first = {k: v.clone() for k, v in merged_state_dict(models).items()}
    second, _, _ = prepare_items(store, samples[3:], config, 1, None, None)
    expected = train_step(models, optimizer, second, config)
    expected_weights = merged_state_dict(models)
    # What a trainer that lost its AdamW state would give (fresh optimizer on the step-1 weights).
    fresh = load_train_models(config)
    fresh.causal_lm.load_state_dict(after_first)
    second_again, _, _ = prepare_items(store, samples[3:], config, 1, None, None)
    train_step(fresh, make_optimizer(fresh, config), second_again, config)
    without_optimizer = merged_state_dict(fresh)
    store.close()

    _run_trainer(_torchrun(2), store_file, run_dir, tiny_model_path, settings, max_steps=1)
    found = load_latest(run_dir)
    assert (found.step, found.policy_version) == (1, 1) and found.optimizer is not None
    _run_trainer([sys.executable], store_file, run_dir, tiny_model_path, settings, max_steps=1)

    store = Store(store_file)
    steps = store.steps()
    assert [(s["step"], s["policy_version"]) for s in steps] == [(1, 1), (2, 2)]
    assert sorted(steps[1]["turn_ids"]) == sorted(s.turn_id for s in samples[3:])
    assert store.count_samples() == {"consumed": 6}
    assert steps[1]["metrics"]["world_size"] == 1.0
    assert steps[1]["metrics"]["loss"] == pytest.approx(expected["loss"], rel=1e-4, abs=1e-6)
    store.close()
    weights = load_file(str(run_dir / "weights" / "v2" / "model.safetensors"))
    lr = settings["lr"]
    _assert_same_update(weights, expected_weights, lr)
    # The comparison can tell: without the restored AdamW state the second update lands elsewhere.
    assert max(float((without_optimizer[k] - expected_weights[k]).abs().max()) for k in expected_weights) > lr
    found = load_latest(run_dir)
    assert (found.step, found.policy_version) == (2, 2)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_1", "step_2"]

    # A crash after step 2 was committed but before its checkpoint: the newest checkpoint is step 1's, the store
    # is ahead. The local store gives step 2's samples back, so they train into the resumed weights once: as
    # step 3, version 3, to the same weights (step 2's row stays, marked requeued; no number is used twice).
    (run_dir / "checkpoints" / "latest").write_text("step_1\n")
    _run_trainer([sys.executable], store_file, run_dir, tiny_model_path, settings, max_steps=1)
    store = Store(store_file)
    steps = store.steps()
    assert [(s["step"], s["policy_version"], s["requeued"]) for s in steps] == \
        [(1, 1, False), (2, 2, True), (3, 3, False)]
    assert sorted(steps[2]["turn_ids"]) == sorted(s.turn_id for s in samples[3:])
    assert store.count_samples() == {"consumed": 6}
    store.close()
    weights = load_file(str(run_dir / "weights" / "v3" / "model.safetensors"))
    _assert_same_update(weights, expected_weights, lr)
    assert load_latest(run_dir).step == 3


@pytest.mark.timeout(200)
def test_a_lease_lost_during_a_step_neither_stops_nor_stalls_the_ranks(base_model, tiny_tokenizer, tiny_model_path,
                                                                        tmp_path):
    """Rank 0's commit is refused (its lease expired while the step ran): every rank goes on, and exits."""
    run_dir = tmp_path / "run"
    store_file = run_dir / "store.sqlite"
    store = Store(store_file)
    _fill(store, base_model, tiny_tokenizer)
    store.close()
    args = _torchrun(2) + [str(HERE / "lost_lease_worker.py"), str(store_file), str(tiny_model_path), str(run_dir)]
    done = _run_group(args, timeout_s=180)
    out, err = done.stdout, done.stderr
    # Both ranks went through both steps; neither commit was taken, so nothing is recorded as trained.
    assert "rank 0 trained 2" in out and "rank 1 trained 2" in out, out
    assert err.count("refused the commit") == 2, err[-4000:]
    store = Store(store_file)
    counts = store.count_samples()
    # No teacher runs in this job: after the first (uncommitted) update moved a sample's top-k, a sample with only
    # an OPD branch has no scores at its new ids and is dropped as teacher_error; none is ever marked trained.
    assert store.steps() == [] and set(counts) <= {TurnState.READY, TurnState.DROPPED}, counts
    assert sum(counts.values()) == 5 and counts.get(TurnState.READY, 0) >= 4, counts
    dropped = [t for t in store.turns() if t.state == TurnState.DROPPED]
    assert all(t.reason == "teacher_error" for t in dropped), [(t.id, t.reason) for t in dropped]
    store.close()


@pytest.mark.timeout(300)
def test_the_gate_on_rank_0_publishes_what_passes_and_takes_every_rank_back_from_what_fails(
        base_model, tiny_tokenizer, tiny_model_path, tmp_path):
    settings = dict(rollout_batch_size=5, micro_batch_size=2, lr=1e-2, lora=True, lora_rank=4, lora_alpha=8.0,
                    gate=True, gate_every=1, gate_probe_tokens=8, checkpoint_every=1)
    # The tiny random model writes word salad, so the guard's share is left out; the KL bound decides.
    outcomes = {}
    for name, max_kl in (("passes", 1e9), ("fails", 1e-9)):
        run_dir = tmp_path / name
        store_file = run_dir / "store.sqlite"
        store = Store(store_file)
        _fill(store, base_model, tiny_tokenizer)
        store.close()
        done = _run_trainer(_torchrun(2), store_file, run_dir, tiny_model_path,
                            dict(settings, gate_min_guard_pass=0.0, gate_max_kl=max_kl), max_steps=1)
        store = Store(store_file)
        (row,) = store.steps()
        events = [e["kind"] for e in store.events() if e["kind"].startswith("gate_")]
        store.close()
        adapter = load_latest(run_dir).weights
        outcomes[name] = (row, events, adapter, done.stderr)

    row, events, adapter, _ = outcomes["passes"]
    assert row["metrics"]["gate_accepted"] == 1.0 and row["metrics"]["published"] == 1.0 and row["policy_version"] == 1
    assert events == ["gate_accepted"] and (tmp_path / "passes" / "weights" / "v1").is_dir()
    assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k)  # the update is kept

    row, events, adapter, err = outcomes["fails"]
    assert row["metrics"]["gate_accepted"] == 0.0 and row["metrics"]["published"] == 0.0 and row["policy_version"] == 0
    assert events == ["gate_rejected"] and "rejected by the publication gate" in err
    assert not (tmp_path / "fails" / "weights" / "v1").exists()  # never published
    # Every rank went back to the accepted (starting) weights: the checkpoint after the step holds LoRA's B = 0.
    assert all(float(v.abs().max()) == 0 for k, v in adapter.items() if "lora_B" in k)


def test_a_gate_that_fails_rejects_the_candidate_instead_of_stopping_training(make_config, base_model,
                                                                            tiny_tokenizer, tmp_path):
    """The one loop on any rank: a gate that raises (out of memory on rank 0, say) rejects the candidate, which is
    never served; the step stands with its samples consumed and the weights go back to the accepted ones."""
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.model import trainable_state_dict
    from clawloop.trainer.publish import LocalVersion

    class BrokenGateView:
        def check(self, gate, candidate, accepted):
            raise RuntimeError("out of memory")

    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i else -1.0)
    config = make_config(method="rl", lr=1e-2, gate=True, gate_every=1)
    trainer = Trainer(config, store, LocalVersion(), console=None, gate_view=BrokenGateView())
    before = trainable_state_dict(trainer.models)
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics["gate_accepted"] == 0.0 and metrics["gate_error"] == 1.0 and metrics["published"] == 0.0
    assert trainer.policy_version == 0 and store.count_samples() == {"consumed": 2}
    (event,) = [e for e in store.events() if e["kind"].startswith("gate_")]
    assert event["kind"] == "gate_rejected" and "out of memory" in event["detail"]["reasons"][0]
    after = trainable_state_dict(trainer.models)
    assert all(torch.equal(before[k], after[k]) for k in before)
    trainer.close()
    store.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("max_kl", [1e9, 1e-9], ids=["accepted", "rejected"])
def test_torchrun_records_versions_and_gate_events_as_the_embedded_trainer_does(make_config, base_model,
                                                                                tiny_tokenizer, tiny_model_path,
                                                                                tmp_path, max_kl):
    """The same batch through the embedded trainer and through 2 ranks: the same version rows (numbered by the
    store), the same gate events and the same version folders on disk."""
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion
    from clawloop.trainer.versions import list_versions

    settings = dict(rollout_batch_size=5, micro_batch_size=2, lr=1e-2, lora=True, lora_rank=4, lora_alpha=8.0,
                    gate=True, gate_every=1, gate_probe_tokens=8, checkpoint_every=1, gate_min_guard_pass=0.0,
                    gate_max_kl=max_kl)
    recorded = {}
    for name in ("embedded", "torchrun"):
        run_dir = tmp_path / name
        store_file = run_dir / "store.sqlite"
        store = Store(store_file)
        _fill(store, base_model, tiny_tokenizer)
        if name == "embedded":
            trainer = Trainer(make_config(run_dir=str(run_dir), **settings), store, LocalVersion(), console=None)
            trainer.run_batch(*store.lease_samples(5))
            trainer.close()
            store.close()
        else:
            store.close()
            _run_trainer(_torchrun(2), store_file, run_dir, tiny_model_path, settings, max_steps=1)
        store = Store(store_file)
        recorded[name] = (
            [(v["version"], v["step"], v["status"]) for v in store.versions()],
            [(e["kind"], e["step"], e["version"], e["detail"].get("steps"), e["detail"].get("restored_version"))
             for e in store.events()],
            [(s["step"], s["policy_version"], s["metrics"]["published"]) for s in store.steps()],
            list_versions(run_dir))
        store.close()
    assert recorded["torchrun"] == recorded["embedded"]
    versions, events, steps, kept = recorded["torchrun"]
    if max_kl > 1:
        assert versions == [(1, 1, "accepted")] and kept == [0, 1] and steps == [(1, 1, 1.0)]
        assert [e[0] for e in events] == ["gate_accepted"]
    else:
        assert versions == [] and kept == [0] and steps == [(1, 0, 0.0)]
        assert events == [("gate_rejected", 1, 0, [1], 0)]
