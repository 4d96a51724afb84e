"""SandboxFusion's ``/run_code`` and ``/run_jupyter``: request planning and answer translation.

SandboxFusion semantics, which verl's reward code and the ``sandbox-fusion`` SDK rely on:
``compile_result``/``run_result.status`` is ``Finished`` when the program ran to an end (whatever
its exit code), ``TimeLimitExceeded`` on its timeout (with what it printed until then), ``Error``
when it could not be started; ``return_code`` is the process's exit status, negative for a
signal (-9 for a kill, 1 for an uncaught Python exception such as MemoryError). The top-level
``status`` is ``Success`` when every step finished with 0, ``Failed`` otherwise, ``SandboxError``
when the sandbox itself broke; all three come with HTTP 200 (verl scores any other code as an API
error). Limits above the server maximum are clamped, not refused, and ``warnings`` says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from sandbox.http.server.schemas import (
    CellRunResult,
    CommandRunResult,
    RunCodeRequest,
    RunCodeResponse,
    RunJupyterRequest,
    RunJupyterResponse,
)
from sandbox.languages import RunSpec
from sandbox.limits import LimitError, Limits
from sandbox.result import ExecResult, SandboxUnavailable

MARGIN_S = 5.0
"""Seconds of the server's wall-time maximum kept for starting and ending the driver."""


@dataclass
class RunPlan:
    """A validated ``/run_code`` request: the driver's spec, the worker's limits, the notes."""

    spec: RunSpec
    limits: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise LimitError(f"{name} must be > 0, got {value}")


def memory_mb(requested: int, maxima: Limits, warnings: list[str], unlimited: int | None = None) -> int:
    """-1 (SandboxFusion's "no limit") is ``unlimited`` (default: the server maximum); more than
    the maximum is clamped."""
    if requested == -1:
        return unlimited or maxima.memory_mb
    if requested <= 0:
        raise LimitError(f"memory_limit_MB must be > 0 or -1 (the server maximum), got {requested}")
    if requested > maxima.memory_mb:
        warnings.append(f"memory_limit_MB={requested} clamped to the server maximum {maxima.memory_mb}")
        return maxima.memory_mb
    return requested


def plan_run(
    body: RunCodeRequest, maxima: Limits, output_bytes: int, unlimited_memory_mb: int | None = None
) -> RunPlan:
    """Clamp the timeouts and memory into what the server allows (never a 422 for "too much")."""
    _positive("run_timeout", body.run_timeout)
    _positive("compile_timeout", body.compile_timeout)
    warnings: list[str] = []
    longest = maxima.wall_s - MARGIN_S
    run_timeout = float(body.run_timeout)
    if run_timeout > longest:
        warnings.append(f"run_timeout={body.run_timeout:g} clamped to the server maximum {longest:g}")
        run_timeout = longest
    compile_timeout = float(body.compile_timeout)
    compile_room = max(1.0, longest - run_timeout)
    spec = RunSpec(
        language=body.language,
        code=body.code,
        stdin=body.stdin or "",
        compile_timeout=min(compile_timeout, compile_room),
        run_timeout=run_timeout,
        output_bytes=output_bytes,
        fetch_files=tuple(body.fetch_files),
    )
    if spec.compile_timeout < compile_timeout and spec.budget_s > run_timeout + MARGIN_S:
        warnings.append(
            f"compile_timeout={body.compile_timeout:g} clamped to {spec.compile_timeout:g} "
            f"(compile and run share the server maximum {maxima.wall_s:g} s)"
        )
    budget = min(spec.budget_s, maxima.wall_s)
    limits = {
        "wall_s": budget,
        "cpu_s": min(budget, maxima.cpu_s),
        "output_bytes": maxima.output_bytes,
        "memory_mb": memory_mb(body.memory_limit_MB, maxima, warnings, unlimited_memory_mb),
    }
    return RunPlan(spec, limits, warnings)


def plan_request(body: RunCodeRequest, settings: Any) -> RunPlan:
    """``plan_run`` under the server's settings: both ``/run_code`` routes must plan alike."""
    return plan_run(
        body, settings.max_limits, settings.default_limits.output_bytes, settings.fusion_default_memory_mb
    )


def _step(raw: dict[str, Any] | None) -> CommandRunResult | None:
    if raw is None:
        return None
    return CommandRunResult(
        status=raw["status"],
        execution_time=raw.get("execution_time"),
        return_code=raw.get("return_code"),
        stdout=raw.get("stdout", ""),
        stderr=raw.get("stderr", ""),
    )


def _status(steps: list[CommandRunResult]) -> tuple[str, str]:
    for s in steps:
        if s.status == "Error":
            return "SandboxError", s.stderr or "the program could not be started"
    if any(s.status == "TimeLimitExceeded" or s.return_code != 0 for s in steps):
        return "Failed", ""
    return "Success", ""


