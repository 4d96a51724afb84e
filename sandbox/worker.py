"""The sandbox worker: one long-lived Python process that runs code cells in persistent globals.

This file is a standalone, stdlib-only script. It is run as ``python3 worker.py [CONFIG_JSON]`` (or
``python3 -c <this source> [CONFIG_JSON]``) by whatever confines it: bubblewrap (LocalSandbox and the
HTTP server), a Docker container attached over stdio, or plain rlimits. It never imports the
``sandbox`` package, so any Python 3.8+ interpreter the sandbox uid can execute will do.

Protocol
--------
The worker talks to its driver over its original stdin (requests) and stdout (replies). Every
message is one frame: a 4-byte big-endian unsigned length N, then N bytes of a UTF-8 JSON object.
One request gets exactly one reply, in order; the driver never pipelines.

At start-up the worker applies the limits in CONFIG_JSON (below), moves the protocol to private
close-on-exec descriptors, points fd 0 at /dev/null and fds 1/2 at capture pipes (so output from
C extensions and child processes is all captured; the worker's own sys.stdout and sys.stderr write
into the same capture directly), then sends::

    {"op": "ready", "pid": int, "python": "3.11.2"}

Requests and replies:

``{"op": "exec", "id": n, "code": str, "cpu_s": float|null, "max_output_bytes": int,
"want_value": bool, "stdin": str|null}``
    Runs ``code`` in the session's globals. If the last statement is an expression and
    ``want_value`` is true, its ``repr`` is returned as ``value`` (notebook style; it is not
    printed). ``cpu_s`` sets a CPU-seconds budget for this cell (RLIMIT_CPU soft limit; the kernel
    kills the worker with SIGXCPU when it is spent). Reply::

        {"id": n, "stdout": str, "stderr": str, "value": str|null,
         "error": null | {"type": str, "message": str, "traceback": str, "exit_code": int|null},
         "wall_s": float, "cpu_s": float, "truncated": bool,
         "memory_exceeded": bool, "limit": null | "memory", "restart": bool}

    ``restart`` true means the worker's state can no longer be trusted (it ran out of memory):
    the driver should replace it. Output is returned as valid UTF-8; undecodable bytes are
    escaped as ``\\xNN``. Output beyond ``max_output_bytes`` per stream is dropped and a marker
    line is appended. After each cell every process the cell started is killed and reaped: a
    double-forked daemon does not outlive its cell.

``{"op": "put_files", "id": n, "files": {relative_path: base64_content}}``
    Writes files under the working directory (paths may not escape it). Reply ``{"id": n,
    "written": [paths]}`` or ``{"id": n, "error": {...}}``.

``{"op": "ping", "id": n}``  ->  ``{"id": n, "pong": true}``

``{"op": "shutdown"}``  ->  the worker exits 0 without replying.

CONFIG_JSON (all keys optional): ``memory_bytes`` (RLIMIT_AS), ``nproc`` (RLIMIT_NPROC: processes
and threads of the sandbox uid), ``nofile`` (RLIMIT_NOFILE), ``fsize_bytes`` (RLIMIT_FSIZE),
``session_cpu_s`` (hard RLIMIT_CPU: the whole session's CPU budget), ``own_pid_namespace`` (true
when the worker is pid 2 under bubblewrap's init: strays are found through /proc; otherwise the
worker becomes a child subreaper and kills its descendants), ``workdir``, ``template`` (this
process is a session template, sandbox/session_template.py: each session's worker is a clone of
it, and the protocol runs over pipes the host sends per session) and ``disk_bytes`` (the size of
each session's /tmp and /workspace under a template).

What is covered: resource limits the kernel enforces per process (rlimits), capture of all output,
clean-up of every process a cell starts. What is not covered here: namespaces, cgroups, wall-clock
timeouts and the network; those belong to the launcher that starts this script.
"""

# Start-up cost matters: a one-shot execution pays for a whole worker. Only modules that are built
# in (or tiny) are imported here; json, threading, signal, ast, traceback and linecache would pull in
# re, enum, collections, functools and tokenize, which cost more CPU than the interpreter itself.
# Their C cores (_json, _thread, _signal, _ast) do the same work; the rest is imported when needed.
import _ast
import _signal
import _thread
import io
import os
import resource
import select
import struct
import sys
import time

try:
    import _json

    _encode_str = _json.encode_basestring  # JSON string literal, non-ASCII kept (ensure_ascii=False)
