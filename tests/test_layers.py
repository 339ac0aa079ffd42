"""Imports run only downward, and the planning actions stay free of torch and DeepSpeed.

Floors, top to bottom (docs/parallelism.md, "Layers"): cli -> launch -> runtime -> engines ->
parallel -> plan, data -> config -> models, paths. A module may import from its own floor
or below, never above: an AST walk of every module in launcher/, imports inside functions
included.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "launcher"
FLOOR = {
    "cli": 10,
    "launch": 9,
    "runtime": 8,
    "rehearse": 8,
    "checkpoint": 7,
    "resilience": 7,
    "observe": 6,
    "engines": 5,
    "parallel": 4,
    "plan": 3,
    "data": 3,
    "config": 2,
    "hf": 1,
    "models": 0,
    "job_env": 0,
    "paths": 0,
}


def room_of(module: str) -> str:
    """'launcher.plan.resolve' -> 'plan'; 'launcher.cli' -> 'cli'."""
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
    ("from launcher import cli\n", "launcher.plan.plan"),
])
def test_the_walk_sees_upward_imports_even_inside_functions(source, module):
    assert upward_imports(source, module), "an upward import went unnoticed"


def test_downward_and_same_floor_imports_pass():
    assert upward_imports("from launcher.plan.layout import Layout\nimport launcher.data.dataset\n",
                          "launcher.plan.plan") == []


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
