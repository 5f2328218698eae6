"""``clawloop eval-users``: several simulated users on one server at once, each with a policy of their own.

The server runs with ``policy_scope = "per_user"`` and one fresh key per persona. Each persona's simulated user
talks through its own key, in its own thread, all at the same time, so their turns interleave on the server as
real users' would; the trainer trains each user's adapter on that user's samples only
(``clawloop/trainer/per_user.py``).

Evaluation, before and after: each user's held-out questions go out under that user's key (greedy, side turns),
and every answer is scored by the user's own checker (the preference score: follows it and passes the guard) and
by every other persona's checker: a user whose answers start following another user's preference is what a shared
policy does and what per-user policies must not.

Pacing: before each session a user waits until fewer than ``max_lag`` of *its own* answers wait to be judged or
trained on, so a fast simulated user does not run far ahead of its own training.

Written: the run folder ``OUT/run`` (store, users' folders), its ``summary.json`` and a table (printed, and in
``OUT/run/table.md``).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clawloop.api.auth import owner_of
from clawloop.config import Config
from clawloop.sim.demo import DEMO_INTERACTIONS, DEMO_MAX_LAG, demo_config, heldout_n_problem, wait_for_training
from clawloop.sim.driver import EvalResult, Simulation, evaluate
from clawloop.sim.persona_file import PersonaFileError, load_persona_file
from clawloop.sim.personas import Persona, get_persona
from clawloop.sim.sessions import session_record, sessions_to_stable_effect, share_after_base
from clawloop.store import TurnState

DEFAULT_PERSONAS = ("brief", "inshort")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--personas", default=None, help="Comma-separated built-in personas, one simulated user "
                        f"each (default {','.join(DEFAULT_PERSONAS)}, or none when --persona-file is given).")
    parser.add_argument("--persona-file", action="append", default=[], help="A persona from a TOML or JSON file "
                        "(clawloop/sim/persona_file.py), one more simulated user; may be given several times.")
    parser.add_argument("--interactions", type=int, default=DEMO_INTERACTIONS, help="Answers per user.")
    parser.add_argument("--max-lag", type=int, default=DEMO_MAX_LAG, help="A user waits before a session until "
                        "fewer than this many of its own answers wait to be judged or trained on (0 = never waits).")
    parser.add_argument("--heldout-n", type=int, default=0, help="Held-out questions per user (0 = all).")
    parser.add_argument("--out", default="runs/users", help="Output folder (run folder, summary, table).")


def _waiting(runtime: Any, owner: str) -> int:
    """``owner``'s answers waiting to be judged or trained on."""
    store = runtime.server.store
    turns = store.count_turns(owner)
    return turns.get(TurnState.JUDGEABLE, 0) + turns.get(TurnState.JUDGING, 0) + store.ready_count(owner=owner)


def _cross(result: EvalResult, personas: list[Persona]) -> dict[str, float]:
    """Share of ``result``'s answers that each persona's checker accepts (sound or not)."""
    return {p.name: sum(p.judge(item.answer, item.question).satisfied for item in result.items) / max(result.n, 1)
            for p in personas}


def _scores(base_url: str, users: list[tuple[Persona, str]], heldout_n: int, seed: int) -> dict[str, Any]:
    personas = [p for p, _ in users]
    out: dict[str, Any] = {}
    for persona, key in users:
        result = evaluate(base_url, persona, persona.heldout_questions[: heldout_n or None], api_key=key,
                          seed=seed, concurrency=8)
        out[persona.name] = {"score": result.score, "guard": result.guard_pass_rate,
                             "checker": result.satisfied_rate, "follows": _cross(result, personas)}
    return out


