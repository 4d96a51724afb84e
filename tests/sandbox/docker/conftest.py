"""Fixtures for tests that run real containers.

Without a reachable engine these tests skip on a laptop but FAIL under CI=true: CI installs the
engine (.ci/docker_setup.sh), so a missing one there is a broken pipeline, not a reason to pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SANDBOX_IMAGE = os.environ.get("AGENT_RL_SANDBOX_IMAGE", "agent-rl/sandbox:latest")
OFFLINE_BASE = "agent-rl/base:bookworm"


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true but {reason}; .ci/docker_setup.sh should have provided it")
    pytest.skip(reason)


def base_image() -> str:
    """The offline base if this machine has it (no registry here), else the official image."""
    explicit = os.environ.get("BASE_IMAGE")
    if explicit:
        return explicit
    found = subprocess.run(["docker", "image", "inspect", OFFLINE_BASE], capture_output=True, check=False)
    return OFFLINE_BASE if found.returncode == 0 else "python:3.12-slim"


TRAINER_BASE = "agent-rl/base-torch:bookworm"


def trainer_base_env() -> dict[str, str]:
    """TRAINER_BASE_IMAGE for compose when this machine has the offline torch base (it has the CPU
    torch wheel inside; the official image would download torch), else nothing (compose's default)."""
    found = subprocess.run(["docker", "image", "inspect", TRAINER_BASE], capture_output=True, check=False)
    return {"TRAINER_BASE_IMAGE": TRAINER_BASE} if found.returncode == 0 else {}


@pytest.fixture(scope="session")
def docker_client():
    """A docker SDK client for a reachable engine."""
    try:
        import docker
    except ImportError:
        _missing("the docker SDK is not installed (pip install 'agent-rl[docker]')")
    if shutil.which("docker") is None:
        _missing("the docker CLI is not on PATH")
    try:
        client = docker.from_env(timeout=120)
        client.ping()
    except docker.errors.DockerException as exc:
        _missing(f"no reachable Docker engine ({exc})")
    return client


@pytest.fixture(scope="session")
def sandbox_image(docker_client) -> str:
    """Build sandbox/Dockerfile once per run (layer cache makes repeat builds take seconds)."""
    cmd = [
        "docker", "build", "-q", "-f", "sandbox/Dockerfile",
        "--build-arg", f"BASE_IMAGE={base_image()}", "-t", SANDBOX_IMAGE, ".",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, f"building {SANDBOX_IMAGE} failed:\n{done.stderr[-4000:]}"
    return SANDBOX_IMAGE
