"""The deployment examples in examples/deploy/ load, validate and describe a coherent layout."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from clawloop.config import Config
from clawloop.fleet import Fleet
from clawloop.engines.vllm_server import VLLMServerSettings

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "deploy"
TOML_FILES = sorted(EXAMPLES.rglob("*.toml"))


def load_example(path: Path, tmp_path: Path, **env: str) -> Config:
    """The example as clawloop reads it, with its model folders pointed at a local stand-in folder."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text('{"vocab_size": 151936}')
    text = path.read_text()
    for line in text.splitlines():
        if line.strip().startswith("model ="):
            text = text.replace(line, f'model = "{model}"')
    local = tmp_path / path.name
    local.write_text(text)
    return Config.load(file=local, env=env)


def test_every_example_is_listed():
    names = {p.relative_to(EXAMPLES).as_posix() for p in TOML_FILES}
    assert names == {"one-gpu-embedded.toml", "one-gpu-vllm.toml", "node-8gpu.toml", "multi-node/api.toml"}


@pytest.mark.parametrize("path", TOML_FILES, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_example_loads_and_validates(path, tmp_path):
    config = load_example(path, tmp_path, CLAWLOOP_ADMIN_KEY="k")
    assert config.api_key, "an example that listens on 0.0.0.0 must require an API key"
    fleet = Fleet.plan(config)
    for server in fleet.servers.values():
        if server.managed:
            assert server.settings.command("python")[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]


def test_one_gpu_examples(tmp_path):
    embedded = load_example(EXAMPLES / "one-gpu-embedded.toml", tmp_path)
    assert embedded.engine == "embedded" and embedded.lora and Fleet.plan(embedded).servers == {}
    config = load_example(EXAMPLES / "one-gpu-vllm.toml", tmp_path)
    fleet = Fleet.plan(config)
    assert set(fleet.servers) == {"policy", "teacher"} and fleet.policy.settings.enable_lora
    shares = [s.settings.gpu_memory_utilization for s in fleet.servers.values()]
    assert sum(shares) <= 0.6, "the trainer shares the GPU: the servers must leave it room"


def test_8_gpu_node_lays_out_roles_as_the_original(tmp_path):
    config = load_example(EXAMPLES / "node-8gpu.toml", tmp_path, CLAWLOOP_ADMIN_KEY="k")
    assert config.engine == "vllm" and config.trainer == "remote" and config.admin_key == "k"
    fleet = Fleet.plan(config)
    gpus = {role: server.settings.env["CUDA_VISIBLE_DEVICES"].split(",") for role, server in fleet.servers.items()}
    assert gpus == {"policy": ["4", "5"], "teacher": ["6"], "judge": ["7"]}
    tp = fleet.policy.settings.extra_args
    assert int(tp[tp.index("--tensor-parallel-size") + 1]) == len(gpus["policy"])
    assert fleet.policy.settings.dev_mode  # full fine-tuning: checkpoints are reloaded through dev-mode routes
    # The trainer runs on the four GPUs nobody else uses, as the file's torchrun line says.
    text = (EXAMPLES / "node-8gpu.toml").read_text()
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc_per_node 4" in text
    assert not set("0123") & {g for ids in gpus.values() for g in ids}
    ports = [s.settings.port for s in fleet.servers.values()] + [config.port]
    assert len(set(ports)) == len(ports)


def test_8_gpu_node_needs_the_admin_key():
    with pytest.raises(Exception, match="admin_key"):
        Config.load(file=EXAMPLES / "node-8gpu.toml", env={})


def test_multi_node_api_attaches_to_the_servers_its_settings_describe(tmp_path):
    config = load_example(EXAMPLES / "multi-node" / "api.toml", tmp_path, CLAWLOOP_ADMIN_KEY="k")
    fleet = Fleet.plan(config)
    assert not any(server.managed for server in fleet.servers.values())
    servers = {}
    for name in ("policy", "teacher", "judge"):
        data = json.loads((EXAMPLES / "multi-node" / f"{name}-server.json").read_text())
        servers[name] = VLLMServerSettings.from_mapping(data)
    assert config.policy_url.endswith(f":{servers['policy'].port}")
    assert config.teacher_url.endswith(f":{servers['teacher'].port}")
    assert config.judge_url.endswith(f":{servers['judge'].port}/v1")
    assert config.judge_model == servers["judge"].served_model_name
    assert servers["policy"].dev_mode and not config.lora  # full weights reach the policy node by reload
    readme = (EXAMPLES / "multi-node" / "README.md").read_text()
    for name in ("policy", "teacher", "judge"):
        assert f"clawloop.engines.vllm_server {name}-server.json" in readme
    assert "--config api.toml" in readme and tomllib.loads((EXAMPLES / "multi-node" / "api.toml").read_text())
