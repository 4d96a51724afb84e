"""ToolEnv over the sandbox HTTP service: a real server, and a real outage (the server is killed)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import envs

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    from sandbox import Client

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox", "serve", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    client = Client(url, retries=0)
    deadline = time.monotonic() + 60
    while not client.healthy():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("sandbox server did not start")
        time.sleep(0.2)
    yield proc, client
    proc.kill()
    proc.wait(timeout=10)
    client.close()


def test_episode_over_http_and_outage_mid_episode(server) -> None:
    proc, client = server
    env = envs.PythonMathEnv(sandbox=envs.Shared(client), families=("multiply",), difficulty=0)
    assert envs.demonstration(env, 0).total_reward == 1.0

    env.reset(seed=0)
    env.step("```python\nx = 5\n```")
    obs, *_ = env.step("```python\nprint(x * 2)\n```")
    assert obs[0]["content"] == "```output\n10\n```"

    proc.kill()
    proc.wait(timeout=10)
    obs, reward, terminated, truncated, info = env.step("```python\nprint(x)\n```")
    assert (obs, reward, terminated, truncated) == ([], 0.0, False, True)
    assert "unreachable" in info["infra_error"]
    _, info = env.reset(seed=1)  # the next episode reports the outage instead of raising
    assert "infra_error" in info
    env.close()
