"""Local-disk storage: every write is temp file -> fsync -> rename/link -> fsync of the directory.

Large writes from page-aligned memory go through ``O_DIRECT`` (the page cache costs more than the device on
the machines we measured: buffered write+fsync ran at ~36% of the disk's O_DIRECT rate). The tail that is
not a multiple of the block size goes through a small aligned bounce buffer and the file is then truncated to
its exact length. Filesystems without ``O_DIRECT`` (tmpfs) fall back to buffered writes.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import shutil
import stat
import tempfile
import threading
import uuid
from typing import List, Optional

import numpy as np

from .base import Buffer, NewFile, NotRegularFileError, Storage

ALIGN = 4096
DIRECT_MIN_BYTES = 1 << 20          # below this, O_DIRECT's bookkeeping is not worth it
BOUNCE_BYTES = 16 << 20             # per-thread aligned buffer for O_DIRECT writes from unaligned memory
_MAX_WRITE = 1 << 30                # bytes per os.write call
_O_DIRECT = getattr(os, "O_DIRECT", 0)
#: files :meth:`LocalStorage.discard` renames into ``trash/`` and unlinks in the background (smaller: unlinked)
DISCARD_LATER_BYTES = 4 << 20
#: the folder of a local root that discarded files wait in until unlinked (FORMAT.md, "Layout")
TRASH = "trash"


try:
    _IOV_MAX = max(16, min(1024, os.sysconf("SC_IOV_MAX")))
except (ValueError, OSError, AttributeError):
    _IOV_MAX = 1024


def _load_syncfs():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.syncfs
        fn.argtypes = [ctypes.c_int]
        return fn
    except (OSError, AttributeError):
        return None


_SYNCFS = _load_syncfs()


def buffer_address(buf: memoryview) -> int:
    """Address of the first byte of a (possibly read-only) contiguous buffer."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0] if len(buf) else 0


