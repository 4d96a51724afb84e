"""The zygote: a warm, already-sandboxed interpreter that forks one isolated child per one-shot program.

Standalone and stdlib-only, like worker.py: the host (sandbox/zygote.py) starts it under the same
bubblewrap confinement as a worker and talks to it with the worker's framing (4-byte big-endian
length, then a UTF-8 JSON object) on its original stdin/stdout.

Requests: ``{"op": "run", "id": n, "code": str, "stdin": str, "timeout_s": float,
"output_bytes": int, "memory_bytes": int, "nproc": int, "fsize_bytes": int, "nofile": int,
"cpu_s": float, "disk_bytes": int, "fetch_files": [str], "fetch_bytes": int}``; replies
``{"id": n, "report": {...}}`` (the same report as run_driver.py: ``{"compile": null, "run": step,
"files": {...}, "missing": [...]}``) or ``{"id": n, "error": str}``. Requests run concurrently;
replies come in completion order.

Per request, two processes (why each exists):

* S, the supervisor, cloned from the zygote straight into new user, pid, mount, ipc, uts and
  network namespaces (one raw clone(2): fork's CPU is most of a one-shot's cost, so no extra
  fork + unshare step). It is pid 1 of its namespace. It closes every descriptor but its result
  pipe (so nothing below it can reach the zygote's control channel), maps only its own uid, mounts
  fresh tmpfs over /tmp, /workspace and /dev/shm and a /proc that shows only this request, makes
  itself non-dumpable (the program, same uid, cannot ptrace it or read /proc/1/*), feeds stdin,
  keeps the output up to the cap, enforces the wall-clock timeout and writes the report. When the
  program ends or times out S kills everything left in the namespace (kill(-1) from pid 1), so a
  daemon (double fork, setsid) cannot outlive the request. S dies with the zygote (PDEATHSIG), and
  with S the whole namespace.
* Q, the program, an ordinary fork of S: rlimits (address space, processes, file size,
  descriptors, CPU), no capabilities (bounding set empty, no_new_privs), its own session, then the
  code runs as ``__main__`` in this preloaded interpreter (no exec: that is what makes a one-shot
  cheap).

Q can name no process outside its pid namespace, so it cannot signal or ptrace the zygote or other
requests; signals to S, its pid 1, are dropped by the kernel; it holds no capability, so it cannot
unmount its /proc or tmpfs. Memory written by Q is its own copy-on-write copy; nothing flows back
but S's report. The zygote stays single-threaded (a clone would otherwise copy locks other threads
hold), and ``gc.freeze()`` keeps the collector in a child from touching, and so copying, the
preloaded heap.
"""

import ctypes
import ctypes.util
import gc
import json
import os
import select
import signal
import struct
import sys
import time

if "Pipes" not in globals():  # in the repository; shipped, the host put output_pipes.py in front
    from sandbox.output_pipes import Pipes

# "The usual imports": what one-shot programs commonly import, loaded once here instead of per
# run. Kept lean on purpose: every MB the zygote holds makes each fork dearer (page tables copied
# and torn down per request), so heavy modules (unittest, decimal, numpy) are left to the program.
PRELOAD = (
    "json", "re", "math", "collections", "itertools", "functools", "random", "string",
    "heapq", "bisect", "typing", "dataclasses", "traceback", "io", "copy", "operator", "atexit",
    "threading",
)  # fmt: skip
_config = json.loads(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].startswith("{") else {}
for _name in _config.get("preload", PRELOAD):
    try:
        __import__(_name)
    except ImportError:
        pass
if _config.get("numpy"):
    # One BLAS thread: the zygote must stay single-threaded, or a clone could copy a lock held
    # by another thread (malloc's, stdio's) and hang the child.
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = "1"
    try:
        import numpy  # noqa: F401  (only when the sandbox's interpreter has it)
    except ImportError:
        pass
import atexit  # noqa: E402
import base64  # noqa: E402
import traceback  # noqa: E402

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 4, 24, 38, 47
_HEADER = struct.Struct(">I")
_DRAIN_S = 0.5
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_api = ctypes.pythonapi
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)