except (ImportError, AttributeError):  # an interpreter without the C accelerator: use the module
    _json = None

_HEADER = struct.Struct(">I")
_MAX_FRAME = 256 * 1024 * 1024
_TRUNCATION_MARKER = "\n[... output truncated: {dropped} more bytes not shown ...]\n"
_VALUE_REPR_LIMIT = 10_000
_THIS_FILE = sys._getframe().f_code.co_filename


class _ScanContext:
    """What ``_json.make_scanner`` reads from a ``json.JSONDecoder``: the defaults of ``json.loads``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = float  # "NaN", "Infinity", "-Infinity"


def _loads(text):
    """``json.loads`` for one protocol frame, with only the C scanner (no ``re``, no ``json``)."""
    if _json is None:
        import json

        return json.loads(text)
    text = text.strip()
    try:
        obj, end = _scan(text, 0)
    except StopIteration:
        raise ValueError("a frame is not JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON object")
    return obj


def _dumps(obj):
    """``json.dumps(obj, ensure_ascii=False)`` for what replies hold: dict, list, str, numbers, None."""
    if _json is None:
        import json

        return json.dumps(obj, ensure_ascii=False)
    t = type(obj)
    if t is str:
        return _encode_str(obj)
    if obj is None:
        return "null"
    if obj is True:
        return "true"
    if obj is False:
        return "false"
    if t is int:
        return int.__repr__(obj)
    if t is float:
        if obj != obj:
            return "NaN"
        if obj in (float("inf"), float("-inf")):
            return "Infinity" if obj > 0 else "-Infinity"
        return float.__repr__(obj)
    if t is dict:
        return "{" + ", ".join(_encode_str(str(k)) + ": " + _dumps(v) for k, v in obj.items()) + "}"
    if t is list or t is tuple:
        return "[" + ", ".join(_dumps(v) for v in obj) + "]"
    raise TypeError(f"cannot encode {t.__name__} in a reply")


_scan = _json.make_scanner(_ScanContext()) if _json is not None else None


class _CellSources:
    """Cell sources for tracebacks, handed to ``linecache`` only once something imports it.

    ``linecache`` imports ``tokenize`` and ``re``: milliseconds of every worker's start-up that most
    executions never need. Until it is imported the sources wait here. As a meta-path finder this
    object sees the import of ``linecache`` (by a traceback: ours or one the cell prints itself)
    and fills its cache as soon as the module has run, so tracebacks show the cells' lines.
    """

    def __init__(self):
        self.pending = {}
        sys.meta_path.insert(0, self)

    def add(self, filename, code):
        entry = (len(code), None, code.splitlines(True), filename)
        linecache = sys.modules.get("linecache")
        if linecache is not None and isinstance(getattr(linecache, "cache", None), dict):
            linecache.cache[filename] = entry
        else:
            self.pending[filename] = entry

    def find_spec(self, name, path=None, target=None):
        if name != "linecache":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one import to watch, then out of the way
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _ThenFill(spec.loader, self)
                return spec
        return None


class _ThenFill:
    """Loader wrapper: run the real loader, then give ``linecache`` the pending cell sources."""

    def __init__(self, loader, sources):
        self.loader = loader
        self.sources = sources

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        cache = getattr(module, "cache", None)
        if isinstance(cache, dict):
            cache.update(self.sources.pending)
            self.sources.pending.clear()


class _Stream:
    """Collects one output pipe into a bounded buffer; bytes past the cap are counted, not kept."""

    def __init__(self, read_fd, write_fd):
        self.read_fd = read_fd
        self.write_fd = write_fd
        self.chunks = []
        self.size = 0
        self.dropped = 0
        self.cap = 1 << 20

    def take(self, data):
        room = self.cap - self.size
        if room >= len(data):
            self.chunks.append(data)
            self.size += len(data)
        else:
            if room > 0:
                self.chunks.append(data[:room])
                self.size += room
            self.dropped += len(data) - max(room, 0)

    def reset(self, cap):
        self.chunks = []
        self.size = 0
        self.dropped = 0
        self.cap = cap

    def text(self):
        data = b"".join(self.chunks)
        out = data.decode("utf-8", "backslashreplace")
        if self.dropped:
            out += _TRUNCATION_MARKER.format(dropped=self.dropped)
        return out


class _Capture:
    """Drains the stdout/stderr pipes on a thread so a chatty cell never blocks on a full pipe."""

    def __init__(self):
        self.lock = _thread.allocate_lock()
        self.streams = []
        for target in (1, 2):
            r, w = os.pipe()
            os.set_blocking(r, False)
            try:
                import fcntl

                fcntl.fcntl(r, 1031, 1 << 20)  # F_SETPIPE_SZ: fewer wake-ups for big outputs
            except OSError:
                pass
            os.dup2(w, target)
            self.streams.append(_Stream(r, w))
        self.poller = select.poll()
        for s in self.streams:
            self.poller.register(s.read_fd, select.POLLIN)
        _thread.stack_size(256 * 1024)  # keep our own thread cheap under RLIMIT_AS
        _thread.start_new_thread(self._run, ())  # a bare thread: `threading` is not imported
        _thread.stack_size(0)

    def _run(self):
        while True:
            try:
                events = self.poller.poll()
            except InterruptedError:
                continue
            if events:
                with self.lock:
                    self._drain_all()

    def _drain_all(self):
        for s in self.streams:
            self._drain(s)

    @staticmethod
    def _drain(s):
        while True:
            try:
                data = os.read(s.read_fd, 1 << 16)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            if not data:
                return
            s.take(data)

    def append(self, index, data):
        """Output written by this process's own sys.stdout/sys.stderr (see _OwnOutput)."""
        stream = self.streams[index]
        with self.lock:
            self._drain(stream)  # what went through this stream's pipe before comes first
            stream.take(data)

    def start(self, cap):
        with self.lock:
            self._drain_all()  # leftovers from a previous cell's stray processes are discarded
            for s in self.streams:
                s.reset(cap)
        for target, s in enumerate(self.streams, start=1):
            os.dup2(s.write_fd, target)  # undo any dup2/close the previous cell did to fds 1 and 2

    def finish(self):
        with self.lock:
            self._drain_all()
            return [s.text() for s in self.streams], any(s.dropped for s in self.streams)


