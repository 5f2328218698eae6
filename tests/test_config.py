"""The one Config: the documented defaults, aliases of the original, precedence, and loud failures."""

import argparse
import json

import pytest

from clawloop.config import Config, ConfigError, add_cli_arguments, config_from_args


def test_spec_defaults():
    c = Config.load(env={})
    assert c.method == "hybrid" and c.weights == (1.0, 1.0)
    assert c.topk == 4 and c.max_candidates == 3 and c.prm_m == 3
    assert c.hint_selection == "sequence_optimal" and c.subset_mode == "student"
    assert c.adv_diff_clip == 1.0 and (c.eps_clip, c.eps_clip_high) == (0.2, 0.28)
    assert c.hint_min_chars == 10 and c.rollout_batch_size == 16
    assert c.kl_coef == 0.0 and c.entropy_coef == 0.0
    assert (c.host, c.port) == ("127.0.0.1", 30000)
    assert c.learning_rate == 1e-5
    assert Config.load(env={}, lora=True).learning_rate == 1e-4


@pytest.mark.parametrize("method,weights", [("rl", (1.0, 0.0)), ("opd", (0.0, 1.0)), ("hybrid", (1.0, 1.0))])
def test_method_presets_set_branch_weights(method, weights):
    assert Config.load(env={}, method=method).weights == weights


def test_original_env_names_are_aliases():
    env = {
        "OPENCLAW_TOPK_K": "8", "OPENCLAW_TOPK_W_RL": "0.5", "OPENCLAW_TOPK_W_OPD": "2",
        "OPENCLAW_TOPK_ADV_DIFF_CLIP": "2.0", "OPENCLAW_TOPK_MAX_CAND": "2",
        "OPENCLAW_TOPK_HINT_SELECTION": "token_optimal", "OPENCLAW_TOPK_SUBSET_MODE": "overlap", "PRM_M": "5",
    }
    c = Config.load(env=env)
    assert (c.topk, c.weights, c.adv_diff_clip, c.max_candidates) == (8, (0.5, 2.0), 2.0, 2)
    assert (c.hint_selection, c.subset_mode, c.prm_m) == ("token_optimal", "overlap", 5)


def test_precedence_file_then_alias_then_env_then_cli(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[objective]\ntopk = 5\nprm_m = 2\nlr = 3e-5\n')
    env = {"OPENCLAW_TOPK_K": "6", "CLAWLOOP_PRM_M": "7", "PRM_M": "9"}
    c = Config.load(file=path, env=env)
    assert c.topk == 6  # alias beats file
    assert c.prm_m == 7  # CLAWLOOP_* beats alias
    assert c.lr == 3e-5  # file beats default
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--topk", "3", "--lora"])
    c = config_from_args(args, env=env)
    assert c.topk == 3 and c.lora is True and c.learning_rate == 3e-5


def test_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"method": "rl", "rollout_batch_size": 4}))
    c = Config.load(file=path, env={})
    assert c.weights == (1.0, 0.0) and c.rollout_batch_size == 4


@pytest.mark.parametrize("bad,words", [
    ({"method": "ppo"}, ["method", "hybrid, rl, opd"]),
    ({"hint_selection": "best"}, ["hint_selection", "sequence_optimal"]),
    ({"subset_mode": "union"}, ["subset_mode", "student, teacher, overlap"]),
    ({"topk": 0}, ["topk", ">= 1"]),
    ({"w_rl": -1.0}, ["w_rl", ">= 0"]),
    ({"eps_clip": 1.2}, ["eps_clip", "(0, 1)"]),
    ({"eps_clip_high": 0.0}, ["eps_clip_high"]),
    ({"method": "rl", "w_opd": 1.0}, ["w_opd", "contradicts"]),
    ({"w_rl": 0.0, "w_opd": 0.0}, ["nothing would be trained"]),
    ({"topk": "four"}, ["topk", "not a valid int"]),
    ({"lora": "maybe"}, ["lora", "bool"]),
    ({"judge_context": "everything"}, ["judge_context", "none, last_user, full"]),
    ({"gate_knowledge_samples": -1}, ["gate_knowledge_samples", ">= 0"]),
    ({"gate_max_fact_drop": 1.5}, ["gate_max_fact_drop", "[0, 1]"]),
    ({"gate_reference_dice": 0}, ["gate_reference_dice", "at least 1"]),
    ({"gate_max_preference_drop": -0.5}, ["gate_max_preference_drop", ">= 0"]),
    ({"gate_prompt_state_tokens": -1}, ["gate_prompt_state_tokens", ">= 0"]),
    ({"device": "gpu"}, ["device='gpu'", "auto, cpu, cuda, cuda:N"]),
    ({"api_keys": [1, 2]}, ["api_keys", "not a valid list"]),
    ({"lora": True, "lora_target_modules": [""]}, ["lora_target_modules"]),
])
def test_invalid_values_fail_naming_the_setting(bad, words):
    with pytest.raises(ConfigError) as err:
        Config.load(env={}, **bad)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("name,content,words", [
    ("list.json", b"[1, 2]", "holds a list"),
    ("latin.toml", "topk = 4 # caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ("twice.toml", b"[method]\nlr = 1e-4\n[trainer]\nlr = 2e-4\n", "sets lr twice"),
])
def test_config_files_that_cannot_be_read_as_settings_fail_naming_why(tmp_path, name, content, words):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=words):
        Config.load(file=path, env={})


