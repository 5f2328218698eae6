"""``clawloop eval`` / ``demo`` / ``eval-users`` refuse a mistake before anything is written or run, never reuse
cells run with other settings, and keep the table of the finished cells when a cell fails. Every cell here is a
stand-in for ``run_loop``: no model is loaded."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from clawloop.cli import main
from clawloop.sim import compare
from clawloop.sim import demo as demo_module
from clawloop.sim import users as users_module


def _summary(config, options):
    """What ``run_loop`` returns, in the parts the table and the settings check read."""
    curve = [{"interactions": 0, "score": 0.0, "guard_pass_rate": 1.0},
             {"interactions": 12, "score": 0.6, "guard_pass_rate": 1.0}]
    return {"curve": curve, "before": {"score": 0.0, "guard_pass_rate": 1.0},
            "after": {"score": 0.6, "guard_pass_rate": 1.0}, "steps": 3, "timings_s": {"total_s": 60.0},
            "settings": config.to_dict(redact=True), "options": asdict(options)}


@pytest.fixture
def cells(monkeypatch):
    """The (method, persona, seed) of every cell run, each by a stand-in for ``run_loop``."""
    ran = []

    def fake_run_loop(config, options, out=print):
        ran.append((config.method, options.persona, options.seed))
        return _summary(config, options)

    monkeypatch.setattr(compare, "run_loop", fake_run_loop)
    return ran


def _eval(out, *flags):
    return main(["eval", "--model", "tiny", "--personas", "brief", "--seeds", "0", "--methods", "hybrid",
                 "--out", str(out), *flags])


@pytest.mark.parametrize("flags, setting", [
    (["--w-opd", "0.3"], "w_opd"),
    (["--w-rl", "0.5"], "w_rl"),
    (["--no-eval-each-version"], "eval_each_version"),
])
def test_eval_does_not_reuse_cells_run_with_other_weights_or_version_scoring(tmp_path, cells, capsys, flags,
                                                                               setting):
    out = tmp_path / "eval"
    assert _eval(out) == 0 and len(cells) == 1
    capsys.readouterr()
    assert _eval(out, *flags) == 2
    assert len(cells) == 1 and f"other settings ({setting})" in capsys.readouterr().out


def test_a_folder_from_before_these_settings_were_recorded_is_judged_by_what_its_cells_ran_with(tmp_path, cells,
                                                                                               capsys):
    out = tmp_path / "eval"
    assert _eval(out) == 0
    recorded = json.loads((out / "settings.json").read_text())
    for key in ("w_rl", "w_opd", "eval_each_version"):
        del recorded[key]
    (out / "settings.json").write_text(json.dumps(recorded))
    assert _eval(out, "--seeds", "1") == 0 and cells[-1] == ("hybrid", "brief", 1)  # as its cells ran: goes on
    assert _eval(out, "--seeds", "2", "--w-opd", "0.3") == 2
    assert _eval(out, "--seeds", "2", "--no-eval-each-version") == 2
    assert len(cells) == 2

    # A cell from before the option existed scored no served version: only --no-eval-each-version matches it.
    result_path = out / "cells" / "hybrid-brief-s0" / "result.json"
    result = json.loads(result_path.read_text())
    del result["options"]["eval_each_version"]
    result_path.write_text(json.dumps(result))
    (out / "cells" / "hybrid-brief-s1" / "result.json").unlink()
    assert _eval(out, "--seeds", "1") == 2
    assert _eval(out, "--seeds", "1", "--no-eval-each-version") == 0 and len(cells) == 3


@pytest.mark.parametrize("personas", ["nope", "brief,nope"])
def test_an_unknown_persona_stops_eval_before_anything_is_written(tmp_path, cells, capsys, personas):
    out = tmp_path / "eval"
    assert main(["eval", "--model", "tiny", "--personas", personas, "--seeds", "0", "--out", str(out)]) == 2
    assert not out.exists() and cells == []
    assert "no built-in persona 'nope'" in capsys.readouterr().err


def test_a_method_whose_settings_are_invalid_stops_eval_before_its_first_cell(tmp_path, cells, capsys):
    out = tmp_path / "eval"
    assert _eval(out, "--methods", "hybrid,rl", "--w-opd", "0.5") == 2
    assert not out.exists() and cells == []
    err = capsys.readouterr().err
    assert "method 'rl'" in err and "w_opd=0.5" in err and "Traceback" not in err


def test_seeds_that_are_not_numbers_stop_eval_before_anything_is_written(tmp_path, cells, capsys):
    out = tmp_path / "eval"
    assert _eval(out, "--seeds", "0,x") == 2
    assert not out.exists() and "--seeds" in capsys.readouterr().err


def test_a_failing_cell_leaves_the_table_of_the_cells_that_finished(tmp_path, monkeypatch):
    def run_loop_failing_on_seed_1(config, options, out=print):
        if options.seed == 1:
            raise RuntimeError("the machine ran out of memory")
        return _summary(config, options)

    monkeypatch.setattr(compare, "run_loop", run_loop_failing_on_seed_1)
    out = tmp_path / "eval"
    with pytest.raises(RuntimeError, match="out of memory"):
        _eval(out, "--seeds", "0,1")
    table = (out / "table.md").read_text()
    assert "| brief | hybrid | 0 |" in table
    assert json.loads((out / "table.json").read_text())["rows"][0]["seeds"] == [0]


def test_an_unknown_persona_stops_the_demo_before_anything_is_written(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(demo_module, "run_loop", lambda config, options: ran.append(options))
    run_dir = tmp_path / "demo"
    assert main(["demo", "--model", "tiny", "--persona", "nope", "--run-dir", str(run_dir)]) == 2
    assert not run_dir.exists() and ran == []
    assert "no built-in persona 'nope'" in capsys.readouterr().err


def test_a_negative_heldout_n_is_refused_by_demo_eval_and_eval_users(tmp_path, monkeypatch, cells, capsys):
    ran = []
    monkeypatch.setattr(demo_module, "run_loop", lambda config, options: ran.append(options))
    monkeypatch.setattr(users_module, "run_users", lambda *args, **kwargs: ran.append(kwargs))
    for command, folder in (("demo", "--run-dir"), ("eval", "--out"), ("eval-users", "--out")):
        assert main([command, "--model", "tiny", "--heldout-n", "-1", folder, str(tmp_path / command)]) == 2
        assert "--heldout-n must be 0" in capsys.readouterr().err
    assert ran == [] and cells == []
