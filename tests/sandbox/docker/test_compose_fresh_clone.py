"""`docker compose up` on a fresh clone, with no `.env` and no token set anywhere (issue 16).

The sandbox must generate its token on first start, print it once in its logs with how to use
it, and the host must reach the service with that token (as a bearer header, and as the URL
path prefix verl's SandboxFusion client uses). Only the machine's own needs are passed as
environment variables (the offline base image, a free port, a small pool); none is a token.

Cost on the 2-core reference machine: a cold build of the sandbox image (pip: fastapi and the
scientific stack; apt: g++) takes several minutes; with the layer cache warm, `up` takes well
under a minute. The trainer (a short quickstart: 2 RL steps) runs last, from the same clone, and
finds the generated token in the shared volume; its image is the stack test's (test_compose.py
builds it first), so here the build is a cache hit.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.sandbox.docker.conftest import REPO, base_image, trainer_base_env

pytestmark = pytest.mark.docker

TOKEN_LINE = re.compile(r"sandbox token \(generated on first start[^)]*\): (\S+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def fresh_stack(docker_client, tmp_path_factory):
    clone = tmp_path_factory.mktemp("fresh") / "agent-rl"
    done = subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (clone / ".env").exists()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SANDBOX_", "AGENT_RL_"))}
    env.update(
        COMPOSE_PROJECT_NAME=f"agentrl-fresh-{os.getpid()}",
        SANDBOX_PORT=str(port),
        BASE_IMAGE=base_image(),
        SANDBOX_POOL_SIZE="2",
        SANDBOX_MEM_LIMIT="2g",
        **trainer_base_env(),
    )
    t0 = time.monotonic()
    up = _run(["docker", "compose", "up", "-d", "--wait", "--build", "sandbox", "gateway"], clone, env, 1800)
    took = time.monotonic() - t0
    try:
        assert up.returncode == 0, f"compose up failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
        print(f"fresh clone: `docker compose up -d --wait --build sandbox gateway` took {took:.0f} s")
        yield clone, env, f"http://127.0.0.1:{port}"
    finally:
        _run(["docker", "compose", "down", "-v", "--remove-orphans", "--timeout", "20"], clone, env, 300)
        shutil.rmtree(clone, ignore_errors=True)


def _logged_token(clone: Path, env: dict[str, str]) -> tuple[str, str]:
    logs = _run(["docker", "compose", "logs", "--no-color", "sandbox"], clone, env, 60).stdout
    found = TOKEN_LINE.findall(logs)
    assert len(found) == 1, f"the token must be printed exactly once:\n{logs[-2000:]}"
    return found[0], logs


def test_fresh_clone_comes_up_without_env_and_the_logged_token_works(fresh_stack) -> None:
    clone, env, url = fresh_stack
    token, logs = _logged_token(clone, env)
    assert len(token) >= 32 and f"{url}/{token}/run_code" in logs  # the printed usage is right
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/v1/execute", json={"code": "1"}).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        r = http.post("/v1/execute", json={"code": "6 * 7"}, headers=auth)
        assert r.status_code == 200 and r.json()["value"] == "42"
        fusion = http.post(
            f"/{token}/run_code",
            json={"code": "import numpy, sympy; print(sympy.Integer(6) * int(numpy.int64(7)))"},
        )
        assert fusion.status_code == 200 and fusion.json()["run_result"]["stdout"] == "42\n", fusion.text
        cpp = http.post(
            f"/{token}/run_code",
            json={"language": "cpp", "code": '#include <cstdio>\nint main(){puts("c++ ok");}'},
        )
        assert cpp.json()["status"] == "Success", cpp.text
        # Executed code cannot read the token file (it belongs to the trainer's uid, mode 0400).
        peek = http.post(
            f"/{token}/run_code",
            json={"language": "bash", "code": "cat /run/agent-rl-secrets/token && echo LEAKED"},
        ).json()
        assert "LEAKED" not in peek["run_result"]["stdout"] and token not in peek["run_result"]["stdout"]


def test_the_token_survives_a_restart_and_is_not_printed_again(fresh_stack) -> None:
    clone, env, url = fresh_stack
    token, _ = _logged_token(clone, env)
    restarted = _run(["docker", "compose", "restart", "sandbox"], clone, env, 300)
    assert restarted.returncode == 0, restarted.stderr
    up = _run(["docker", "compose", "up", "-d", "--wait", "sandbox", "gateway"], clone, env, 600)
    assert up.returncode == 0, up.stderr
    again, _ = _logged_token(clone, env)  # still exactly one printed line, the same token
    assert again == token
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post(f"/{token}/run_code", json={"code": "print('still')", "fetch_files": []})
        assert r.status_code == 200 and r.json()["run_result"]["stdout"] == "still\n"


@pytest.mark.slow
def test_the_trainer_finds_the_generated_token_and_trains(fresh_stack) -> None:
    """`docker compose up` starts the trainer too: with no token given anywhere, it must read the
    generated one from the `secrets` volume and run against the sandbox (a wrong or missing token
    fails its first session with 401)."""
    clone, env, _ = fresh_stack
    short = (
        "--set train.steps=2 --set env.eval_tasks=4 --set train.warmup.steps=5 --set train.warmup.demos=16"
    )
    built = _run(["docker", "compose", "build", "trainer"], clone, env, 3000)
    assert built.returncode == 0, built.stderr[-3000:]
    done = _run(
        ["docker", "compose", "run", "--rm", "-e", f"AGENT_RL_TRAIN_ARGS={short}", "trainer"],
        clone,
        env,
        3000,
    )
    assert done.returncode == 0, f"trainer failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    listing = _run(
        ["docker", "compose", "run", "--rm", "--no-deps", "--entrypoint", "find", "trainer", "/runs", "-name", "summary.json"],
        clone, env, 300,
    )  # fmt: skip
    assert "/runs/quickstart/summary.json" in listing.stdout, listing.stdout + listing.stderr
