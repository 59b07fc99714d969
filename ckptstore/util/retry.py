"""Retries with exponential backoff and jitter, under an overall deadline, for object-store calls.

Transient failures (connection refused/reset, timeouts, throttling, 5xx) are retried; anything else (a
missing file, a permission error, a precondition failure) is raised at once. A call that does not return
within ``op_timeout`` seconds counts as stalled: it is abandoned (its thread is left to finish on its own) and
retried, and when the deadline passes the last error is raised as :class:`~ckptstore.util.errors.UploadError`.

The deadline counts from the call's start, or from the moment a storage it talks to stopped answering if
that is earlier (:class:`Outage`, kept per remote storage by :mod:`ckptstore.storage.retrying`, which every
attempt reports to): a call made during an outage does not get a fresh deadline of its own, so a sequence of
calls (a close: the upload in flight, then the step's in-flight marker, then the writer lease) ends within one
deadline of the outage, not one each. ``fresh=True`` gives a call a deadline of its own all the same: the
uploader's first call after it reported a failure (it tries for a whole deadline again, so that a save is
not refused at every call during a long outage).

The backoff's jitter comes from a generator of ckptstore's own, never from Python's global ``random`` (issue
26: the caller's random draws must not depend on whether, or when, a request was retried).
"""
from __future__ import annotations

import concurrent.futures
import contextvars
import errno
import itertools
import logging
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Set, TypeVar

from .errors import CheckpointError, UploadError

log = logging.getLogger("ckptstore")
T = TypeVar("T")

#: the backoff's jitter: a private generator, so retries never move the caller's global ``random``
_JITTER = random.Random()

_TRANSIENT_WORDS = ("timeout", "timed out", "throttl", "slowdown", "slow down", "too many requests",
                    "connection", "reset by peer", "broken pipe", "temporarily", "serviceunavailable",
                    "internalerror", "requesttimeout", "cannot connect", "server disconnected", "endpoint", "eof",
                    # a body damaged or cut short in transfer: read it again (never "no checkpoint")
                    "checksum", "incompleteread", "incomplete read", "content-length", "payload", "truncated")
# HTTP statuses worth a retry, as whole numbers only: blob ids (hex) and step numbers contain "500" or "429"
_TRANSIENT_STATUS = re.compile(r"(?<![0-9a-f])(429|500|502|503|504)(?![0-9a-f])")


_UNSATISFIABLE = ("416", "invalidrange", "range not satisfiable", "requested range")


def unsatisfiable_range(e: BaseException) -> bool:
    """A ranged read past the end of an object: S3's 416 / InvalidRange (s3fs raises it as ``OSError(EINVAL)``).
    The object is shorter than a manifest claims: damage, never worth a retry (retrying hung resume until the
    deadline, issue 17)."""
    text = f"{type(e).__name__}: {e}".lower()
    return (isinstance(e, OSError) and e.errno == errno.EINVAL) or any(w in text for w in _UNSATISFIABLE)


def is_transient(e: BaseException) -> bool:
    """Whether a failed call is worth retrying. Damage found in a checkpoint never is, nor is a ranged read past
    the end of an object (:func:`unsatisfiable_range`)."""
    if isinstance(e, (CheckpointError, FileNotFoundError, PermissionError, FileExistsError, IsADirectoryError,
                      NotADirectoryError, ValueError, TypeError, KeyError)):
        return False
    if unsatisfiable_range(e):
        return False
    if isinstance(e, (ConnectionError, TimeoutError, concurrent.futures.TimeoutError)):
        return True
    if type(e).__name__ in ("FlexibleChecksumError", "IncompleteRead", "ResponseStreamingError",
                            "ClientPayloadError", "ContentLengthError"):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    return (any(w in text for w in _TRANSIENT_WORDS) or _TRANSIENT_STATUS.search(text) is not None
            or isinstance(e, OSError))


