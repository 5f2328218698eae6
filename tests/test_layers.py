"""The package's import layers (docs/layers.md): a module may import from its own layer or a lower one, never
from a higher one. Read from the source with ``ast``, so lazy imports inside functions count too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "clawloop"

# Lowest first. A module belongs to the layer of the longest prefix that names it; "clawloop" names only the
# package's __init__, so a new top-level module has no layer until it is given one.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("clawloop", "clawloop.memory", "clawloop.atomic", "clawloop.weight_folder", "clawloop.openclaw_format",
              "clawloop.retry", "clawloop.temperature", "clawloop.priority")),
    ("records", ("clawloop.store", "clawloop.wire")),
    ("engines, renderers", ("clawloop.engines", "clawloop.renderers")),
    ("losses", ("clawloop.losses",)),
    ("config", ("clawloop.config",)),
    ("judge, teacher, gate", ("clawloop.judge", "clawloop.teacher", "clawloop.gate")),
    ("pipeline", ("clawloop.pipeline",)),
    ("trainer", ("clawloop.trainer",)),
    ("api", ("clawloop.api",)),
    ("dashboard", ("clawloop.dashboard",)),
    ("assembly, serve, runtime", ("clawloop.run_folder", "clawloop.fleet", "clawloop.assemble", "clawloop.serve",
                                  "clawloop.runtime")),
    ("commands", ("clawloop.cli", "clawloop.sim", "clawloop.openclaw_config", "clawloop.openclaw_launch")),
]


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = module == prefix or (prefix != "clawloop" and module.startswith(prefix + "."))
            if inside and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` (dotted, under clawloop) is a module or package in the source tree."""
    path = PACKAGE_DIR.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(path: Path) -> list[tuple[int, str, str]]:
    """(line, imported clawloop module, the import as written) for every import in ``path``."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "clawloop":
                    out.append((node.lineno, alias.name, f"import {alias.name}"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "clawloop":
                continue
            written = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            for alias in node.names:
                target = f"{source}.{alias.name}"
                out.append((node.lineno, target if is_module(target) else source, written))
    return out


def source_files() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("*.py"))


def test_every_module_has_a_layer():
    unplaced = [module_name(p) for p in source_files() if layer_of(module_name(p)) < 0]
    assert not unplaced, f"modules with no layer (add them to LAYERS here and to docs/layers.md): {unplaced}"


def test_no_import_reaches_up_a_layer():
    offences = []
    for path in source_files():
        here = module_name(path)
        for line, target, written in imported_modules(path):
            if layer_of(target) > layer_of(here):
                offences.append(f"{path.relative_to(PACKAGE_DIR.parent)}:{line}: {written!r} — {here} "
                                f"({LAYERS[layer_of(here)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
    assert not offences, "imports from a higher layer:\n" + "\n".join(offences)


def test_the_layer_check_sees_an_upward_import(tmp_path, monkeypatch):
    # The check itself must be able to fail: a store module importing the API is reported.
    fake = tmp_path / "clawloop"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "api").mkdir()
    (fake / "api" / "__init__.py").write_text("")
    (fake / "api" / "wiring.py").write_text("")
    (fake / "store.py").write_text("def f():\n    from clawloop.api import wiring\n    from .api.wiring import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", fake)
    imports = imported_modules(fake / "store.py")
    assert [(line, target) for line, target, _ in imports] == [(2, "clawloop.api.wiring"), (3, "clawloop.api.wiring")]
    assert all(layer_of(target) > layer_of("clawloop.store") for _, target, _ in imports)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_names(tree: ast.AST) -> set[str]:
    """Names a module defines itself: functions, classes, module and class variables, ``self._x`` attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


# Standard-library names that start with an underscore yet are documented public API: os._exit is the one way to
# leave a process without running the interpreter's teardown.
DOCUMENTED_PUBLIC = {"os._exit"}


def private_reaches(path: Path) -> list[str]:
    """``from m import _x`` of another module, and ``obj._x`` where ``_x`` is no name this module defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own = own_names(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module != "__future__":
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if is_private(a.name)]
        elif isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr not in own:
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                    and ast.unparse(node) not in DOCUMENTED_PUBLIC:
                out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_private_name_is_reached_from_another_module():
    offences = [f"{path.relative_to(PACKAGE_DIR.parent)}:{line}" for path in source_files()
                for line in private_reaches(path)]
    assert not offences, "private names reached from another module:\n" + "\n".join(offences)


def test_the_private_name_check_sees_both_forms(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from clawloop.trainer.step import _helper\n\n\nclass A:\n    def __init__(self):\n"
                      "        self._mine = 1\n\n    def f(self, other):\n        return other._theirs + self._mine + "
                      "other._mine\n")
    assert private_reaches(module) == ["1: from clawloop.trainer.step import _helper", "9: other._theirs"]


def test_the_private_name_check_lets_only_documented_stdlib_names_through(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\n\nos._exit(0)\nprint(os._Environ)\n")
    assert private_reaches(module) == ["4: os._Environ"]
