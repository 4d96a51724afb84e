"""Translate an ExecResult into SandboxFusion's /run_code answer, so its clients work unchanged.

SandboxFusion semantics: ``run_result.status`` is ``Finished`` when the program ran to an end
(whatever its exit code), ``TimeLimitExceeded`` on timeout, ``Error`` when it could not run;
the top-level ``status`` is ``Success`` only for a finished run with return code 0, ``Failed``
otherwise, and ``SandboxError`` when the sandbox itself broke.
"""

from __future__ import annotations

from sandbox.http.server.schemas import CommandRunResult, RunCodeResponse
from sandbox.result import ExecResult


def return_code(result: ExecResult) -> int:
    """What ``python script.py`` would have exited with."""
    if result.exit_code is not None:
        return result.exit_code
    if result.limit == "cpu_time":
        return 128 + 24  # SIGXCPU
    if result.memory_exceeded or result.timed_out:
        return 128 + 9  # SIGKILL
    return 1 if result.error is not None else 0


def fusion_response(result: ExecResult) -> RunCodeResponse:
    stderr = result.stderr
    if result.error is not None and result.error.traceback and result.error.type != "SystemExit":
        stderr += result.error.traceback  # a script would have printed its traceback to stderr
    elif result.error is not None and not result.error.traceback:
        stderr += f"{result.error.type}: {result.error.message}\n"
    if result.timed_out:
        status = "TimeLimitExceeded"
    else:
        status = "Finished"
    rc = return_code(result)
    run = CommandRunResult(
        status=status,  # type: ignore[arg-type]
        execution_time=result.duration_s,
        return_code=None if result.timed_out else rc,
        stdout=result.stdout,
        stderr=stderr,
    )
    ok = status == "Finished" and rc == 0
    message = "" if ok else (result.error.message if result.error else status)
    return RunCodeResponse(status="Success" if ok else "Failed", message=message, run_result=run)