class _OwnOutput(io.RawIOBase):
    """fd 1 or 2 as the worker's own sys.stdout/sys.stderr write it: straight into the capture.

    Why not through the pipe: a cell's print reached the capture thread through it, and waking
    that thread (and handing it the GIL) cost a good part of a small cell (32 cells of one print on
    one core: 13.2 ms of sandbox CPU through the pipe, 10.2 ms written directly). Order is kept: the pipe is drained before each write is
    appended, and a Python-level write is a flush, which the block-buffered sys.stdout did at the
    cell's end before too. Output of other processes (a subprocess, C code writing to fd 1) and of
    a process the cell forked still goes through the pipe: a fork's copy of this object writes there.
    """

    def __init__(self, capture, fd):
        super().__init__()
        self.capture = capture
        self.fd = fd
        self.pid = os.getpid()

    def writable(self):
        return True

    def fileno(self):
        return self.fd

    def write(self, data):
        if os.getpid() != self.pid:  # a process the cell forked: its output goes where others' goes
            return os.write(self.fd, data)
        self.capture.append(self.fd - 1, bytes(data))
        return len(data)


class _Worker:
    def __init__(self, config):
        self.config = config
        self.own_pid_ns = bool(config.get("own_pid_namespace"))
        self.globals = {"__name__": "__main__", "__builtins__": __builtins__}
        self.cell = 0
        self.sources = _CellSources()
        self.pid = os.getpid()
        self.cpu_hard = resource.RLIM_INFINITY
        self._setup_fds()
        self._apply_limits()
        self.capture = _Capture()
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(
                io.BufferedWriter(_OwnOutput(self.capture, fd)),
                encoding="utf-8",
                errors="backslashreplace",
                line_buffering=fd == 2,
            )
            for fd in (1, 2)
        )
        self.stdout, self.stderr = sys.stdout, sys.stderr
        if not self.own_pid_ns:
            self._become_subreaper()

    def _setup_fds(self):
        self.proto_in = os.dup(0)  # os.dup gives non-inheritable fds: children never see the protocol
        self.proto_out = os.dup(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.close(devnull)
        workdir = self.config.get("workdir")
        if workdir:
            os.chdir(workdir)

    def _apply_limits(self):
        c = self.config
        limits = [
            ("memory_bytes", resource.RLIMIT_AS),
            ("nproc", resource.RLIMIT_NPROC),
            ("nofile", resource.RLIMIT_NOFILE),
            ("fsize_bytes", resource.RLIMIT_FSIZE),
        ]
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        for key, which in limits:
            value = c.get(key)
            if value:
                value = int(value)
                _, hard = resource.getrlimit(which)
                if hard != resource.RLIM_INFINITY:
                    value = min(value, hard)
                resource.setrlimit(which, (value, value))
        if c.get("session_cpu_s"):
            self.cpu_hard = int(c["session_cpu_s"]) + 1
            resource.setrlimit(resource.RLIMIT_CPU, (self.cpu_hard, self.cpu_hard))

    def _become_subreaper(self):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except Exception:
            pass

    # -- protocol ---------------------------------------------------------------------------
    def _read_exact(self, n):
        buf = bytearray()
        while len(buf) < n:
            try:
                chunk = os.read(self.proto_in, n - len(buf))
            except InterruptedError:
                continue
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def recv(self):
        header = self._read_exact(_HEADER.size)
        if header is None:
            return None
        (n,) = _HEADER.unpack(header)
        if n > _MAX_FRAME:
            raise ValueError("frame too large")
        body = self._read_exact(n)
        if body is None:
            return None
        return _loads(body.decode("utf-8"))

    def send(self, obj):
        body = _dumps(obj).encode("utf-8", "backslashreplace")
        data = _HEADER.pack(len(body)) + body
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.proto_out, view)
            except InterruptedError:
                continue
            view = view[n:]

    def _warm_up(self):
        """Run one throwaway cell before "ready", so that the session's first cell does not pay
        for this process's first touch of the cell path: a worker cloned from its template shares
        the template's pages until it writes them (copy-on-write), and its caches are cold. The
        first cell took 1.35 ms against 0.36 ms for the second (0.40 against 0.09 ms inside
        exec); paid here, it is boot or recycle time, which the pool spends ahead of demand.
        Leaves no trace: its own namespace, no cell number, no kept source, output discarded."""
        namespace, self.globals = self.globals, {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            _loads(_dumps(self.execute({"code": "print(0)\n0", "max_output_bytes": 64})))
        finally:
            self.globals = namespace
            filename, self.cell = f"<cell-{self.cell}>", 0
            self.sources.pending.pop(filename, None)
            getattr(sys.modules.get("linecache"), "cache", {}).pop(filename, None)

    def serve(self):
        self._warm_up()
        self.send({"op": "ready", "pid": os.getpid(), "python": ".".join(map(str, sys.version_info[:3]))})
        while True:
            msg = self.recv()
            if msg is None or msg.get("op") == "shutdown":
                return
            op = msg.get("op")
            if op == "exec":
                reply = self.execute(msg)
            elif op == "ping":
                reply = {"pong": True}
            elif op == "put_files":
                reply = self.put_files(msg.get("files") or {})
            else:
                reply = {"error": {"type": "ProtocolError", "message": f"unknown op {op!r}"}}
            reply["id"] = msg.get("id")
            self.send(reply)
            if reply.get("restart"):
                return

    # -- execution --------------------------------------------------------------------------
    def _compile(self, code, want_value):
        self.cell += 1
        filename = f"<cell-{self.cell}>"
        self.sources.add(filename, code)
        tree = compile(code, filename, "exec", _ast.PyCF_ONLY_AST)  # ast.parse, without `ast`
        last = None
        if want_value and tree.body and isinstance(tree.body[-1], _ast.Expr):
            last = _ast.Expression(tree.body.pop().value)
        body = compile(tree, filename, "exec")
        return body, (compile(last, filename, "eval") if last is not None else None)

    def _cpu_used(self):
        me = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def execute(self, msg):
        cap = int(msg.get("max_output_bytes") or (1 << 20))
        cpu_s = msg.get("cpu_s")
        if cpu_s:
            own = resource.getrusage(resource.RUSAGE_SELF)
            soft = int(own.ru_utime + own.ru_stime + float(cpu_s) + 0.999)
            hard = self.cpu_hard
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        sys.stdout, sys.stderr = self.stdout, self.stderr
        sys.stdin = io.StringIO(msg.get("stdin") or "")
        self.capture.start(cap)
        error = None
        value = None
        limit = None
        restart = False
        cpu0 = self._cpu_used()
        t0 = time.perf_counter()
        try:
            body, last = self._compile(msg.get("code", ""), bool(msg.get("want_value", True)))
            exec(body, self.globals)
            if last is not None:
                result = eval(last, self.globals)
                if result is not None:
                    value = repr(result)
                    if len(value) > _VALUE_REPR_LIMIT:
                        value = value[:_VALUE_REPR_LIMIT] + "...[truncated]"
        except MemoryError:
            error = self._describe(*sys.exc_info())
            limit = "memory"
            restart = True
        except BaseException:
            error = self._describe(*sys.exc_info())
        wall = time.perf_counter() - t0
        if os.getpid() != self.pid:
            os._exit(0)  # a process forked by the cell ran off its end: it must not act as the worker
        for stream in (self.stdout, self.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        self._kill_strays()
        cpu = self._cpu_used() - cpu0
        (out, err), truncated = self.capture.finish()
        return {
            "stdout": out,
            "stderr": err,
            "value": value,
            "error": error,
            "wall_s": wall,
            "cpu_s": cpu,
            "truncated": truncated,
            "memory_exceeded": limit == "memory",
            "limit": limit,
            "restart": restart,
        }

    def _describe(self, etype, exc, tb):
        # Drop the worker's own frames so the traceback starts at the user's cell.
        while tb is not None and tb.tb_frame.f_code.co_filename == _THIS_FILE:
            tb = tb.tb_next
        exit_code = None
        if etype is SystemExit:
            code = exc.code
            exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        try:
            import traceback

            text = "".join(traceback.format_exception(etype, exc, tb))
        except BaseException:
            text = f"{etype.__name__}: <traceback unavailable>"
        try:
            message = str(exc)
        except BaseException:
            message = f"<unprintable {etype.__name__}>"
        return {
            "type": etype.__name__,
            "message": _safe(message)[:_VALUE_REPR_LIMIT],
            "traceback": _safe(text)[-_VALUE_REPR_LIMIT:],
            "exit_code": exit_code,
        }

    def _kill_strays(self):
        """Kill and reap every process the cell left behind (daemons included)."""
        me = os.getpid()
        for attempt in range(400):
            victims = [p for p in self._descendants(me) if p != me]
            if not victims:
                return
            for pid in victims:
                try:
                    os.kill(pid, _signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            self._reap()
            if attempt >= 2:
                time.sleep(0.0025)  # orphans are reaped by the namespace's init: give it a moment

    def _descendants(self, me):
        pids = []
        try:
            names = os.listdir("/proc")
        except OSError:
            return pids
        if self.own_pid_ns:
            # Under bubblewrap's init (pid 1) everything else in this pid namespace is ours.
            return [int(n) for n in names if n.isdigit() and int(n) not in (1, me)]
        parents = {}
        for n in names:
            if not n.isdigit():
                continue
            try:
                with open(f"/proc/{n}/stat", "rb") as f:
                    stat = f.read()
                parents[int(n)] = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        found, frontier = [], [me]
        while frontier:
            parent = frontier.pop()
            kids = [p for p, pp in parents.items() if pp == parent]
            found.extend(kids)
            frontier.extend(kids)
        return found

    def _reap(self):
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return

    def put_files(self, files):
        root = os.path.realpath(os.getcwd())
        written = []
        try:
            for rel, content in files.items():
                path = os.path.realpath(os.path.join(root, rel))
                if not path.startswith(root + os.sep):
                    raise ValueError(f"file path {rel!r} escapes the workspace")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    import binascii  # base64 itself would import re

                    f.write(binascii.a2b_base64(content))
                written.append(rel)
        except BaseException:
            return {"error": self._describe(*sys.exc_info())}
        return {"written": written}


def _safe(text):
    """Make a str encodable as UTF-8 (lone surrogates become escapes)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _undo_ignored_signals():
    """Signals the host ignored stay ignored across exec, into this worker and every program it
    runs (a server started under ``nohup`` ignores SIGHUP, so a program's ``kill -HUP`` of itself
    would do nothing): a program must start as a fresh process does, whoever started the server."""
    for sig in _signal.valid_signals():
        if sig != _signal.SIGXFSZ and _signal.getsignal(sig) == _signal.SIG_IGN:  # SIGXFSZ: Python's own
            _signal.signal(sig, _signal.SIG_DFL)


def main(argv):
    config = _loads(argv[1]) if len(argv) > 1 and argv[1] else {}
    if config.get("template"):
        # session_template.py, shipped in front of this file: returns in each session's worker.
        serve_sessions(config)  # noqa: F821
    _undo_ignored_signals()
    _signal.signal(_signal.SIGPIPE, _signal.SIG_DFL)
    worker = _Worker(config)
    try:
        worker.serve()
    finally:
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
