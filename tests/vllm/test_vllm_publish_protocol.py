"""What the publishers ask a vLLM server to do, in which order, and what happens when a step fails.

A fake server records the calls and keeps the set of loaded adapters; real adapter and checkpoint folders are
written. The real server is exercised in test_vllm_engine.py; these run in every session.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import load_file, save_file

from clawloop.engines.base import EngineError, SamplingParams
from clawloop.engines.vllm import VLLMEngine
from clawloop.engines.vllm_publish import CheckpointPublisher, LoRAPublisher, LoRAWeights


class FakeAdmin:
    """Answers the publication endpoints; ``fail`` maps a path to the status to answer there, ``fail_once`` to the
    status to answer there the next time only."""

    def __init__(self, dev_mode: bool = True):
        self.calls: list[tuple[str, dict]] = []
        self.adapters: dict[str, str] = {}
        self.fail: dict[str, int] = {}
        self.fail_once: dict[str, int] = {}
        self.dev_mode = dev_mode
        self.hold_completions = threading.Event()
        self.hold_completions.set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.loads(raw) if raw else {}
                status, answer = owner.handle(self.path, body)
                payload = answer.encode() if isinstance(answer, str) else json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, path: str, body: dict):
        self.calls.append((path, body))
        if path in self.fail or path in self.fail_once:
            status = self.fail_once.pop(path, None) or self.fail[path]
            return status, {"error": {"message": f"{path} failed"}}
        if path == "/v1/completions":
            self.hold_completions.wait(10)
            choice = {"text": "", "token_ids": [2], "finish_reason": "stop",
                      "logprobs": {"token_logprobs": [-0.1], "tokens": ["token_id:2"], "top_logprobs": None}}
            return 200, {"choices": [choice], "model": body["model"]}
        if path == "/v1/load_lora_adapter":
            if body["lora_name"] in self.adapters:
                return 400, {"error": {"message": "The lora adapter has already been loaded."}}
            self.adapters[body["lora_name"]] = body["lora_path"]
            return 200, "Success"
        if path == "/v1/unload_lora_adapter":
            if self.adapters.pop(body["lora_name"], None) is None:
                return 404, {"error": {"message": "cannot be found"}}
            return 200, "Success"
        if not self.dev_mode:
            return 404, {"detail": "Not Found"}
        return 200, {"status": "ok"}

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls if p != "/v1/completions"]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def admin():
    server = FakeAdmin()
    yield server
    server.close()


def adapter(seed: int) -> LoRAWeights:
    generator = torch.Generator().manual_seed(seed)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    prefix = "base_model.model.layers.0.q_proj"
    return LoRAWeights(config, {f"{prefix}.lora_A.weight": torch.randn(2, 8, generator=generator),
                                f"{prefix}.lora_B.weight": torch.randn(8, 2, generator=generator)})


def test_lora_versions_route_requests_and_retire_once_unused(admin, tmp_path):
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = LoRAPublisher(engine, tmp_path / "adapters")
    params = SamplingParams(max_tokens=1)

    async def run():
        seen = []
        assert await publisher.publish(adapter(1)) == 1
        seen.append((await engine.generate([1], params)).policy_version)
        admin.hold_completions.clear()  # a request on v1 is still running when v2 arrives
        running = asyncio.ensure_future(engine.generate([1], params))
        await asyncio.sleep(0.2)
        assert await publisher.publish(adapter(2)) == 2
        seen.append(sorted(admin.adapters))  # v1 still loaded: a request uses it
        admin.hold_completions.set()
        seen.append((await running).policy_version)
        await publisher.wait_retired()
        seen.append(sorted(admin.adapters))
        with engine.hold("policy-v2"):  # a stale sample pins v2
            await publisher.publish(adapter(3))
            seen.append(sorted(admin.adapters))
        await publisher.wait_retired()
        seen.append(sorted(admin.adapters))
        return seen

    seen = asyncio.run(run())
    assert seen == [1, ["policy-v1", "policy-v2"], 1, ["policy-v2"], ["policy-v2", "policy-v3"], ["policy-v3"]]
    models = [body["model"] for path, body in admin.calls if path == "/v1/completions"]
    assert models == ["policy-v1", "policy-v1"]
    folder = tmp_path / "adapters" / "policy-v3"
    assert admin.adapters["policy-v3"] == str(folder.resolve())
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 2
    assert torch.equal(load_file(str(folder / "adapter_model.safetensors"))[
        "base_model.model.layers.0.q_proj.lora_B.weight"], adapter(3).state_dict[
        "base_model.model.layers.0.q_proj.lora_B.weight"])
    assert not (tmp_path / "adapters" / "policy-v1").exists() and publisher.unloaded == ["policy-v1", "policy-v2"]

    # After a server restart the publisher loads what it keeps again.
    admin.adapters.clear()
    asyncio.run(publisher.restore())
    assert sorted(admin.adapters) == ["policy-v3"]


def test_lora_publication_failure_keeps_the_old_version(admin, tmp_path):
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = LoRAPublisher(engine, tmp_path / "adapters")
    asyncio.run(publisher.publish(adapter(1)))
    admin.fail["/v1/load_lora_adapter"] = 400
    with pytest.raises(EngineError, match="loading LoRA adapter policy-v2"):
        asyncio.run(publisher.publish(adapter(2)))
    assert engine.policy_version == 1 and engine.route.model == "policy-v1"
    with pytest.raises(EngineError, match="not a PEFT adapter folder"):
        asyncio.run(publisher.publish(tmp_path))
    with pytest.raises(EngineError, match="cannot publish a dict"):
        asyncio.run(publisher.publish({"weight": torch.zeros(1)}))


@pytest.fixture
def base_folder(tmp_path):
    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": True, "vocab_size": 8}))
    (folder / "tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(8, 4), "model.norm.weight": torch.ones(4)},
              str(folder / "model.safetensors"))
    return folder


def full_weights(value: float) -> dict[str, torch.Tensor]:
    embed = torch.full((8, 4), value)
    return {"model.embed_tokens.weight": embed, "model.norm.weight": torch.ones(4), "lm_head.weight": embed}


def test_checkpoint_publication_pauses_reloads_and_resumes(admin, tmp_path, base_folder):
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = CheckpointPublisher(engine, tmp_path / "ckpt", base_folder, keep=1)
    assert asyncio.run(publisher.publish(full_weights(1.0))) == 1
    folder = tmp_path / "ckpt" / "policy-v1"
    assert admin.paths() == ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/update_weight_version",
                             "/resume"]
    rpc = dict(admin.calls)["/collective_rpc"]
    assert rpc == {"method": "reload_weights", "kwargs": {"weights_path": str(folder.resolve())}}
    saved = load_file(str(folder / "model.safetensors"))
    assert sorted(saved) == ["model.embed_tokens.weight", "model.norm.weight"]  # tied lm_head left out
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    assert engine.policy_version == 1 and engine.route.model == "base"

    asyncio.run(publisher.publish(full_weights(2.0)))
    assert not folder.exists() and (tmp_path / "ckpt" / "policy-v2").is_dir()  # keep=1

    with pytest.raises(EngineError, match="does not match the served checkpoint"):
        asyncio.run(publisher.publish({"model.norm.weight": torch.ones(4)}))


def test_a_failed_reload_restores_the_previous_weights_and_resumes(admin, tmp_path, base_folder):
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = CheckpointPublisher(engine, tmp_path / "ckpt", base_folder)
    asyncio.run(publisher.publish(full_weights(1.0)))
    admin.calls.clear()
    admin.fail_once["/reset_prefix_cache"] = 500  # the step after the reload fails; the restore then succeeds
    with pytest.raises(EngineError, match="reloading weights from .*policy-v2 failed.*previous weights .* reloaded"):
        asyncio.run(publisher.publish(full_weights(2.0)))
    paths = admin.paths()
    assert paths[0] == "/pause?mode=wait" and paths[-1] == "/resume" and "/update_weight_version" not in paths
    rpcs = [body["kwargs"]["weights_path"] for path, body in admin.calls if path == "/collective_rpc"]
    assert rpcs == [str((tmp_path / "ckpt" / "policy-v2").resolve()), str((tmp_path / "ckpt" / "policy-v1").resolve())]
    assert engine.policy_version == 1 and publisher.current == tmp_path / "ckpt" / "policy-v1"


def test_when_the_rollback_fails_too_the_server_stays_paused(admin, tmp_path, base_folder):
    """Neither the new nor the previous weights are whole: resuming would serve a half-loaded model under the old
    version, so the server is left paused and the error says so."""
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = CheckpointPublisher(engine, tmp_path / "ckpt", base_folder)
    asyncio.run(publisher.publish(full_weights(1.0)))
    admin.calls.clear()
    admin.fail["/reset_prefix_cache"] = 500  # after the reload and after the rollback alike
    with pytest.raises(EngineError, match="failed too.*the server stays paused"):
        asyncio.run(publisher.publish(full_weights(2.0)))
    paths = admin.paths()
    assert paths[0] == "/pause?mode=wait" and "/resume" not in paths
    assert engine.policy_version == 1
    del admin.fail["/reset_prefix_cache"]
    assert asyncio.run(publisher.publish(full_weights(3.0))) == 2  # a publication that succeeds resumes serving
    assert admin.paths()[-1] == "/resume"


def test_a_version_the_server_fails_to_record_is_still_the_one_served(admin, tmp_path, base_folder):
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = CheckpointPublisher(engine, tmp_path / "ckpt", base_folder)
    admin.fail["/update_weight_version"] = 500  # after the reload succeeded: the new weights are in
    assert asyncio.run(publisher.publish(full_weights(1.0))) == 1
    assert engine.policy_version == 1 and publisher.current == tmp_path / "ckpt" / "policy-v1"
    assert admin.paths()[-1] == "/resume"


def test_checkpoint_publication_needs_a_dev_mode_server(tmp_path, base_folder):
    server = FakeAdmin(dev_mode=False)
    try:
        engine = VLLMEngine(server.url, "base", max_context=64)
        publisher = CheckpointPublisher(engine, tmp_path / "ckpt", base_folder)
        with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
            asyncio.run(publisher.publish(full_weights(1.0)))
        assert engine.policy_version == 0
    finally:
        server.close()


def test_rollback_to_a_loaded_or_retired_adapter_version(admin, tmp_path):
    """A rollback publishes a kept version again under its own number: one still loaded is served as it is (vLLM
    refuses to load a name twice), one already unloaded is loaded again."""
    engine = VLLMEngine(admin.url, "base", max_context=64)
    publisher = LoRAPublisher(engine, tmp_path / "adapters")

    async def run():
        await publisher.publish(adapter(1))
        await publisher.publish(adapter(2))
        await publisher.wait_retired()
        assert sorted(admin.adapters) == ["policy-v2"]
        assert await publisher.publish(adapter(2), version=2) == 2  # back to the version being served
        await publisher.wait_retired()
        assert sorted(admin.adapters) == ["policy-v2"] and engine.policy_version == 2
        assert await publisher.publish(adapter(1), version=1) == 1  # back to a retired version
        await publisher.wait_retired()
        assert sorted(admin.adapters) == ["policy-v1"] and engine.policy_version == 1
        assert (await engine.generate([1], SamplingParams(max_tokens=1))).policy_version == 1

    asyncio.run(run())
    loads = [body["lora_name"] for path, body in admin.calls if path == "/v1/load_lora_adapter"]
    assert loads == ["policy-v1", "policy-v2", "policy-v1"]
    assert torch.equal(load_file(str(tmp_path / "adapters" / "policy-v1" / "adapter_model.safetensors"))[
        "base_model.model.layers.0.q_proj.lora_B.weight"], adapter(1).state_dict[
        "base_model.model.layers.0.q_proj.lora_B.weight"])
