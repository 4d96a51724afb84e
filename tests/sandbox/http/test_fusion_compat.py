"""SandboxFusion compatibility, checked the way verl uses it (issue 16's ten gaps, one test each).

``VerlClient`` re-implements, from its documented behaviour, what verl's
``sandbox_fusion/utils.py`` does with a sandbox: POST a JSON body with ``code``, ``stdin``,
``language``, ``compile_timeout``, ``run_timeout``, ``files`` and ``fetch_files`` and no auth
header; retry only on HTTP 504 (waiting 1 s, then 2 s; 3 tries in all), treat any other non-2xx
status as an API error; give up after compile_timeout + run_timeout + 10 s. ``score`` maps an
answer to verl's per-case result: True (output matches), False (wrong answer), -1 (API or
sandbox error), -2 (runtime error), -3 (timeout), -4 (compile error).
"""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from sandbox import LocalSandbox
from sandbox.http.server import create_app
from sandbox.http.settings import SandboxSettings
from sandbox.result import SandboxUnavailable

TOKEN = "compat-token"
REPO = Path(__file__).resolve().parents[3]


@dataclass
class VerlClient:
    """verl's request conventions: no header, the URL as given, retries only on 504."""

    http: TestClient
    url: str
    sleep: Callable[[float], None] = time.sleep
    attempts: list[int] = field(default_factory=list)

    def call(self, code: str, stdin: str = "", timeout: int = 10, language: str = "python", **extra: Any):
        payload = json.dumps(
            {
                "compile_timeout": timeout,
                "run_timeout": timeout,
                "code": code,
                "stdin": stdin,
                "language": language,
                "files": {},
                "fetch_files": [],
                **extra,
            }
        )
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        error = None
        for attempt in range(3):
            # (verl's request timeout, compile + run + 10 s, is the TestClient's to enforce: it has none.)
            r = self.http.post(self.url, content=payload, headers=headers)
            self.attempts.append(r.status_code)
            if r.status_code == 504:
                error = "Gateway Timeout (504)"
                if attempt < 2:
                    self.sleep(1 * (attempt + 1))
                continue
            if r.status_code >= 400:
                return None, f"HTTP {r.status_code}: {r.text[:200]}"
            return r.json(), None
        return None, error


def score(answer: dict[str, Any] | None, error: str | None, expected: str) -> bool | int:
    """verl's per-case result for one answer (see the module docstring)."""
    if error is not None or answer is None:
        return -1
    status, comp, run = answer.get("status"), answer.get("compile_result"), answer.get("run_result")
    if status == "SandboxError":
        return -1
    if status == "Failed":
        if comp and (comp["status"] in ("Error", "TimeLimitExceeded") or comp.get("return_code") != 0):
            return -4
        if run is None:
            return -1
        if run["status"] == "TimeLimitExceeded":
            return -3
        if run["status"] == "Error" or run.get("return_code") != 0:
            return -2
        return -1
    if status == "Success" and run and run["status"] == "Finished":
        return (run.get("stdout") or "").rstrip("\n") == expected.rstrip("\n")
    return -1


def client(sb: LocalSandbox, **settings: Any) -> TestClient:
    return TestClient(create_app(SandboxSettings(auth_token=TOKEN, **settings), sandbox=sb))


@pytest.fixture(scope="module")
def http(sb: LocalSandbox) -> Iterator[TestClient]:
    with client(sb) as c:
        yield c


@pytest.fixture
def verl(http: TestClient) -> VerlClient:
    return VerlClient(http, f"/{TOKEN}/run_code")


