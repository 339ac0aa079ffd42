"""Imports run only downward, never in a cycle, and the planning actions stay free of torch and DeepSpeed.

Floors, top to bottom (docs/parallelism.md, "Layers"): cli -> launch -> runtime, rehearse ->
checkpoint, resilience -> observe -> engines -> parallel -> plan, data -> config -> hf ->
models, paths, job_env, gpus. A module may import from its own floor or below, never above; and no
two modules, nor two packages (the rooms of launcher/, the subpackages of a room), import each
other, directly or round a longer loop. An AST walk of every module in launcher/, imports inside
functions included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "launcher"
# Each room's floor follows from what it imports:
# - the rehearsal runs the runtime's entry for each rank, so it shares the runtime's floor and the
#   cycle check keeps the import one way (rehearse -> runtime);
# - checkpoint/ saves the engines' states (engines, parallel's phase group), resilience/ dumps the
#   OOM memory snapshot (observe): both sit under the rank's loop, which calls them, and over what
#   they use; launch/ (the host) reads their torch-free modules from above;
# - observe/ compares measurements with the plan (plan, models) and imports no engine: the floor
#   just above the engines, so the rank loop, the rehearsal and resilience can all reach it;
# - config/ reads Hugging Face folders through hf/ (model=hf, folder checks); hf/ imports only models.
FLOOR = {
    "cli": 10,
    "__main__": 10,  # python -m launcher: the cli
    "launch": 9,
    "runtime": 8,
    "rehearse": 8,
    "checkpoint": 7,
    "resilience": 7,
    "observe": 6,
    "eval": 6,  # downstream evaluation: scores through the engines' eval path; the rank loop calls it
    "engines": 5,
    "parallel": 4,
    "plan": 3,
    "data": 3,
    "config": 2,
    "hf": 1,
    "models": 0,
    "job_env": 0,
    "paths": 0,
    "gpus": 0,  # the local GPUs, torch-free: visible count, hardware entry by name
    "compat": 0,  # every torch capability newer than the floor: imports nothing of the launcher
}


def room_of(module: str) -> str:
    """'launcher.plan.decide.resolve' -> 'plan'; 'launcher.cli' -> 'cli'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def launcher_imports(tree: ast.AST) -> Iterator[Tuple[int, str]]:
    """(line, imported launcher module) for every import anywhere in the tree."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("launcher."):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "launcher":
                for alias in node.names:
                    yield node.lineno, f"launcher.{alias.name}"
            elif node.module.startswith("launcher."):
                yield node.lineno, node.module


def upward_imports(source: str, module: str) -> List[str]:
    """Every import in `source` (the code of `module`) that reaches a floor above its own."""
    here = room_of(module)
    bad = []
    for line, target in launcher_imports(ast.parse(source)):
        there = room_of(target)
        if here in FLOOR and there in FLOOR and FLOOR[there] > FLOOR[here]:
            bad.append(f"{module}:{line} imports {target} ({there} is above {here})")
    return bad


def test_every_room_has_a_floor():
    rooms = {room_of(module_name(p)) for p in PACKAGE.rglob("*.py")} - {""}
    assert rooms <= set(FLOOR), f"add these to FLOOR (and docs/parallelism.md): {sorted(rooms - set(FLOOR))}"


def test_imports_only_run_downward():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += upward_imports(path.read_text(), module_name(path))
    assert not problems, "imports that run up the layers:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("source, module", [
    ("def f():\n    from launcher.launch.slurm import check_cluster_config\n", "launcher.config.validate"),
    ("import launcher.runtime.entry\n", "launcher.engines.native"),
    ("from launcher import cli\n", "launcher.plan.present.plan"),
])
def test_the_walk_sees_upward_imports_even_inside_functions(source, module):
    assert upward_imports(source, module), "an upward import went unnoticed"


def test_downward_and_same_floor_imports_pass():
    assert upward_imports("from launcher.plan.layout import Layout\nimport launcher.data.dataset\n",
                          "launcher.plan.present.plan") == []


# Cycles: the graph of which module imports which, and for every package the graph of its
# children (subpackages and modules) that it implies. A floor says nothing about two modules or
# two subpackages on one floor; a cycle between them still makes neither understandable alone.


def imported_modules(source: str, modules: Set[str]) -> Set[str]:
    """The modules of `modules` that `source` imports anywhere; `from pkg import name` counts as
    pkg.name when that is a module, else as pkg (its __init__)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    return found & modules


def import_graph(sources: Dict[str, str]) -> Dict[str, Set[str]]:
    """Module -> the modules it imports, over the modules given as {name: source}."""
    modules = set(sources)
    return {module: imported_modules(source, modules) - {module} for module, source in sources.items()}


