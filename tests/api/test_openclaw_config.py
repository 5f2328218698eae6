"""``clawloop openclaw-config``: the OpenClaw config follows the served model's real limits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clawloop.cli import main
from clawloop.openclaw_config import (LEAN_PROMPT_TOKENS, OpenClawConfigError, ServedLimits, build_config,
                                      limits_from_server)

PLUGIN = Path(__file__).resolve().parents[2] / "integrations" / "openclaw" / "plugin"


def test_config_from_a_running_server_matches_its_context(make_server, tmp_path, capsys):
    server = make_server(served_model_name="my-policy")
    limits = limits_from_server(server.base_url)
    assert (limits.model_name, limits.context) == ("my-policy", 2048)  # the tiny model's position limit
    assert limits.base_url == server.base_url + "/v1"
    # 2048 tokens cannot hold OpenClaw's prompt: refused with the reason, nothing written.
    out = tmp_path / "openclaw.json"
    assert main(["openclaw-config", "--url", server.base_url, "--out", str(out)]) == 2
    assert "2048 tokens" in capsys.readouterr().err and not out.exists()


def test_lean_and_full_configs_and_the_plugin_block():
    limits = ServedLimits("http://127.0.0.1:30000/v1", "clawloop", 8192)
    cfg = build_config(limits, max_tokens=512)
    model = cfg["models"]["providers"]["clawloop"]["models"][0]
    assert (model["contextWindow"], model["maxTokens"]) == (8192, 512)
    assert model["contextWindow"] - model["maxTokens"] > LEAN_PROMPT_TOKENS
    assert cfg["agents"]["defaults"]["model"]["primary"] == "clawloop/clawloop"
    assert cfg["agents"]["defaults"]["contextInjection"] == "never" and cfg["tools"] == {"profile": "minimal"}
    assert "plugins" not in cfg
    with pytest.raises(OpenClawConfigError, match="16k|longer context"):
        build_config(limits, lean=False)  # stock OpenClaw needs ~13k tokens
    big = build_config(ServedLimits("http://h:1/v1", "qwen", 32768), max_tokens=2048, lean=False)
    assert "tools" not in big and "contextInjection" not in big["agents"]["defaults"]
    assert build_config(ServedLimits("http://h:1/v1", "m", 4096), max_tokens=4096)["models"]["providers"][
        "clawloop"]["models"][0]["maxTokens"] == 1024  # at most a quarter of the context
    with_plugin = build_config(limits, plugin=PLUGIN)
    assert with_plugin["plugins"] == {"load": {"paths": [str(PLUGIN)]}, "entries": {"clawloop": {"enabled": True}}}


def test_cli_writes_the_file_atomically(tmp_path, capsys):
    out = tmp_path / "sub" / "openclaw.json"
    assert main(["openclaw-config", "--model", "default", "--port", "31250", "--max-tokens", "256",
                 "--plugin", str(PLUGIN), "--out", str(out)]) == 0
    cfg = json.loads(out.read_text())
    assert cfg["models"]["providers"]["clawloop"]["baseUrl"] == "http://127.0.0.1:31250/v1"
    assert cfg["models"]["providers"]["clawloop"]["models"][0]["contextWindow"] == 8192  # SmolLM2-135M
    assert [p.name for p in out.parent.iterdir()] == ["openclaw.json"]  # no temporary left
