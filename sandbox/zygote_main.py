"""The zygote: a warm, already-sandboxed interpreter that clones one isolated process per one-shot program.

Standalone and stdlib-only, like worker.py: the host (sandbox/zygote.py) starts it under the same
bubblewrap confinement as a worker and talks to it with the worker's framing (4-byte big-endian
length, then a UTF-8 JSON object) on its original stdin/stdout.

Requests: ``{"op": "run", "id": n, "code": str, "stdin": str, "timeout_s": float,
"output_bytes": int, "memory_bytes": int, "nproc": int, "fsize_bytes": int, "nofile": int,
"cpu_s": float, "disk_bytes": int, "fetch_files": [str], "fetch_bytes": int}``; replies
``{"id": n, "report": {...}}`` (the same report as run_driver.py: ``{"compile": null, "run": step,
"files": {...}, "missing": [...]}``) or ``{"id": n, "error": str}``. Requests run concurrently;
replies come in completion order.

Per request, one process: S, cloned straight into new user, pid, mount, ipc and uts namespaces
(one raw clone(2): fork's CPU is most of a one-shot's cost), inside the network namespace of one
of the zygote's slots. A slot is a holder process H with a user and a network namespace of its own
(see _Holder): a fresh network namespace per request cost ~0.9 ms, so each slot keeps one and
serves one request at a time in it; S's user namespace sits below H's, so S can use the namespace
(loopback down, no interface) but not configure it, and when S is reaped nothing of its request is
left there. The holders are cloned before the first request is read and S is cloned from its
slot's holder, never from the zygote itself: a program's memory is a copy of a process that never
held another request's code, stdin or output (a fork server's own heap holds every request it
has served). S gets its request through a memfd and is the zygote's child (CLONE_PARENT). More
concurrent requests than slots wait for a free one. S is pid 1 of its namespace, and S *is* the
program: it takes the request's three pipes as fds 0-2 and closes every other descriptor (nothing
in it can reach the zygote's control channel or another request's pipes), maps only its own uid,
mounts fresh tmpfs over /tmp, /workspace and /dev/shm and a /proc that shows only this request,
makes itself non-dumpable, sets the rlimits (address space, processes, file size, descriptors,
CPU), drops every capability (bounding set empty, no_new_privs), starts its own session, and then
runs the code as ``__main__`` in this preloaded interpreter (no exec: that is what makes a
one-shot cheap).

The zygote supervises from outside, single-threaded, for all requests at once: it feeds stdin,
keeps stdout/stderr up to the cap (draining the rest), watches S through a pidfd, and at the
wall-clock timeout SIGKILLs S. When pid 1 of a pid namespace ends, for any reason, the kernel kills
everything else in it, so a daemon (double fork, setsid) cannot outlive the request; S also dies
with the zygote (PDEATHSIG, and bubblewrap's pid namespace around the zygote).

Being pid 1 shows, but not in the report. The kernel drops signals pid 1 gets from inside its
namespace (from itself, its children, its own timers) when it has no handler for them. So the
zygote installs, once, a handler for each signal whose default action ends a process (inherited
by every clone; in any process but a request's pid 1 it just does the default action), and wraps
os.kill / os.killpg / signal.raise_signal / os.abort for SIGKILL and for such signals reset to
SIG_DFL: the program ends as a non-init process would, and the report says ``return_code: -N`` as
before (S writes N into a page shared with the zygote; a program that scribbles on it can only
misreport itself). Faults (SIGSEGV, ...) and the RLIMIT_CPU SIGKILL come from the kernel, which
pid 1 does not ignore. What a program can still see: os.getpid() == 1 and os.getppid() == 0;
orphans of its children are reparented to it (os.wait() may reap one; the rest are reaped when it
ends); signal.getsignal() names the handler, not SIG_DFL; a handled signal acts between bytecodes
(after a long C call, not in it); a stop signal it sends itself, or a deadly one it reset to
SIG_DFL and then gets from a child or a timer, is ignored; C-level abort() (not os.abort) ends it
by SIGSEGV (glibc's fallback); and a daemon it leaves dies the moment it ends, so output written
after that is not collected (before, for up to 0.5 s).

Requests with ``fetch_files`` keep a second process: S forks Q, the program, and supervises it from
inside the namespace (stdin, output cap, timeout, kill(-1) of whatever Q left); after Q ends S
reads the files from the request's /workspace and writes the whole report to a result pipe. The files must be read by code that runs after the program, in its
mount namespace, and that the program cannot have tampered with: S is that code.

Memory written by the program is its own copy-on-write copy of its holder's; nothing flows back
but its output and exit status. The zygote stays single-threaded (a clone would otherwise copy locks other threads
hold), and ``gc.freeze()`` keeps the collector in a child from touching, and so copying, the
preloaded heap.
"""