def strongly_connected(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The cycles of a directed graph, each as the sorted nodes of a strongly connected
    component of more than one node (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_cycles(graph: Dict[str, Set[str]], packages: Set[str]) -> List[str]:
    """For every package, cycles among its children that involve a subpackage: a child imports
    another when any module inside it does. (Cycles of plain modules are the module check's.)"""
    problems = []
    for package in sorted(packages):
        def child(module: str) -> str:
            rest = module[len(package) + 1:] if module.startswith(package + ".") else ""
            return f"{package}.{rest.split('.')[0]}" if rest else ""

        edges: Dict[str, Set[str]] = {}
        for module, targets in graph.items():
            here = child(module)
            for target in targets:
                there = child(target)
                if here and there and here != there:
                    edges.setdefault(here, set()).add(there)
        problems += [f"{package}: {' <-> '.join(component)}" for component in strongly_connected(edges)
                     if set(component) & packages]
    return problems


def launcher_sources() -> Tuple[Dict[str, str], Set[str]]:
    """({module: source} of every module in launcher/, the packages among them)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    return ({module_name(p): p.read_text() for p in paths},
            {module_name(p) for p in paths if p.name == "__init__.py"})


def test_no_two_modules_import_each_other():
    sources, _ = launcher_sources()
    cycles = strongly_connected(import_graph(sources))
    assert not cycles, "modules that import each other (round a loop):\n  " + "\n  ".join(" <-> ".join(c) for c in cycles)


def test_no_two_packages_import_each_other():
    sources, packages = launcher_sources()
    cycles = package_cycles(import_graph(sources), packages)
    assert not cycles, ("packages that import each other (move what both need below both):\n  "
                        + "\n  ".join(cycles))


@pytest.mark.parametrize("sources", [
    {"launcher.a.x": "from launcher.a.y import f\n", "launcher.a.y": "def g():\n    from launcher.a.x import h\n"},
    {"launcher.a.x": "import launcher.a.y\n", "launcher.a.y": "import launcher.a.z\n",
     "launcher.a.z": "from launcher.a import x\n"},
])
def test_the_walk_sees_module_cycles_even_inside_functions(sources):
    assert strongly_connected(import_graph(sources)), "a cycle of modules went unnoticed"


def test_the_walk_sees_package_cycles_without_module_cycles():
    """hf.format imports config.errors, config.loader imports hf.format: no module loop, a package loop."""
    sources = {"launcher.hf.format": "from launcher.config.errors import ConfigError\n",
               "launcher.config.errors": "", "launcher.config.loader": "from launcher.hf.format import f\n",
               "launcher.hf": "", "launcher.config": "", "launcher": ""}
    graph = import_graph(sources)
    assert not strongly_connected(graph)
    assert package_cycles(graph, {"launcher", "launcher.hf", "launcher.config"}) == [
        "launcher: launcher.config <-> launcher.hf"]


def test_one_way_imports_between_packages_pass():
    sources = {"launcher.plan.decide.resolve": "from launcher.plan.estimate.memory import m\n",
               "launcher.plan.estimate.memory": "from launcher.plan.layout import Layout\n",
               "launcher.plan.layout": "", "launcher.plan": "", "launcher.plan.decide": "", "launcher.plan.estimate": ""}
    graph = import_graph(sources)
    assert not strongly_connected(graph)
    assert package_cycles(graph, {"launcher.plan", "launcher.plan.decide", "launcher.plan.estimate"}) == []


@pytest.mark.parametrize("action", ["plan", "search"])
def test_planning_actions_import_neither_torch_nor_deepspeed(tmp_path, action):
    """`train action=plan|search` end to end (Hydra, resolver, estimators, report) in one process."""
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: sys.stderr.write('HEAVY=' + repr(sorted(m for m in ('torch', 'deepspeed') "
        "if m in sys.modules)) + '\\n'))\n"
        f"sys.argv = ['train', '+recipe=debug', 'action={action}', 'plan.plots=false', 'plan.format=json', "
        f"'cluster.gpus_per_node=2', 'hydra.run.dir={tmp_path / 'run'}']\n"
        "from launcher.cli import main\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "HEAVY=[]" in proc.stderr, proc.stderr[-2000:]


# Function-local imports only where they buy something (a torch-free host path, a slow or
# optional package on some paths), each saying why: `# lazy: <reason>` on its line or the line
# above. Every module of the package is held to it.


def unexplained_local_imports(source: str) -> List[int]:
    """Lines of imports inside functions that carry no `# lazy: <reason>` comment."""
    lines = source.splitlines()

    def explained(node: ast.stmt) -> bool:
        own = lines[node.lineno - 1:node.end_lineno]
        above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
        candidates = [line.partition("#")[2] for line in own if "#" in line]
        if above.startswith("#"):
            candidates.append(above[1:])
        return any(text.strip().startswith("lazy:") and text.strip()[len("lazy:"):].strip() for text in candidates)

    bad = set()
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and not explained(node):
                    bad.add(node.lineno)
    return sorted(bad)


def test_function_local_imports_say_why():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        problems += [f"{path.relative_to(REPO)}:{line}" for line in unexplained_local_imports(path.read_text())]
    assert not problems, ("function-local imports without a `# lazy: <reason>` comment (move them to the top, or "
                          "say what importing them late buys):\n  " + "\n  ".join(problems))


@pytest.mark.parametrize("source, bad", [
    ("def f():\n    import json\n", [2]),
    ("def f():\n    import json  # lazy:\n", [2]),  # a marker without a reason
    ("def f():\n    import torch  # lazy: keeps the planner torch-free\n    import numpy\n", [3]),
    ("def f():\n    # lazy: deepspeed is slow to import\n    import deepspeed\n", []),
    ("import json\n\nclass A:\n    def f(self):\n        def g():\n            from x import (a,\n                b)  # lazy: x is optional\n", []),
])
def test_the_lazy_rule_sees_bare_local_imports(source, bad):
    assert unexplained_local_imports(source) == bad
