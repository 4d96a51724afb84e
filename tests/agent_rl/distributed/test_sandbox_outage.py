"""Training goes on through a sandbox outage (issue 14, item 2): a real sandbox service (a subprocess,
`python -m sandbox serve`) is killed with SIGKILL, its workers with it, as a step's collection
starts, and started again on the same port OUTAGE_S seconds later. Every episode of that step
fails at reset (connection refused); the trainer logs it, waits and collects the step again, and
once the service is back the run trains to its last step. The same in this process and with Ray
rollout workers (each its own HTTP client in another process).

Before the fix, a step whose episodes had all failed crashed the trainer in the log-prob pass
(a 1-token-wide batch); before the client waited for capacity, nothing here would differ.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torch")

from agent_rl.config import build_config
from agent_rl.metrics import read_metrics
from agent_rl.train import Trainer
from tests.agent_rl.test_train import SMALL
from tests.sandbox.conftest import need_bwrap

pytestmark = pytest.mark.slow

OUTAGE_S = 10.0
RETRY_WAITS_S = (4.0, 4.0, 4.0, 4.0, 4.0)
"""Waits before collecting a failed step again: the service is back within the third (about 12 s);
short, so the test is quick, and several, so a slow restart on a loaded machine still fits."""
STEPS = 3
KILLED_AT = 2
"""The step whose collection starts with the service dead."""


class SandboxService:
    """A sandbox service subprocess on a fixed loopback port that can be killed and started again."""

    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarted = threading.Event()

    def start(self) -> None:
        cmd = [sys.executable, "-m", "sandbox", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--workers-pool-size", "2", "--log-level", "warning"]
        env = {k: v for k, v in os.environ.items() if k != "SANDBOX_AUTH_TOKEN"}
        # Its own process group: the kill takes the service's workers down with it, as a crash would.
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "sandbox service did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def kill_and_restart_later(self, delay_s: float) -> None:
        """Kill now; start again on the same port after ``delay_s`` seconds, on a thread."""
        self.kill()

        def restart() -> None:
            time.sleep(delay_s)
            self.start()
            self.restarted.set()

        threading.Thread(target=restart, daemon=True).start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.fixture
def service() -> Iterator[SandboxService]:
    need_bwrap()
    svc = SandboxService()
    svc.start()
    yield svc
    svc.restarted.wait(60)  # never leave a restart thread starting a server after the test
    svc.stop()


def _kill_when_step_starts(trainer: Trainer, service: SandboxService) -> list[float]:
    """Wrap the trainer's collector: the collection of step KILLED_AT starts with the service killed
    (restarted OUTAGE_S later). Returns the kill time (filled in when it happens)."""
    collector, calls, killed_at = trainer.collector, [0], []
    inner = collector.collect

    def collect(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == KILLED_AT:
            service.kill_and_restart_later(OUTAGE_S)
            killed_at.append(time.monotonic())
        return inner(*args, **kwargs)

    collector.collect = collect  # type: ignore[method-assign]
    return killed_at


def _train_through_outage(tiny_model_dir: Path, out: Path, service: SandboxService, extra: list[str]) -> None:
    sets = [
        *SMALL,
        f"model.path={tiny_model_dir}",
        f"run.out_dir={out}",
        "run.name=outage",
        f"train.steps={STEPS}",
        "train.warmup.steps=0",
        "env.eval_tasks=0",
        "sandbox.backend=http",
        f"sandbox.url={service.url}",
        *extra,
    ]
    trainer = Trainer(build_config({}, sets))
    trainer.retry_backoff_s = RETRY_WAITS_S
    killed_at = _kill_when_step_starts(trainer, service)
    try:
        trainer.fit()
    finally:
        for part in (trainer.sampler, trainer.learner):
            if hasattr(part, "shutdown"):
                part.shutdown()
    assert killed_at, "the service was never killed: the test did not test anything"
    rows = {r["step"]: r for r in read_metrics(out / "outage") if "env/infra_errors" in r}
    assert sorted(rows) == list(range(1, STEPS + 1)), "a step was lost"
    hit = rows[KILLED_AT]
    # Collected again until the service was back (down 10 s, waits of 4 s: 2-5 retries), then trained.
    assert 2 <= hit["perf/rollout_retries"] <= len(RETRY_WAITS_S), hit
    assert "losses/loss" in hit and hit["env/infra_errors"] == 0, hit
    for step, row in rows.items():
        if step != KILLED_AT:
            assert row["perf/rollout_retries"] == 0 and row["env/infra_errors"] == 0, (step, row)
        assert "losses/loss" in row and "train/skipped_step" not in row, (step, row)
    assert (out / "outage" / "checkpoints" / f"step_{STEPS:06d}").is_dir()


def test_in_process_training_goes_on_through_a_sandbox_restart(
    tiny_model_dir: Path, tmp_path: Path, service: SandboxService
) -> None:
    _train_through_outage(tiny_model_dir, tmp_path, service, [])


def test_ray_training_goes_on_through_a_sandbox_restart(
    ray_cluster: Any, tiny_model_dir: Path, tmp_path: Path, service: SandboxService
) -> None:
    _train_through_outage(tiny_model_dir, tmp_path, service, ["scale.backend=ray", "scale.rollout_workers=1"])