class LocalStorage(Storage):
    """A directory on a local filesystem. ``direct_io``: use O_DIRECT for large aligned writes."""

    coalesce_gap = 64 << 10

    def __init__(self, root: str, *, direct_io: bool = True):
        self.root = os.path.abspath(os.fspath(root))
        self.url = self.root
        self._direct = bool(direct_io and _O_DIRECT)
        self._made_dirs = set()
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._unsynced = set()              # files created by write_new, not yet made durable by sync()
        self._trash_checked = False         # trash/ looked at by this instance (leftovers queued for unlinking)
        self._dirty_dirs = set()            # directories holding an entry of a directory we created, not yet
        #                                     fsynced (the new directory's name is lost at power loss until then)
        if not os.path.isdir(self.root):
            self._makedirs(self.root)
        self._flush_dirs()                  # the root's own entry is durable before anything is written in it
        #: whether ``syncfs(2)`` on this filesystem makes everything durable (see :func:`syncfs_trusted`)
        self.syncfs_trusted = _SYNCFS is not None and syncfs_trusted(self.root)

    # -- paths --------------------------------------------------------------------------------------------
    def _abs(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"refusing path outside the store root: {path!r}")
        return os.path.join(self.root, *path.split("/")) if path else self.root

    def _ensure_parent(self, full: str) -> str:
        parent = os.path.dirname(full)
        if parent not in self._made_dirs:
            self._makedirs(parent)
            with self._lock:
                self._made_dirs.add(parent)
        return parent

    def _makedirs(self, path: str) -> None:
        """``os.makedirs``, remembering the parent of every directory it creates: that parent's entry for it
        must be fsynced before any file below is relied on (power loss forgets an un-fsynced mkdir)."""
        missing = []
        p = path
        while not os.path.isdir(p):
            missing.append(p)
            up = os.path.dirname(p)
            if up == p:
                break
            p = up
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                if not os.path.isdir(d):
                    raise
                continue                  # made by a concurrent writer, which makes it durable itself
            with self._lock:
                self._dirty_dirs.add(os.path.dirname(d))

    def _flush_dirs(self) -> None:
        """fsync every directory that gained a subdirectory since the last flush (deepest first)."""
        with self._lock:
            dirs, self._dirty_dirs = self._dirty_dirs, set()
        for d in sorted(dirs, key=len, reverse=True):
            _fsync_dir(d)

    # -- reads --------------------------------------------------------------------------------------------
    # Only regular files are read: a FIFO, device or directory planted at a store path must neither hang a
    # reader (open(2) of a FIFO blocks without O_NONBLOCK) nor stream forever (/dev/zero).
    def _open_regular(self, path: str) -> int:
        full = self._abs(path)
        fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise NotRegularFileError(errno.EINVAL, "not a regular file", full)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def read_bytes(self, path: str, limit: Optional[int] = None) -> bytes:
        with os.fdopen(self._open_regular(path), "rb") as f:
            if limit is None:
                return f.read()
            # read(n) may allocate n bytes up front: never more than the file holds (a hostile limit)
            return f.read(max(0, min(limit, os.fstat(f.fileno()).st_size + 1)))

    def read_into(self, path: str, out: memoryview) -> int:
        with os.fdopen(self._open_regular(path), "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if size > len(out):
                raise ValueError(f"{path}: {size} bytes do not fit in a buffer of {len(out)}")
            got = 0
            while got < size:
                n = f.readinto(out[got:size])
                if not n:
                    break
                got += n
            return got

    def read_range_into(self, path: str, offset: int, out: memoryview) -> int:
        """``pread`` of ``len(out)`` bytes at ``offset`` (one system call for most ranges)."""
        return self.read_range_scatter(path, offset, [out])

    def read_range_scatter(self, path: str, offset: int, bufs) -> int:
        """``preadv`` straight into ``bufs`` (at most ``IOV_MAX`` buffers per call; short reads resumed)."""
        bufs = [b for b in bufs if len(b)]
        fd = self._open_regular(path)
        try:
            total, i, skip = 0, 0, 0           # bytes read; first buffer not yet full, and how much of it is
            while i < len(bufs):
                iov = [bufs[i][skip:]] + bufs[i + 1: i + _IOV_MAX]
                k = os.preadv(fd, iov, offset + total)
                if k <= 0:
                    break
                total += k
                while k > 0:
                    room = len(bufs[i]) - skip
                    if k < room:
                        skip += k
                        break
                    k -= room
                    i, skip = i + 1, 0
            return total
        finally:
            os.close(fd)

    def size(self, path: str) -> Optional[int]:
        """Size of a regular file; ``None`` when missing or not a regular file (nothing a reader may open)."""
        try:
            st = os.stat(self._abs(path))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def mtime(self, path: str) -> Optional[float]:
        try:
            return os.stat(self._abs(path)).st_mtime
        except FileNotFoundError:
            return None

    def is_link(self, path: str) -> bool:
        return os.path.islink(self._abs(path))

    def listdir(self, path: str) -> List[str]:
        try:
            return sorted(os.listdir(self._abs(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    # -- writes -------------------------------------------------------------------------------------------
    def _write_temp(self, full: str, data: Buffer, fsync: bool = True) -> str:
        """Write ``data`` to a fresh temp file beside ``full`` (fsync it unless told not to), return its path."""
        self._ensure_parent(full)
        tmp = f"{full}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        mv = memoryview(data).cast("B")
        n = len(mv)
        try:
            if self._direct and n >= DIRECT_MIN_BYTES:
                try:
                    if buffer_address(mv) % ALIGN == 0:
                        self._write_direct(tmp, mv, fsync)
                    else:
                        self._write_direct_bounced(tmp, mv, fsync)
                    return tmp
                except OSError as e:
                    if e.errno != errno.EINVAL:     # filesystem without O_DIRECT: fall back below
                        raise
                    self._direct = False
                    _unlink_quiet(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_loop(fd, mv)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return tmp
        except BaseException:
            _unlink_quiet(tmp)
            raise

    def _bounce(self, size: int) -> mmap.mmap:
        """This thread's page-aligned bounce buffer (allocated once per thread, at most BOUNCE_BYTES)."""
        buf = getattr(self._tls, "bounce", None)
        if buf is None or len(buf) < size:
            if buf is not None:
                buf.close()
            buf = self._tls.bounce = mmap.mmap(-1, size)
        return buf

    def _write_direct_bounced(self, tmp: str, mv: memoryview, fsync: bool = True) -> None:
        """O_DIRECT from unaligned memory: copy through an aligned buffer piece by piece (the copy runs at
        memory speed, ~10x the disk's; buffered writes + fsync reached ~40% of the disk's rate here)."""
        n = len(mv)
        piece = min(BOUNCE_BYTES, -(-n // ALIGN) * ALIGN)
        bounce = self._bounce(piece)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
        try:
            bmv = memoryview(bounce)
            off = 0
            while off < n:
                k = min(piece, n - off)
                bmv[:k] = mv[off: off + k]
                padded = -(-k // ALIGN) * ALIGN
                if padded > k:
                    bmv[k:padded] = bytes(padded - k)
                _write_loop(fd, bmv[:padded])
                off += k
            if n % ALIGN:
                os.ftruncate(fd, n)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _write_direct(tmp: str, mv: memoryview, fsync: bool = True) -> None:
        n = len(mv)
        body = n - n % ALIGN
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
        try:
            _write_loop(fd, mv[:body])
            if body < n:
                bounce = mmap.mmap(-1, ALIGN)        # page-aligned, zero-filled
                try:
                    bounce[: n - body] = mv[body:]
                    _write_loop(fd, memoryview(bounce))
                finally:
                    bounce.close()
                os.ftruncate(fd, n)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_atomic(self, path: str, data: Buffer) -> None:
        full = self._abs(path)
        tmp = self._write_temp(full, data)
        try:
            self._install_temp(tmp, full)
        except BaseException:
            _unlink_quiet(tmp)
            raise

    def _install_temp(self, tmp: str, full: str) -> None:
        """Rename the fsynced temp file ``tmp`` over ``full``, then fsync its directory and every directory on its
        path this storage created (:meth:`write_atomic`, :meth:`LocalNewFile.replace`)."""
        os.replace(tmp, full)
        _fsync_dir(os.path.dirname(full))
        self._flush_dirs()

    def _link_temp(self, tmp: str, full: str) -> bool:
        """``link(2)`` the finished temp file ``tmp`` at ``full``, create-only; False when ``full`` exists. The
        caller unlinks ``tmp``; the new name is made durable by :meth:`sync` (:meth:`write_new`,
        :meth:`LocalNewFile.link`)."""
        try:
            os.link(tmp, full)
        except FileExistsError:
            return False
        with self._lock:
            self._unsynced.add(full)
        return True

    def write_new(self, path: str, data: Buffer) -> bool:
        """Create-only, via ``link(2)`` of a finished temp file: never exposes a partial file, never replaces.

        Durability is batched: the file's bytes and its directory entry are made durable by :meth:`sync`, which
        the caller runs before anything names the file (one ``syncfs(2)`` costs one journal commit where a
        fsync per file costs one each: 1.18 s -> 0.93 s for a 1 GB state of 404 tensors here).
        """
        full = self._abs(path)
        if os.path.exists(full):
            return False
        tmp = self._write_temp(full, data, fsync=False)
        try:
            return self._link_temp(tmp, full)
        finally:
            _unlink_quiet(tmp)

    def open_new(self, folder: str) -> "LocalNewFile":
        """See :meth:`Storage.open_new`: the pieces streamed to a temp file in ``folder`` (garbage collection
        removes it if this process dies before it is named), through O_DIRECT where large writes use it, then
        linked under its name (create-only) or renamed over it."""
        return LocalNewFile(self, folder)

    conditional_writes = True

    def adopt(self, path: str, size: Optional[int] = None) -> bool:
        """See :meth:`Storage.adopt`: a regular file of the expected size whose ctime is at least ``BOOT_MARGIN`` seconds after
        this boot began was created in this boot by ``write_new`` (temp file written whole, then linked), so its
        bytes are the writer's; it joins the files the next :meth:`sync` makes durable."""
        full = self._abs(path)
        try:
            st = os.stat(full)
        except OSError:
            return False
        if (not stat.S_ISREG(st.st_mode) or (size is not None and st.st_size != size) or _BOOT_TIME is None
                or st.st_ctime < _BOOT_TIME + BOOT_MARGIN):
            return False
        with self._lock:
            self._unsynced.add(full)
        return True

    def local_path(self, path: str) -> Optional[str]:
        return self._abs(path)

    def read_versioned(self, path: str):
        try:
            with os.fdopen(self._open_regular(path), "rb") as f:
                st = os.fstat(f.fileno())
                return f.read(), (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            return None, None

    def write_if_match(self, path: str, data: Buffer, token) -> bool:
        """Compare-and-swap under an exclusive ``flock`` on ``<root>/.lock`` (all writers of this root on this
        host take it); the swap itself is write-temp, fsync, rename."""
        lock_fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            try:
                st = os.stat(self._abs(path))
                current = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                current = None
            if current != token:
                return False
            self.write_atomic(path, data)
            return True
        finally:
            os.close(lock_fd)                     # releases the lock

    def sync(self, dirs) -> None:
        """Make durable every file :meth:`write_new` created so far, the entries of ``dirs``, of every
        directory holding such a file, and of every directory this storage created: one ``syncfs(2)`` where the
        filesystem honours it (:func:`syncfs_trusted`), else a fsync of each file, then of each directory.
        Raises ``OSError`` when a fsync fails (the caller must not name the files then)."""
        with self._lock:
            files, self._unsynced = self._unsynced, set()
        if (files or self._dirty_dirs) and self.syncfs_trusted:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if _SYNCFS(fd) == 0:
                    with self._lock:
                        self._dirty_dirs.clear()      # syncfs wrote back every inode and entry of the fs
                    return
            finally:
                os.close(fd)
        for f in sorted(files):
            try:
                fd = os.open(f, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        parents = {os.path.dirname(f) for f in files} | {self._abs(d) for d in dirs}
        for d in sorted(parents, key=len, reverse=True):
            _fsync_dir(d)
        self._flush_dirs()

    def delete(self, path: str) -> None:
        _unlink_quiet(self._abs(path))

    def discard(self, path: str) -> None:
        """Remove ``path`` from its name at once; a file of :data:`DISCARD_LATER_BYTES` or more is renamed into
        :data:`TRASH` (same filesystem: one ``rename``) and unlinked by a background thread, since unlinking a
        large file frees its page-cache pages and extents in the caller's time (~55 ms per 60 MiB file measured
        on ext4, the whole of a retention step after a 0.55 GB save). Who may delete, and when, is unchanged:
        the name goes at the same moment an unlink would have removed it, and nothing ever reads ``trash/``.
        What a killed process left there is unlinked by the next process that discards into this root."""
        full = self._abs(path)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode) or st.st_size < DISCARD_LATER_BYTES:
            _unlink_quiet(full)
            return
        trash = os.path.join(self.root, TRASH)
        if not self._trash_checked:
            self._trash_checked = True
            os.makedirs(trash, exist_ok=True)
            leftovers = [os.path.join(trash, n) for n in os.listdir(trash)]
            _UNLINKER.add(leftovers)
        target = os.path.join(trash, uuid.uuid4().hex)
        try:
            os.rename(full, target)
        except FileNotFoundError:
            return
        except OSError:                     # another filesystem (a mount below the root): unlink here
            _unlink_quiet(full)
            return
        _UNLINKER.add([target])

    def rmtree(self, path: str) -> None:
        full = self._abs(path)
        self._forget_dirs(full)
        shutil.rmtree(full, ignore_errors=True)
        self._forget_dirs(full)       # and any a concurrent writer of this process remembered meanwhile

    def _forget_dirs(self, full: str) -> None:
        """Directories this storage made at or below ``full`` are gone (``rmtree``): make them again when
        needed (a step deleted and then saved again in one process wrote into a vanished directory)."""
        with self._lock:
            self._made_dirs = {d for d in self._made_dirs if d != full and not d.startswith(full + os.sep)}

    def move(self, src: str, dst: str) -> None:
        full_dst = self._abs(dst)
        self._ensure_parent(full_dst)
        os.replace(self._abs(src), full_dst)

    def __repr__(self) -> str:
        return f"LocalStorage({self.root!r})"


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


_BOOT_TIME = _boot_time()
BOOT_MARGIN = 120.0     # seconds: a clock stepped at boot (RTC off, then NTP) must not date an old file "new"


# Filesystems whose syncfs(2) writes back every inode and directory entry to stable storage. Linux returns 0
# from syncfs on FUSE mounts without telling the filesystem (only virtiofs gets FUSE_SYNCFS), and network or
# cluster filesystems differ in what it reaches: on any type not listed, files and directories are fsynced one
# by one (issue 17, D3).
SYNCFS_TRUSTED = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "jfs", "reiserfs", "nilfs2", "zfs",
                            "bcachefs", "overlay", "tmpfs", "ramfs", "virtiofs"})


def filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem ``path`` is on, from ``/proc/self/mountinfo`` (the mount point that is the
    longest prefix of its real path), or ``None`` when it cannot be told."""
    real = os.path.realpath(path)
    best, fstype = -1, None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, sep, right = line.partition(" - ")
                fields = left.split()
                if not sep or len(fields) < 5 or not right.split():
                    continue
                mnt = fields[4].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best:
                    best, fstype = len(mnt), right.split()[0]
    except OSError:
        return None
    return fstype


def syncfs_trusted(path: str) -> bool:
    """Whether one ``syncfs(2)`` makes the files and directories under ``path`` durable (its filesystem type is
    in :data:`SYNCFS_TRUSTED`). ``CKPTSTORE_SYNCFS=0`` forces per-file fsyncs anywhere."""
    if os.environ.get("CKPTSTORE_SYNCFS", "") == "0":
        return False
    return filesystem_type(path) in SYNCFS_TRUSTED


@contextlib.contextmanager
def atomic_file(path, *, prefix: Optional[str] = None, suffix: str = ""):
    """Replace the file ``path`` atomically: yields the path of a new temporary file in ``path``'s directory
    (``tempfile.mkstemp`` with ``prefix`` and ``suffix``, mode 0o644; the directory is created if missing) for
    the block to write. When the block returns, the temporary file is fsynced and renamed over ``path``, then
    the directory is fsynced (best effort: a filesystem that refuses it is not an error); when the block raises,
    the temporary file is removed and the exception propagates. ``path`` is never seen partly written. Used by
    :func:`ckptstore.io.export.export` and the Lightning stubs (public: ``ckptstore.atomic_file``)."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path) + ".tmp-" if prefix is None else prefix,
                               suffix=suffix)
    try:
        try:
            os.fchmod(fd, 0o644)
        finally:
            os.close(fd)
        yield tmp
        fd = os.open(tmp, os.O_RDWR)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        _unlink_quiet(tmp)
        raise
    try:
        _fsync_dir(d)
    except OSError:
        pass


class LocalNewFile(NewFile):
    """:meth:`LocalStorage.open_new`'s file: pieces gathered in this thread's page-aligned bounce buffer (taken
    until :meth:`discard`, then given back) and
    written in pieces of up to :data:`BOUNCE_BYTES` (O_DIRECT where the storage uses it: the disk writes while
    the caller goes on producing the next pieces), to ``<folder>/new.tmp-<pid>-<random>``, then linked
    (create-only, as :meth:`LocalStorage.write_new`: the name durable after :meth:`LocalStorage.sync`) or renamed
    (as :meth:`LocalStorage.write_atomic`)."""

    def __init__(self, storage: "LocalStorage", folder: str):
        super().__init__(storage, folder)
        self._parts = None
        full = storage._abs(f"{folder}/new.tmp-{os.getpid()}-{uuid.uuid4().hex[:10]}")
        storage._ensure_parent(full)
        self.tmp: Optional[str] = full
        self._direct = storage._direct
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            self._fd: Optional[int] = os.open(full, flags | (_O_DIRECT if self._direct else 0), 0o644)
        except OSError as e:
            if not self._direct or e.errno != errno.EINVAL:
                raise
            storage._direct = self._direct = False    # a filesystem without O_DIRECT (tmpfs)
            self._fd = os.open(full, flags, 0o644)
        self._bounce = storage._bounce(BOUNCE_BYTES)
        storage._tls.bounce = None          # taken: a write of this thread meanwhile gets a bounce buffer of its own
        self._buf = memoryview(self._bounce)
        self._fill = 0

    def write(self, data: Buffer) -> None:
        mv = memoryview(data).cast("B")
        off, n = 0, len(mv)
        while off < n:
            k = min(n - off, len(self._buf) - self._fill)
            self._buf[self._fill: self._fill + k] = mv[off: off + k]
            self._fill += k
            off += k
            if self._fill == len(self._buf):
                self._flush()
        self.size += n

    def _flush(self) -> None:
        """Write the bounce buffer out (a whole number of pages while more may follow)."""
        if self._fill:
            _write_loop(self._fd, self._buf[: self._fill])
            self._fill = 0

    def _finish(self) -> str:
        """Write what is left (O_DIRECT: padded to a page, then the file cut to its size), close; the temp path."""
        if self._fd is None:
            raise ValueError("this new file was discarded")
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN if self._direct else self._fill
                if padded > self._fill:
                    self._buf[self._fill: padded] = bytes(padded - self._fill)
                _write_loop(self._fd, self._buf[:padded])
                if padded > self._fill:
                    os.ftruncate(self._fd, self.size)
                self._fill = 0
        finally:
            fd, self._fd = self._fd, None
            os.close(fd)
        return self.tmp

    def link(self, path: str) -> bool:
        storage = self._storage
        full = storage._abs(path)
        tmp = self._finish() if self._fd is not None else self.tmp
        storage._ensure_parent(full)
        if not storage._link_temp(tmp, full):
            return False                            # the temp file stays, for replace()
        _unlink_quiet(tmp)
        self.tmp = None
        return True

    def replace(self, path: str) -> None:
        storage = self._storage
        full = storage._abs(path)
        tmp = self._finish() if self._fd is not None else self.tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        storage._ensure_parent(full)
        storage._install_temp(tmp, full)
        self.tmp = None

    def discard(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)
        if self.tmp is not None:
            _unlink_quiet(self.tmp)
            self.tmp = None
        if self._buf is not None:
            self._buf.release()
            self._buf = None
            tls = self._storage._tls                # the bounce buffer back to this thread, unless it has another
            if getattr(tls, "bounce", None) is None:
                tls.bounce = self._bounce
            else:
                self._bounce.close()
            self._bounce = None


def _write_loop(fd: int, mv: memoryview) -> None:
    off, n = 0, len(mv)
    while off < n:
        w = os.write(fd, mv[off: off + min(n - off, _MAX_WRITE)])
        if w <= 0:
            raise OSError(errno.EIO, "short write")
        off += w


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _Unlinker:
    """Unlinks discarded files on a thread of its own, started when there is work and ended when there is none
    (not a daemon: a process that exits waits for the unlinks it queued, so the space is back when it ends; a
    killed process leaves them in ``trash/`` for the next one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: List[str] = []
        self._running = False

    def add(self, paths: List[str]) -> None:
        if not paths:
            return
        with self._lock:
            self._queue.extend(paths)
            if self._running:
                return
            self._running = True
        threading.Thread(target=self._run, name="ckptstore-unlink").start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                path = self._queue.pop(0)
            try:
                os.unlink(path)
            except OSError:
                pass                        # gone already, or unremovable: the next process retries


_UNLINKER = _Unlinker()
