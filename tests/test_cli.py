"""The ``clawloop`` command: serve (as a real subprocess), records export, train, and argument errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from clawloop.cli import build_parser, main
from clawloop.serve import free_port
from clawloop.store import Store, TurnRecord


def _store_with_turns(run_dir, n=2):
    store = Store(run_dir / "store.sqlite")
    for i in range(n):
        store.add_turn(TurnRecord(session_id="s", messages=[{"role": "user", "content": f"q{i}"}], prompt_ids=[1],
                                  response_ids=[5, 2], logprobs=[-0.1, -0.2], temperature=1.0, top_p=1.0,
                                  policy_version=0, turn_index=i))
    store.close()


def test_records_export_appends_jsonl_and_never_truncates(tmp_path, capsys):
    _store_with_turns(tmp_path, 2)
    out = tmp_path / "out"
    assert main(["records", "export", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["lines_appended"] == {"turns.jsonl": 2}
    rows = [json.loads(line) for line in (out / "turns.jsonl").read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in rows] == ["q0", "q1"] and rows[0]["response_ids"] == [5, 2]
    assert main(["records", "export", str(tmp_path), "--out", str(out)]) == 0
    assert len((out / "turns.jsonl").read_text().splitlines()) == 4
    assert main(["records", "export", str(tmp_path)]) == 0  # default folder RUN_DIR/export
    assert (tmp_path / "export" / "turns.jsonl").is_file()


def test_records_export_of_a_folder_without_a_store_fails_cleanly(tmp_path, capsys):
    assert main(["records", "export", str(tmp_path)]) == 2
    assert "no store" in capsys.readouterr().err
    assert main(["records", "export", str(tmp_path / "missing")]) == 2
    (tmp_path / "store.sqlite").write_bytes(b"not a database, " * 512)
    assert main(["records", "export", str(tmp_path)]) == 2
    assert "cannot be read" in capsys.readouterr().err


def test_records_export_runs_beside_the_process_that_holds_the_run(tmp_path, capsys):
    """An export only reads: it does not wait for the store's writer, nor take the run from it."""
    from clawloop.run_folder import open_run_store

    _store_with_turns(tmp_path, 1)
    writer = open_run_store(tmp_path)
    try:
        assert main(["records", "export", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
        assert json.loads(capsys.readouterr().out)["lines_appended"] == {"turns.jsonl": 1}
    finally:
        writer.close()


@pytest.mark.parametrize("command", ["train", "demo", "eval", "serve"])
def test_unknown_flags_are_refused(command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--anything"])
    assert exc.value.code == 2


def _subcommand_paths(parser, prefix=()):
    import argparse

    for action in parser._actions:  # argparse keeps its subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,)
                yield from _subcommand_paths(sub, prefix + (name,))


def test_every_command_prints_its_help(capsys):
    paths = list(_subcommand_paths(build_parser()))
    assert ("serve",) in paths and ("judge", "check") in paths
    for path in [()] + paths:
        with pytest.raises(SystemExit) as exc:
            main([*path, "--help"])
        assert exc.value.code == 0, path
        assert "usage:" in capsys.readouterr().out


def test_train_on_a_folder_without_a_run_fails_cleanly(tmp_path, capsys):
    assert main(["train", str(tmp_path), "--model", "tiny"]) == 2
    assert "holds no run" in capsys.readouterr().err
    _store_with_turns(tmp_path / "a", 1)
    assert main(["train", str(tmp_path / "a"), "--run-dir", str(tmp_path / "b"), "--model", "tiny"]) == 2
    assert "name the run once" in capsys.readouterr().err


def test_train_with_nothing_ready_takes_no_step(tmp_path, capsys):
    _store_with_turns(tmp_path, 2)  # turns still awaiting their next state: no sample to train on
    assert main(["train", str(tmp_path), "--model", "tiny", "--device", "cpu", "--num-threads", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 0


@pytest.mark.parametrize("keys_file_text,words", [(None, "cannot be read"), ("# no key yet\n\n", "holds no key")])
def test_serve_refuses_a_keys_file_without_keys_before_loading_a_model(tmp_path, capsys, keys_file_text, words):
    """An empty keys file would serve everyone without a key; a missing one used to fail after the models loaded."""
    keys_file = tmp_path / "keys.txt"
    if keys_file_text is not None:
        keys_file.write_text(keys_file_text)
    started = time.monotonic()
    assert main(["serve", "--model", "tiny", "--run-dir", str(tmp_path / "run"), "--api-keys-file",
                 str(keys_file)]) == 2
    assert words in capsys.readouterr().err and time.monotonic() - started < 30
    assert not (tmp_path / "run" / "store.sqlite").exists()  # stopped before the run folder was touched


def test_model_files_problems_are_one_line_not_a_traceback(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "no-such-model"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clawloop: ") and "Traceback" not in err


def test_serve_has_a_flag_for_every_setting():
    from dataclasses import fields

    from clawloop.config import Config

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "tiny", "--port", "1234", "--session-idle-timeout-s", "5",
                              "--no-train"])
    assert (args.model, args.port, args.session_idle_timeout_s, args.train) == ("tiny", "1234", "5", False)
    for f in fields(Config):
        assert hasattr(args, f.name)


def wait_until_serving(proc: subprocess.Popen, port: int) -> None:
    """Until the `clawloop serve` process ``proc`` answers /healthz on ``port``; its output if it ends first."""
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "serve did not come up"
        time.sleep(0.2)


def test_clawloop_serve_runs_as_a_process(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawloop.cli", "serve", "--model", "tiny", "--port", str(port), "--run-dir",
         str(tmp_path / "run"), "--num-threads", "2", "--default-max-tokens", "3", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, port)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        # A second server or an offline trainer in the same run folder is refused before it loads anything.
        run_dir = str(tmp_path / "run")
        for command in (["serve", "--run-dir", run_dir, "--model", "tiny", "--port", str(free_port())],
                        ["train", run_dir, "--model", "tiny"]):
            second = subprocess.run([sys.executable, "-m", "clawloop.cli", *command], env=env, capture_output=True,
                                    text=True, timeout=120)
            assert second.returncode == 2, second.stderr
            assert f"Another clawloop process (pid {proc.pid}) is serving or training in" in second.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert (tmp_path / "run" / "store.sqlite").is_file()
    store = Store(tmp_path / "run" / "store.sqlite")
    assert len(store.turns()) == 1  # still awaiting: shutdown keeps it for the next start
    assert store.turns()[0].state == "awaiting_next"


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_service_manager_or_a_closed_terminal_stops_serve_cleanly(tmp_path, stop_signal):
    """SIGTERM and SIGHUP end `clawloop serve` through its own shutdown (exit 0, the run folder closed), not by
    the signal's default, which would leave the vLLM servers it started running."""
    port = free_port()
    # The signal at its default action, as from a terminal: a suite run under ``nohup`` hands its children an
    # ignored SIGHUP, which serve leaves alone.
    start = (f"import runpy, signal, sys; signal.signal({int(stop_signal)}, signal.SIG_DFL); "
             "sys.argv[0] = 'clawloop'; runpy.run_module('clawloop.cli', run_name='__main__')")
    proc = subprocess.Popen(
        [sys.executable, "-c", start, "serve", "--model", "tiny", "--port", str(port), "--run-dir",
         str(tmp_path / "run"), "--num-threads", "2", "--log-level", "warning"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until_serving(proc, port)
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_train_asks_the_base_teacher_for_hinted_samples(tiny_tokenizer, tmp_path, capsys):
    """Offline training has no server, so `clawloop train` loads the frozen base model as the teacher: a sample
    whose only signal is a hint (vote 0) trains its distillation branch instead of being dropped."""
    from clawloop.store import SampleRecord

    store = Store(tmp_path / "store.sqlite")
    messages = [{"role": "user", "content": "Describe the sea."}]
    prompt = list(tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    response = tiny_tokenizer("The sea is wide and deep.", add_special_tokens=False)["input_ids"] + [2]
    tid = store.add_turn(TurnRecord(session_id="s", messages=messages, prompt_ids=prompt, response_ids=response,
                                    logprobs=[-1.0] * len(response), temperature=0.7, top_p=1.0, policy_version=0))
    store.set_next_state(tid, [{"role": "user", "content": "Shorter, please."}])
    store.claim_judgeable(1)
    assert store.put_sample(SampleRecord(turn_id=tid, reward=0.0, kind="opd", hints=["Answer in five words."]))
    store.close()
    assert main(["train", str(tmp_path), "--model", "tiny", "--device", "cpu", "--num-threads", "2",
                 "--method", "hybrid", "--rollout-batch-size", "1", "--no-gate"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["samples"] == 1
    assert summary["last_metrics"]["teacher_asked"] == 1.0 and summary["last_metrics"].get("teacher_missing", 0) == 0
    store = Store(tmp_path / "store.sqlite")
    assert store.count_samples() == {"consumed": 1}
    assert store.get_sample(tid).targets is not None  # the scores it trained on are kept with it
    store.close()


def test_forget_by_key_file_deletes_that_keys_turns_and_writes_a_receipt(tmp_path, capsys):
    from clawloop.api.auth import owner_of

    store = Store(tmp_path / "store.sqlite")
    for owner, text in ((owner_of("alice-secret-key"), "Zanzibar-quartz"), (owner_of("bob-key"), "Kilimanjaro")):
        store.add_turn(TurnRecord(session_id=owner, owner=owner, messages=[{"role": "user", "content": text}],
                                  prompt_ids=[1], response_ids=[5, 2], logprobs=[-0.1, -0.2], temperature=1.0,
                                  top_p=1.0, policy_version=0))
    store.close()
    key_file = tmp_path / "alice.key"
    key_file.write_text("alice-secret-key\n")
    assert main(["forget", str(tmp_path), "--key-file", str(key_file)]) == 0
    receipt = json.loads(capsys.readouterr().out)
    assert receipt["owner"] == owner_of("alice-secret-key") and receipt["turn_ids"] == [1]
    assert "alice-secret-key" not in (tmp_path / "receipts").glob("*.json").__next__().read_text()
    store = Store(tmp_path / "store.sqlite")
    assert [t.owner for t in store.turns()] == [owner_of("bob-key")]
    store.close()
    assert main(["forget", str(tmp_path), "--key-file", str(tmp_path / "missing.key")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["forget", str(tmp_path / "nowhere"), "--user", "k_x"]) == 2


def test_serve_under_nohup_keeps_serving_when_its_terminal_closes(tmp_path):
    """nohup leaves SIGHUP ignored: serve keeps that, and still stops cleanly on SIGTERM."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawloop.cli", "serve", "--model", "tiny", "--port", str(port), "--run-dir",
         str(tmp_path / "run"), "--num-threads", "2", "--log-level", "warning"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))  # what nohup does
    try:
        wait_until_serving(proc, port)
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
