"""Background threads that yield the CPU to training.

A save or upload in the background competes with the training loop for cores (on 2 cores, DCP's async
writer cut a concurrent matmul loop's throughput by 62%). Linux schedules threads individually, so the
threads ckptstore starts lower their own priority (``nice``) when they begin: the training threads, at normal
priority, get the CPU whenever they want it, and the background work uses what is left.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

#: niceness added to ckptstore's background threads (0 disables); env ``CKPTSTORE_BACKGROUND_NICE``.
BACKGROUND_NICE = int(os.environ.get("CKPTSTORE_BACKGROUND_NICE", "10"))


def lower_priority(nice: int = None) -> None:
    """Set the calling thread's niceness to at least ``nice`` (best effort; Linux only).

    An absolute level, not an increment: threads started by already-niced threads inherit their niceness, and
    must not end up lower still."""
    nice = BACKGROUND_NICE if nice is None else nice
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, nice))
    except (OSError, AttributeError):
        pass


def background_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at lowered priority."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=lower_priority)
