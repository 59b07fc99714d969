"""Storage backends: one small interface (:class:`Storage`), a local and an fsspec implementation, and the
retrying wrapper every remote storage is opened in.

Imports: :mod:`ckptstore.util` only.
"""
from __future__ import annotations

import os
from typing import Optional

from ..util.retry import RetryPolicy

from .base import Storage
from .fsspec_storage import FsspecStorage
from .local import LocalStorage
from .retrying import RetryingStorage, with_retries


def is_local(url) -> bool:
    url = os.fspath(url)
    return "://" not in url or url.startswith("file://")


def open_storage(url, storage_options: Optional[dict] = None, *, direct_io: bool = True,
                 retry: Optional[RetryPolicy] = None, create: bool = True) -> Storage:
    """A path or ``file://`` URL -> :class:`LocalStorage` (its directory created if missing, unless ``create`` is
    false: then ``FileNotFoundError``); any other fsspec URL -> :class:`FsspecStorage`, every
    call of which runs under ``retry`` (:class:`~ckptstore.storage.retrying.RetryingStorage`): a per-attempt
    timeout, retries, a deadline. ``retry=None`` (a store opened on a URL root, the command line): one attempt
    per call, bounded by ``RetryPolicy().op_timeout`` seconds and not retried, so a one-shot command against a
    dead endpoint fails at once and against a silent one does not hang."""
    url = os.fspath(url)
    if is_local(url):
        path = url[len("file://"):] if url.startswith("file://") else url
        if not create and not os.path.isdir(path):
            raise FileNotFoundError(f"no store at {url}")
        return LocalStorage(path, direct_io=direct_io)
    storage = FsspecStorage(url, storage_options)
    if retry is None:
        return RetryingStorage(storage, RetryPolicy(), attempts=1)
    return with_retries(storage, retry)


__all__ = ["Storage", "LocalStorage", "FsspecStorage", "RetryingStorage", "open_storage", "is_local"]