def test_unknown_settings_fail_loudly(tmp_path):
    with pytest.raises(ConfigError, match="unknown setting"):
        Config.load(env={}, top_k=3)
    with pytest.raises(ConfigError, match="CLAWLOOP_TOPKK"):
        Config.load(env={"CLAWLOOP_TOPKK": "3"})
    # Variables the README names for other tools (the vLLM interpreter, the model cache) are not settings but
    # must not stop a server that inherits them.
    for name in ("CLAWLOOP_VLLM_PYTHON", "CLAWLOOP_CACHE", "CLAWLOOP_CHROMIUM", "CLAWLOOP_FULL_DISK_MODE",
                 "CLAWLOOP_FUZZ_N", "CLAWLOOP_FUZZ_SEED"):
        assert Config.load(env={name: "/somewhere"}).topk == Config().topk
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(file=tmp_path / "missing.toml", env={})
    broken = tmp_path / "broken.toml"
    broken.write_text("topk = = 3")
    with pytest.raises(ConfigError, match="not valid"):
        Config.load(file=broken, env={})


def test_secrets_are_redacted_in_dumps():
    c = Config.load(env={}, api_key="s3cret", judge_api_key="k")
    dumped = json.dumps(c.to_dict(redact=True))
    assert "s3cret" not in dumped and c.to_dict()["api_key"] == "s3cret"


# ---- vLLM roles --------------------------------------------------------------------------------------------


def test_vllm_server_tables_stay_tables_in_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('engine = "vllm"\nlora = true\n[trainer_settings]\nrollout_batch_size = 8\n'
                    '[vllm_policy]\nport = 8001\nextra_args = ["--tensor-parallel-size", "2"]\n'
                    '[vllm_policy.env]\nCUDA_VISIBLE_DEVICES = "4,5"\n')
    config = Config.load(file=path, env={})
    assert config.rollout_batch_size == 8  # an ordinary section is flattened
    assert config.vllm_policy == {"port": 8001, "extra_args": ["--tensor-parallel-size", "2"],
                                  "env": {"CUDA_VISIBLE_DEVICES": "4,5"}}


def test_vllm_server_table_from_env_is_json():
    config = Config.load(env={"CLAWLOOP_ENGINE": "vllm", "CLAWLOOP_VLLM_TEACHER": '{"port": 8002}'})
    assert config.vllm_teacher == {"port": 8002}
    with pytest.raises(ConfigError, match="vllm_teacher"):
        Config.load(env={"CLAWLOOP_ENGINE": "vllm", "CLAWLOOP_VLLM_TEACHER": "port=8002"})


