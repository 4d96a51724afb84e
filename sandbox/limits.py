"""Resource limits: defaults, server maxima, and validation of what a request asks for.

A request may lower any limit, and raise it only up to the server's maximum; anything else is
rejected with a message that names the field and the allowed range, so the HTTP layer can answer
4xx instead of silently clamping.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

# Limits a single execution may override; the rest shape the worker process and are per-session.
PER_EXECUTION = frozenset({"wall_s", "cpu_s", "output_bytes"})


class LimitError(ValueError):
    """A requested limit is unknown, of the wrong type, non-positive, or above the server maximum."""


@dataclass(frozen=True)
class Limits:
    """What one execution (wall/cpu/output) and one session (the rest) may consume."""

    # -- per execution --
    wall_s: float = 10.0
    """Wall-clock seconds for one execution; the session's process tree is killed when it runs out."""
    cpu_s: float = 10.0
    """CPU seconds for one execution (RLIMIT_CPU soft limit, counted in whole seconds by the kernel)."""
    output_bytes: int = 1 << 20
    """Bytes kept per stream (stdout, stderr) per execution; the rest is dropped behind a marker."""
    # -- per session --
    session_cpu_s: float = 3600.0
    """CPU seconds for the whole session (hard RLIMIT_CPU)."""
    memory_mb: int = 1024
    """Address space of the worker (RLIMIT_AS) and, where cgroups are writable, its memory cgroup."""
    processes: int = 64
    """Processes and threads (RLIMIT_NPROC for the session's own uid; pids cgroup where writable)."""
    open_files: int = 256
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    file_size_mb: int = 64
    """Largest file a process may write (RLIMIT_FSIZE)."""
    disk_mb: int = 256
    """Size of the private /workspace tmpfs (and of /tmp): the workspace disk quota."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def updated(self, overrides: dict[str, Any] | None, maxima: Limits) -> Limits:
        """Return a copy with ``overrides`` applied, after checking each against ``maxima``."""
        if not overrides:
            return self
        known = {f.name: f for f in fields(self)}
        clean: dict[str, Any] = {}
        for name, value in overrides.items():
            if value is None:
                continue
            if name not in known:
                raise LimitError(f"unknown limit {name!r}; valid limits are {sorted(known)}")
            want_int = known[name].type in ("int", int)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise LimitError(f"limit {name!r} must be a number, got {type(value).__name__}")
            if want_int and isinstance(value, float):
                if not value.is_integer():
                    raise LimitError(f"limit {name!r} must be a whole number, got {value}")
                value = int(value)
            ceiling = getattr(maxima, name)
            if not value > 0:
                raise LimitError(f"limit {name!r} must be > 0, got {value}")
            if value > ceiling:
                raise LimitError(f"limit {name!r}={value} exceeds the server maximum {ceiling}")
            if value < WORKER_MINIMUM.get(name, 0):
                raise LimitError(
                    f"limit {name!r}={value} is below {WORKER_MINIMUM[name]}, the least a sandbox "
                    "worker needs to start"
                )
            clean[name] = value
        return replace(self, **clean)

    def session_key(self) -> tuple[Any, ...]:
        """The part of the limits baked into a worker process: equal keys can share a warm pool."""
        return tuple(v for k, v in asdict(self).items() if k not in PER_EXECUTION)


WORKER_MINIMUM = {"open_files": 16, "memory_mb": 32}
"""Below these a worker cannot start (measured: Python 3.11 under bubblewrap needs about 10 file
descriptors and 16 MB of address space; the floors leave room for other interpreters). Refusing
them makes such a request a 4xx with a reason instead of a worker that fails to start (a 503)."""

DEFAULT_LIMITS = Limits()
MAX_LIMITS = Limits(
    wall_s=300.0,
    cpu_s=300.0,
    output_bytes=16 << 20,
    session_cpu_s=86400.0,
    memory_mb=8192,
    processes=512,
    open_files=4096,
    file_size_mb=1024,
    disk_mb=4096,
)
