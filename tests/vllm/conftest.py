"""Fixtures for tests against real vLLM servers (marker ``vllm``).

* ``vllm_python`` (session): the vLLM interpreter (``$CLAWLOOP_VLLM_PYTHON`` or ``.venv-vllm/bin/python``);
  every ``vllm`` test is skipped with the reason when there is none.
* ``vllm_fleet`` (session): two servers on SmolLM2-135M-Instruct started from a ``Config`` (``engine = "vllm"``,
  ``lora``, ``[vllm_policy]`` / ``[vllm_teacher]``) by ``clawloop.fleet.Fleet``, as ``clawloop serve``
  starts them: float32, eager mode (no torch.compile: a start of 2-5 minutes on a small shared CPU instead of
  5-10), launched together and stopped at the end; yields the fleet and the config with their URLs.
* ``vllm_servers`` (session): the same servers by name: ``"policy"`` with LoRA hot-loading (generation,
  publication) and ``"scorer"`` (the teacher) without LoRA (prompt log-prob scoring, which crashes vLLM 0.32's
  CPU engine when LoRA is enabled). Both run in dev mode for checkpoint reloads. Their logs are in the run
  folder's ``logs/``; a failed start shows the log's tail.
* ``hf_engine`` (session): the embedded engine on the same model, the reference for every number.
* ``smol_tokenizer`` / ``smol_prompt(text)``: the model's tokenizer and a ChatML prompt for one user message.
"""

from __future__ import annotations

import pytest

from clawloop.config import Config
from clawloop.engines import model_files
from clawloop.fleet import Fleet
from clawloop.engines.vllm_server import find_vllm_python

STARTUP_TIMEOUT_S = 900.0


def pytest_collection_modifyitems(config, items):
    if find_vllm_python() is not None:
        return
    skip = pytest.mark.skip(reason="no vLLM interpreter: run scripts/setup_vllm_venv.sh (.venv-vllm) or set "
                                   "CLAWLOOP_VLLM_PYTHON")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def vllm_python():
    python = find_vllm_python()
    if python is None:
        pytest.skip("no vLLM interpreter: run scripts/setup_vllm_venv.sh or set CLAWLOOP_VLLM_PYTHON")
    return python


@pytest.fixture(scope="session")
def smol_dir():
    return model_files.default_model_dir()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir):
    return model_files.load_tokenizer(smol_dir)


@pytest.fixture(scope="session")
def smol_prompt(smol_tokenizer):
    def make(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return list(smol_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

    return make


@pytest.fixture(scope="session")
def vllm_fleet(vllm_python, smol_dir, tmp_path_factory):
    """The servers, started the way ``clawloop serve`` starts them: ``Fleet.plan(config).start()``."""
    run_dir = tmp_path_factory.mktemp("vllm-run")
    common = dict(python=str(vllm_python), max_model_len=2048, max_num_seqs=8, max_logprobs=64, enforce_eager=True,
                  dev_mode=True, block_size=32, startup_timeout_s=STARTUP_TIMEOUT_S)
    config = Config.load(env={}, model=str(smol_dir), run_dir=str(run_dir), engine="vllm", lora=True, lora_rank=8,
                         method="hybrid", vllm_policy={**common, "max_loras": 2}, vllm_teacher=common)
    fleet = Fleet.plan(config)
    assert set(fleet.servers) == {"policy", "teacher"}
    fleet.start()
    try:
        yield fleet, fleet.resolve(config)
    finally:
        fleet.stop()


@pytest.fixture(scope="session")
def vllm_servers(vllm_fleet):
    """``"policy"``: LoRA hot-loading (generation, publication); ``"scorer"``: the frozen teacher, no LoRA."""
    fleet, _ = vllm_fleet
    return {"policy": fleet.policy, "scorer": fleet.teacher}


@pytest.fixture(scope="session")
def hf_engine(smol_dir):
    from clawloop.engines.hf import HFEngine

    engine = HFEngine(smol_dir, device="cpu", num_threads=2, max_batch_size=4)
    yield engine
    engine.close_sync()
