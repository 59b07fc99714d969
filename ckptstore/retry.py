"""Retries with exponential backoff and jitter, under an overall deadline, for object-store calls.

Transient failures (connection refused/reset, timeouts, throttling, 5xx) are retried; anything else (a
missing file, a permission error, a precondition failure) is raised at once. A call that does not return
within ``op_timeout`` seconds counts as stalled: it is abandoned (its thread is left to finish on its own) and
retried, and when the deadline passes the last error is raised as :class:`~ckptstore.errors.UploadError`.
"""
from __future__ import annotations

import concurrent.futures
import errno
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from .errors import CheckpointError, UploadError

log = logging.getLogger("ckptstore")
T = TypeVar("T")

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


@dataclass(frozen=True)
class RetryPolicy:
    """``deadline``: seconds one logical operation (e.g. one blob upload) may take in total, retries included.
    ``op_timeout``: seconds one attempt may take before it counts as stalled. Backoff doubles from
    ``backoff`` up to ``max_backoff`` seconds, with full jitter."""
    deadline: float = 300.0
    op_timeout: float = 120.0
    backoff: float = 0.2
    max_backoff: float = 10.0

    def call(self, fn: Callable[[], T], what: str, *, executor: Optional[concurrent.futures.Executor] = None,
             on_retry: Optional[Callable[[BaseException], None]] = None) -> T:
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            remaining = self.deadline - (time.monotonic() - start)
            try:
                if executor is None:
                    return fn()
                return executor.submit(fn).result(timeout=max(0.01, min(self.op_timeout, remaining)))
            except BaseException as e:  # noqa: B902 - classified below
                if isinstance(e, concurrent.futures.TimeoutError):
                    e = TimeoutError(f"no answer within {min(self.op_timeout, remaining):.1f} s (stalled)")
                if not is_transient(e):
                    raise
                if on_retry is not None:
                    on_retry(e)
                elapsed = time.monotonic() - start
                if elapsed >= self.deadline:
                    raise UploadError(f"{what}: gave up after {attempt} attempt(s) in {elapsed:.1f} s "
                                      f"(deadline {self.deadline:.0f} s): {type(e).__name__}: {e}") from None
                sleep = min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * random.random()
                sleep = min(sleep, max(0.0, self.deadline - elapsed))
                log.info("%s: attempt %d failed (%s: %s); retrying in %.2f s", what, attempt, type(e).__name__,
                         e, sleep)
                time.sleep(sleep)
