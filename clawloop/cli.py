"""The ``clawloop`` command. It parses arguments and calls into the package; it holds no logic of its own.

    clawloop serve [--model tiny] [--port 30000] [--api-key KEY] ...   (every Config setting is a flag)
    clawloop records export RUN_DIR [--out DIR]
    clawloop demo [--persona brief] [--interactions 72] [--seed 0] [--run-dir DIR] [--judge-url URL] ...
    clawloop eval [--methods rl,opd,hybrid] [--personas brief,inshort] [--seeds 0,1,2] [--out DIR] ...
    clawloop eval-users [--personas brief,inshort] [--persona-file FILE] [--out DIR] ...
    clawloop train ...
    clawloop judge check [--backend rules|engine | --judge-url URL --judge-model M --judge-api-key-env VAR]
    clawloop openclaw [--openclaw-dir DIR] [--plugin DIR] ...   (every Config setting is a flag, as for serve)
    clawloop openclaw-end SESSION [--run-dir DIR] [--openclaw-dir DIR]
    clawloop openclaw-config [--url http://127.0.0.1:30000] [--out ~/.openclaw/openclaw.json]
    clawloop rollback RUN_DIR --to N [--url http://127.0.0.1:30000] [--admin-key KEY]
    clawloop forget RUN_DIR (--user OWNER | --key-file FILE)
    clawloop dashboard RUN_DIR [--host 127.0.0.1] [--port 30100] [--admin-key KEY]
"""

from __future__ import annotations

import argparse
import json
import logging
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path

from clawloop.config import ConfigError, add_cli_arguments, config_from_args

from clawloop.store import STORE_FILENAME, find_store


