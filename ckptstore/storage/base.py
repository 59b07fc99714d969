"""The small storage interface every backend implements.

Paths are store-relative, ``/``-separated, and come from :mod:`ckptstore.format.layout` only. A backend knows bytes
and names, nothing of tensors, steps or manifests. Two write primitives carry the commit protocol:

* :meth:`Storage.write_atomic` replaces a file as a whole: a reader sees the old bytes or the new ones, never a
  mix (local: temp file, fsync, rename, fsync of the directory; object stores: one PUT).
* :meth:`Storage.write_new` creates a file only if it does not exist yet, and says whether it did: blobs are
  write-once, and on object stores that support it the latest pointer uses it for compare-and-swap.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Union

Buffer = Union[bytes, bytearray, memoryview]


class NotRegularFileError(OSError):
    """A store path names something other than a regular file (a FIFO, a device, a directory): never read."""


def content_token(data: bytes):
    """A version token derived from the content, for backends without object versions."""
    import hashlib
    return ("sha256", hashlib.sha256(data).hexdigest())


def scatter(data: memoryview, bufs: Sequence[memoryview]) -> None:
    """Copy ``data`` into ``bufs`` in order, filling each before the next, until ``data`` runs out."""
    pos = 0
    for b in bufs:
        if pos >= len(data):
            break
        n = min(len(b), len(data) - pos)
        b[:n] = data[pos: pos + n]
        pos += n


class BytesReads:
    """Reads into a caller's buffer made of :meth:`Storage.read_bytes` / :meth:`Storage.read_range_bytes`: for
    storages whose reads arrive as bytes anyway (object stores: the response body), and for
    :class:`~ckptstore.storage.retrying.RetryingStorage`, whose abandoned attempts must never write into a
    caller's buffer."""

    def read_into(self, path: str, out: memoryview) -> int:
        data = self.read_bytes(path)
        if len(data) > len(out):
            raise ValueError(f"{path}: {len(data)} bytes do not fit in a buffer of {len(out)}")
        out[: len(data)] = data
        return len(data)

    def read_range_into(self, path: str, offset: int, out: memoryview) -> int:
        return self.read_range_scatter(path, offset, [out])

    def read_range_scatter(self, path: str, offset: int, bufs: Sequence[memoryview]) -> int:
        total = sum(len(b) for b in bufs)
        if not total:
            return 0
        data = self.read_range_bytes(path, offset, total)
        scatter(memoryview(data), bufs)
        return len(data)


