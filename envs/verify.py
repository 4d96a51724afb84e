"""Answer verification with a hard timeout on the verifier itself.

Integers, decimals and fractions are compared exactly in-process (the generated tasks never need
more, and it is microseconds). Anything else goes to math-verify (symbolic equivalence through
sympy) in a separate worker process: sympy can take unbounded time on adversarial expressions,
and a thread cannot be stopped, so the worker is killed and restarted when it runs past
`timeout_s`. A timeout or crash is reported as `Verification.error`, never as a silent "wrong".
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class Verification:
    """The verdict on one answer. `error` set means "unknown": the verifier failed, not the agent."""

    correct: bool
    method: str
    """Which comparison decided: exact, numeric, symbolic, or none (no answer / error)."""
    error: str | None = None


_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)(/[+-]?\d+)?$")


def _normalize(text: str) -> str:
    text = text.strip().strip("$").strip()
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text)
    text = re.sub(r"\\[,!;: ]", "", text)  # LaTeX spacing commands
    text = text.replace("\\!", "").replace("{,}", "")
    return re.sub(r"(?<=\d)[,_ ](?=\d{3}\b)", "", text).replace(" ", "")


def as_number(text: str) -> Fraction | None:
    """Exact value of an integer, decimal or a/b string (thousands separators allowed); else None."""
    norm = _normalize(text)
    frac = re.fullmatch(r"\\d?frac\{([+-]?\d+)\}\{([+-]?\d+)\}", norm)
    if frac:
        norm = f"{frac.group(1)}/{frac.group(2)}"
    if len(norm) > 5000 or not _NUMBER.match(norm):
        return None
    try:
        return Fraction(norm)
    except (ValueError, ZeroDivisionError):
        return None


def symbolic_equal(predicted: str, gold: str) -> bool:
    """math-verify's symbolic equivalence (runs inside the worker process)."""
    from math_verify import parse, verify

    def wrap(s: str) -> str:
        return s if "\\boxed" in s or s.startswith("$") else f"${s}$"

    return bool(verify(parse(wrap(gold)), parse(wrap(predicted))))


def _worker_main(conn: Any, compare: Callable[[str, str], bool]) -> None:
    try:
        compare("1", "1")  # warm up imports before declaring readiness
        conn.send(("ready", None))
    except BaseException as exc:
        conn.send(("error", f"verifier failed to start: {type(exc).__name__}: {exc}"))
        return
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        try:
            conn.send(("ok", bool(compare(*request))))
        except BaseException as exc:  # the verifier crashing is data, not a reason to die
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


STARTUP_TIMEOUT_S = 60.0
"""Spawning the worker imports sympy and math-verify: slow once, so it has its own limit."""


class SymbolicWorker:
    """A long-lived process that runs `compare`; killed and restarted when it overruns."""

    def __init__(self, compare: Callable[[str, str], bool] = symbolic_equal, timeout_s: float = 5.0) -> None:
        self.compare = compare
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self.restarts = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")  # fork is unsafe in processes with threads (torch, tokenizers)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker_main, args=(child, self.compare), daemon=True)
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        if not parent.poll(STARTUP_TIMEOUT_S):
            self._kill()
            raise RuntimeError(f"verifier worker did not start within {STARTUP_TIMEOUT_S}s")
        status, value = parent.recv()
        if status != "ready":
            self._kill()
            raise RuntimeError(value)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(timeout=5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

    def __call__(
        self, predicted: str, gold: str, timeout_s: float | None = None
    ) -> tuple[bool | None, str | None]:
        """(verdict, None) or (None, error message)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            try:
                if self._proc is None or not self._proc.is_alive():
                    if self._proc is not None:
                        self.restarts += 1
                        self._kill()
                    self._start()
            except (RuntimeError, EOFError, OSError) as exc:
                return None, str(exc)
            try:
                self._conn.send((predicted, gold))
                if self._conn.poll(limit):
                    status, value = self._conn.recv()
                    return (value, None) if status == "ok" else (None, f"verifier crashed: {value}")
            except (EOFError, OSError, BrokenPipeError) as exc:
                self._kill()
                return None, f"verifier process died: {type(exc).__name__}"
            self._kill()
            return None, f"verifier timed out after {limit}s"

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                try:
                    self._conn.send(None)
                except (OSError, BrokenPipeError):
                    pass
            self._kill()


class MathVerifier:
    """Exact comparison for numbers, symbolic equivalence (with a timeout) for the rest."""

    def __init__(
        self,
        timeout_s: float = 5.0,
        symbolic: bool = True,
        compare: Callable[[str, str], bool] = symbolic_equal,
    ) -> None:
        """`symbolic=False` gives exact string/number comparison only (fast, no worker process).
        `compare` replaces the symbolic check; it must be a picklable module-level function."""
        self.timeout_s = timeout_s
        self.symbolic = symbolic
        self._compare = compare
        self._worker: SymbolicWorker | None = None

    def __call__(self, predicted: str | None, gold: str) -> Verification:
        if predicted is None:
            return Verification(False, "none")
        p_num, g_num = as_number(predicted), as_number(gold)
        if p_num is not None and g_num is not None:
            return Verification(p_num == g_num, "numeric")
        if _normalize(predicted) == _normalize(gold):
            return Verification(True, "exact")
        if not self.symbolic:
            return Verification(False, "exact")
        if self._worker is None:
            self._worker = SymbolicWorker(self._compare, self.timeout_s)
        verdict, error = self._worker(predicted, gold)
        if error is not None:
            return Verification(False, "symbolic", error=error)
        return Verification(bool(verdict), "symbolic")

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __deepcopy__(self, memo: dict[int, Any]) -> MathVerifier:
        # gymnasium.make deep-copies env kwargs; a verifier (and its worker) is shared, not copied.
        return self


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    """One MathVerifier per process, so N environments share one symbolic worker, not N."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
            atexit.register(_default.close)
        return _default
