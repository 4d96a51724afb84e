"""The project's import graph has no cycle, function-local imports included.

Why count the lazy ones: a cycle defused by a function-local import still means two modules that
each need the other; the last one (distributed/worker.py, now rollout_worker.py, -> train.make_sandbox) existed only because
the Config -> parts wiring lived in two places. `agent_rl.build` now holds it once.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agent_rl", "envs", "sandbox")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import mod` imports the submodule when there is one, else pkg itself.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_cycle_through_a_function_local_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_project_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert "agent_rl.build" in graph["agent_rl.distributed.rollout_worker"]  # the graph sees real edges
    assert "agent_rl.train" not in graph["agent_rl.distributed.rollout_worker"]
    assert cycles(graph) == []


def test_packages_import_only_downwards() -> None:
    """sandbox <- envs <- agent_rl: nothing imports a package stacked above it."""
    rank = {"sandbox": 0, "envs": 1, "agent_rl": 2}
    upward = [
        (src, dst)
        for src, targets in import_graph().items()
        for dst in targets
        if rank[dst.split(".")[0]] > rank[src.split(".")[0]]
    ]
    assert upward == []