class Storage(ABC):
    """A flat namespace of files under one root. Implementations must be thread-safe."""

    #: human-readable location of the root (a path or a URL); never contains credentials.
    url: str
    #: ranged reads of one pack are merged across holes of at most this many bytes (reading a hole costs
    #: less than another request / system call up to about this size)
    coalesce_gap: int = 1 << 20

    @abstractmethod
    def read_bytes(self, path: str, limit: Optional[int] = None) -> bytes:
        """The whole file, or with ``limit`` at most its first ``limit`` bytes, in ONE request (a ranged GET on
        object stores: no size lookup first). A reader that knows how large a file may be (a manifest: its
        size in the commit marker) asks for one byte more and treats a full answer as "too large", so a
        hostile file can never make it read more. Raises ``FileNotFoundError`` when it does not exist."""

    def read_into(self, path: str, out: memoryview) -> int:
        """Read the file into ``out`` (a writable byte buffer); return the file's size in bytes.

        Raises ``FileNotFoundError``; a file larger than ``out`` raises ``ValueError`` (nothing is trusted to
        fit). Backends override this to avoid the intermediate copy.
        """
        return BytesReads.read_into(self, path, out)

    def read_range_into(self, path: str, offset: int, out: memoryview) -> int:
        """Read up to ``len(out)`` bytes of ``path`` starting at byte ``offset`` into ``out``; return how many
        were read (fewer at the end of the file). Raises ``FileNotFoundError``. Backends override this with a
        real ranged read (``pread``, HTTP ``Range``); this default reads the whole file."""
        data = self.read_bytes(path)[offset: offset + len(out)]
        out[: len(data)] = data
        return len(data)

    def read_range_bytes(self, path: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of ``path`` from byte ``offset`` (fewer at the end of the file), as new bytes:
        one ranged read. Raises ``FileNotFoundError``."""
        out = memoryview(bytearray(length))
        return bytes(out[: self.read_range_into(path, offset, out)])

    def read_range_scatter(self, path: str, offset: int, bufs: Sequence[memoryview]) -> int:
        """Read ``sum(len(b) for b in bufs)`` consecutive bytes of ``path`` from ``offset`` into ``bufs`` in
        order (a scatter read: the bytes land in their destinations, no staging buffer of the whole range);
        return how many were read (fewer at the end of the file). Raises ``FileNotFoundError``. This default
        reads the range into one buffer and copies it out; local files override it with ``preadv``."""
        total = sum(len(b) for b in bufs)
        tmp = memoryview(bytearray(total))
        got = self.read_range_into(path, offset, tmp)
        scatter(tmp[:got], bufs)
        return got

    @abstractmethod
    def size(self, path: str) -> Optional[int]:
        """Size in bytes, or ``None`` when the file does not exist."""

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    @abstractmethod
    def write_atomic(self, path: str, data: Buffer) -> None:
        """Create or replace ``path`` with ``data``, atomically and durably. ``data`` is not used after this
        returns (a caller may reuse its buffer: :meth:`BlobStore.put <ckptstore.format.blobs.BlobStore.put>`)."""

    @abstractmethod
    def write_new(self, path: str, data: Buffer) -> bool:
        """Create ``path`` with ``data`` if it does not exist; return False (writing nothing) if it does.
        Atomic; durable once :meth:`sync` returns (object stores: at once). ``data`` is not used after this
        returns (as :meth:`write_atomic`)."""

    @abstractmethod
    def listdir(self, path: str) -> List[str]:
        """Names (not paths) directly under directory/prefix ``path``; ``[]`` if there is none."""

    def listdir_after(self, path: str, after: str) -> List[str]:
        """The names :meth:`listdir` gives that sort after ``after`` (object stores ask the server for only
        those: one LIST request however many names sort before ``after``)."""
        return [n for n in self.listdir(path) if n > after]

    def list_sizes(self, path: str) -> Optional[dict]:
        """Every file directly under ``path`` with its size, ``{name: bytes}``, in as few requests as the storage
        allows (one LIST per 1,000 names on S3); ``None`` where the storage cannot tell sizes in a listing."""
        return None

    @abstractmethod
    def delete(self, path: str) -> None:
        """Remove one file; a missing file is not an error."""

    def discard(self, path: str) -> None:
        """Remove one file from its path now, as :meth:`delete` does; the space it held may be reclaimed later,
        off the caller's thread (:class:`~ckptstore.storage.local.LocalStorage`: a large file is renamed into
        ``trash/`` and unlinked in the background). A missing file is not an error."""
        self.delete(path)

    @abstractmethod
    def rmtree(self, path: str) -> None:
        """Remove a directory/prefix and everything under it; missing is not an error."""

    # -- compare-and-swap, for the forward-only latest pointer ---------------------------------------------
    #: whether write_if_match is a real conditional write (False: check-then-write, racy between writers)
    conditional_writes = False

    def read_versioned(self, path: str):
        """``(data or None, token)``: the file's bytes and an opaque version token for :meth:`write_if_match`
        (``None`` data and token when the file does not exist)."""
        try:
            data = self.read_bytes(path)
        except FileNotFoundError:
            return None, None
        return data, content_token(data)

    def write_if_match(self, path: str, data: Buffer, token) -> bool:
        """Write ``path`` only if it is still at version ``token`` (``None``: only if it does not exist).
        Returns False, writing nothing, when another writer got there first. This default re-reads and
        compares, then writes: correct for one writer, racy between several (see ``conditional_writes``)."""
        if token is None:
            return self.write_new(path, data)
        if self.read_versioned(path)[1] != token:
            return False
        self.write_atomic(path, data)
        return True

    def open_new(self, folder: str) -> "NewFile":
        """A file written piece by piece and named once whole (a pack is named by the hash of its bytes, known
        only after the last piece), its temp file (where there is one) in store folder ``folder`` (one garbage
        collection sweeps temp files from): :meth:`NewFile.write` the pieces, then :meth:`NewFile.link` (create-only,
        as :meth:`write_new`) or :meth:`NewFile.replace` (as :meth:`write_atomic`), and :meth:`NewFile.discard`
        in any case. Default: the pieces gathered in memory, then one :meth:`write_new` / :meth:`write_atomic`;
        a local disk streams them to a temp file instead (:class:`~ckptstore.storage.local.LocalStorage`)."""
        return NewFile(self, folder)

    # -- whole files ----------------------------------------------------------------------------------------
    def put_file(self, path: str, local_file: str) -> None:
        """Upload a local file to ``path`` (object stores: multipart, parallel, bounded memory)."""
        with open(local_file, "rb") as f:
            self.write_atomic(path, f.read())

    def local_path(self, path: str) -> Optional[str]:
        """The OS path of ``path`` when this storage is a local filesystem, else ``None``."""
        return None

    def adopt(self, path: str, size: Optional[int] = None) -> bool:
        """Whether the existing file ``path`` (of ``size`` bytes, when given) holds exactly what its writer wrote, so a writer may name it
        without hashing it: only a local file created during this boot can be told so (a power loss can leave a
        file of an earlier boot with any bytes). If so, the file is made durable by this storage's next
        :meth:`sync`. Default: ``False`` (hash it)."""
        return False

    def move(self, src: str, dst: str) -> None:
        """Move a file (used to quarantine corrupt blobs). Not atomic on object stores."""
        self.write_atomic(dst, self.read_bytes(src))
        self.delete(src)

    def mtime(self, path: str) -> Optional[float]:
        """Modification time (seconds since the epoch), or ``None`` if unknown / missing."""
        return None

    def is_link(self, path: str) -> bool:
        """Whether ``path`` is a symbolic link (gc never deletes through one); object stores have none."""
        return False

    def sync(self, dirs) -> None:
        """Make durable what :meth:`write_new` created, and the entries of ``dirs`` (local disk); no-op where
        every write is durable when it returns (object stores)."""

    def refresh(self) -> None:
        """Forget any cached listings / metadata (after an outage the backend may have changed)."""

    def close(self) -> None:
        pass


class NewFile:
    """What :meth:`Storage.open_new` returns: the pieces gathered in memory (a local disk's subclass streams them
    to a temp file). Not thread-safe: one writer."""

    def __init__(self, storage: Storage, folder: str = ""):
        self._storage = storage
        self._parts: Optional[list] = []
        self.size = 0                           # bytes written so far

    def write(self, data: Buffer) -> None:
        """Append ``data`` (copied: the caller may reuse it once this returns)."""
        self._parts.append(bytes(data))
        self.size += len(self._parts[-1])

    def link(self, path: str) -> bool:
        """Create ``path`` with the bytes written, if it does not exist (as :meth:`Storage.write_new`: durable
        once :meth:`Storage.sync` returns). False when it exists: nothing is replaced, and the bytes are kept
        for :meth:`replace` until :meth:`discard`."""
        return self._storage.write_new(path, b"".join(self._parts))

    def replace(self, path: str) -> None:
        """Create or replace ``path`` with the bytes written, atomically and durably (as
        :meth:`Storage.write_atomic`)."""
        self._storage.write_atomic(path, b"".join(self._parts))

    def discard(self) -> None:
        """Drop what is left (idempotent; after :meth:`link` or :meth:`replace` too)."""
        self._parts = None
