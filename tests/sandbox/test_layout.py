"""The shape of sandbox/: the shared core imports no backend, old import paths still lead to the
same modules, and no function grows past what a reader can hold at once."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import sandbox

PACKAGE = Path(sandbox.__file__).parent
BACKENDS = ("sandbox.bwrap", "sandbox.docker", "sandbox.http")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_the_shared_core_imports_no_backend() -> None:
    for path in (PACKAGE / "session").glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith(BACKENDS)}
        assert not bad, f"{path.name} imports {sorted(bad)}: session/ is shared by every backend"


def test_local_and_docker_backends_do_not_import_each_other_or_the_http_layer() -> None:
    for folder, others in (("bwrap", ("sandbox.docker", "sandbox.http")), ("docker", ("sandbox.bwrap", "sandbox.http"))):
        for path in (PACKAGE / folder).glob("*.py"):
            bad = {m for m in _imports(path) if m.startswith(others)}
            assert not bad, f"{folder}/{path.name} imports {sorted(bad)}"


def test_old_module_paths_are_the_modules_at_their_new_homes() -> None:
    for old, new in sandbox.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    from sandbox.server.app import create_app  # a submodule through an old package path

    assert create_app is importlib.import_module("sandbox.http.server.app").create_app
    assert importlib.import_module("sandbox.http.server.app").__spec__.name == "sandbox.http.server.app"
    # What compose.yaml's command and agent_rl import, in a fresh interpreter.
    code = (
        "from sandbox.server import create_app\n"
        "from sandbox.settings import SandboxSettings\n"
        "from sandbox.docker_backend import DockerSandbox\n"
        "from sandbox import DockerSandbox as D, Client, LocalSandbox\n"
        "import sandbox.docker.backend as b\n"
        "assert DockerSandbox is D is b.DockerSandbox\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_no_function_is_longer_than_60_lines() -> None:
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if size > 60:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({size} lines)")
    assert not long, long