def _check(rc, what):
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    _check(_libc.mount(source, target.encode(), fstype, flags, data), f"mount {target}")


def _drop_capabilities():
    """No capability left in any set, none to regain: the bounding set empty, no_new_privs on."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL: past the last capability this kernel knows
    _libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words: all zero
    _check(_libc.syscall(126, header, data), "capset")  # SYS_capset on x86_64
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _clone():
    """fork() into fresh user/pid/mount/ipc/uts/net namespaces in one step (raw clone(2)).

    One process instead of fork + unshare + fork: the child is pid 1 of its own namespace, and
    fork's CPU cost (copying and tearing down the page tables) dominates a one-shot's. Python's
    fork bookkeeping runs around it as os.fork() would. glibc's cached thread id is stale in the
    child; only S runs there, which never calls raise()/pthread_kill (Q is an ordinary fork).
    """
    flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET
    _api.PyOS_BeforeFork()
    pid = _libc.syscall(56, flags | signal.SIGCHLD, 0, 0, 0, 0)  # SYS_clone on x86_64
    if pid == 0:
        _api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    _api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _isolate(req, uid, gid):
    """(in S) Map only our uid, an empty private scratch, a /proc of this namespace only."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    size = f"size={int(req['disk_bytes'])},mode=1777".encode()
    for target in ("/tmp", "/workspace", "/dev/shm"):
        if os.path.isdir(target):
            _mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, size)
    _mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)


def _program(req, fds):
    """(in Q) Limits, no capabilities, the request's pipes as 0/1/2, then the code as __main__."""
    import resource

    limits = (
        (resource.RLIMIT_AS, req["memory_bytes"]),
        (resource.RLIMIT_NPROC, req["nproc"]),
        (resource.RLIMIT_FSIZE, req["fsize_bytes"]),
        (resource.RLIMIT_NOFILE, req["nofile"]),
        (resource.RLIMIT_CPU, max(1, int(req["cpu_s"] + 0.999))),
        (resource.RLIMIT_CORE, 0),
    )
    for which, value in limits:
        resource.setrlimit(which, (int(value), int(value)))
    _drop_capabilities()
    os.setsid()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    os.closerange(3, 1 << 16)
    os.chdir("/workspace")
    for key in [k for k in os.environ if k not in ("PATH", "HOME", "TMPDIR", "LANG", "MALLOC_ARENA_MAX")]:
        del os.environ[key]
    path = "/tmp/main.py"
    with open(path, "w", encoding="utf-8") as f:
        f.write(req["code"])
    _exit_with(_run_main(req["code"], path))


def _run_main(code, path):
    """Run ``code`` as ``python -u path`` would; the exit status it would have."""
    import io
    import types

    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    sys.argv = [path]
    sys.path[0:1] = [os.path.dirname(path)]
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    signal.signal(signal.SIGINT, signal.default_int_handler)
    status = 0
    try:
        exec(compile(code, path, "exec"), main.__dict__)
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException as e:  # what the interpreter does with an uncaught exception
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this frame
        status = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # non-daemon threads are joined at exit, as in a real interpreter
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        pass
    return status


def _exit_status(e):
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _exit_with(status):
    os._exit(status)