def run_users(config: Config, personas: list[Persona], *, seed: int = 0, interactions: int = DEMO_INTERACTIONS,
              max_lag: int = DEMO_MAX_LAG, heldout_n: int = 0, out: Callable[[str], None] = print) -> dict[str, Any]:
    """One run with one simulated user per persona on one per-user server; returns (and writes) its summary."""
    from clawloop.runtime import build_runtime

    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    gate_log: list[dict[str, Any]] = []
    runtime = build_runtime(config, console=None, on_gate=gate_log.append)
    runtime.start()
    users = list(zip(personas, config.api_keys))
    base_url = runtime.server.base_url
    sessions: dict[str, list[dict[str, Any]]] = {p.name: [] for p in personas}
    errors: list[str] = []
    try:
        before = _scores(base_url, users, heldout_n, seed)
        for name, s in before.items():
            out(f"[before] {name}: score {s['score']:.2f} guard {s['guard']:.2f} follows {s['follows']}")

        def talk(persona: Persona, key: str) -> None:
            owner = owner_of(key)
            sim = Simulation(base_url, persona, seed=seed, api_key=key, model=config.served_model_name,
                             session_prefix=f"users-{persona.name}-s{seed}")
            done = 0
            try:
                while done < interactions:
                    deadline = time.monotonic() + 900
                    while max_lag > 0 and _waiting(runtime, owner) >= max_lag and time.monotonic() < deadline:
                        time.sleep(0.5)
                    session = sim.run_session(min(persona.session_turns, interactions - done))
                    done += len(session.turns)
                    first = session.turns[0]
                    record = {**session_record(len(sessions[persona.name]) + 1, session), "interactions": done,
                              "elapsed_s": round(time.monotonic() - t_start, 1)}
                    sessions[persona.name].append(record)
                    out(f"[{persona.name} session {len(sessions[persona.name]):>3}] first answer "
                        f"{'ok' if first.satisfied and first.sound else 'not ok'} by v{first.policy_version} | "
                        f"interactions {done}/{interactions} | {time.monotonic() - t_start:.0f}s")
            except Exception as exc:  # noqa: BLE001 - reported with the results, the other users go on
                errors.append(f"{persona.name}: {type(exc).__name__}: {exc}")
            finally:
                sim.client.close()

        threads = [threading.Thread(target=talk, args=user, name=f"user-{user[0].name}") for user in users]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        caught_up = wait_for_training(runtime, 1800)
        after = _scores(base_url, users, heldout_n, seed)
        for name, s in after.items():
            out(f"[after] {name}: score {s['score']:.2f} guard {s['guard']:.2f} follows {s['follows']}")
        store = runtime.server.store
        steps = store.steps()
        per_user = {}
        for persona, key in users:
            owner = owner_of(key)
            checks = [e for e in gate_log if e.get("owner") == owner]
            per_user[persona.name] = {
                "owner": owner, "steps": sum(st.get("owner") == owner for st in steps),
                "versions": [v["version"] for v in store.versions(owner=owner) if v["status"] == "accepted"],
                "share_after_base": share_after_base(sessions[persona.name]),
                "gate_checks": len(checks), "gate_rejections": sum(e.get("kind") == "gate_rejected" for e in checks)}
    finally:
        runtime.stop()
    summary = {
        "personas": [p.name for p in personas], "seed": seed, "interactions_per_user": interactions,
        "settings": {**config.to_dict(redact=True), "lr": config.learning_rate},
        "before": before, "after": after, "caught_up": caught_up, "users": per_user, "errors": errors,
        "sessions": sessions,
        "sessions_to_stable_effect": {name: sessions_to_stable_effect(rows) for name, rows in sessions.items()},
        "gate": {"checks": len(gate_log), "rejections": sum(e.get("kind") == "gate_rejected" for e in gate_log)},
        "total_s": round(time.monotonic() - t_start, 1),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False, default=str))
    table = summary_table(summary)
    (run_dir / "table.md").write_text(table + "\n")
    out(table)
    return summary


def summary_table(summary: dict[str, Any]) -> str:
    """The run's table, one row per user: held-out scores, what each user's answers follow, sessions to a stable
    effect, the versions served to the user (and the share of their sessions opened by one newer than the base) and
    the gate's rejections of the user's candidates."""
    names = summary["personas"]
    columns = " | ".join(f"follows {n} (before → after)" for n in names)
    head = (f"| user | score before → after | guard after | {columns} | sessions to stable effect | versions served "
            f"(sessions newer than the base) | gate rejections |")
    lines = [head, "|" + "---|" * (7 + len(names))]
    for name in names:
        b, a, user = summary["before"][name], summary["after"][name], summary["users"][name]
        follows = " | ".join(f"{b['follows'][n]:.2f} → {a['follows'][n]:.2f}" for n in names)
        stable = summary["sessions_to_stable_effect"][name]
        share = user.get("share_after_base")
        served = f"{len(user['versions'])}" + (f" ({share:.0%})" if share is not None else "")
        rejections = f"{user['gate_rejections']} of {user['gate_checks']}" if "gate_checks" in user else "–"
        lines.append(f"| {name} | {b['score']:.2f} → {a['score']:.2f} | {a['guard']:.2f} | {follows} | "
                     f"{stable if stable is not None else 'not reached'} | {served} | {rejections} |")
    return "\n".join(lines)


def cmd_eval_users(args: argparse.Namespace, cli_settings: dict[str, Any]) -> int:
    problem = heldout_n_problem(args.heldout_n)
    if problem:
        print(f"clawloop eval-users: {problem}", file=sys.stderr)
        return 2
    given = args.personas if args.personas is not None else ("" if args.persona_file else ",".join(DEFAULT_PERSONAS))
    try:
        personas = [get_persona(n.strip()) for n in given.split(",") if n.strip()]
        personas += [load_persona_file(path) for path in args.persona_file]
    except (KeyError, PersonaFileError) as exc:
        print(f"clawloop eval-users: {exc}", file=sys.stderr)
        return 2
    names = [p.name for p in personas]
    if len(names) < 2 or len(set(names)) != len(names):
        print("clawloop eval-users: give two or more different personas (--personas, --persona-file)", file=sys.stderr)
        return 2
    keys = [f"sim-{secrets.token_hex(12)}" for _ in names]
    config = demo_config(cli_settings, policy_scope="per_user", api_keys=keys, run_dir=str(Path(args.out) / "run"),
                         port=0)
    run_users(config, personas, seed=config.seed, interactions=args.interactions, max_lag=args.max_lag,
              heldout_n=args.heldout_n)
    return 0