def _report(result: ExecResult) -> dict[str, Any] | None:
    """The driver's JSON line, or None when the worker ended before printing it."""
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _without_report(result: ExecResult, plan: RunPlan) -> RunCodeResponse:
    """The worker itself stopped: its own time budget, memory, or a crash."""
    if result.timed_out:
        run = CommandRunResult(
            status="TimeLimitExceeded", execution_time=result.duration_s, stdout="", stderr=""
        )
        return RunCodeResponse(status="Failed", run_result=run, warnings=plan.warnings)
    if result.memory_exceeded:
        # The memory cgroup killed the whole worker rather than only the program: report it as
        # the program being killed, which is what a script under a memory limit would see.
        run = CommandRunResult(
            status="Finished",
            execution_time=result.duration_s,
            return_code=-9,
            stdout="",
            stderr=f"killed: memory limit of {plan.limits['memory_mb']} MB exceeded\n",
        )
        return RunCodeResponse(status="Failed", run_result=run, warnings=plan.warnings)
    why = f"{result.error.type}: {result.error.message}" if result.error else "no report from the runner"
    return RunCodeResponse(status="SandboxError", message=why, warnings=plan.warnings)


def fusion_response(result: ExecResult, plan: RunPlan) -> RunCodeResponse:
    report = _report(result)
    if report is None:
        return _without_report(result, plan)
    return report_response(report, plan)


def report_response(report: dict[str, Any], plan: RunPlan) -> RunCodeResponse:
    """The answer for a driver report (run_driver.py's, or the zygote's: the same shape)."""
    compile_result, run_result = _step(report.get("compile")), _step(report.get("run"))
    status, message = _status([s for s in (compile_result, run_result) if s is not None])
    warnings = list(plan.warnings)
    if report.get("missing"):
        warnings.append(f"fetch_files not found or too large: {report['missing']}")
    return RunCodeResponse(
        status=status,  # type: ignore[arg-type]
        message=message,
        compile_result=compile_result,
        run_result=run_result,
        files=report.get("files") or {},
        warnings=warnings,
    )


# -- /run_jupyter -----------------------------------------------------------------------------
_FETCH_CELL = """
import base64 as _b64, json as _json
_got = {}
for _name in %s:
    try:
        with open(_name, "rb") as _f:
            _got[_name] = _b64.b64encode(_f.read()).decode("ascii")
    except OSError:
        pass
print(_json.dumps(_got))
"""


def fetch_cell(names: list[str]) -> str:
    return _FETCH_CELL % json.dumps(names)


def cell_result(result: ExecResult) -> CellRunResult:
    """One notebook cell as SandboxFusion reports it: display for the value, error for a raise."""
    display = [{"text/plain": result.value}] if result.value is not None else []
    error = []
    if result.error is not None:
        error.append(
            {
                "ename": result.error.type,
                "evalue": result.error.message,
                "traceback": result.error.traceback.splitlines(),
            }
        )
    return CellRunResult(stdout=result.stdout, stderr=result.stderr, display=display, error=error)


def jupyter_response(
    cells: list[ExecResult], elapsed_s: float, timed_out: bool, files: dict[str, str]
) -> RunJupyterResponse:
    """``Failed`` only when the notebook ran out of time; a cell that raises is still ``Success``."""
    driver = CommandRunResult(
        status="TimeLimitExceeded" if timed_out else "Finished",
        execution_time=elapsed_s,
        return_code=None if timed_out else 0,
        stdout="",
        stderr="",
    )
    return RunJupyterResponse(
        status="Failed" if timed_out else "Success",
        driver=driver,
        cells=[cell_result(r) for r in cells],
        files=files,
    )


def zygote_run(plan: RunPlan) -> dict[str, Any] | None:
    """``Zygote.run`` arguments for ``plan``, or None when it needs the worker path (not Python)."""
    spec = plan.spec
    if spec.language != "python":
        return None
    return {
        "code": spec.code,
        "stdin": spec.stdin,
        "timeout_s": spec.run_timeout,
        "cpu_s": plan.limits["cpu_s"],
        "memory_mb": plan.limits["memory_mb"],
        "output_bytes": spec.output_bytes,
        "fetch_files": list(spec.fetch_files),
        "fetch_bytes": spec.fetch_bytes,
    }


async def zygote_answer(state: Any, plan: RunPlan, run: dict[str, Any]) -> dict[str, Any]:
    """The ``/run_code`` answer from the fork server, for the FastAPI route and the fast one alike.

    Queued like every SandboxFusion request (a QueueTimeout becomes the app's 504); a zygote that
    fails is answered 200 with SandboxError, since verl scores any other status as an API error.
    """
    zygote = state.zygote
    t0 = time.perf_counter()
    try:
        report = await state.execute_queued(
            lambda: zygote.run_async(**run), state.settings.fusion_queue_wait_s
        )
    except SandboxUnavailable as e:
        return RunCodeResponse(status="SandboxError", message=str(e), warnings=plan.warnings).model_dump()
    state.metrics.record("run_code", ExecResult(duration_s=time.perf_counter() - t0))
    return report_response(report, plan).model_dump()


def jupyter_budget(body: RunJupyterRequest, maxima: Limits) -> tuple[float, float, list[str]]:
    """(per-cell seconds, total seconds, warnings): 0 per cell means "the rest of the total"."""
    warnings: list[str] = []
    _positive("total_timeout", body.total_timeout)
    if body.cell_timeout < 0:
        raise LimitError(f"cell_timeout must be >= 0, got {body.cell_timeout}")
    total = float(body.total_timeout)
    if total > maxima.wall_s:
        warnings.append(f"total_timeout={total:g} clamped to the server maximum {maxima.wall_s:g}")
        total = maxima.wall_s
    per_cell = min(float(body.cell_timeout or total), total)
    return per_cell, total, warnings
