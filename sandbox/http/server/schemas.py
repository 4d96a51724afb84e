"""Request and response bodies of the HTTP API (v1 and the SandboxFusion-compatible /run_code)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ValidationIssue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorOut(BaseModel):
    """Every error body. ``detail`` is a message, or, for a request that does not parse or fit the
    schema (422 from validation), the list of what is wrong with it."""

    detail: str | list[ValidationIssue]


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for these error statuses, so the schema documents what is answered."""
    what = {
        400: "Bad request: a body that is not UTF-8 JSON, or an unsupported language",
        401: "Missing or wrong bearer token",
        404: "Unknown session (expired, deleted, or never created)",
        409: "The session was closed while this execution ran: it was cancelled",
        413: "Body or code over the size limit",
        422: "Invalid request or limits",
        429: "Overloaded: retry after the Retry-After header's seconds",
        504: "Queued longer than the server's bound (SandboxFusion routes): retry after Retry-After",
        503: "The sandbox itself failed (a worker could not start, ...)",
    }
    return {code: {"model": ErrorOut, "description": what[code]} for code in codes}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LimitsIn(_Strict):
    """Any subset of :class:`sandbox.limits.Limits`; each is checked against the server maximum."""

    wall_s: float | None = None
    cpu_s: float | None = None
    output_bytes: int | None = None
    session_cpu_s: float | None = None
    memory_mb: int | None = None
    processes: int | None = None
    open_files: int | None = None
    file_size_mb: int | None = None
    disk_mb: int | None = None

    def given(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class SessionCreate(_Strict):
    limits: LimitsIn = Field(default_factory=LimitsIn)


class SessionPublic(BaseModel):
    id: str
    limits: dict[str, Any]
    executions: int = 0
    restarts: int = 0
    idle_s: float = 0.0


class ExecuteIn(_Strict):
    code: str
    language: Literal["python"] = "python"
    timeout_s: float | None = Field(None, description="Wall-clock limit for this execution.")
    limits: LimitsIn = Field(default_factory=LimitsIn)
    want_value: bool = True
    stdin: str | None = None
    files: dict[str, str] | None = Field(None, description="Workspace path -> base64 content.")


class ErrorPublic(BaseModel):
    type: str
    message: str
    traceback: str = ""
    exit_code: int | None = None


class ExecResultPublic(BaseModel):
    stdout: str
    stderr: str
    ok: bool
    value: str | None
    error: ErrorPublic | None
    timed_out: bool
    memory_exceeded: bool
    truncated: bool
    session_restarted: bool
    limit: str | None
    duration_s: float
    cpu_s: float
    exit_code: int | None


class BatchIn(_Strict):
    programs: list[ExecuteIn] = Field(..., min_length=1)


class BatchPublic(BaseModel):
    results: list[ExecResultPublic]


# -- SandboxFusion /run_code and /run_jupyter -------------------------------------------------
class RunCodeRequest(BaseModel):
    """SandboxFusion's request. Unknown fields are ignored, as SandboxFusion does."""

    model_config = ConfigDict(extra="ignore")

    code: str
    language: str = "python"
    """python, bash, cpp or c (``GET /v1/ping`` is not the list: see the 400's message)."""
    compile_timeout: float = 10
    run_timeout: float = 10
    """Seconds; above the server maximum it is clamped (``warnings`` says so), not refused."""
    memory_limit_MB: int = -1
    """-1: the server maximum. Above the maximum: clamped."""
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict, description="Path -> base64 content.")
    fetch_files: list[str] = Field(default_factory=list, description="Paths returned base64 in ``files``.")


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    """Exit status; negative for a signal (-9: killed), as Python's subprocess reports it."""
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
    """Not in SandboxFusion (its clients ignore it): limits clamped, files not found."""


class RunJupyterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = 0
    """Seconds per cell; 0: whatever is left of ``total_timeout``."""
    total_timeout: float = 45
    kernel: Literal["python3"] = "python3"
    files: dict[str, str] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str = ""
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