class Outage:
    """Since when one storage has not answered, shared by every call to it (thread-safe).

    An attempt that raised a transient error, or that has been under way for ``op_timeout`` seconds or more
    (stalled), shows the storage failing from the moment it started; any answer (a success, a missing file, a
    failed precondition) shows it answering and ends the outage: :meth:`since` is then ``None`` again. A call
    made once the storage has been silent for a whole deadline still makes one attempt (which is how the
    storage is found answering again), and gives up after it."""

    def __init__(self, op_timeout: float):
        self.op_timeout = op_timeout
        self._lock = threading.Lock()
        self._failing: Optional[float] = None     # start of the first failed attempt since the last answer
        self._answered = float("-inf")            # when the last answer came
        self._open: Dict[int, float] = {}         # attempts under way: token -> start (time.monotonic())
        self._tokens = itertools.count()

    def since(self, now: Optional[float] = None) -> Optional[float]:
        """When the storage stopped answering (``time.monotonic()`` seconds), or ``None`` while it answers."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stalled = [s for s in self._open.values() if now - s >= self.op_timeout and s >= self._answered]
            if self._failing is not None:
                stalled.append(self._failing)
        return min(stalled) if stalled else None

    def begin(self) -> int:
        with self._lock:
            token = next(self._tokens)
            self._open[token] = time.monotonic()
            return token

    def end(self, token: int, answered: bool) -> None:
        """The attempt ``token`` ended: ``answered`` (the storage answered, whatever it said) or failed."""
        now = time.monotonic()
        with self._lock:
            start = self._open.pop(token)
            if answered:
                self._failing, self._answered = None, now
            elif self._failing is None:
                # sent after the last answer: failing since it was sent; else (an attempt abandoned long ago
                # that failed only now) nothing is known of the time before now
                self._failing = start if start >= self._answered else now


class _Operation:
    """One logical operation run by :meth:`RetryPolicy.call` (a context variable while its ``fn`` runs): the
    outages of the storages its attempts talked to, so its deadline counts from the earliest of them."""

    def __init__(self):
        self.outages: Set[Outage] = set()

    def since(self, start: float) -> float:
        times = [start] + [t for t in (o.since() for o in list(self.outages)) if t is not None]
        return min(times)


_OPERATION: contextvars.ContextVar[Optional[_Operation]] = contextvars.ContextVar("ckptstore_operation",
                                                                                 default=None)


def current_operation() -> Optional[_Operation]:
    """The :meth:`RetryPolicy.call` this code runs under (its retries and deadline cover it), or ``None``."""
    return _OPERATION.get()


@dataclass(frozen=True)
class RetryPolicy:
    """``deadline``: seconds one logical operation (e.g. one blob upload) may take in total, retries included,
    counted from its start or from the moment the storage stopped answering, whichever is earlier.
    ``op_timeout``: seconds one attempt may take before it counts as stalled. Backoff doubles from
    ``backoff`` up to ``max_backoff`` seconds, with full jitter (from a private generator). Every call to a
    remote storage runs under the store's policy (:mod:`ckptstore.storage.retrying`), so ``Store.close()``
    returns or raises within about ``deadline + 2 x op_timeout`` seconds of the store going silent."""
    deadline: float = 300.0
    op_timeout: float = 120.0
    backoff: float = 0.2
    max_backoff: float = 10.0

    def call(self, fn: Callable[[], T], what: str, *, executor: Optional[concurrent.futures.Executor] = None,
             on_retry: Optional[Callable[[BaseException], None]] = None, attempts: Optional[int] = None,
             fresh: bool = False) -> T:
        """``fn()`` until it returns, retrying transient errors, for at most ``deadline`` seconds counted from
        now or from the start of an outage of a storage ``fn`` talks to (see :class:`Outage`; not with
        ``fresh``), whichever is earlier, and at most ``attempts`` times when given. With ``executor``, each
        attempt runs there and is abandoned after ``op_timeout`` seconds. Storage calls inside ``fn`` make one
        attempt each and leave the retrying to this call (:mod:`ckptstore.storage.retrying`). Raises ``fn``'s
        error at once when it is not transient, else :class:`~ckptstore.util.errors.UploadError` naming ``what``
        past the deadline."""
        op = _Operation()
        ctx = contextvars.copy_context()
        ctx.run(_OPERATION.set, op)
        start = time.monotonic()

        def origin() -> float:
            return start if fresh else op.since(start)
        attempt = 0
        while True:
            attempt += 1
            limit = self.op_timeout
            if attempt > 1:                  # the first attempt always gets op_timeout (capped by the deadline)
                limit = min(limit, self.deadline - (time.monotonic() - origin()))
            limit = max(0.01, min(limit, self.deadline))
            try:
                if executor is None:
                    return ctx.copy().run(fn)
                # a copy per attempt: an abandoned attempt may still be running in its own
                return executor.submit(ctx.copy().run, fn).result(timeout=limit)
            except BaseException as e:  # noqa: B902 - classified below
                if isinstance(e, concurrent.futures.TimeoutError):
                    e = TimeoutError(f"no answer within {limit:.1f} s (stalled)")
                if not is_transient(e):
                    raise
                if on_retry is not None:
                    on_retry(e)
                now = time.monotonic()
                elapsed, silent = now - start, now - origin()
                if silent >= self.deadline or (attempts is not None and attempt >= attempts):
                    raise UploadError(f"{what}: gave up after {attempt} attempt(s) in {elapsed:.1f} s "
                                      f"(deadline {self.deadline:.0f} s" +
                                      (f", no answer for {silent:.1f} s" if silent > elapsed + 0.05 else "") +
                                      f"): {type(e).__name__}: {e}") from None
                sleep = min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * _JITTER.random()
                sleep = min(sleep, max(0.0, self.deadline - silent))
                log.info("%s: attempt %d failed (%s: %s); retrying in %.2f s", what, attempt, type(e).__name__,
                         e, sleep)
                time.sleep(sleep)