@pytest.mark.parametrize("overrides, words", [
    ({"engine": "sglang"}, "engine"),
    ({"engine": "vllm", "vllm_policy": {"prot": 8001}}, "prot"),
    ({"engine": "vllm", "vllm_policy": {"port": "8001"}}, "port"),
    ({"engine": "vllm", "vllm_policy": {"enable_lora": "yes"}}, "enable_lora"),
    ({"engine": "vllm", "vllm_policy": {"extra_args": [2]}}, "extra_args"),
    ({"policy_url": "http://gpu1:8001"}, "engine='vllm'"),
    ({"vllm_teacher": {"port": 1}}, "engine='vllm'"),
    ({"engine": "vllm", "policy_url": "gpu1:8001"}, "http"),
    ({"engine": "vllm", "policy_url": "http://gpu1:8001", "vllm_policy": {"port": 1}}, "exclude"),
    ({"judge_url": "http://j/v1", "vllm_judge": {"port": 1}}, "exclude"),
    ({"judge_backend": "rules", "vllm_judge": {"port": 1}}, "judge_backend"),
    ({"engine": "vllm", "lora": True, "vllm_policy": {"enable_lora": False}}, "enable_lora"),
    ({"trainer": "remote"}, "admin_key"),
    ({"trainer": "elsewhere"}, "trainer"),
])
def test_inconsistent_vllm_and_role_settings_fail(overrides, words):
    with pytest.raises(ConfigError, match=words):
        Config.load(env={}, **overrides)


def test_an_http_judge_may_be_the_judge_server_clawloop_starts():
    config = Config.load(env={}, engine="vllm", judge_backend="http", vllm_judge={"port": 8003})
    assert config.judge_backend == "http" and config.vllm_judge == {"port": 8003}
    with pytest.raises(ConfigError, match="judge_url"):
        Config.load(env={}, judge_backend="http")


def test_remote_trainer_with_admin_key_is_valid():
    config = Config.load(env={}, trainer="remote", admin_key="k")
    assert config.trainer == "remote"
    assert Config.load(env={}, trainer="remote", train=False).train is False  # nothing leases: no key needed


# ---- sections ----------------------------------------------------------------------------------------------


def test_sections_partition_the_settings_and_every_field_has_help():
    from dataclasses import fields

    from clawloop.config import SECTIONS

    names = [f.name for _, section in SECTIONS for f in fields(section)]
    assert sorted(names) == sorted(f.name for f in fields(Config)) and len(names) == len(set(names))
    assert not {attribute for attribute, _ in SECTIONS} & set(names)  # no section hides a flat setting
    assert [f.name for f in fields(Config)] == names  # flat order = reading order of the sections
    assert all(f.metadata.get("help") for f in fields(Config))


def test_each_component_can_take_its_section(tmp_path):
    from clawloop.config import SECTIONS, GateSettings, TrainerSettings

    path = tmp_path / "c.toml"
    path.write_text('[training]\nlr = 3e-5\nlora = true\n[gating]\ngate_every = 2\n')
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--config", str(path), "--rollout-batch-size", "4", "--judge-url", "http://j/v1"])
    config = config_from_args(args, env={"CLAWLOOP_GATE_MAX_KL": "2.5", "PRM_M": "5"})
    assert config.training == TrainerSettings(lr=3e-5, lora=True, rollout_batch_size=4)
    assert config.training.learning_rate == 3e-5 and config.lr == 3e-5  # the flat names stay
    assert config.gating == GateSettings(gate_every=2, gate_max_kl=2.5)
    assert (config.judging.judge_url, config.judging.prm_m) == ("http://j/v1", 5)
    assert config.objective.weights == config.weights == (1.0, 1.0) and config.objective.needs_hints
    for attribute, section in SECTIONS:
        part = getattr(config, attribute)
        assert type(part) is section and isinstance(config, section)
    assert not hasattr(config.serving, "lr") and not hasattr(config.training, "host")
    # A copy: changing a component's section leaves the config as it was.
    part = config.training
    part.lr = 1.0
    assert config.lr == 3e-5


def test_objective_settings_come_from_the_config_or_its_section():
    from clawloop.losses import ObjectiveSettings

    config = Config.load(env={}, method="rl", subset_mode="teacher", train_temperature=0.0, eps_clip=0.1)
    whole, section = ObjectiveSettings.from_config(config), ObjectiveSettings.from_config(config.objective)
    assert whole == section
    assert (whole.weights, whole.subset_mode, whole.eps_clip) == ((1.0, 0.0), "teacher", 0.1)
    assert whole.temperature == 0.0  # Config's own default: each turn's sampling temperature


def test_help_groups_the_flags_by_section():
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    text = parser.format_help()
    for title in ("engines settings", "serving settings", "judging settings", "objective settings",
                  "training settings", "gating settings"):
        assert title in text
    assert text.index("training settings") < text.index("\n  --lr LR") < text.index("gating settings")