def cmd_serve(args: argparse.Namespace) -> int:
    from clawloop.judge.endpoint_check import JudgeEndpointError
    from clawloop.run_folder import RunFolderError

    config = config_from_args(args)
    if config.train:
        from clawloop.runtime import run
    else:
        from clawloop.serve import run
    kwargs = {"resume": args.resume, "fresh": args.fresh} if config.train else {}
    for flag, given in (("--resume", args.resume), ("--fresh", args.fresh)):
        if given and not config.train:
            print(f"clawloop serve: {flag} needs training on (drop --no-train)", file=sys.stderr)
            return 2
        if given and config.trainer != "embedded":  # this process then keeps no checkpoints of its own
            print(f"clawloop serve: {flag} is for the embedded trainer; with trainer={config.trainer} the trainer "
                  "processes resume from the checkpoints they write themselves", file=sys.stderr)
            return 2
    from clawloop.serve import stop_on_termination

    stop_on_termination()
    try:
        run(config, log_level=args.log_level, **kwargs)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP, after a clean shutdown: not an error
        pass
    except (RunFolderError, JudgeEndpointError) as exc:  # a known start-up problem: its own paragraph
        print(f"clawloop serve: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_records_export(args: argparse.Namespace) -> int:
    from clawloop.store import Store

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"clawloop: {run_dir} is not a folder", file=sys.stderr)
        return 2
    try:
        path = find_store(run_dir)
    except FileNotFoundError as exc:
        print(f"clawloop: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "export"
    try:  # read-only: an export changes nothing in the run, and runs beside a server writing it
        store = Store(path, readonly=True)
        try:
            counts = store.export_jsonl(out)
        finally:
            store.close()
    except sqlite3.DatabaseError as exc:
        print(f"clawloop: the store {path} cannot be read (SQLite: {exc})", file=sys.stderr)
        return 2
    print(json.dumps({"store": str(path), "out": str(out), "lines_appended": counts}))
    return 0


def _config_cli_values(args: argparse.Namespace) -> dict:
    import dataclasses

    from clawloop.config import Config

    names = {f.name for f in dataclasses.fields(Config)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def cmd_demo(args: argparse.Namespace) -> int:
    from clawloop.sim.demo import (LoopOptions, check_user_arguments, default_run_dir, demo_config, persona_name,
                                   print_result, run_loop)

    cli = _config_cli_values(args)
    seed = int(cli.get("seed", 0))
    run_dir = Path(cli.get("run_dir") or default_run_dir(persona_name(args), seed))
    if (run_dir / STORE_FILENAME).exists():
        print(f"clawloop demo: {run_dir} already holds a run; pick a fresh --run-dir", file=sys.stderr)
        return 2
    problem = check_user_arguments(args)
    if problem:
        print(f"clawloop demo: {problem}", file=sys.stderr)
        return 2
    cli.update(run_dir=str(run_dir), seed=seed)
    cli.setdefault("port", 0)
    config = demo_config(cli, file=args.config)
    options = LoopOptions(persona=args.persona, persona_file=(args.persona_file or [""])[0],
                          interactions=args.interactions, seed=seed,
                          eval_every=args.eval_every, heldout_n=args.heldout_n, user_url=args.user_url,
                          user_model=args.user_model, user_api_key_env=args.user_api_key_env, max_lag=args.max_lag)
    summary = run_loop(config, options)
    print_result(summary)
    print(f"  wrote {run_dir / 'summary.json'} and {run_dir / 'learning_curve.png'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from clawloop.sim.compare import main_from_args
    from clawloop.sim.demo import check_user_arguments

    problem = check_user_arguments(args)
    if problem:
        print(f"clawloop eval: {problem}", file=sys.stderr)
        return 2
    return main_from_args(args, _config_cli_values(args))


def cmd_eval_users(args: argparse.Namespace) -> int:
    from clawloop.sim.users import cmd_eval_users as run

    return run(args, _config_cli_values(args))


def cmd_train(args: argparse.Namespace) -> int:
    from clawloop.engines.model_files import resolve_model
    from clawloop.run_folder import RunFolderError, TrainedWith, check_resumable, open_run_store
    from clawloop.trainer.offline import train_offline

    run_dir = Path(args.folder)
    if args.run_dir and Path(args.run_dir).resolve() != run_dir.resolve():
        print(f"clawloop train: RUN_DIR is {run_dir} and --run-dir {args.run_dir}: name the run once",
              file=sys.stderr)
        return 2
    if not (run_dir / STORE_FILENAME).exists():
        print(f"clawloop train: {run_dir} holds no run ({STORE_FILENAME} missing)", file=sys.stderr)
        return 2
    config = config_from_args(args).replace(run_dir=str(run_dir))
    try:  # the checks `clawloop serve --resume` makes, before any model is loaded
        held = open_run_store(run_dir)  # kept open: the run folder is this process's until training ends
    except RunFolderError as exc:
        print(f"clawloop train: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            check_resumable(run_dir, TrainedWith(resolve_model(config.model), config.lora))
        except RunFolderError as exc:
            print(f"clawloop train: {exc}", file=sys.stderr)
            return 2
        from clawloop.assemble import offline_teacher

        with offline_teacher(config) as teacher:
            summary = train_offline(config, run_dir, args.max_steps, teacher=teacher)
    finally:
        held.close()
    print(json.dumps(summary, default=str))
    return 0


def cmd_judge_check(args: argparse.Namespace) -> int:
    import os

    from clawloop.judge.check import run_command
    from clawloop.judge.endpoint_check import JudgeEndpointError

    if args.backend:
        args.judge_backend = args.backend
    if args.judge_api_key_env:
        key = os.environ.get(args.judge_api_key_env, "")
        if not key:
            print(f"clawloop judge check: ${args.judge_api_key_env} is empty or unset", file=sys.stderr)
            return 2
        args.judge_api_key = key
    if args.judge_url and not args.judge_backend:
        args.judge_backend = "http"
    config = config_from_args(args)
    try:
        return run_command(config, cases_path=Path(args.cases) if args.cases else None, limit=args.limit,
                           case_concurrency=args.case_concurrency,
                           details=Path(args.details) if args.details else None, as_json=args.json)
    except JudgeEndpointError as exc:
        print(f"clawloop judge check: {exc}", file=sys.stderr)
        return 2


def cmd_openclaw_config(args: argparse.Namespace) -> int:
    from clawloop.openclaw_config import (OpenClawConfigError, build_config, limits_from_model, limits_from_server,
                                          plugin_dir, write_config)

    try:
        if args.url:
            limits = limits_from_server(args.url, args.api_key or "")
        else:
            limits = limits_from_model(args.model, args.host, args.port, args.served_model_name)
        plugin = plugin_dir(args.plugin) if args.plugin else None
        config = build_config(limits, max_tokens=args.max_tokens, lean=not args.full, plugin=plugin)
    except OpenClawConfigError as exc:
        print(f"clawloop openclaw-config: {exc}", file=sys.stderr)
        return 2
    if args.out:
        write_config(config, Path(args.out).expanduser())
        print(f"wrote {args.out} (context {limits.context}, maxTokens "
              f"{config['models']['providers']['clawloop']['models'][0]['maxTokens']})", file=sys.stderr)
    else:
        print(json.dumps(config, indent=2))
    return 0


def cmd_openclaw(args: argparse.Namespace) -> int:
    from clawloop.openclaw_config import OpenClawConfigError
    from clawloop.judge.endpoint_check import JudgeEndpointError
    from clawloop.openclaw_launch import OpenClawSetupError, bring_up
    from clawloop.run_folder import RunFolderError
    from clawloop.serve import stop_on_termination

    stop_on_termination()
    try:
        bring_up(config_from_args(args), openclaw_dir=args.openclaw_dir, plugin=args.plugin,
                 max_tokens=args.max_tokens, full=args.full, openclaw=args.openclaw_bin, resume=args.resume,
                 fresh=args.fresh, log_level=args.log_level)
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP, after a clean shutdown: not an error
        pass
    except (OpenClawSetupError, OpenClawConfigError, RunFolderError, JudgeEndpointError) as exc:
        print(f"clawloop openclaw: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_openclaw_end(args: argparse.Namespace) -> int:
    from clawloop.openclaw_launch import OpenClawFolder, OpenClawSetupError, end_openclaw_session

    config = config_from_args(args)
    folder = OpenClawFolder.for_run(config.run_dir, args.openclaw_dir)
    try:
        ended = end_openclaw_session(config, folder, args.session)
    except OpenClawSetupError as exc:
        print(f"clawloop openclaw-end: {exc}", file=sys.stderr)
        return 2
    if ended:
        print(f"ended {', '.join(ended)} (OpenClaw session {args.session}); its last answer gets no next state")
    else:
        print(f"OpenClaw session {args.session} had ended already")
    return 0


def cmd_forget(args: argparse.Namespace) -> int:
    from clawloop.trainer.forget import forget_command

    owner = args.user
    if args.key_file:
        from clawloop.api.auth import owner_of

        try:
            lines = Path(args.key_file).read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            print(f"clawloop forget: cannot read {args.key_file}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        key = lines[0].strip() if lines else ""
        if not key:
            print(f"clawloop forget: {args.key_file} holds no key on its first line", file=sys.stderr)
            return 2
        owner = owner_of(key)
    return forget_command(args.run_dir, owner)


def cmd_rollback(args: argparse.Namespace) -> int:
    from clawloop.trainer.rollback import rollback_command

    return rollback_command(args.run_dir, args.to, url=args.url, admin_key=args.admin_key)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from clawloop.config import Config
    from clawloop.dashboard.standalone import serve_dashboard

    run_dir = Path(args.run_dir)
    try:
        find_store(run_dir)
    except FileNotFoundError as exc:
        print(f"clawloop: {exc}", file=sys.stderr)
        return 2
    cli = {"host": args.host, "port": args.port, "admin_key": args.admin_key}
    serve_dashboard(run_dir, Config.load(cli=cli), model=args.model, log_level=args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clawloop", description="Train an LLM agent online from its own "
                                     "conversations.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Serve the policy behind an OpenAI-compatible API.")
    add_cli_arguments(serve)
    serve.add_argument("--resume", action="store_true", help="Continue the run in --run-dir from its newest "
                       "intact checkpoint (samples of steps after it are trained again, none twice; a damaged "
                       "checkpoint is skipped, and the log says which).")
    serve.add_argument("--fresh", action="store_true", help="Start the run in --run-dir over from the starting "
                       "weights: its checkpoints/ and versions/ are moved to RUN_DIR/archive/<date-time>/ (nothing "
                       "is deleted; the store's record is kept and step and version numbers go on). Without "
                       "--resume or --fresh, a run folder that holds checkpoints or versions is refused.")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="Log level of the server.")
    serve.set_defaults(func=cmd_serve)

    records = sub.add_parser("records", help="Work with the records of a run.")
    records_sub = records.add_subparsers(dest="records_command", required=True)
    export = records_sub.add_parser("export", help="Append every turn, sample and step of a run to JSONL files.")
    export.add_argument("run_dir", metavar="RUN_DIR", help="The run folder (holding store.sqlite).")
    export.add_argument("--out", metavar="DIR", help="Output folder (default RUN_DIR/export); files are appended "
                        "to, never truncated.")
    export.set_defaults(func=cmd_records_export)

    from clawloop.sim import demo as demo_defaults

    demo = sub.add_parser("demo", help="Watch the default model learn a simulated user's preference online.",
                          description="Serve the default model, run a simulated user through the HTTP API while "
                          "the server judges and trains online, and report the held-out preference score before "
                          "and after. The demo preset (LoRA, lr, KL, batch size, rule judge) applies to every "
                          "setting not given explicitly.")
    add_cli_arguments(demo)
    demo.add_argument("--persona", default=demo_defaults.DEMO_PERSONA, help="Simulated user (brief, inshort, "
                      "french, spanish).")
    demo.add_argument("--interactions", type=int, default=demo_defaults.DEMO_INTERACTIONS,
                      help="Answers the simulated user reacts to.")
    demo.add_argument("--eval-every", type=int, default=demo_defaults.DEMO_EVAL_EVERY,
                      help="Score the held-out questions every N interactions (0 = before and after only).")
    demo.add_argument("--heldout-n", type=int, default=0, help="Held-out questions to score (0 = all).")
    demo.add_argument("--max-lag", type=int, default=demo_defaults.DEMO_MAX_LAG,
                      help="Before each session, wait until fewer than this many answers wait to be judged or "
                      "trained on (0 = never wait: the scripted user then finishes long before the trainer).")
    demo_defaults.add_user_arguments(demo)
    demo.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                      help="Log level of the server and pipeline.")
    demo.set_defaults(func=cmd_demo)

    evaluation = sub.add_parser("eval", help="Compare methods over personas and seeds (resumable).",
                                description="Run the demo loop for every (method, persona, seed) cell, cache each "
                                "cell's result in the output folder, and write a markdown + JSON table and a plot.")
    add_cli_arguments(evaluation)
    from clawloop.sim.compare import add_arguments as add_compare_arguments

    add_compare_arguments(evaluation)
    demo_defaults.add_user_arguments(evaluation)
    evaluation.add_argument("--log-level", default="warning",
                            choices=["critical", "error", "warning", "info", "debug"],
                            help="Log level of the server and pipeline.")
    evaluation.set_defaults(func=cmd_eval)

    users = sub.add_parser("eval-users", help="Simulated users on one server at once, each with its own policy "
                           "(policy_scope per_user).",
                           description="One simulated user per persona, each with its own key, talking at the "
                           "same time to one server that trains a LoRA adapter per user; held-out scores before "
                           "and after by every persona's checker (docs/per-user.md).")
    add_cli_arguments(users)
    from clawloop.sim.users import add_arguments as add_users_arguments

    add_users_arguments(users)
    users.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                       help="Log level of the server and pipeline.")
    users.set_defaults(func=cmd_eval_users)

    judge = sub.add_parser("judge", help="Work with the judge.")
    judge_sub = judge.add_subparsers(dest="judge_command", required=True)
    check = judge_sub.add_parser(
        "check", help="Score a judge on the labelled cases before trusting it with training.",
        description="Build the judge the settings select (as `clawloop serve` would) and score it on the labelled "
        "cases shipped with clawloop: agreement of its evaluative vote and of its hints with the labels, the "
        "invalid-vote rate, and vote latency (p50/p95). Examples: `clawloop judge check` (the default judge), "
        "`clawloop judge check --backend engine --num-threads 2`, `clawloop judge check --judge-url "
        "http://host:8000/v1 --judge-model M --judge-api-key-env JUDGE_KEY`.")
    add_cli_arguments(check)
    check.add_argument("--backend", choices=["auto", "rules", "engine", "http"], default=None,
                       help="Shorthand for --judge-backend.")
    check.add_argument("--judge-api-key-env", metavar="VAR", default="",
                       help="Read the judge endpoint's key from this environment variable.")
    check.add_argument("--limit", type=int, default=0, help="Score a class-balanced subset of this many cases.")
    check.add_argument("--cases", metavar="JSONL", default="", help="Another labelled set (same format).")
    check.add_argument("--case-concurrency", type=int, default=4, help="Cases judged at once.")
    check.add_argument("--details", metavar="JSONL", default="", help="Write per-case results here.")
    check.add_argument("--json", action="store_true", help="Print the headline numbers as one JSON object.")
    check.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                       help="Log level.")
    check.set_defaults(func=cmd_judge_check)

    oc = sub.add_parser("openclaw-config", help="Print (or write) an OpenClaw config for this server, from the "
                        "served model's real context.",
                        description="Generate the OpenClaw provider block and agent defaults for a clawloop server. "
                        "With --url the limits come from the running server; otherwise from --model's folder.")
    oc.add_argument("--url", default="", help="A running clawloop server, e.g. http://127.0.0.1:30000 (preferred).")
    oc.add_argument("--api-key", default=None, help="The server's API key, if it has one (only to read its limits; "
                    "the config refers to ${CLAWLOOP_API_KEY}).")
    oc.add_argument("--model", default="default", help="Without --url: the model that will be served.")
    oc.add_argument("--host", default="127.0.0.1", help="Without --url: the server's host.")
    oc.add_argument("--port", type=int, default=30000, help="Without --url: the server's port.")
    oc.add_argument("--served-model-name", default="clawloop", help="Without --url: the served model name.")
    oc.add_argument("--max-tokens", type=int, default=512, help="Most tokens per answer (capped at a quarter of the "
                    "context).")
    oc.add_argument("--full", action="store_true", help="Keep OpenClaw's own prompt defaults (workspace files, "
                    "skills, all tools): only for models with a large context.")
    oc.add_argument("--plugin", default="", metavar="DIR", help="Load clawloop's OpenClaw plugin from DIR "
                    "(integrations/openclaw/plugin): session ids and compaction marked by OpenClaw itself.")
    oc.add_argument("--out", default="", help="Write here (e.g. ~/.openclaw/openclaw.json) instead of printing.")
    oc.set_defaults(func=cmd_openclaw_config, log_level="warning")

    up = sub.add_parser("openclaw", help="Bring clawloop up for OpenClaw: serve and train, write OpenClaw's config "
                        "and a launcher, print what to run next.",
                        description="Serve and train as `clawloop serve` does (every setting is a flag) and, once the "
                        "server answers, write OpenClaw's config, the server's keys and a launcher (bin/openclaw) into "
                        "OpenClaw's own folder (default RUN_DIR/openclaw; ~/.openclaw is never used unless named), "
                        "then print the commands to talk to OpenClaw, to end a conversation and to open the dashboard. "
                        "Keys are generated on the first start unless given, and kept in that folder.")
    add_cli_arguments(up)
    up.add_argument("--openclaw-dir", default="", metavar="DIR", help="OpenClaw's config and state folder "
                    "(default RUN_DIR/openclaw). A config there that clawloop did not write is never replaced.")
    up.add_argument("--plugin", default="", metavar="DIR", help="Also load clawloop's OpenClaw plugin from DIR "
                    "(integrations/openclaw/plugin).")
    up.add_argument("--openclaw-bin", default="", metavar="PATH", help="The OpenClaw the launcher runs (default: "
                    "the pinned one of integrations/openclaw when installed, else openclaw on PATH).")
    up.add_argument("--max-tokens", type=int, default=512, help="Most tokens per answer OpenClaw asks for (capped "
                    "at a quarter of the context).")
    up.add_argument("--full", action="store_true", help="Keep OpenClaw's own prompt defaults (workspace files, "
                    "skills, all tools): only for models with a large context.")
    up.add_argument("--resume", action="store_true", help="Continue the run's training (the default when the run "
                    "folder holds any).")
    up.add_argument("--fresh", action="store_true", help="Start the run's training over (as clawloop serve --fresh).")
    up.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                    help="Log level of the server.")
    up.set_defaults(func=cmd_openclaw)

    end = sub.add_parser("openclaw-end", help="End the clawloop session of an OpenClaw conversation now.",
                         description="OpenClaw's `agent --local` never ends a session, so a conversation's last "
                         "answer waits for session_idle_timeout_s. This ends the clawloop session(s) OpenClaw's "
                         "session SESSION became (found by the session id OpenClaw writes into a conversation's "
                         "first message), with the key and address `clawloop openclaw` wrote.")
    end.add_argument("session", metavar="SESSION", help="OpenClaw's session id (its --session-id).")
    end.add_argument("--run-dir", default=None, help="The run folder (default runs/default or CLAWLOOP_RUN_DIR).")
    end.add_argument("--openclaw-dir", default="", metavar="DIR", help="OpenClaw's folder as given to clawloop "
                     "openclaw (default RUN_DIR/openclaw).")
    end.set_defaults(func=cmd_openclaw_end, log_level="warning")

    train = sub.add_parser("train", help="Train offline on the ready samples of a stored run (resumes from its "
                           "latest checkpoint).")
    add_cli_arguments(train)
    train.add_argument("folder", metavar="RUN_DIR", help="The run folder (holding store.sqlite).")
    train.add_argument("--max-steps", type=int, default=None, help="Stop after this many optimizer steps.")
    train.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                       help="Log level.")
    train.set_defaults(func=cmd_train)

    rollback = sub.add_parser("rollback", help="Serve an earlier accepted version of a run again.",
                              description="With --url, the running server of RUN_DIR serves version N at once "
                              "(POST /v1/admin/rollback) and trains on from it. Without --url, the run's store is "
                              "marked so the next start of RUN_DIR serves version N.")
    rollback.add_argument("run_dir", metavar="RUN_DIR", help="The run folder (holding store.sqlite and versions/).")
    rollback.add_argument("--to", type=int, required=True, metavar="N", help="The version to serve.")
    rollback.add_argument("--url", default="", help="Base URL of the server running RUN_DIR (e.g. "
                          "http://127.0.0.1:30000).")
    rollback.add_argument("--admin-key", default=None, help="Admin key of that server (default: the "
                          "CLAWLOOP_ADMIN_KEY environment variable).")
    rollback.set_defaults(func=cmd_rollback)

    forget = sub.add_parser("forget", help="Delete one user's data from a stopped run, the weights trained on it "
                            "included, and write a receipt.",
                            description="Deletes the user's turns, votes, hints and samples from the run's store "
                            "(leaving none of their text in the file or its log), retires every version trained on "
                            "their samples with the checkpoints from that step on, takes their lines out of "
                            "RUN_DIR/export, and writes RUN_DIR/receipts/forget-*.json (ids and counts only). The "
                            "next start with --resume trains the other users' samples of those steps again. The "
                            "run's server must be stopped.")
    forget.add_argument("run_dir", metavar="RUN_DIR", help="The run folder (holding store.sqlite).")
    who = forget.add_mutually_exclusive_group(required=True)
    who.add_argument("--user", metavar="OWNER", help="The user's name in the run's records (k_…: the fingerprint "
                     "of their per-user key, the 'owner' of their turns in the records export).")
    who.add_argument("--key-file", metavar="FILE", help="A file whose first line is the user's key (read, never "
                     "stored): the user is the key's fingerprint.")
    forget.set_defaults(func=cmd_forget)

    dash = sub.add_parser("dashboard", help="Watch a finished or running run in the browser (read-only).",
                          description="Serve the dashboard of RUN_DIR (its store opened read-only) at "
                          "http://HOST:PORT/dashboard/. A running `clawloop serve` has the same page at /dashboard.")
    dash.add_argument("run_dir", metavar="RUN_DIR", help="The run folder (holding store.sqlite).")
    dash.add_argument("--host", default=None, help="Address to bind (default 127.0.0.1 or CLAWLOOP_HOST).")
    dash.add_argument("--port", type=int, default=30100, help="Port to bind.")
    dash.add_argument("--admin-key", default=None, help="Key the page's data needs (default: CLAWLOOP_ADMIN_KEY; "
                      "without one only loopback callers on a loopback address may read it).")
    dash.add_argument("--model", default=None, help="Model whose tokenizer shows token texts (default: the run's, "
                      "else the default model).")
    dash.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                      help="Log level.")
    dash.set_defaults(func=cmd_dashboard)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_anything", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from clawloop.engines.model_files import ModelFilesError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, ModelFilesError) as exc:  # a setting, or the model files it names: the user's to fix
        print(f"clawloop: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
