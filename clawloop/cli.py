"""The ``clawloop`` command. It parses arguments and calls into the package; it holds no logic of its own.

    clawloop serve [--model tiny] [--port 30000] [--api-key KEY] ...   (every Config setting is a flag)
    clawloop records export RUN_DIR [--out DIR]
    clawloop train | demo | eval ...
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from clawloop.config import ConfigError, add_cli_arguments, config_from_args

STORE_FILENAME = "store.sqlite"


def _run_store_path(run_dir: Path) -> Path:
    """RUN_DIR/store.sqlite, or the only *.sqlite / *.db file in RUN_DIR."""
    default = run_dir / STORE_FILENAME
    if default.exists():
        return default
    found = sorted(p for pattern in ("*.sqlite", "*.db") for p in run_dir.glob(pattern))
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{run_dir} holds no store ({STORE_FILENAME})")
    raise FileNotFoundError(f"{run_dir} holds several stores ({', '.join(p.name for p in found)})")


def cmd_serve(args: argparse.Namespace) -> int:
    from clawloop.serve import run

    config = config_from_args(args)
    try:
        run(config, log_level=args.log_level)
    except KeyboardInterrupt:  # Ctrl-C / SIGINT after a clean shutdown: not an error
        pass
    return 0


def cmd_records_export(args: argparse.Namespace) -> int:
    from clawloop.store import Store

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"clawloop: {run_dir} is not a folder", file=sys.stderr)
        return 2
    try:
        path = _run_store_path(run_dir)
    except FileNotFoundError as exc:
        print(f"clawloop: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "export"
    store = Store(path)
    try:
        counts = store.export_jsonl(out)
    finally:
        store.close()
    print(json.dumps({"store": str(path), "out": str(out), "lines_appended": counts}))
    return 0


def cmd_not_yet(args: argparse.Namespace) -> int:
    print(f"clawloop {args.command}: not available yet", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clawloop", description="Train an LLM agent online from its own "
                                     "conversations.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Serve the policy behind an OpenAI-compatible API.")
    add_cli_arguments(serve)
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

    for name, help_ in (("train", "Train on a run's collected samples."),
                        ("demo", "Run the end-to-end demo."),
                        ("eval", "Evaluate a policy.")):
        p = sub.add_parser(name, help=help_)
        p.set_defaults(func=cmd_not_yet, accepts_anything=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_anything", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=getattr(logging, level, logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"clawloop: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
