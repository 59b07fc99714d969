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
import queue
import threading
from concurrent.futures import Executor, Future, ThreadPoolExecutor

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


class DaemonPool(Executor):
    """Runs each call in a daemon thread, reusing idle ones (a thread start costs ~0.1-0.3 ms, a hand-off to a
    waiting thread ~0.05 ms). Unbounded: a call that never returns (a request to a silent server, abandoned by
    its caller) holds its thread, and the next call gets another; an idle thread exits after ``idle`` seconds.
    Unlike a ``ThreadPoolExecutor``, whose workers the interpreter joins at exit, a stalled call never holds up
    the process's exit."""

    def __init__(self, name: str, idle: float = 30.0):
        self.name, self.idle = name, idle
        self._work: "queue.SimpleQueue" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting = 0                    # threads waiting for work that no submit has counted on yet

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        with self._lock:
            start = self._waiting == 0
            if not start:
                self._waiting -= 1           # that thread takes this call
        self._work.put((future, fn, args, kwargs))
        if start:
            threading.Thread(target=self._worker, name=self.name, daemon=True).start()
        return future

    def _worker(self) -> None:
        while True:
            try:
                future, fn, args, kwargs = self._work.get(timeout=self.idle)
            except queue.Empty:
                with self._lock:
                    if self._waiting > 0:    # not counted on: leave (else a call is on its way to us)
                        self._waiting -= 1
                        return
                continue
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: B902 - handed to the caller
                    future.set_exception(e)
            del future, fn, args, kwargs
            with self._lock:
                self._waiting += 1