def run(http: TestClient, **body: Any) -> dict[str, Any]:
    r = http.post(f"/{TOKEN}/run_code", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# -- 1. languages beyond python, isolated like python ----------------------------------------
BASH_ISOLATION = """read x; echo $((x * 2))
cat /proc/sys/kernel/hostname
[ -e {repo}/README.md ] && echo host-visible || echo host-hidden
(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo net || echo no-net
id -u"""


def test_bash_runs_confined_like_python(verl: VerlClient) -> None:
    """Own hostname (uts namespace), no host files, no host network, not root: like python code."""
    with socket.socket() as listener:  # reachable from here; must not be from inside
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        code = BASH_ISOLATION.format(repo=REPO, port=listener.getsockname()[1])
        answer, error = verl.call(code, stdin="21\n", language="bash")
    assert score(answer, error, "") is False  # it ran and printed (not the expected "")
    out = answer["run_result"]["stdout"].splitlines()
    assert out[:4] == ["42", "sandbox", "host-hidden", "no-net"]
    py, _ = verl.call(
        "import os; print(open('/proc/sys/kernel/hostname').read().strip()); print(os.getuid() != 0)"
    )
    assert py["run_result"]["stdout"] == "sandbox\nTrue\n"
    assert int(out[4]) != 0


def test_cpp_and_c_compile_and_run(verl: VerlClient) -> None:
    cpp = "#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<std::endl;}"
    answer, error = verl.call(cpp, stdin="40 2", language="cpp")
    assert score(answer, error, "42") is True
    assert answer["compile_result"]["status"] == "Finished" and answer["compile_result"]["return_code"] == 0
    c_code = '#include <stdio.h>\nint main(void){int x; scanf("%d", &x); printf("%d\\n", x * 3); return 0;}'
    answer, error = verl.call(c_code, stdin="14", language="c")
    assert score(answer, error, "42") is True


def test_unknown_language_is_a_clear_400(http: TestClient) -> None:
    r = http.post(f"/{TOKEN}/run_code", json={"code": "1", "language": "cobol"})
    assert r.status_code == 400 and "python" in r.json()["detail"] and "cpp" in r.json()["detail"]


# -- 2. fetch_files -----------------------------------------------------------------------------
def test_fetch_files_returns_base64_contents(http: TestClient) -> None:
    given = {"in.txt": base64.b64encode(b"abc").decode()}
    code = (
        "data = open('in.txt').read()\nopen('out/r.bin', 'wb').write(data.upper().encode() + bytes([0, 255]))"
    )
    code = "import os; os.makedirs('out')\n" + code
    answer = run(http, code=code, language="python", files=given, fetch_files=["out/r.bin", "absent.txt"])
    assert answer["status"] == "Success"
    assert base64.b64decode(answer["files"]["out/r.bin"]) == b"ABC\x00\xff"
    assert "absent.txt" not in answer["files"] and any("absent.txt" in w for w in answer["warnings"])
    bash = run(http, code="echo hi > note.txt", language="bash", fetch_files=["note.txt"])
    assert base64.b64decode(bash["files"]["note.txt"]) == b"hi\n"


# -- 3. output before a timeout -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("python", "import time\nprint('before')\ntime.sleep(30)"),
        ("bash", "echo before; echo err >&2; sleep 30"),
    ],
)
def test_output_printed_before_a_timeout_is_returned(verl: VerlClient, language: str, code: str) -> None:
    t0 = time.monotonic()
    answer, error = verl.call(code, timeout=1, language=language)
    assert time.monotonic() - t0 < 10
    assert score(answer, error, "before") == -3
    assert answer["run_result"]["status"] == "TimeLimitExceeded"
    assert answer["run_result"]["stdout"] == "before\n"


