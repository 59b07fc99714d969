"""A :class:`~ckptstore.storage.base.Storage` whose reads are retried: for loads that read straight from an
object store (a resharding resume from the remote, ``load_path``), so a dropped connection or a throttled
request is retried under the store's :class:`~ckptstore.retry.RetryPolicy` instead of failing the step (which
would send resume to an older step). Restic's shape: the repository code above never sees a retry.

Only reads are wrapped (``READS``); everything else passes through unchanged. Attempts are not abandoned on
``op_timeout``: a read into a caller's buffer (``read_into``, ``read_range_*``) left running after a retry could
write into memory the caller has moved on with, so only errors are retried (the client's own timeouts turn a
stalled request into one). Past the policy's deadline the last error is raised as
:class:`~ckptstore.errors.UploadError` (a :class:`~ckptstore.errors.TransferError`: resume raises it, and
neither skips the step nor starts fresh). A missing object or damage is raised at once (see
:func:`ckptstore.retry.is_transient`); bytes that arrive but fail their check are judged above, by
:func:`ckptstore.blobs.read_verified`.
"""
from __future__ import annotations

import functools
from typing import Any

from ..retry import RetryPolicy

READS = frozenset({"read_bytes", "read_into", "read_range_into", "read_range_scatter", "size", "exists",
                   "listdir_after", "list_sizes",
                   "listdir", "mtime"})


class RetryingReads:
    """``storage`` with its ``READS`` run under ``policy`` (see the module docstring)."""

    def __init__(self, storage, policy: RetryPolicy):
        self.storage, self.policy = storage, policy

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.storage, name)
        if name not in READS:
            return attr
        url = self.storage.url

        @functools.wraps(attr)
        def retried(*args, **kw):
            return self.policy.call(lambda: attr(*args, **kw), f"{name} {args[0] if args else ''} of {url}")
        return retried


def with_read_retries(storage, policy: RetryPolicy):
    """``storage`` with retried reads when it is remote; a local storage as it is (its errors are not
    transient: a failed local read is damage, and resume falls back on it at once)."""
    return storage if storage.local_path("") is not None else RetryingReads(storage, policy)
