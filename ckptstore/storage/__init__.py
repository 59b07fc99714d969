"""Storage backends: one small interface (:class:`Storage`), a local and an fsspec implementation."""
from __future__ import annotations

import os
from typing import Optional

from .base import Storage
from .fsspec_storage import FsspecStorage
from .local import LocalStorage


def is_local(url) -> bool:
    url = os.fspath(url)
    return "://" not in url or url.startswith("file://")


def open_storage(url, storage_options: Optional[dict] = None, *, direct_io: bool = True) -> Storage:
    """A path or ``file://`` URL -> :class:`LocalStorage`; any other fsspec URL -> :class:`FsspecStorage`."""
    url = os.fspath(url)
    if is_local(url):
        return LocalStorage(url[len("file://"):] if url.startswith("file://") else url, direct_io=direct_io)
    return FsspecStorage(url, storage_options)


__all__ = ["Storage", "LocalStorage", "FsspecStorage", "open_storage", "is_local"]