def _supervise(req, result_w, uid, gid):
    """(in S, pid 1) Isolate, start Q, collect its output until it ends or times out; report."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the zygote gone: this tree goes too
    os.closerange(0, result_w)
    os.closerange(result_w + 1, 1 << 16)
    t0 = time.perf_counter()
    try:
        _isolate(req, uid, gid)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # Q (same uid) cannot ptrace S or read /proc/1/*
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        q = os.fork()
        if q == 0:
            for fd in (result_w, in_w, out_r, err_r):
                os.close(fd)
            try:
                _program(req, (in_r, out_w, err_w))
            finally:
                os._exit(70)
        for fd in (in_r, out_w, err_w):
            os.close(fd)
    except OSError as e:
        _report(result_w, {"error": f"cannot isolate the program: {e}"})
        return
    stdin = req["stdin"].encode("utf-8")
    step = _collect(req, q, Pipes(in_w, out_r, err_r, stdin, req["output_bytes"]), t0)
    report = {"compile": None, "run": step, "files": {}, "missing": []}
    report["files"], report["missing"] = _fetch(req.get("fetch_files") or [], req.get("fetch_bytes", 0))
    _report(result_w, {"report": report})


def _collect(req, q, out, t0):
    """Wait for Q (reaping orphans: this is pid 1); on the timeout kill everything in the namespace."""
    deadline, status, ended, code = t0 + float(req["timeout_s"]), "Finished", None, None
    while ended is None or (out.open and time.perf_counter() < ended + _DRAIN_S):
        now = time.perf_counter()
        if ended is None and now >= deadline:
            status, ended = "TimeLimitExceeded", now
            _kill_namespace()
            os.waitpid(q, 0)
            continue
        limit = deadline if ended is None else ended + _DRAIN_S
        if out.open:
            out.pump(min(limit - now, 0.05))
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid == q:
                code, ended = os.waitstatus_to_exitcode(st), time.perf_counter()
        if ended is None and not out.open:
            time.sleep(0.001)
    _kill_namespace()  # whatever Q left behind (daemons): as pid 1, kill(-1) reaches all of it
    out.close()
    return {
        "status": status,
        "return_code": code,
        "stdout": out.text(out.out_r),
        "stderr": out.text(out.err_r),
        "execution_time": ended - t0,
    }


def _kill_namespace():
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _fetch(names, budget):
    files, missing = {}, []
    for name in names:
        try:
            path = os.path.join("/workspace", name)
            if os.path.getsize(path) > budget:
                raise OSError("over the fetch budget")
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            missing.append(name)
            continue
        budget -= len(data)
        files[name] = base64.b64encode(data).decode("ascii")
    return files, missing


def _report(fd, obj):
    view = memoryview(json.dumps(obj).encode())
    while view:
        view = view[os.write(fd, view) :]


# -- the zygote's loop ------------------------------------------------------------------------
def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _send(fd, obj):
    data = json.dumps(obj).encode()
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _start(req, running, poller):
    r, w = os.pipe()
    uid, gid = os.getuid(), os.getgid()
    try:
        pid = _clone()
    except OSError as e:
        os.close(r)
        os.close(w)
        return {"id": req["id"], "error": f"cannot start the request: {e}"}
    if pid == 0:
        try:
            _supervise(req, w, uid, gid)
        finally:
            os._exit(0)
    os.close(w)
    running[r] = (req["id"], pid, bytearray())
    poller.register(r, select.POLLIN)
    return None


def _finish(fd, running, poller, ctl_out):
    rid, pid, buf = running.pop(fd)
    poller.unregister(fd)
    os.close(fd)
    os.waitpid(pid, 0)
    try:
        reply = json.loads(bytes(buf))
    except ValueError:
        reply = {"error": "the request's supervisor died without a report"}
    reply["id"] = rid
    _send(ctl_out, reply)


def main():
    config = _config
    import resource

    if config.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (config["nproc"], config["nproc"]))
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    _send(ctl_out, {"op": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    running = {}
    gc.freeze()  # the preloaded heap stays shared: no collector pass in a child touches (copies) it
    poller = select.poll()
    poller.register(ctl_in, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd != ctl_in:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    running[fd][2].extend(chunk)
                else:
                    _finish(fd, running, poller, ctl_out)
                continue
            try:
                req = json.loads(_read_exact(ctl_in, _HEADER.unpack(_read_exact(ctl_in, 4))[0]))
            except EOFError:
                os._exit(0)
            if req.get("op") == "run":
                failed = _start(req, running, poller)
                if failed is not None:
                    _send(ctl_out, failed)
            elif req.get("op") == "ping":
                _send(ctl_out, {"id": req.get("id"), "pong": True, "running": len(running)})
            elif req.get("op") == "shutdown":
                os._exit(0)


if __name__ == "__main__":
    main()