import gc
import json
import mmap
import os
import select
import signal
import socket
import struct
import sys
import time

if "Pipes" not in globals():  # in the repository; shipped, the host put these files in front
    from sandbox.namespaces import (
        CLONE_NEWIPC,
        CLONE_NEWNET,
        CLONE_NEWNS,
        CLONE_NEWPID,
        CLONE_NEWUSER,
        CLONE_NEWUTS,
        CLONE_PARENT,
        PR_SET_DUMPABLE,
        PR_SET_PDEATHSIG,
        _clone,
        _drop_capabilities,
        _libc,
        _map_ids,
        _private_scratch,
        _tid_slot,
    )
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
import collections  # noqa: E402
import traceback  # noqa: E402

_HEADER = struct.Struct(">I")
_PAGE = struct.Struct("=iI")
"""The shared page's head: the signal the program ended by (S is pid 1), the length of S's error."""
_ISOLATION_FAILED = 70
_DRAIN_S = 0.5
# Signals that end a process by default and that software sends: pid 1 would drop them unhandled.
# Not the faults (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP: the kernel forces those through, and a
# handler that returns would re-run the faulting instruction forever), not SIGINT (Python's own
# handler), not SIGPIPE/SIGXFSZ (the interpreter ignores them).
_NOT_DEADLY = {"SIGKILL", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGCONT", "SIGCHLD", "SIGURG",
               "SIGWINCH", "SIGINT", "SIGPIPE", "SIGXFSZ", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL",
               "SIGTRAP"}  # fmt: skip
_DEADLY = frozenset(s for s in signal.valid_signals() if getattr(s, "name", "SIGRT") not in _NOT_DEADLY)


def _isolate(req, uid, gid):
    """(in S) Map only our uid, an empty private scratch, a /proc of this namespace only."""
    _private_scratch(uid, gid, req["disk_bytes"])


def _limit(req, nproc):
    """Rlimits, no capabilities, a session of its own: what the program runs under."""
    import resource

    limits = (
        (resource.RLIMIT_AS, req["memory_bytes"]),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_FSIZE, req["fsize_bytes"]),
        (resource.RLIMIT_NOFILE, req["nofile"]),
        (resource.RLIMIT_CPU, max(1, int(req["cpu_s"] + 0.999))),
        (resource.RLIMIT_CORE, 0),
    )
    for which, value in limits:
        resource.setrlimit(which, (int(value), int(value)))
    _drop_capabilities()
    os.setsid()


def _program(req, fds):
    """(in Q, the fetch_files path) Limits, the request's pipes as 0/1/2, then the code."""
    _limit(req, req["nproc"])
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    os.closerange(3, 1 << 16)
    _run_code(req)


