"""The rooms and the one way imports point (docs/architecture.md), read from the source itself.

cli -> api -> converters -> core, and dist beside api (dist -> api/converters/core): nothing
points back up, not even a lazy import inside a function. core/ imports no framework; the live
library (dist/ without dist/jobs/) never imports what `hpckpt run` launches; no two modules import
each other, directly or around a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "api", "converters", "core", "dist")
# what each top-level package may import from hpckpt besides itself (and the root, which holds only
# __version__)
ALLOWED = {
    "core": set(),
    "converters": {"core"},
    "api": {"converters", "core"},
    "cli": {"api", "converters", "core"},
    "dist": {"api", "converters", "core"},
}
FRAMEWORKS = ("torch", "mindspore")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["hpckpt", *parts])


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    found["hpckpt"] = ROOT / "__init__.py"
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every import statement of the module."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body}
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[:len(here) - node.level + 1]
                base = ".".join(here + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        out += [(target, node.lineno, id(node) in top) for target in targets]
    return out


def _owner(target: str) -> str | None:
    """The hpckpt module an import names (a name inside a module counts as the module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges(module_level_only: bool = False) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for target, _, at_top in _imports(name, path):
            owner = _owner(target) if target.startswith("hpckpt") else None
            if owner and owner != name and (at_top or not module_level_only):
                edges.setdefault(name, set()).add(owner)
    return edges


def test_the_scan_sees_the_whole_package():
    """A guard for the tests below: they read every module, and the rooms are there."""
    assert len(MODULES) > 150
    for room in ("core.geometry", "core.io", "core.commit", "core.safety", "core.codecs", "core.storage", "dist.jobs",
                 "dist.frameworks", "converters.torch_dcp"):
        assert f"hpckpt.{room}" in MODULES, room
    engine = _imports("hpckpt.core.io.engine", MODULES["hpckpt.core.io.engine"])
    assert any(target == "hpckpt.core.io.box_filler" and at_top for target, _, at_top in engine)
    lazy = _imports("hpckpt.dist.jobs.reshard_job", MODULES["hpckpt.dist.jobs.reshard_job"])
    assert any(not at_top for _, _, at_top in lazy)  # imports inside functions are read too


def test_imports_point_one_way():
    wrong = []
    for name, path in MODULES.items():
        package = _package(name)
        if not package:
            continue
        for target, line, _ in _imports(name, path):
            if not target.startswith("hpckpt"):
                continue
            other = _package(target)
            if other and other != package and other not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports that point back up:\n" + "\n".join(wrong)


def test_the_live_library_does_not_import_the_run_jobs():
    wrong = [f"{name} -> {target}" for name, targets in _edges().items()
             if name.startswith("hpckpt.dist") and not name.startswith("hpckpt.dist.jobs")
             for target in targets if target.startswith("hpckpt.dist.jobs")]
    assert not wrong


def test_core_and_converters_import_no_framework():
    wrong = []
    for name, path in MODULES.items():
        if _package(name) in ("core", "converters", "api", "cli"):
            for target, line, _ in _imports(name, path):
                if target.split(".")[0] in FRAMEWORKS:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(MODULES):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_object_store_client_is_imported_in_one_place_only_when_needed():
    """obstore (the optional extra) is imported by `core.storage.object_store` alone, and there only
    inside functions, so that local runs and `--help` work without it (tests/test_object_store.py
    proves they do not import it)."""
    where = [(name, line, at_top) for name, path in MODULES.items()
             for target, line, at_top in _imports(name, path) if target.split(".")[0] == "obstore"]
    assert where and {name for name, _, _ in where} == {"hpckpt.core.storage.object_store"}, where
    assert not any(at_top for _, _, at_top in where), where


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "lazy-too"])
def test_no_import_cycles(module_level_only):
    # a package's __init__ that re-exports its modules is not a cycle with them
    edges = {name: {t for t in targets if not (MODULES[t].name == "__init__.py" and name.startswith(t + "."))}
             for name, targets in _edges(module_level_only).items()}
    assert _cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"hpckpt.core.errors": {"hpckpt.core.dtypes"}, "hpckpt.core.dtypes": {"hpckpt.core.errors"}}) \
        == [["hpckpt.core.dtypes", "hpckpt.core.errors"]]


def test_the_commit_room_refuses_to_guess_without_the_formats(tmp_path):
    """core/commit asks the converters' registration what a directory holds; asked before
    `hpckpt.converters` is imported, it says so instead of answering wrongly."""
    import subprocess
    import sys

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    code = ("import sys; from pathlib import Path; from hpckpt.core.commit.destination import refuse_existing\n"
            "try:\n    refuse_existing(Path(sys.argv[1]), True)\n"
            "except RuntimeError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.strip() == "hpckpt.core.commit needs the formats: import hpckpt.converters first", done
