"""``clawloop eval``: the demo loop for several methods × personas × seeds, a table and a plot.

Every (method, persona, seed) cell is one ``demo.run_loop`` on a fresh runtime in ``OUT/cells/<cell>/``; its
summary is cached there as ``result.json``. A cell with a result is never run again, and a cell without one
(interrupted) is wiped and run from scratch, so the grid can be run in pieces, in any order, across sessions
(``--methods hybrid --seeds 0`` now, the rest later). The settings shared by all cells (everything but the method,
persona, seed and run folder) are written to ``OUT/settings.json`` on the first run; a later run with different
settings stops instead of mixing incomparable cells (``--force`` overrides, ``--table-only`` just re-aggregates).
A setting recorded only by later versions (the branch weights, ``--eval-each-version``) is read, for a folder whose
settings.json lacks it, from what its finished cells ran with. The persona names and every method's config are checked
before anything is written, and a cell that fails leaves the table of the cells that finished.

Per (method, persona), over the seeds that have results:

* **interactions to target**: the first evaluation point whose held-out score reaches ``--target`` (mean over
  the seeds that reached it, and how many did; a seed that never does counts as not reached, not as 0);
* **final score**: held-out preference score after training, mean ± standard deviation (min–max);
* **guard after**: the degeneracy guard's pass rate after training (mean), next to **before** (mean);
* **sessions to stable effect**: the first training session of the first run of 3 in a row whose first answer (as
  served to the simulated user) follows the preference and passes the guard (``sessions.py``); mean over the seeds
  that reached it, and how many did;
* the score before training, for reference.

Personas are built-in (``--personas``) or defined in files (``--persona-file``, any number of times). A file's
persona is recorded in ``OUT/personas/<name>.json`` when its first cell runs; a later run whose file defines it
differently stops, as for the settings.

Written: ``OUT/table.md`` (with the command that made it), ``OUT/table.json`` and ``OUT/comparison.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clawloop.config import ConfigError
from clawloop.sim.demo import DEMO_EVAL_EVERY, DEMO_INTERACTIONS, DEMO_MAX_LAG, DEMO_PRESET, LoopOptions, demo_config, \
    run_loop
from clawloop.sim.persona_file import PersonaFileError, load_persona_file, read_persona_file
from clawloop.sim.personas import PERSONAS
from clawloop.sim.sessions import STABLE_RUN, sessions_to_stable_effect

DEFAULT_METHODS = ("rl", "opd", "hybrid")
DEFAULT_PERSONAS = ("brief", "inshort")
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_INTERACTIONS = DEMO_INTERACTIONS
DEFAULT_TARGET = 0.5
DEFAULT_MAX_LAG = DEMO_MAX_LAG
# Settings that differ between cells by design, or that do not change what a cell measures.
_PER_CELL = {"method", "seed", "run_dir", "port", "num_threads", "host"}
# Settings a folder's settings.json did not record before some version; for such a folder, every finished cell's
# result says what it ran with: (the part of the result holding it, its value where the result lacks it too).
_RECORDED_BY_CELLS: dict[str, tuple[str, Any]] = {
    "w_rl": ("settings", None),
    "w_opd": ("settings", None),
    "eval_each_version": ("options", False),  # cells run before the option existed scored no served version
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="Comma-separated methods.")
    parser.add_argument("--personas", default=None, help="Comma-separated built-in personas (default "
                        f"{','.join(DEFAULT_PERSONAS)}, or none when --persona-file is given).")
    parser.add_argument("--seeds", default=",".join(map(str, DEFAULT_SEEDS)), help="Comma-separated seeds.")
    parser.add_argument("--interactions", type=int, default=DEFAULT_INTERACTIONS, help="Interactions per cell.")
    parser.add_argument("--eval-every", type=int, default=DEMO_EVAL_EVERY,
                        help="Held-out evaluation every N interactions (the resolution of 'interactions to target').")
    parser.add_argument("--heldout-n", type=int, default=0, help="Held-out questions per evaluation (0 = all).")
    parser.add_argument("--target", type=float, default=DEFAULT_TARGET, help="Score that counts as learnt.")
    parser.add_argument("--out", default="runs/eval", help="Output folder (cells, table, plot).")
    parser.add_argument("--table-only", action="store_true", help="Only aggregate the cells already run.")
    parser.add_argument("--force", action="store_true", help="Run even if the settings differ from the "
                        "folder's settings.json.")
    parser.add_argument("--eval-each-version", action=argparse.BooleanOptionalAction, default=True,
                        help="Also score the held-out questions whenever a new version is being served, so the "
                        "table's lowest served guard covers the versions served between evaluation points.")
    parser.add_argument("--max-lag", type=int, default=DEFAULT_MAX_LAG,
                        help="The simulated user waits before a session until fewer than this many answers wait to "
                        "be judged or trained on (0 = never waits), so a cell measures the method, not how busy "
                        "the CPU was.")
    parser.add_argument("--max-cells", type=int, default=0, help="Stop after running this many new cells "
                        "(0 = all).")


def _split(text: str) -> list[str]:
    return [x.strip() for x in str(text).split(",") if x.strip()]


def cell_name(method: str, persona: str, seed: int) -> str:
    return f"{method}-{persona}-s{seed}"


def shared_settings(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(config_dict.items()) if k not in _PER_CELL}


def run_cell(out_dir: Path, method: str, persona: str, seed: int, *, cli: Mapping[str, Any],
             options: LoopOptions, file: str | None = None, out: Callable[[str], None] = print,
             persona_file: str = "", **loop_kwargs: Any) -> dict[str, Any]:
    """The cached result of one cell, running it first when there is none (``persona_file``: the file that
    defines ``persona``, for a persona that is not built in)."""
    cell_dir = out_dir / "cells" / cell_name(method, persona, seed)
    result_path = cell_dir / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    if cell_dir.exists():  # an interrupted cell: its store and weights are half a run; start over
        shutil.rmtree(cell_dir)
    config = demo_config({**cli, "method": method, "seed": seed, "run_dir": str(cell_dir), "port": 0}, file=file)
    opts = LoopOptions(**{**options.__dict__, "persona": persona, "persona_file": persona_file, "seed": seed,
                          "label": cell_name(method, persona, seed)})
    summary = run_loop(config, opts, out=out, **loop_kwargs)
    result = {"method": method, "persona": persona, "seed": seed, **summary}
    cell_dir.mkdir(parents=True, exist_ok=True)
    result_path.write_text(json.dumps(result, indent=1, ensure_ascii=False, default=str))
    return result


def load_cells(out_dir: Path) -> list[dict[str, Any]]:
    cells = []
    for path in sorted((out_dir / "cells").glob("*/result.json")):
        cells.append(json.loads(path.read_text()))
    return cells


def interactions_to_target(curve: Iterable[Mapping[str, Any]], target: float) -> int | None:
    """The first scheduled evaluation (every ``--eval-every`` interactions) reaching ``target``. Points scored
    because a new version was served are left out, so every cell is read at the same resolution."""
    for point in curve:
        if point.get("phase") == "version":
            continue
        if point["score"] >= target:
            return int(point["interactions"])
    return None


def stable_effect(cell: Mapping[str, Any]) -> int | None:
    """A cell's sessions to a stable effect; cells run before it was stored are read from their session records."""
    if "sessions_to_stable_effect" in cell:
        return cell["sessions_to_stable_effect"]
    return sessions_to_stable_effect(cell.get("sessions") or [])