def _become_program(req, fds, page, uid, gid):
    """(in S, pid 1) The request's pipes as 0/1/2 and no other descriptor, isolation, then the code."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the zygote gone: this namespace goes too
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
    os.closerange(3, 1 << 16)  # the zygote's control channel, other requests' pipes
    try:
        _isolate(req, uid, gid)
        _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    except OSError as e:
        error = f"cannot isolate the program: {e}".encode()[: len(page) - _PAGE.size]
        _PAGE.pack_into(page, 0, 0, len(error))
        page[_PAGE.size : _PAGE.size + len(error)] = error
        os._exit(_ISOLATION_FAILED)
    global _signal_page
    _signal_page = page  # see _end_by_signals_as_non_init: its handlers came with the clone
    # One process less in this user namespace than with a separate supervisor: the same room left.
    _limit(req, max(1, req["nproc"] - 1))
    _run_code(req)


_signal_page = None
"""In S (the program, pid 1): the page shared with the zygote, where the signal it ended by goes."""


def _end_by_signals_as_non_init():
    """Signals a program sends itself end it, as they would a process that is not pid 1.

    The kernel drops a signal to pid 1 from inside its namespace unless pid 1 handles it. Handled
    here: the deadly signals (a handler that does the default action) and, through the calls a
    program makes, SIGKILL and deadly signals it reset to SIG_DFL. The signal goes in
    ``_signal_page``; the zygote reports ``-signal`` as for a real death by it. Installed once, in
    the zygote (some 0.2 ms of signal.signal calls per request otherwise), and inherited by every
    clone: in any process but the program the handler is exactly the default action.
    """
    kill, killpg, raise_signal, abort = os.kill, os.killpg, signal.raise_signal, os.abort

    def die(signum, frame=None):
        if os.getpid() != 1 or _signal_page is None:  # the zygote, a fork of the program: the default
            signal.signal(signum, signal.SIG_DFL)
            kill(os.getpid(), signum)
            return
        _PAGE.pack_into(_signal_page, 0, int(signum), 0)
        os._exit(0)  # as a death by signal: no cleanup, no flush (stdout and stderr are unbuffered)

    def to_self(sig):
        if (
            os.getpid() == 1
            and _signal_page is not None
            and (sig == signal.SIGKILL or (sig in _DEADLY and signal.getsignal(sig) == signal.SIG_DFL))
        ):
            die(sig)

    def os_kill(pid, sig, /):
        if pid in (0, 1):
            to_self(sig)
        return kill(pid, sig)

    def os_killpg(pgid, sig, /):
        if pgid in (0, 1):
            to_self(sig)
        return killpg(pgid, sig)

    def signal_raise_signal(sig, /):
        to_self(sig)
        return raise_signal(sig)

    def os_abort():
        if os.getpid() == 1 and _signal_page is not None:
            die(signal.SIGABRT)
        abort()

    for signum in _DEADLY:
        signal.signal(signum, die)
    os.kill, os.killpg, signal.raise_signal, os.abort = os_kill, os_killpg, signal_raise_signal, os_abort


def _run_code(req):
    """The code as ``python -u /tmp/main.py`` would run it, in /workspace, with a plain environment."""
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


# -- slots: one network namespace each, kept by a holder ---------------------------------------
_IN_SLOT = CLONE_PARENT | CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS


class _SlotGone(Exception):
    pass


class _Holder:
    """One slot: a process H that keeps a network namespace and clones each request's S into it.

    Why a process: a fresh network namespace is ~0.9 ms of a one-shot's CPU, and a clone cannot
    join an existing one owned by a user namespace it has no capabilities in. H owns the slot's
    user and network namespaces; S, cloned by H, gets a user namespace of its own below H's, so it
    can use the network namespace (loopback down, no interface) but not configure it (no
    CAP_NET_ADMIN there). One request at a time per slot: when S, pid 1 of its namespace, is
    reaped, every process and so every socket of that request is gone before the next one starts.

    H is cloned at start-up, before the zygote has read any request, and S is cloned from H, never
    from the zygote: a program's memory is a copy of H's, which never held another request's code,
    stdin or output (a clone of the zygote would carry every request it had served). S gets its
    request through a memfd and its pipes through SCM_RIGHTS; CLONE_PARENT makes S the zygote's
    child, so the zygote supervises it exactly as before.
    """

    def __init__(self, tid_slot, uid, gid):
        self.page = mmap.mmap(-1, mmap.PAGESIZE)  # this slot's: the signal its program ended by
        self.sock, theirs = socket.socketpair()
        self.pid = _clone(tid_slot, CLONE_NEWUSER | CLONE_NEWNET)
        if self.pid == 0:
            try:
                _hold(theirs, self.page, tid_slot, uid, gid)
            finally:
                os._exit(_ISOLATION_FAILED)
        theirs.close()
        self.page.madvise(mmap.MADV_DONTFORK)  # later holders (and their programs) do not get it

    def spawn(self, kind, fds):
        """Clone one request's S into this slot (``kind`` b"r": the program, b"f": a supervisor)."""
        _PAGE.pack_into(self.page, 0, 0, 0)
        try:
            socket.send_fds(self.sock, [kind], fds)
            answer = self.sock.recv(4, socket.MSG_WAITALL)
        except OSError:
            answer = b""
        if len(answer) != 4:
            raise _SlotGone("the slot's holder is gone")
        (pid,) = struct.unpack("=i", answer)
        if pid < 0:
            raise OSError(-pid, f"clone: {os.strerror(-pid)}")
        return pid


