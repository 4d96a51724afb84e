"""Languages that SandboxFusion's ``/run_code`` accepts here, and the cell that runs one program.

Every language runs the same way: a pooled worker (bubblewrap, or rlimits inside the container)
executes ``sandbox/run_driver.py``, which writes the source to a private temp dir, compiles it
when the language needs that, and runs it as the worker's child. The child inherits the worker's
namespaces, uid, rlimits and cgroup, so a bash script or a C++ binary is confined exactly like
Python code. Names follow SandboxFusion's (``python``, ``bash``, ``cpp``); ``c`` is extra.

A language whose tools are missing on this machine (no g++) is not offered: the request gets a
400 that names what is missing instead of a compile error that verl would score as wrong code.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sandbox.output_pipes import prepend_to

_DRIVER = Path(__file__).with_name("run_driver.py")


@dataclass(frozen=True)
class Language:
    """How to build and run one language; ``{src}``, ``{exe}``, ``{dir}``, ``{python}`` are filled in."""

    name: str
    source: str
    """File name the code is written to (in a private temp dir, not the workspace)."""
    run: tuple[str, ...]
    compile: tuple[str, ...] = ()
    """Empty: nothing to compile. Otherwise its own step with ``compile_timeout``."""
    needs: tuple[str, ...] = ()
    """Programs that must be on PATH (host or image) for the language to be offered."""


LANGUAGES: dict[str, Language] = {
    lang.name: lang
    for lang in (
        Language("python", "main.py", ("{python}", "-u", "{src}")),  # -u: output survives a kill
        Language("bash", "main.sh", ("bash", "{src}"), needs=("bash",)),
        Language(
            "cpp",
            "main.cpp",
            ("{exe}",),
            compile=("g++", "-std=c++17", "-O2", "-o", "{exe}", "{src}", "-lm"),
            needs=("g++",),
        ),
        Language(
            "c",
            "main.c",
            ("{exe}",),
            compile=("gcc", "-std=c11", "-O2", "-o", "{exe}", "{src}", "-lm"),
            needs=("gcc",),
        ),
    )
}


@cache
def available() -> tuple[str, ...]:
    """Languages whose tools this machine has (cached: the set does not change while serving)."""
    return tuple(name for name, lang in LANGUAGES.items() if all(shutil.which(p) for p in lang.needs))


def unsupported_message(language: str) -> str:
    if language in LANGUAGES:
        missing = [p for p in LANGUAGES[language].needs if not shutil.which(p)]
        return f"language {language!r} needs {', '.join(missing)}, which this server does not have"
    return f"unsupported language {language!r}: this sandbox runs {', '.join(available())}"


@cache
def _driver_source() -> str:
    return prepend_to(_DRIVER.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class RunSpec:
    """One ``/run_code`` request after validation and clamping: what the driver is told."""

    language: str
    code: str
    stdin: str
    compile_timeout: float
    run_timeout: float
    output_bytes: int
    fetch_files: tuple[str, ...] = ()
    fetch_bytes: int = 8 << 20

    def cell(self) -> str:
        """The Python cell a worker runs: the driver, then one call that prints its JSON report."""
        lang = LANGUAGES[self.language]
        spec: dict[str, Any] = {
            "source": lang.source,
            "code": self.code,
            "stdin": self.stdin,
            "compile": list(lang.compile),
            "run": list(lang.run),
            "compile_timeout": self.compile_timeout,
            "run_timeout": self.run_timeout,
            "output_bytes": self.output_bytes,
            "fetch_files": list(self.fetch_files),
            "fetch_bytes": self.fetch_bytes,
        }
        return f"{_driver_source()}\nprint(_fusion_main(json.loads({json.dumps(json.dumps(spec))})))\n"

    @property
    def budget_s(self) -> float:
        """Worst case for the whole cell: both steps, plus a margin for start-up and teardown."""
        return (self.compile_timeout if LANGUAGES[self.language].compile else 0.0) + self.run_timeout + 5.0
