"""What every backend shares: the worker protocol, the session core, the warm pool, the session front.

``protocol`` frames requests to the worker over a pair of descriptors (a pipe pair, or a Docker
attach socket with its stream headers removed); ``core`` drives one session's cells on a worker
and turns every way a worker can fail into an ``ExecResult`` or ``SandboxUnavailable``; ``pool``
keeps workers from any ``Launcher`` warm; ``box`` is the sandbox/session API the backends expose.
"""

from __future__ import annotations