def _hold(sock, page, tid_slot, uid, gid):
    """(in H) Keep this slot's namespaces; for each request, clone its S and say S's pid."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    fd = sock.fileno()
    os.closerange(3, fd)  # the zygote's channel, other slots' sockets; 0-2 stay (/dev/null, stderr)
    os.closerange(fd + 1, 1 << 16)
    _map_ids(uid, gid)
    while True:
        kind, fds, _, _ = socket.recv_fds(sock, 1, 4)
        if not kind:
            os._exit(0)
        try:
            pid = _clone(tid_slot, _IN_SLOT)
        except OSError as e:
            pid = -e.errno
        if pid == 0:
            try:
                _in_slot(kind, fds, page, uid, gid)
            finally:
                os._exit(_ISOLATION_FAILED)
        for fd in fds:
            os.close(fd)
        os.write(sock.fileno(), struct.pack("=i", pid))


def _in_slot(kind, fds, page, uid, gid):
    """(in S) Read the request from its memfd, then become the program or its supervisor."""
    chunks = []
    while chunk := os.read(fds[0], 1 << 20):
        chunks.append(chunk)
    os.close(fds[0])
    req = json.loads(b"".join(chunks))
    if kind == b"r":
        _become_program(req, fds[1:], page, uid, gid)
    else:
        _supervise(req, fds[1], uid, gid)


def _request_fd(raw):
    """A memfd holding the request's JSON, read from the start by S."""
    fd = os.memfd_create("request")
    view = memoryview(raw)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


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


class _Run:
    """The zygote's side of one request whose program is S: its pipes, pidfd, output, clock."""

    def __init__(self, req, pid, pipes, slot, t0):
        self.rid, self.pid, self.slot, self.page, self.t0 = req["id"], pid, slot, slot.page, t0
        self.in_w, self.out_r, self.err_r = pipes
        self.pidfd = os.pidfd_open(pid)
        self.cap = int(req["output_bytes"])
        self.deadline = t0 + float(req["timeout_s"])
        self.stdin = memoryview(req["stdin"].encode("utf-8"))
        self.bufs = {self.out_r: bytearray(), self.err_r: bytearray()}
        self.open = {self.out_r, self.err_r}  # until EOF: every writer (all in the namespace) gone
        self.status, self.ended, self.wait_status = "Finished", None, None

    def reply(self):
        """The report run_driver.py would give (or S's isolation error)."""
        code = None if self.status != "Finished" else os.waitstatus_to_exitcode(self.wait_status)
        signum, size = _PAGE.unpack_from(self.page, 0)
        if code == _ISOLATION_FAILED and size:
            error = bytes(self.page[_PAGE.size : _PAGE.size + min(size, len(self.page) - _PAGE.size)])
            return {"id": self.rid, "error": error.decode("utf-8", errors="replace")}
        if code == 0 and 0 < signum < signal.NSIG:
            code = -signum  # ended by a signal it sent itself (see _end_by_signals_as_non_init)
        step = {
            "status": self.status,
            "return_code": code,
            "stdout": bytes(self.bufs[self.out_r]).decode("utf-8", errors="replace"),
            "stderr": bytes(self.bufs[self.err_r]).decode("utf-8", errors="replace"),
            "execution_time": self.ended - self.t0,
        }
        return {"id": self.rid, "report": {"compile": None, "run": step, "files": {}, "missing": []}}


