"""The local backend: workers in bubblewrap namespaces with per-worker uids, rlimits and cgroups.

``launcher`` starts one confined worker (or, loudly, an rlimits-only one), ``cgroups`` gives it a
memory and pids cgroup where the host allows, ``local`` is ``LocalSandbox``.
"""

from __future__ import annotations