# -- 4. overload: queue, then what verl retries ------------------------------------------------
def _concurrently(n: int, fn: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        out[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_overload_queues_instead_of_refusing(sb: LocalSandbox) -> None:
    """One running slot, four requests at once: all wait their turn and all are answered 200."""
    with client(sb, max_concurrent_executions=1, fusion_queue_wait_s=30) as http:
        code = "import time; time.sleep(0.3); print('done')"
        answers = _concurrently(4, lambda i: VerlClient(http, f"/{TOKEN}/run_code").call(code))
    assert [score(a, e, "done") for a, e in answers] == [True] * 4


def test_past_the_queue_bound_the_answer_is_504_which_verl_retries(sb: LocalSandbox) -> None:
    with client(sb, max_concurrent_executions=1, fusion_queue_wait_s=0.2) as http:
        code = "import time; time.sleep(1.5); print('done')"
        clients = [VerlClient(http, f"/{TOKEN}/run_code", sleep=lambda s: time.sleep(s)) for _ in range(2)]
        answers = _concurrently(2, lambda i: (time.sleep(0.3 * i), clients[i].call(code))[1])
        # The second found the slot busy past the bound: 504 (never 429), then a retry got in.
        assert 504 in clients[1].attempts and 429 not in clients[0].attempts + clients[1].attempts
        assert [score(a, e, "done") for a, e in answers] == [True, True]
        r = http.post(f"/{TOKEN}/run_code", json={"code": "1"})
        assert r.status_code == 200  # idle again


def test_504_carries_retry_after(sb: LocalSandbox) -> None:
    with client(sb, max_concurrent_executions=1, fusion_queue_wait_s=0.1) as http:
        slow = threading.Thread(
            target=lambda: http.post(f"/{TOKEN}/run_code", json={"code": "import time; time.sleep(1.5)"})
        )
        slow.start()
        time.sleep(0.5)
        r = http.post(f"/{TOKEN}/run_code", json={"code": "print(1)"})
        slow.join()
    assert r.status_code == 504 and r.headers["Retry-After"] == "1"


# -- 5. the token in the URL --------------------------------------------------------------------
def test_token_as_path_prefix_authenticates_header_less_clients(http: TestClient) -> None:
    assert http.post("/run_code", json={"code": "print(1)"}).status_code == 401
    assert http.post("/not-the-token/run_code", json={"code": "print(1)"}).status_code in (401, 404)
    answer = run(http, code="print(1)")
    assert answer["status"] == "Success"
    header = http.post("/run_code", json={"code": "print(1)"}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert header.status_code == 200
    # The same prefix works for the rest of the API (a base URL that carries the token).
    assert http.post(f"/{TOKEN}/v1/execute", json={"code": "6 * 7"}).json()["value"] == "42"


def test_path_token_can_be_turned_off(sb: LocalSandbox) -> None:
    with client(sb, token_in_path=False) as http:
        assert http.post(f"/{TOKEN}/run_code", json={"code": "print(1)"}).status_code in (401, 404)


# -- 6. and 7. limits: clamp, and -1 is the server maximum ---------------------------------------
def test_limits_over_the_maximum_are_clamped_and_reported(http: TestClient) -> None:
    answer = run(http, code="print('ok')", run_timeout=1000, compile_timeout=1000, memory_limit_MB=10**6)
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "ok\n"
    joined = " ".join(answer["warnings"])
    assert "run_timeout=1000 clamped" in joined and "memory_limit_MB=1000000 clamped" in joined
    bad = http.post(f"/{TOKEN}/run_code", json={"code": "1", "run_timeout": 0})
    assert bad.status_code == 422 and "run_timeout" in bad.text


def test_memory_minus_one_means_the_server_maximum(http: TestClient) -> None:
    """1.2 GB is over the 1024 MB default of a session but within the 8192 MB server maximum."""
    code = "b = bytearray(1200 << 20); print(len(b) >> 20)"
    answer = run(http, code=code, memory_limit_MB=-1, run_timeout=60)
    assert answer["status"] == "Success" and answer["run_result"]["stdout"] == "1200\n"
    capped = run(http, code=code, memory_limit_MB=512, run_timeout=60)
    assert capped["status"] == "Failed" and "MemoryError" in capped["run_result"]["stderr"]


# -- 8. return codes ----------------------------------------------------------------------------
def test_return_codes_match_a_script(http: TestClient) -> None:
    mem = run(http, code="b = bytearray(300 << 20)", memory_limit_MB=128)
    assert mem["run_result"]["return_code"] == 1 and "MemoryError" in mem["run_result"]["stderr"]
    killed = run(http, code="import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert killed["run_result"]["return_code"] == -9 and killed["run_result"]["status"] == "Finished"
    assert run(http, code="import sys; sys.exit(3)")["run_result"]["return_code"] == 3
    assert run(http, code="exit 7", language="bash")["run_result"]["return_code"] == 7


# -- 9. SandboxError is HTTP 200 ----------------------------------------------------------------
def test_sandbox_failure_is_200_with_status_sandboxerror(sb: LocalSandbox, monkeypatch) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise SandboxUnavailable("worker could not start (simulated)")

    with client(sb, oneshot="worker") as http:  # the zygote path: tests/sandbox/test_zygote.py
        monkeypatch.setattr(sb, "run_async", broken)
        verl = VerlClient(http, f"/{TOKEN}/run_code")
        answer, error = verl.call("print(1)")
        monkeypatch.undo()
    assert error is None and verl.attempts == [200]
    assert answer["status"] == "SandboxError" and "simulated" in answer["message"]
    assert score(answer, error, "1") == -1


# -- 10. /v1/ping, /run_jupyter, the scientific stack ----------------------------------------
def test_ping(http: TestClient) -> None:
    r = http.get("/v1/ping")
    assert r.status_code == 200 and r.json() == "pong"


def test_run_jupyter_runs_cells_in_one_session(http: TestClient) -> None:
    body = {
        "cells": ["a = 123", "a", "print(a)", "raise RuntimeError('boom')", "open('o.txt', 'w').write('x')"],
        "fetch_files": ["o.txt"],
    }
    r = http.post(f"/{TOKEN}/run_jupyter", json=body)
    assert r.status_code == 200
    out = r.json()
    assert out["status"] == "Success" and out["driver"]["status"] == "Finished"
    cells = out["cells"]
    assert cells[1]["display"] == [{"text/plain": "123"}] and cells[2]["stdout"] == "123\n"
    assert cells[3]["error"][0]["ename"] == "RuntimeError" and cells[3]["error"][0]["evalue"] == "boom"
    assert base64.b64decode(out["files"]["o.txt"]) == b"x"
    slow = http.post(
        f"/{TOKEN}/run_jupyter", json={"cells": ["import time; time.sleep(5)"], "total_timeout": 0.5}
    )
    assert slow.json()["status"] == "Failed" and slow.json()["driver"]["status"] == "TimeLimitExceeded"


def test_scientific_stack_is_importable_in_the_worker(verl: VerlClient) -> None:
    code = (
        "import numpy as np, sympy, scipy.linalg, pandas as pd\n"
        "x = sympy.symbols('x')\n"
        "print(sympy.solve(x**2 - 4, x), round(np.linalg.det(np.eye(3) * 2)), pd.Series([1, 2]).sum())"
    )
    answer, error = verl.call(code, timeout=60)
    assert score(answer, error, "[-2, 2] 8 3") is True, answer


# -- verl's conventions score a planted program set correctly ----------------------------------
PLANTED = [
    # (language, code, stdin, expected stdout, verl's result)
    ("python", "print(sum(map(int, input().split())))", "2 3", "5", True),
    ("python", "print(int(input()) * 2)", "4", "9", False),
    ("python", "import sys\nprint(1)\nsys.exit(2)", "", "1", -2),
    ("python", "raise ValueError('planted')", "", "", -2),
    ("python", "while True:\n    pass", "", "", -3),
    ("bash", "read a b; echo $((a * b))", "6 7", "42", True),
    ("bash", "echo wrong", "", "right", False),
    ("cpp", '#include <cstdio>\nint main(){int n; scanf("%d",&n); printf("%d\\n", n*n);}', "9", "81", True),
    ("cpp", "int main() { this is not C++ }", "", "", -4),
    ("cpp", "#include <cstdlib>\nint main(){ abort(); }", "", "", -2),
]


def test_verl_scores_a_planted_program_set_correctly(verl: VerlClient) -> None:
    got = []
    for language, code, stdin, expected, _ in PLANTED:
        answer, error = verl.call(code, stdin=stdin, timeout=2 if "while" in code else 10, language=language)
        got.append(score(answer, error, expected))
    assert got == [want for *_, want in PLANTED]
    assert set(verl.attempts) == {200}
