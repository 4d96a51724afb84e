"""Linux namespace plumbing for the scripts that run inside the sandbox: raw clone, id maps, mounts.

Stdlib only, no package imports, like output_pipes.py: the zygote (zygote_main.py) and the session
template (session_template.py) run inside the sandbox as source text, and the host puts this file's
source in front of theirs (``prepend_to``). In the repository they import it like any module.
x86_64 syscall numbers (clone 56, capset 126), as everywhere in the sandbox.
"""

import ctypes
import os
import signal

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
CLONE_CHILD_SETTID, CLONE_PARENT = 0x01000000, 0x00008000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE = 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 1, 4, 24, 38, 47

_libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's own libc; no ctypes.util (15 ms)
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


def _tid_slot():
    """The address of glibc's cached thread id for this (main) thread, or 0 when it cannot be found.

    A raw clone leaves the child's copy stale (the zygote's tid), and glibc uses it for recursive
    mutexes and pthread calls on the main thread; since the program runs in the clone, S must look
    like a glibc fork's child. fork() passes this address as CLONE_CHILD_SETTID so the kernel writes
    the child's tid there; _clone does the same. Its offset in struct pthread varies between glibc
    builds, so it is found: the int that holds our tid here and the child's tid in a forked child.
    """
    _libc.pthread_self.restype = ctypes.c_ulong
    base = _libc.pthread_self()
    words = (ctypes.c_int * 576).from_address(base)  # struct pthread is ~2.3 KiB on x86_64
    here = [i for i in range(576) if words[i] == os.getpid()]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b" ".join(b"%d" % i for i in here if words[i] == os.getpid()))
        os._exit(0)
    os.close(w)
    found = [int(i) for i in os.read(r, 4096).split()]
    os.close(r)
    os.waitpid(pid, 0)
    return base + 4 * found[0] if len(found) == 1 else 0


def _clone(tid_slot, flags):
    """fork() into the namespaces ``flags`` asks for, in one step (raw clone(2)).

    One process instead of fork + unshare + fork: the child is pid 1 of its own namespace, and
    fork's CPU cost (copying and tearing down the page tables) dominates a one-shot's. Python's
    fork bookkeeping runs around it as os.fork() would, and glibc's cached tid is set as fork()
    sets it (``tid_slot``, see _tid_slot).
    """
    if tid_slot:
        flags |= CLONE_CHILD_SETTID
    _api.PyOS_BeforeFork()
    pid = _libc.syscall(56, flags | signal.SIGCHLD, 0, 0, ctypes.c_void_p(tid_slot), 0)  # SYS_clone, x86_64
    if pid == 0:
        _api.PyOS_AfterFork_Child()
        return 0
    err = ctypes.get_errno()
    _api.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(err, f"clone: {os.strerror(err)}")
    return pid


def _map_ids(uid, gid):
    """(in a new user namespace) Map only our own uid and gid, as themselves."""
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def _private_scratch(uid, gid, disk_bytes):
    """(first thing in a new user + mount + pid namespace) Map only our ids; empty, private /tmp,
    /workspace and /dev/shm of ``disk_bytes`` each; a /proc that shows only this pid namespace.

    /dev goes read-only: it is bubblewrap's tmpfs, owned by the sandbox uid and shared by every
    program cloned in that sandbox, so a file made there would reach the next one. Its device
    nodes are bind mounts of their own and stay writable (writing to /dev/null is not a write to
    the filesystem that holds it).
    """
    _map_ids(uid, gid)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    size = f"size={int(disk_bytes)},mode=1777".encode()
    for target in ("/tmp", "/workspace", "/dev/shm"):
        if os.path.isdir(target):
            _mount(b"tmpfs", target, b"tmpfs", MS_NOSUID | MS_NODEV, size)
    if os.path.isdir("/dev"):
        _mount(None, "/dev", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount(b"proc", "/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
