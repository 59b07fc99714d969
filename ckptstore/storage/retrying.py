"""A remote :class:`~ckptstore.storage.base.Storage` whose every call runs under the store's
:class:`~ckptstore.util.retry.RetryPolicy`: the one place where remote calls get their per-attempt timeout,
their retries and their deadline (restic's backend_retry shape: the code above never sees a retry).

:func:`~ckptstore.storage.open_storage` wraps every remote storage it opens in it, so every path that talks to
an object store (uploads, resume, pulls, the writer lease and its heartbeat, in-flight markers, deletions,
retention, listings, pointer reads and writes, ``close``) is bounded the same way (issue 26 item 6: ``close()``
waited forever in a lease release made without the policy).

* Each attempt runs in a daemon thread (:class:`~ckptstore.util.threads.DaemonPool`) and is abandoned after
  ``op_timeout`` seconds (it counts as stalled, and may finish on its own later; a process exit never waits
  for it). A read into a caller's buffer
  (``read_into``, ``read_range_*``) reads into private bytes first and copies them into the caller's buffer
  only once the attempt returned, so an abandoned attempt never writes into memory the caller has moved on with.
* Outside any :meth:`RetryPolicy.call <ckptstore.util.retry.RetryPolicy.call>`, a call is retried under the policy
  (transient errors only; a missing object or damage is raised at once, see :func:`ckptstore.util.retry.is_transient`).
  Inside one (a step copy's compound operation), it makes one attempt and leaves retries and the deadline to
  the enclosing call, so retries never nest.
* One :class:`~ckptstore.util.retry.Outage` per storage, which every attempt reports to: a call's deadline
  (or that of the RetryPolicy.call around it) counts from its start or from the moment the storage stopped
  answering, whichever is earlier; a call made after a whole deadline of silence makes one attempt and gives
  up. ``close()`` therefore returns or raises within about ``deadline + 2 x op_timeout`` seconds of the
  storage going silent (the uploads in flight give up by the deadline, then the step's in-flight marker and
  the writer lease get one attempt each).

Past the deadline the last error is raised as :class:`~ckptstore.util.errors.UploadError` (a
:class:`~ckptstore.util.errors.TransferError`: resume raises it, and neither skips the step nor starts fresh). A
missing object or damage is raised at once (see :func:`ckptstore.util.retry.is_transient`); bytes that arrive but
fail their check are judged above, by :func:`ckptstore.format.blobs.read_verified`.
"""
from __future__ import annotations

import concurrent.futures
import functools
from typing import Any, Callable, Optional, TypeVar

from ..util.retry import Outage, RetryPolicy, current_operation, is_transient
from ..util.threads import DaemonPool
from .base import BytesReads, NewFile

T = TypeVar("T")

#: every method that talks to the storage (everything else, e.g. ``url``, ``local_path``, passes through)
CALLS = frozenset({"read_bytes", "size", "exists", "write_atomic", "write_new", "listdir", "listdir_after",
                   "list_sizes", "delete", "rmtree", "read_versioned", "write_if_match", "put_file", "move",
                   "mtime", "read_range_bytes"})


class RetryingStorage(BytesReads):
    """``storage`` (remote) with every call run under ``policy`` (see the module docstring). ``outage``: share
    the outage clock of another view of the same storage (:meth:`with_policy`). ``attempts``: at most that
    many attempts per call (``1``: each call is bounded by ``op_timeout`` and not retried). Reads into a
    caller's buffer read private bytes first (:class:`~ckptstore.storage.base.BytesReads`)."""

    def __init__(self, storage, policy: RetryPolicy, outage: Optional[Outage] = None, *,
                 attempts: Optional[int] = None):
        self.storage, self.policy, self.attempts = storage, policy, attempts
        self.outage = outage if outage is not None else Outage(policy.op_timeout)

    def with_policy(self, policy: RetryPolicy) -> "RetryingStorage":
        """The same storage, its calls under ``policy`` (retried up to its deadline), and the same outage
        clock."""
        return RetryingStorage(self.storage, policy, self.outage)

    def call(self, fn: Callable[[], T], what: str, *, attempts: Optional[int] = None) -> T:
        """A compound operation on this storage (several calls) under the storage's policy as one: each attempt
        of the whole is abandoned after ``op_timeout`` seconds, the calls inside it are not retried on their
        own, and with ``attempts`` it is tried at most that many times."""
        return self.policy.call(fn, what, executor=_ATTEMPTS, attempts=attempts)

    def open_new(self, folder: str) -> NewFile:
        """See :meth:`~ckptstore.storage.base.Storage.open_new`: gathered in memory, then one governed
        ``write_new`` / ``write_atomic`` (never the wrapped storage's own, which would not be retried)."""
        return NewFile(self, folder)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.storage, name)
        if name not in CALLS:
            return attr

        @functools.wraps(attr)
        def governed(*args, **kw):
            return self._run(lambda: attr(*args, **kw), f"{name} {args[0] if args else ''} of {self.url}")
        return governed

    def _run(self, fn: Callable[[], T], what: str) -> T:
        if current_operation() is not None:          # the enclosing RetryPolicy.call retries
            return self._attempt(fn)
        return self.policy.call(lambda: self._attempt(fn), what, attempts=self.attempts)

    def _attempt(self, fn: Callable[[], T]) -> T:
        """One attempt, abandoned after ``op_timeout`` seconds; its outcome goes to the outage clock, which the
        enclosing RetryPolicy.call's deadline counts from."""
        op = current_operation()
        if op is not None:
            op.outages.add(self.outage)
        token = self.outage.begin()

        def attempt() -> T:
            answered = False
            try:
                result = fn()
                answered = True
                return result
            except BaseException as e:  # noqa: B902 - an answer unless transient
                answered = not is_transient(e)
                raise
            finally:
                self.outage.end(token, answered)
        try:
            return _ATTEMPTS.submit(attempt).result(timeout=self.policy.op_timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"no answer within {self.policy.op_timeout:.1f} s (stalled)") from None

    def __repr__(self) -> str:
        return f"RetryingStorage({self.storage!r})"


#: where every attempt runs: daemon threads, reused (see :class:`~ckptstore.util.threads.DaemonPool`)
_ATTEMPTS = DaemonPool("ckptstore-remote-call")


def with_retries(storage, policy: RetryPolicy):
    """``storage`` with every call under ``policy`` when it is remote (a view sharing the outage clock when it
    is already wrapped); a local storage as it is (its errors are not transient: a failed local read is damage,
    and resume falls back on it at once)."""
    if isinstance(storage, RetryingStorage):
        return storage if storage.policy == policy and storage.attempts is None else storage.with_policy(policy)
    return storage if storage.local_path("") is not None else RetryingStorage(storage, policy)