def _mean_sd(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate(cells: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in cells:
        groups.setdefault((c["persona"], c["method"]), []).append(c)
    rows = []
    for (persona, method), runs in sorted(groups.items()):
        runs.sort(key=lambda c: c["seed"])
        finals = [c["after"]["score"] for c in runs]
        befores = [c["before"]["score"] for c in runs]
        reached = [interactions_to_target(c["curve"], target) for c in runs]
        hit = [r for r in reached if r is not None]
        mean, sd = _mean_sd(finals)
        rows.append({
            "persona": persona, "method": method, "seeds": [c["seed"] for c in runs], "n": len(runs),
            "score_before_mean": statistics.fmean(befores),
            "final_score_mean": mean, "final_score_sd": sd, "final_score_min": min(finals),
            "final_score_max": max(finals), "final_scores": finals,
            "peak_scores": [max([p["score"] for p in c.get("curve") or ()] + [c["after"]["score"]]) for c in runs],
            "share_after_v0": [c.get("share_after_v0") for c in runs],
            "guard_before_mean": statistics.fmean(c["before"]["guard_pass_rate"] for c in runs),
            "guard_after_mean": statistics.fmean(c["after"]["guard_pass_rate"] for c in runs),
            "interactions_to_target": reached,
            "interactions_to_target_mean": statistics.fmean(hit) if hit else None,
            "reached_target": len(hit),
            "sessions_to_stable_effect": (stable := [stable_effect(c) for c in runs]),
            "sessions_to_stable_effect_mean": (statistics.fmean(v for v in stable if v is not None)
                                               if any(v is not None for v in stable) else None),
            "reached_stable_effect": sum(v is not None for v in stable),
            "steps_mean": statistics.fmean(c["steps"] for c in runs),
            "served_guard_lowest": _lowest_served_guard(runs),
            "served_versions_scored": [len((c.get("served_guard") or {}).get("by_version") or {}) for c in runs],
            "gate_rejections": [int((c.get("gate") or {}).get("rejections", 0)) for c in runs],
            "rollbacks": [int((c.get("gate") or {}).get("rollbacks", 0)) for c in runs],
            "minutes_mean": statistics.fmean(c["timings_s"]["total_s"] for c in runs) / 60.0,
        })
    return rows


def _lowest_served_guard(runs: list[dict[str, Any]]) -> float:
    """The lowest held-out guard rate of any scored served version over the seeds (cells run before versions were
    scored on publication only have their evaluation points)."""
    lows = []
    for c in runs:
        served = (c.get("served_guard") or {}).get("lowest")
        lows.append(served if served is not None else min(p["guard_pass_rate"] for p in c["curve"]))
    return min(lows)


def markdown_table(rows: list[dict[str, Any]], target: float, interactions: int | None = None) -> str:
    head = ("| persona | method | seeds | score before | final score, mean ± sd (min–max) | peak score per seed | "
            f"interactions to {target:g} (seeds reaching it) | sessions to stable effect ({STABLE_RUN} in a row; "
            "per seed) | guard before → after | lowest guard of a served version (versions scored) | "
            "gate rejections per seed | sessions on a version newer than v0 | rollbacks (all seeds) | steps | "
            "min/run |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        reach = (f"{r['interactions_to_target_mean']:.0f} ({r['reached_target']}/{r['n']})"
                 if r["interactions_to_target_mean"] is not None else f"not reached (0/{r['n']})")
        per_seed = ", ".join("–" if v is None else str(v) for v in r["sessions_to_stable_effect"])
        stable = (f"{r['sessions_to_stable_effect_mean']:.1f} ({r['reached_stable_effect']}/{r['n']} reached: "
                  f"{per_seed})" if r["sessions_to_stable_effect_mean"] is not None
                  else f"not reached (0/{r['n']} reached)")
        peaks = ", ".join(f"{v:.2f}" for v in r.get("peak_scores") or ())
        shares = ", ".join("–" if v is None else f"{v:.0%}" for v in r.get("share_after_v0") or ())
        lines.append(
            f"| {r['persona']} | {r['method']} | {','.join(map(str, r['seeds']))} | {r['score_before_mean']:.2f} | "
            f"{r['final_score_mean']:.2f} ± {r['final_score_sd']:.2f} ({r['final_score_min']:.2f}–"
            f"{r['final_score_max']:.2f}) | {peaks} | {reach} | {stable} | "
            f"{r['guard_before_mean']:.2f} → {r['guard_after_mean']:.2f} | "
            f"{r['served_guard_lowest']:.2f} ({sum(r['served_versions_scored'])}) | "
            f"{','.join(map(str, r['gate_rejections']))} | {shares} | {sum(r['rollbacks'])} | "
            f"{r['steps_mean']:.0f} | {r['minutes_mean']:.1f} |")
    return head + "\n".join(lines) + "\n"


def write_outputs(out_dir: Path, cells: list[dict[str, Any]], target: float, command: str) -> list[dict[str, Any]]:
    rows = aggregate(cells, target)
    table = markdown_table(rows, target)
    settings = json.loads((out_dir / "settings.json").read_text()) if (out_dir / "settings.json").exists() else {}
    text = (f"Command: `{command}`\n\n{table}\n"
            f"Held-out preference score: share of greedy answers to the persona's held-out questions that follow the "
            f"preference and pass the degeneracy guard. Sessions to stable effect: the first training session of the "
            f"first {STABLE_RUN} in a row whose first answer, as served, followed the preference and passed the guard "
            f"(mean over the seeds that reached it). Settings shared by all cells: {out_dir / 'settings.json'}.\n")
    (out_dir / "table.md").write_text(text)
    (out_dir / "table.json").write_text(json.dumps({"command": command, "target": target, "rows": rows,
                                                    "settings": settings}, indent=1, default=str))
    if cells:
        from clawloop.sim.plot import comparison

        comparison(cells, out_dir / "comparison.png", target=target)
    return rows


def check_persona_records(out_dir: Path, persona_files: Mapping[str, str], *, force: bool = False) -> str | None:
    """Record each file persona's definition in ``OUT/personas/<name>.json``; a problem message when a folder's
    cells were run with a different definition of the same name (and not ``force``)."""
    folder = out_dir / "personas"
    for name, path in persona_files.items():
        definition = read_persona_file(path)
        record = folder / f"{name}.json"
        if record.exists():
            if json.loads(record.read_text()) != definition and not force:
                return (f"{out_dir} holds cells of a persona {name!r} defined differently than in {path} ({record}); "
                        "use another --out, rename the persona, or --force")
            continue
        folder.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(definition, indent=1, ensure_ascii=False))
    return None


@dataclass
class Grid:
    """The cells a run asks for, checked before anything is written."""

    methods: list[str]
    built_in: list[str]
    persona_files: dict[str, str]
    """Persona name -> the file that defines it."""
    seeds: list[int]

    @property
    def personas(self) -> list[str]:
        return [*self.built_in, *self.persona_files]


def check_grid(args: argparse.Namespace, cli: Mapping[str, Any]) -> Grid:
    """The grid ``args`` ask for; a ``ConfigError`` for an unknown persona, a seed that is not a number or a method
    whose config is invalid, so that a mistake stops the run before its first cell, not hours into it."""
    persona_files = _persona_files(args.persona_file or [])
    built_in = _split(args.personas) if args.personas is not None else ([] if persona_files else
                                                                       list(DEFAULT_PERSONAS))
    unknown = [name for name in built_in if name not in PERSONAS]
    if unknown:
        raise ConfigError(f"--personas: no built-in persona {unknown[0]!r} (known: {', '.join(PERSONAS)}; others "
                          "come from --persona-file)")
    try:
        seeds = [int(s) for s in _split(args.seeds)]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated whole numbers, got {args.seeds!r}") from None
    methods = _split(args.methods)
    for method in methods:  # a setting that contradicts one method's preset fails here, not when its cell starts
        try:
            demo_config({**cli, "method": method, "run_dir": str(Path(args.out) / "cells"), "port": 0},
                        file=args.config)
        except ConfigError as exc:
            raise ConfigError(f"method {method!r}: {exc}") from None
    return Grid(methods=methods, built_in=built_in, persona_files=persona_files, seeds=seeds)


def _persona_files(paths: Iterable[str]) -> dict[str, str]:
    try:
        return {load_persona_file(path).name: str(path) for path in paths}
    except PersonaFileError as exc:
        raise ConfigError(str(exc)) from None


def changed_settings(out_dir: Path, recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """The settings in ``wanted`` that differ from those the folder's cells ran with (``recorded``: its
    settings.json)."""
    defaults = shared_settings(demo_config({"run_dir": str(out_dir / "cells"), "port": 0}).to_dict(redact=True))
    cells = load_cells(out_dir)
    return sorted(key for key in set(recorded) | set(wanted)
                  if not _same_setting(key, recorded, wanted, defaults, cells))


def _same_setting(key: str, recorded: Mapping[str, Any], wanted: Mapping[str, Any], defaults: Mapping[str, Any],
                  cells: list[dict[str, Any]]) -> bool:
    if key in recorded:
        return recorded[key] == wanted.get(key)
    if key in _RECORDED_BY_CELLS:  # each cell's result says what it ran with; a folder without cells mixes nothing
        part, absent = _RECORDED_BY_CELLS[key]
        return all((cell.get(part) or {}).get(key, absent) == wanted.get(key) for cell in cells)
    # Any other setting the folder does not record did not exist when its cells ran; at its default it changes
    # nothing those cells did, so the folder can be continued.
    return wanted.get(key) is None or (key in defaults and wanted.get(key) == defaults[key])


def _wanted_settings(args: argparse.Namespace, cli: Mapping[str, Any], out_dir: Path) -> dict[str, Any]:
    """The settings every cell of this run shares, as settings.json records them."""
    probe = demo_config({**cli, "run_dir": str(out_dir / "cells"), "port": 0}, file=args.config)
    shared = shared_settings(probe.to_dict(redact=True))
    shared["interactions"], shared["eval_every"], shared["heldout_n"] = (args.interactions, args.eval_every,
                                                                          args.heldout_n)
    shared["eval_each_version"] = args.eval_each_version
    if args.user_url:  # only when given, so folders made before these flags existed still match
        shared["user_url"], shared["user_model"] = args.user_url, args.user_model
    if args.max_lag:  # a folder made before pacing existed is continued with --max-lag 0
        shared["max_lag"] = args.max_lag
    return shared


def _settings_problem(out_dir: Path, args: argparse.Namespace, cli: Mapping[str, Any]) -> str | None:
    """Why this run may not add cells to ``out_dir`` (and not ``--force``); records the settings of a new folder."""
    wanted = _wanted_settings(args, cli, out_dir)
    settings_path = out_dir / "settings.json"
    if not settings_path.exists():
        settings_path.write_text(json.dumps(wanted, indent=1, default=str))
        return None
    diff = changed_settings(out_dir, json.loads(settings_path.read_text()), wanted)
    if diff and not args.force:
        return (f"{out_dir} holds cells run with other settings ({', '.join(diff)}); use another --out, the same "
                "settings, or --force")
    return None


def _run_cells(out_dir: Path, grid: Grid, args: argparse.Namespace, cli: dict[str, Any],
               out: Callable[[str], None]) -> None:
    options = LoopOptions(interactions=args.interactions, eval_every=args.eval_every, heldout_n=args.heldout_n,
                          eval_each_version=args.eval_each_version, user_url=args.user_url,
                          user_model=args.user_model,
                          user_api_key_env=args.user_api_key_env, max_lag=args.max_lag)
    ran = 0
    for persona in grid.personas:
        for seed in grid.seeds:
            for method in grid.methods:
                name = cell_name(method, persona, seed)
                if (out_dir / "cells" / name / "result.json").exists():
                    out(f"[eval] {name}: cached")
                    continue
                if args.max_cells and ran >= args.max_cells:
                    out(f"[eval] {name}: left for a later run (--max-cells {args.max_cells})")
                    continue
                t0 = time.monotonic()
                out(f"[eval] {name}: running")
                r = run_cell(out_dir, method, persona, seed, cli=cli, options=options, file=args.config,
                             out=out, persona_file=grid.persona_files.get(persona, ""))
                ran += 1
                stable = stable_effect(r)
                out(f"[eval] {name}: score {r['before']['score']:.2f} -> {r['after']['score']:.2f}, guard "
                    f"{r['before']['guard_pass_rate']:.2f} -> {r['after']['guard_pass_rate']:.2f}, stable "
                    f"effect {'from session ' + str(stable) if stable is not None else 'not reached'} "
                    f"({(time.monotonic() - t0) / 60:.1f} min)")


def _write_table_after_failure(out_dir: Path, target: float, command: str, out: Callable[[str], None]) -> None:
    """The table of the cells that finished before a cell failed. The failure is raised again afterwards rather
    than skipped: what breaks one cell (the model, the machine, a setting) usually breaks the next ones too, each
    after minutes of work, and Ctrl-C must stop the grid."""
    cells = load_cells(out_dir)
    if not cells:
        return
    try:
        write_outputs(out_dir, cells, target, command)
    except Exception as exc:  # noqa: BLE001 - the cell's error is the one to report
        out(f"[eval] the table of the finished cells was not written either: {type(exc).__name__}: {exc}")
        return
    out(f"[eval] stopped by a failing cell; wrote the table of the {len(cells)} finished cells to "
        f"{out_dir / 'table.md'}")


def main_from_args(args: argparse.Namespace, cli: dict[str, Any], out: Callable[[str], None] = print) -> int:
    out_dir = Path(args.out)
    command = "clawloop eval " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 else \
        "clawloop eval"
    grid = None if args.table_only else check_grid(args, cli)  # before the folder is made or written to
    out_dir.mkdir(parents=True, exist_ok=True)
    if grid is not None:
        problem = _settings_problem(out_dir, args, cli) or check_persona_records(out_dir, grid.persona_files,
                                                                                 force=args.force)
        if problem:
            out(f"clawloop eval: {problem}")
            return 2
        try:
            _run_cells(out_dir, grid, args, cli, out)
        except BaseException:
            _write_table_after_failure(out_dir, args.target, command, out)
            raise
    cells = load_cells(out_dir)
    rows = write_outputs(out_dir, cells, args.target, command)
    out("")
    out(markdown_table(rows, args.target))
    out(f"wrote {out_dir / 'table.md'}, {out_dir / 'table.json'}, {out_dir / 'comparison.png'}")
    return 0


__all__ = ["DEMO_PRESET", "Grid", "add_arguments", "aggregate", "changed_settings", "check_grid",
           "check_persona_records", "interactions_to_target", "load_cells", "main_from_args", "markdown_table",
           "run_cell", "stable_effect", "write_outputs"]
