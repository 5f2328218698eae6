"""Weight folders: one writer (atomic, tied tensors, the record last), damage found before loading, and folders
written before the writer existed still load."""

import json

import torch
from safetensors.torch import load_file, save_file

from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer import versions
from clawloop.weight_folder import FolderLayout, folder_problem, read_weight_folder, write_weight_folder

LAYOUT = FolderLayout(tensors="weights.safetensors", record="state.json", required=("step",), optimizer="opt.pt")


def test_tied_tensors_are_written_and_the_folder_reads_back(tmp_path):
    embed = torch.randn(8, 4)
    tied = {"embed.weight": embed, "lm_head.weight": embed, "view.weight": embed[:2]}
    folder = write_weight_folder(tmp_path / "v1", tied, tensors_file="weights.safetensors",
                                 optimizer_state={"state": {}, "param_groups": []}, optimizer_file="opt.pt",
                                 record={"step": 3}, record_file="state.json")
    assert folder_problem(folder, LAYOUT) is None
    read = read_weight_folder(folder, LAYOUT)
    assert read.record == {"step": 3} and read.optimizer == {"state": {}, "param_groups": []}
    assert torch.equal(read.weights["lm_head.weight"], embed) and torch.equal(read.weights["view.weight"], embed[:2])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_damage_is_named_before_anything_loads(tmp_path):
    folder = write_weight_folder(tmp_path / "v1", {"w": torch.ones(64)}, tensors_file="weights.safetensors",
                                 record={"step": 1}, record_file="state.json")
    data = (folder / "weights.safetensors").read_bytes()
    (folder / "weights.safetensors").write_bytes(data[:-10])
    assert folder_problem(folder, LAYOUT) == "weights.safetensors is cut short or corrupt"
    (folder / "state.json").write_text("{\"step\": ")
    assert folder_problem(folder, LAYOUT) == "state.json is not a readable record (damaged JSON or missing fields)"


def test_folders_written_by_the_earlier_code_still_load(tmp_path):
    # The layouts as the earlier writers made them, file by file.
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    save_file({"w": torch.full((3,), 2.0)}, str(step / "weights.safetensors"))
    torch.save({"state": {}, "param_groups": [{"lr": 0.1}]}, step / "optimizer.pt")
    (step / "state.json").write_text(json.dumps({"step": 2, "policy_version": 5}, indent=2) + "\n")
    (tmp_path / "checkpoints" / "latest").write_text("step_2\n")
    loaded = ckpt.load_latest(tmp_path)
    assert (loaded.step, loaded.policy_version) == (2, 5) and torch.equal(loaded.weights["w"], torch.full((3,), 2.0))
    assert loaded.optimizer["param_groups"] == [{"lr": 0.1}]

    v = versions.version_dir(tmp_path, 4)
    v.mkdir(parents=True)
    save_file({"w": torch.ones(2)}, str(v / "weights.safetensors"))
    (v / "version.json").write_text(json.dumps({"version": 4, "step": 2, "lora": True}, indent=1) + "\n")
    stored = versions.load_version(tmp_path, 4)
    assert stored.optimizer is None and stored.meta["step"] == 2 and torch.equal(stored.weights["w"], torch.ones(2))

    # And what the writer makes now reads with the earlier readers' calls.
    written = ckpt.save_checkpoint(tmp_path, 3, 6, {"w": torch.zeros(2)}, None)
    assert json.loads((written / "state.json").read_text())["policy_version"] == 6
    assert torch.equal(load_file(str(written / "weights.safetensors"))["w"], torch.zeros(2))
