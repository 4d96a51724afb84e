"""The session template: a warm process in each worker's sandbox that clones a fresh worker per session.

Stdlib only, like worker.py: the host (sandbox/bwrap/launcher.py) ships namespaces.py, this file
and worker.py as one script, and worker.py's ``main`` calls ``serve_sessions`` when its config
says ``"template": true``.

Why: a worker start is ~21 ms of CPU (bubblewrap's namespaces and mounts ~4 ms, an interpreter
booting ~12 ms, the host's side), and an RL collect ends every episode's session at once, so the
pool used to boot a worker per episode while the engine generated. Here the sandbox (bubblewrap's
namespaces, the worker's uid and cgroups) outlives its session: the template T waits on a control
socket (its stdin/stdout), and for each session the host sends a fresh pair of pipes; T kills the
previous session (if any) and clones the next.

Per session, T clones C straight into new user, pid, mount, ipc and uts namespaces (namespaces.py).
C maps only its own uid, mounts an empty tmpfs over /tmp, /workspace and /dev/shm and a /proc of
its own pid namespace, makes itself non-dumpable, and forks D: the worker (worker.py), pid 2 under
C as it would be under bubblewrap's init, with no capability left. C reaps orphans and ends with
D's status.

What a session cannot pass to the next one in the same sandbox:
* processes, sockets, timers: C is pid 1 of the session's pid namespace; when T kills C (or C
  ends), the kernel kills everything in it, and T's ``waitpid`` returns only after that;
* files: /tmp, /workspace and /dev/shm are the session's own tmpfs, gone with its mount namespace;
  nothing else is writable (bubblewrap's /dev, which outlives sessions, is read-only for them);
* SysV IPC and POSIX message queues: the session's own ipc namespace;
* memory: D is a copy of T, which never reads a request (the host talks to D, never to T);
* the channel: each session gets new pipes, and the host closes the old ones, so a stray writer
  from the last session (there is none left, see above) would have nowhere to write.
What sessions of one sandbox share, one after the other: the host uid, the cgroups (so the memory
limit; a sandbox whose cgroup saw an OOM kill is not reused) and the loopback-only network
namespace (no socket outlives its processes).

When D (so C) ends on its own (a crash, a limit, ``os._exit``), T exits with the same status: the
host sees the sandbox end exactly as it did before templates, and never reuses it.
"""

import os
import select
import signal
import socket

if "_clone" not in globals():  # in the repository; shipped, namespaces.py is in front of this file
    from sandbox.namespaces import (
        CLONE_NEWIPC,
        CLONE_NEWNS,
        CLONE_NEWPID,
        CLONE_NEWUSER,
        CLONE_NEWUTS,
        PR_SET_DUMPABLE,
        PR_SET_PDEATHSIG,
        _clone,
        _drop_capabilities,
        _libc,
        _private_scratch,
        _tid_slot,
    )

_SESSION = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
ISOLATION_FAILED = 70
ISOLATION_MESSAGE = "sandbox session template: cannot isolate the session"


def _status(wait_status):
    """A wait status as a shell (and bubblewrap) reports it: the exit code, or 128 + signal."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.WEXITSTATUS(wait_status)


def serve_sessions(config):
    """(T) Clone a session for each pair of pipes the host sends; returns only in a session's worker."""
    control = socket.socket(fileno=os.dup(0))
    tid_slot, uid, gid = _tid_slot(), os.getuid(), os.getgid()
    disk_bytes = int(config.get("disk_bytes") or 64 << 20)
    poller = select.poll()
    poller.register(control, select.POLLIN)
    session = pidfd = None
    while True:
        ready = {fd for fd, _ in poller.poll()}
        if pidfd in ready:  # the session ended on its own: so does this sandbox, with its status
            os._exit(_status(os.waitpid(session, 0)[1]))
        msg, fds, _, _ = socket.recv_fds(control, 1, 2)
        if not msg or len(fds) != 2:
            os._exit(0)  # the host closed the sandbox
        if session is not None:
            os.kill(session, signal.SIGKILL)  # C is pid 1: its whole namespace goes with it
            os.waitpid(session, 0)  # returns once every process of the session is gone
            poller.unregister(pidfd)
            os.close(pidfd)
        session = _clone(tid_slot, _SESSION)
        if session == 0:
            _become_session(fds, uid, gid, disk_bytes)
            return  # in D: the caller runs the worker
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(session)
        poller.register(pidfd, select.POLLIN)


def _become_session(fds, uid, gid, disk_bytes):
    """(C, pid 1 of the session) Isolate, fork the worker D and return in it; C itself never returns."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # T gone: this namespace goes too
    os.dup2(fds[0], 0)
    os.dup2(fds[1], 1)
    os.closerange(3, 1 << 16)  # T's control socket and pidfd: nothing in a session reaches T
    try:
        _private_scratch(uid, gid, disk_bytes)
        os.chdir("/workspace")
    except OSError as e:
        os.write(2, f"{ISOLATION_MESSAGE}: {e}\n".encode())
        os._exit(ISOLATION_FAILED)
    _libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # the session's code (same uid) cannot ptrace its init
    worker = os.fork()
    if worker == 0:
        # The worker is dumpable again, as it is without templates: its /proc/self entries are its
        # own (tools read /proc/self/fd, /proc/self/mem); its init above stays out of its reach.
        _libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
        _drop_capabilities()
        os.setsid()
        return
    os.close(0)
    os.close(1)
    while True:
        pid, wait_status = os.wait()
        if pid == worker:
            os._exit(_status(wait_status))
