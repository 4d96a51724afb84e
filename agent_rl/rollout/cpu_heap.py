"""Keep freed heap memory in the process on CPU, so that each generate call does not fault it back in.

Why: torch's CPU tensors come from glibc malloc. By default glibc serves blocks above a dynamic
threshold (128 KiB to start) with their own mmap and returns them on free, and it trims free
memory at the top of a heap back to the OS. The HF engine allocates its KV cache, the kept
per-row caches and the prefill activations afresh on every call, so every call faulted tens of
MiB back in, zero-filled by the kernel: 12-32k minor faults a call at the rollout bench's sizes,
whose kernel time alone was 20-40 ms of a ~0.46 s call (5-9%) (benchmarks/rollout_bench.py prints faults per engine call). How many
depended on which thread made the call (each thread allocates from its own arena), which made
the collector's engine thread look slower than the same calls replayed from the main thread.

What it costs: the process keeps the peak of its blocks under 32 MiB mapped after they are freed
(free blocks stay reusable by any later allocation; blocks of 32 MiB or more are still unmapped
on free). That is what allocators built for this (jemalloc, tcmalloc, torch's GPU caching
allocator) do anyway. A no-op where the C library has no `mallopt` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20
"""glibc's largest allowed mmap threshold on 64-bit (4 * 1024 * 1024 * sizeof(long))."""
TRIM_THRESHOLD = 2**30

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set the process's malloc thresholds once (see the module doc); True where they took effect."""
    global _applied
    if _applied is None:
        try:
            libc = ctypes.CDLL(None)
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            _applied = False
        else:
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            # mallopt returns 1 on success, 0 on error.
            _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            )
            if not _applied:
                log.warning("mallopt refused the thresholds; freed CPU memory goes back to the OS")
    return _applied
