"""Feed a child's stdin and keep the first bytes of its stdout/stderr, over raw pipes.

Stdlib only, no package imports: the one-shot driver (run_driver.py) and the zygote
(zygote_main.py) run inside the sandbox as source text, and the host puts this file's source in
front of theirs (`prepend_to`). In the repository they import it like any module.
"""

import os
import select


class Pipes:
    """Feeds stdin and keeps the first ``cap`` bytes of stdout/stderr (the rest is drained, so a
    chatty program never blocks on a full pipe)."""

    def __init__(self, in_w, out_r, err_r, stdin, cap):
        self.cap, self.out_r, self.err_r = cap, out_r, err_r
        self.bufs = {out_r: bytearray(), err_r: bytearray()}
        self.poller = select.poll()
        for fd in (out_r, err_r):
            self.poller.register(fd, select.POLLIN)
        self.stdin, self.in_w = memoryview(stdin), in_w
        if stdin:
            os.set_blocking(in_w, False)
            self.poller.register(in_w, select.POLLOUT)
        else:
            os.close(in_w)
            self.in_w = None
        self.open = {out_r, err_r}

    def _drop(self, fd):
        self.poller.unregister(fd)
        os.close(fd)
        self.open.discard(fd)
        if fd == self.in_w:
            self.in_w = None

    def pump(self, wait_s):
        """Move whatever is ready within ``wait_s`` seconds."""
        for fd, _ in self.poller.poll(max(0, int(wait_s * 1000))):
            if fd == self.in_w:
                try:
                    self.stdin = self.stdin[os.write(fd, self.stdin[: 1 << 16]) :]
                except OSError:  # the program closed its stdin (EPIPE): it wants no more
                    self.stdin = self.stdin[:0]
                if not self.stdin:
                    self._drop(fd)
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                self._drop(fd)
                continue
            buf = self.bufs[fd]
            if len(buf) < self.cap:
                buf += chunk[: self.cap - len(buf)]

    def close(self):
        for fd in list(self.open) + ([self.in_w] if self.in_w is not None else []):
            self._drop(fd)

    def text(self, fd):
        return bytes(self.bufs[fd]).decode("utf-8", errors="replace")


def prepend_to(source):
    """``source`` (a script run inside the sandbox as text) with this module's source in front."""
    with open(__file__, encoding="utf-8") as f:
        return f.read() + "\n" + source
