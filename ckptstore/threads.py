"""Background threads that yield the CPU to training.

A save or upload in the background competes with the training loop for cores (on 2 cores, DCP's async
writer cut a concurrent matmul loop's throughput by 60%). Linux schedules threads individually, so the
threads ckptstore starts lower their own priority (``nice``) when they begin: the training threads, at normal
priority, get the CPU whenever they want it, and the background work uses what is left.

Measured (benchmarks/bench_compute_slowdown.py, 1 GB state, a save every 3 s, 2 cores saturated by matmuls):
loop slowdown 67.8% at nice 0, 17.9% at nice 10, 13.2% at nice 19 (dcp.async_save: 60.4%). The price is
latency only under full CPU contention: a background save took 7.7 s at nice 19 against 2.1 s at nice 10.
With a GPU doing the training, the CPU is mostly idle and both finish as fast.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

#: niceness of ckptstore's background threads (0 disables); env ``CKPTSTORE_BACKGROUND_NICE``.
BACKGROUND_NICE = int(os.environ.get("CKPTSTORE_BACKGROUND_NICE", "19"))


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