class _Zygote:
    """The loop: control frames in, requests started, their pipes and pidfds served, replies out."""

    def __init__(self, ctl_in, ctl_out):
        self.ctl_in, self.ctl_out = ctl_in, ctl_out
        self.poller = select.poll()
        self.poller.register(ctl_in, select.POLLIN)
        self.legacy = {}  # result pipe -> (id, pid, bytes so far, slot): the fetch_files path
        self.owner = {}  # fd -> _Run
        self.runs = set()
        self.uid, self.gid = os.getuid(), os.getgid()
        self.tid_slot = _tid_slot()
        self.free = []  # idle slots (_Holder); a request takes one for as long as its S lives
        self.slots = 0
        self.waiting = collections.deque()  # (request, its raw JSON) while every slot is busy

    def open_slots(self, n):
        """Start ``n`` slots' holders; called before the first request is read (see _Holder)."""
        self.free = [_Holder(self.tid_slot, self.uid, self.gid) for _ in range(n)]
        self.slots = n

    def serve(self):
        while True:
            for fd, _ in self.poller.poll(self._wait_ms()):
                if fd == self.ctl_in:
                    self._control()
                elif fd in self.owner:
                    self._ready(self.owner[fd], fd)
                elif fd in self.legacy:
                    self._legacy_ready(fd)
            if self.runs:
                self._tick()

    def _wait_ms(self):
        if not self.runs:
            return None
        now = time.perf_counter()
        due = min(r.deadline if r.ended is None else r.ended + _DRAIN_S for r in self.runs)
        return max(0, int((due - now) * 1000) + 1)

    def _control(self):
        try:
            raw = _read_exact(self.ctl_in, _HEADER.unpack(_read_exact(self.ctl_in, 4))[0])
        except EOFError:
            os._exit(0)
        req = json.loads(raw)
        op = req.get("op")
        if op == "run":
            self.waiting.append((req, raw))
            self._start_waiting()
        elif op == "ping":
            running = len(self.runs) + len(self.legacy) + len(self.waiting)
            _send(self.ctl_out, {"id": req.get("id"), "pong": True, "running": running})
        elif op == "shutdown":
            os._exit(0)

    def _watch(self, fd, run, events=select.POLLIN):
        self.owner[fd] = run
        self.poller.register(fd, events)

    def _drop(self, fd):
        del self.owner[fd]
        self.poller.unregister(fd)
        os.close(fd)

    def _start_waiting(self):
        while self.waiting and self.free:
            req, raw = self.waiting.popleft()
            slot = self.free.pop()
            try:
                (self._start_legacy if req.get("fetch_files") else self._start)(req, raw, slot)
            except _SlotGone:  # its holder was killed from outside: drop the slot, try another
                self.waiting.appendleft((req, raw))
                self._drop_slot(slot)
            except OSError as e:
                self.free.append(slot)
                _send(self.ctl_out, {"id": req["id"], "error": f"cannot start the request: {e}"})

    def _release(self, slot):
        """The slot's S is reaped (nothing of its request is left in the namespace): free again."""
        self.free.append(slot)
        self._start_waiting()

    def _drop_slot(self, slot):
        os.waitpid(slot.pid, 0)
        slot.sock.close()
        slot.page.close()
        self.slots -= 1
        if self.slots == 0:  # every holder killed from outside: let the host start a fresh zygote
            os._exit(_ISOLATION_FAILED)

    def _start(self, req, raw, slot):
        """S cloned into ``slot`` (it becomes the program); its pipes and pidfd join the loop."""
        t0 = time.perf_counter()
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
        theirs = (_request_fd(raw), in_r, out_w, err_w)
        try:
            pid = slot.spawn(b"r", theirs)
        except (OSError, _SlotGone):
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        run = _Run(req, pid, (in_w, out_r, err_r), slot, t0)
        self.runs.add(run)
        for fd in (out_r, err_r, run.pidfd):
            self._watch(fd, run)
        os.set_blocking(in_w, False)
        if self._feed(run):
            os.close(in_w)
            run.in_w = None
        else:
            self._watch(in_w, run, select.POLLOUT)

    def _feed(self, run):
        """Write as much of stdin as the pipe takes now; True when nothing is left to write."""
        try:
            while run.stdin:
                run.stdin = run.stdin[os.write(run.in_w, run.stdin[: 1 << 16]) :]
        except BlockingIOError:
            return False
        except OSError:  # the program closed its stdin (EPIPE): it wants no more
            run.stdin = run.stdin[:0]
        return True

    def _ready(self, run, fd):
        if fd == run.pidfd:  # S ended; with it, as pid 1, everything else in its namespace
            _, run.wait_status = os.waitpid(run.pid, 0)
            if run.ended is None:
                run.ended = time.perf_counter()
            self._drop(fd)
            run.pidfd = None
        elif fd == run.in_w:
            if self._feed(run):
                self._drop(fd)
                run.in_w = None
        else:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._drop(fd)
                run.open.discard(fd)
                return
            buf = run.bufs[fd]
            if len(buf) < run.cap:
                buf += chunk[: run.cap - len(buf)]

    def _tick(self):
        """Timeouts (SIGKILL to S: the whole namespace goes), then the replies of finished runs."""
        now = time.perf_counter()
        for run in list(self.runs):
            if run.ended is None and now >= run.deadline:
                run.status, run.ended = "TimeLimitExceeded", now
                os.kill(run.pid, signal.SIGKILL)  # not reaped yet, so the pid is still S's
            elif run.wait_status is not None and (not run.open or now >= run.ended + _DRAIN_S):
                self._finish(run)

    def _finish(self, run):
        for fd in [*run.open, run.in_w]:
            if fd is not None:
                self._drop(fd)
        self.runs.discard(run)
        _send(self.ctl_out, run.reply())
        self._release(run.slot)

    # -- the fetch_files path: S supervises Q and writes the whole report ----------------------
    def _start_legacy(self, req, raw, slot):
        r, w = os.pipe()
        theirs = (_request_fd(raw), w)
        try:
            pid = slot.spawn(b"f", theirs)
        except (OSError, _SlotGone):
            os.close(r)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        self.legacy[r] = (req["id"], pid, bytearray(), slot)
        self.poller.register(r, select.POLLIN)

    def _legacy_ready(self, fd):
        chunk = os.read(fd, 1 << 16)
        if chunk:
            self.legacy[fd][2].extend(chunk)
            return
        rid, pid, buf, slot = self.legacy.pop(fd)
        self.poller.unregister(fd)
        os.close(fd)
        os.waitpid(pid, 0)
        try:
            reply = json.loads(bytes(buf))
        except ValueError:
            reply = {"error": "the request's supervisor died without a report"}
        reply["id"] = rid
        _send(self.ctl_out, reply)
        self._release(slot)


def main():
    config = _config
    import resource

    # What the host ignored (SIGHUP under nohup) would stay ignored in every program: undo it, as
    # worker.py does (SIGXFSZ is Python's own; SIGPIPE is set below).
    for sig in signal.valid_signals():
        if sig != signal.SIGXFSZ and signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)

    if config.get("nproc"):
        resource.setrlimit(resource.RLIMIT_NPROC, (config["nproc"], config["nproc"]))
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    zygote = _Zygote(ctl_in, ctl_out)
    _end_by_signals_as_non_init()  # before the holders: every program inherits these handlers
    gc.freeze()  # the preloaded heap stays shared: no collector pass in a child touches (copies) it
    zygote.open_slots(int(config.get("slots", 8)))
    _send(ctl_out, {"op": "ready", "pid": os.getpid(), "python": sys.version.split()[0]})
    zygote.serve()


if __name__ == "__main__":
    main()
