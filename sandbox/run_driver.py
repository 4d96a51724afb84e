"""Runs one program (compile step, then run step) as a child of a sandbox worker; stdlib only.

Why a driver: SandboxFusion's ``/run_code`` runs a *script* (python, bash, C++) with its own
timeout and reports what the program printed even when that timeout fires. Executing the
program as a child process of an ordinary pooled worker gives exactly that while keeping the
isolation the worker already has (bubblewrap namespaces or the container's rlimits, its uid, its
memory and pid limits): the child inherits all of it. The worker only runs this driver.

The server sends this file's text plus one line ``print(_fusion_main(<spec>))`` as a cell. The
driver prints one JSON line: ``{"compile": step|None, "run": step|None, "files": {...},
"missing": [...]}`` where a step is ``{"status": "Finished"|"TimeLimitExceeded"|"Error",
"return_code", "stdout", "stderr", "execution_time"}``. ``return_code`` is the child's exit
status, negative for a signal (-9 for SIGKILL), as Python's subprocess reports it.
"""

import base64
import json
import os
import signal
import sys
import time

if "Pipes" not in globals():  # in the repository; shipped, the host put output_pipes.py in front
    from sandbox.output_pipes import Pipes

# Lean on purpose: no subprocess/threading/tempfile (importing those costs a fresh worker tens of
# milliseconds, more than running a small program): posix_spawn, pipes and poll do the same job.
_DRAIN_S = 0.5
"""After the program ends, how long a background process it left may keep its pipes open."""


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(argv):
    """(pid, stdin fd, stdout fd, stderr fd); the child leads its own process group."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    actions = [
        (os.POSIX_SPAWN_DUP2, in_r, 0),
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
    ]
    try:
        pid = os.posix_spawnp(
            argv[0], argv, dict(os.environ), file_actions=actions, setsid=True, setsigdef=(signal.SIGPIPE,)
        )
    except OSError:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    return pid, in_w, out_r, err_r


def _step(argv, stdin, timeout_s, cap):
    """Run ``argv`` with ``timeout_s``; what it printed is kept even when the timeout fires."""
    t0 = time.perf_counter()
    try:
        pid, in_w, out_r, err_r = _spawn(argv)
    except OSError as e:
        return {
            "status": "Error",
            "return_code": None,
            "stdout": "",
            "stderr": f"{argv[0]}: {e}\n",
            "execution_time": time.perf_counter() - t0,
        }
    pipes = Pipes(in_w, out_r, err_r, stdin.encode("utf-8"), cap)
    deadline, status, code, ended = t0 + timeout_s, "Finished", None, None
    while ended is None or (pipes.open and time.perf_counter() < ended + _DRAIN_S):
        now = time.perf_counter()
        if ended is None and now >= deadline:
            status, ended = "TimeLimitExceeded", now
            _kill_group(pid)
            os.waitpid(pid, 0)
            continue
        # Both pipes at EOF usually means the program ended; wait for it only then, or every
        # 50 ms (a background process it started may hold the pipes open after it ended).
        limit = deadline if ended is None else ended + _DRAIN_S
        if pipes.open:
            pipes.pump(min(limit - now, 0.05))
        if ended is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                code, ended = os.waitstatus_to_exitcode(st), time.perf_counter()
            elif not pipes.open:
                time.sleep(0.001)  # its pipes are closed but it still runs: check again shortly
    _kill_group(pid)  # whatever it left running in its group
    pipes.close()
    return {
        "status": status,
        "return_code": code,
        "stdout": pipes.text(out_r),
        "stderr": pipes.text(err_r),
        "execution_time": ended - t0,
    }


def _fetch(names, cwd, budget):
    """Base64 of each requested file; a missing or unreadable one is listed instead.

    Paths are relative to the workspace; any path the program itself could read is allowed
    (this runs inside the same sandbox, so it reveals nothing the program could not print).
    """
    files, missing = {}, []
    for name in names:
        path = os.path.join(cwd, name)
        try:
            size = os.path.getsize(path)
            if size > budget:
                raise OSError(f"{size} bytes is over what is left of the fetch budget")
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            missing.append(name)
            continue
        budget -= len(data)
        files[name] = base64.b64encode(data).decode("ascii")
    return files, missing


def _fusion_main(spec):
    # A program that stops reading its stdin must not kill the worker with SIGPIPE (the worker
    # keeps the default action); the program itself gets the default back (setsigdef).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    cwd = os.getcwd()
    tmp = f"{os.environ.get('TMPDIR') or '/tmp'}/fusion-{os.getpid()}-{time.monotonic_ns()}"
    os.mkdir(tmp, 0o700)
    names = {
        "src": os.path.join(tmp, spec["source"]),
        "exe": os.path.join(tmp, "main"),
        "dir": tmp,
        "python": sys.executable,
    }
    with open(names["src"], "w", encoding="utf-8") as f:
        f.write(spec["code"])
    result = {"compile": None, "run": None, "files": {}, "missing": []}
    cap = int(spec["output_bytes"])
    if spec.get("compile"):
        argv = [a.format(**names) for a in spec["compile"]]
        step = _step(argv, "", float(spec["compile_timeout"]), cap)
        result["compile"] = step
        if step["status"] != "Finished" or step["return_code"] != 0:
            return json.dumps(result)
    argv = [a.format(**names) for a in spec["run"]]
    result["run"] = _step(argv, spec.get("stdin") or "", float(spec["run_timeout"]), cap)
    result["files"], result["missing"] = _fetch(spec.get("fetch_files") or [], cwd, int(spec["fetch_bytes"]))
    return json.dumps(result)
