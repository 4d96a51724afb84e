"""Server settings: typed, injectable in tests, read from ``SANDBOX_*`` environment variables.

Shaped like a pydantic-settings ``BaseSettings`` (``SandboxSettings.from_env()``), without the
extra dependency. Unsafe combinations are refused with the fix in the message: binding a
non-loopback address requires an auth token.
"""

from __future__ import annotations

import ipaddress
import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from sandbox.bwrap.launcher import default_python
from sandbox.limits import DEFAULT_LIMITS, MAX_LIMITS, Limits

ENV_PREFIX = "SANDBOX_"


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SandboxSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    # -- network --
    host: str = "127.0.0.1"
    """Bind address. Anything but loopback requires ``auth_token``."""
    port: int = Field(8080, ge=0, le=65535)
    auth_token: SecretStr | None = None
    """Bearer token clients must send; read from the variable named by ``auth_token_env``."""
    auth_token_env: str = "SANDBOX_AUTH_TOKEN"
    token_in_path: bool = True
    """Also accept the token as the URL's first path segment (``http://host:8080/<token>/run_code``):
    SandboxFusion clients such as verl send no header but keep the URL they are given as it is.
    The token then appears wherever URLs are logged; turn this off where that matters."""

    # -- capacity --
    pool_size: int = Field(4, ge=0, le=1024)
    """Warm workers kept ready for new sessions and one-shot executions."""
    max_sessions: int = Field(64, ge=1)
    """Live sessions; creating one more answers 429."""
    max_concurrent_executions: int = Field(32, ge=1)
    """Executions running at once; more wait in the queue."""
    max_queued_executions: int = Field(256, ge=1)
    """Executions running or waiting; beyond this the server answers 429 with Retry-After."""
    retry_after_s: int = Field(1, ge=1)
    fusion_queue_wait_s: float = Field(5.0, ge=0)
    """SandboxFusion routes (/run_code, /run_jupyter) do not get 429: a request waits up to this
    long for a running slot, then gets 504 with Retry-After, the status verl retries (it waits 1 s,
    then 2 s; 3 tries). Keep it under 10 s: verl gives up on a request after
    compile_timeout + run_timeout + 10 s."""
    session_idle_timeout_s: float = Field(600.0, gt=0)
    """A session unused this long is closed and its worker killed."""
    max_code_bytes: int = Field(1 << 20, ge=1)
    max_batch: int = Field(256, ge=1)

    fusion_default_memory_mb: int | None = Field(None, ge=1)
    """Memory for a /run_code request with ``memory_limit_MB=-1`` (SandboxFusion's default, and
    what verl sends). None: the server maximum (``max_limits.memory_mb``), as SandboxFusion's
    "no limit" means. Such workers are started per request; set this to
    ``default_limits.memory_mb`` to serve them from the warm pool instead (about 50 ms less each)."""

    # -- limits --
    default_limits: Limits = DEFAULT_LIMITS
    max_limits: Limits = MAX_LIMITS

    # -- isolation --
    isolation: Literal["auto", "bwrap", "rlimits"] = "auto"
    """auto: bubblewrap when installed, else rlimits with a loud warning."""
    require_isolation: bool = False
    """Refuse to start without bubblewrap instead of falling back to rlimits."""
    python: str = Field(default_factory=default_python)
    """Interpreter the workers run; the sandbox uid must be able to execute it."""
    oneshot: Literal["zygote", "worker"] = "zygote"
    """How ``/run_code`` runs a Python program without ``files``: ``zygote`` forks it from a warm,
    sandboxed interpreter into fresh namespaces (sandbox/zygote.py; needs bubblewrap, else the
    worker path is used); ``worker`` runs it in a fresh pooled worker, as every other one-shot."""

    recycle: bool = True
    """Under bubblewrap, reuse a session's sandbox for the next session (a fresh worker cloned
    from a template in it, sandbox/session_template.py) instead of starting a new one."""

    @model_validator(mode="after")
    def _check(self) -> SandboxSettings:
        if not is_loopback(self.host) and self.auth_token is None:
            raise ValueError(
                f"binding {self.host!r} (not loopback) requires an auth token: set "
                f"{self.auth_token_env}=<token> in the server's environment, or bind 127.0.0.1"
            )
        if (
            self.fusion_default_memory_mb is not None
            and self.fusion_default_memory_mb > self.max_limits.memory_mb
        ):
            raise ValueError("fusion_default_memory_mb must not exceed max_limits.memory_mb")
        if self.default_limits.updated(self.default_limits.to_dict(), self.max_limits) != self.default_limits:
            raise ValueError("default_limits must not exceed max_limits")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> SandboxSettings:
        """Build from ``SANDBOX_<FIELD>`` variables (JSON for limits), then explicit overrides."""
        environ = os.environ if environ is None else environ
        overrides = {k: v for k, v in overrides.items() if v is not None}
        values: dict[str, Any] = {}
        for name in cls.model_fields:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is None or name == "auth_token":
                continue
            values[name] = Limits(**json.loads(raw)) if name.endswith("_limits") else raw
        token_env = overrides.get("auth_token_env", values.get("auth_token_env", "SANDBOX_AUTH_TOKEN"))
        if environ.get(token_env):
            values["auth_token"] = environ[token_env]
        values.update(overrides)
        return cls(**values)
