"""A lazy FUSE filesystem for power-loss tests (in the spirit of LazyFS): what is not made durable is lost.

Strict POSIX model, all in memory:
* every write, create, truncate, mkdir, rename, link, unlink and rmdir changes only the *volatile* state;
* ``fsync(file)`` makes that file's current bytes durable (not its name: that is its directory's entry);
* ``fsync(dir)`` makes that directory's current entries durable (the names, pointing at inodes);
* ``syncfs(2)`` never reaches a FUSE filesystem (Linux returns 0 without telling it): it makes nothing durable.

A *crash* keeps only the durable state: the tree is rebuilt from the root's durable entries, each file with the
bytes of its last fsync (empty if never fsynced), each directory with the entries of its last fsync (none if
never). ``--crash-at K`` crashes just before the K-th state-changing operation: the durable state is written to
``--state-out`` and every later operation fails with EIO (the machine is off). ``--state-in`` mounts such a
state (the reboot). ``--count-out`` writes how many state-changing operations ran, at unmount.

    python tests/lazyfs.py MOUNTPOINT [--crash-at K --state-out FILE] [--state-in FILE] [--count-out FILE]

The state files are this tool's own (pickled dicts of bytes); the store under test never sees them.
"""
from __future__ import annotations

import argparse
import errno
import os
import pickle
import stat
import sys
import threading
import time

import mfusepy as fuse


class Node:
    __slots__ = ("ino", "is_dir", "data", "entries", "mode", "nlink", "mtime", "ctime")

    def __init__(self, ino: int, is_dir: bool, mode: int):
        self.ino, self.is_dir, self.mode = ino, is_dir, mode
        self.data = bytearray()
        self.entries = {}                       # name -> Node (directories)
        self.nlink = 2 if is_dir else 1
        self.mtime = self.ctime = time.time()


MUTATING = ("create", "mkdir", "write", "truncate", "unlink", "rmdir", "rename", "link", "fsync", "fsyncdir")


class LazyFS(fuse.Operations):
    use_ns = True

    def __init__(self, crash_at=None, state_out=None, state_in=None, count_out=None):
        self.mu = threading.Lock()
        self.next_ino = 2
        # ino -> ("dir", {name: (ino, is_dir, mode)}, mode) | ("file", bytes, mode)
        self.durable = {1: ("dir", {}, 0o755)}
        self.root = Node(1, True, 0o755)
        self.ops = 0
        self.crash_at, self.state_out, self.count_out = crash_at, state_out, count_out
        self.dead = False
        self.handles = {}                       # fh (= inode number) -> Node, for open files
        if state_in:
            with open(state_in, "rb") as f:
                saved = pickle.load(f)
            self.durable, self.next_ino = saved["durable"], saved["next_ino"]
            self._reboot()

    # -- the model ---------------------------------------------------------------------------------------
    def _reboot(self) -> None:
        built = {}

        def build(ino, is_dir, mode):
            if ino in built:
                return built[ino]
            # an inode whose own contents were never made durable: an empty directory / an empty file
            kind, content, _ = self.durable.get(ino, ("dir" if is_dir else "file", {} if is_dir else b"", mode))
            node = built[ino] = Node(ino, is_dir, mode)
            if is_dir:
                for name, (child, child_dir, child_mode) in content.items():
                    node.entries[name] = build(child, child_dir, child_mode)
            else:
                node.data = bytearray(content)
            return node
        self.root = build(1, True, 0o755)
        for node in built.values():
            node.nlink = 2 if node.is_dir else 0
        for node in built.values():
            for child in node.entries.values():
                if not child.is_dir:
                    child.nlink += 1

    def _crash(self) -> None:
        self.dead = True
        if self.state_out:
            with open(self.state_out + ".tmp", "wb") as f:
                pickle.dump({"durable": self.durable, "next_ino": self.next_ino}, f)
            os.replace(self.state_out + ".tmp", self.state_out)

    def _tick(self, op: str) -> None:
        if self.dead:
            raise fuse.FuseOSError(errno.EIO)
        if op in MUTATING:
            self.ops += 1
            if self.crash_at is not None and self.ops >= self.crash_at:
                self._crash()
                raise fuse.FuseOSError(errno.EIO)

    def _lookup(self, path: str) -> Node:
        node = self.root
        for part in [p for p in path.split("/") if p]:
            if not node.is_dir or part not in node.entries:
                raise fuse.FuseOSError(errno.ENOENT)
            node = node.entries[part]
        return node

    def _parent(self, path: str):
        head, name = os.path.split(path.rstrip("/"))
        parent = self._lookup(head or "/")
        if not parent.is_dir:
            raise fuse.FuseOSError(errno.ENOTDIR)
        return parent, name

    def _new(self, is_dir: bool, mode: int) -> Node:
        node = Node(self.next_ino, is_dir, mode)
        self.next_ino += 1
        return node

    # -- operations ----------------------------------------------------------------------------------------
    def getattr(self, path, fh=None):
        with self.mu:
            self._tick("getattr")
            node = self._lookup(path)
            kind = stat.S_IFDIR if node.is_dir else stat.S_IFREG
            ns = int(node.mtime * 1e9)
            return {"st_mode": kind | node.mode, "st_nlink": node.nlink, "st_size": len(node.data),
                    "st_mtime": ns, "st_ctime": int(node.ctime * 1e9), "st_atime": ns, "st_ino": node.ino,
                    "st_uid": os.getuid(), "st_gid": os.getgid(), "st_blocks": (len(node.data) + 511) // 512}

    def readdir(self, path, fh):
        with self.mu:
            self._tick("readdir")
            node = self._lookup(path)
            return [".", ".."] + list(node.entries)

    def statfs(self, path):
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1 << 24, "f_bfree": 1 << 23,
                "f_bavail": 1 << 23, "f_files": 1 << 20, "f_ffree": 1 << 19, "f_namemax": 255}

    def access(self, path, amode):
        with self.mu:
            self._tick("access")
            self._lookup(path)
            return 0

    def mkdir(self, path, mode):
        with self.mu:
            self._tick("mkdir")
            parent, name = self._parent(path)
            if name in parent.entries:
                raise fuse.FuseOSError(errno.EEXIST)
            parent.entries[name] = self._new(True, mode & 0o7777)
            parent.nlink += 1
            return 0

    def rmdir(self, path):
        with self.mu:
            self._tick("rmdir")
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise fuse.FuseOSError(errno.ENOENT)
            if node.entries:
                raise fuse.FuseOSError(errno.ENOTEMPTY)
            del parent.entries[name]
            return 0

    def create(self, path, mode, fi=None):
        with self.mu:
            self._tick("create")
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                node = parent.entries[name] = self._new(False, mode & 0o7777)
            self.handles[node.ino] = node
            return node.ino

    def open(self, path, flags):
        with self.mu:
            self._tick("open")
            node = self._lookup(path)
            if flags & os.O_TRUNC:
                self._tick("truncate")
                node.data = bytearray()
            self.handles[node.ino] = node
            return node.ino

    def read(self, path, size, offset, fh):
        with self.mu:
            self._tick("read")
            node = self._fh_node(path, fh)
            return bytes(node.data[offset: offset + size])

    def write(self, path, data, offset, fh):
        with self.mu:
            self._tick("write")
            node = self._fh_node(path, fh)
            end = offset + len(data)
            if len(node.data) < end:
                node.data.extend(b"\0" * (end - len(node.data)))
            node.data[offset:end] = data
            node.mtime = node.ctime = time.time()
            return len(data)

    def _fh_node(self, path, fh) -> Node:
        """The file an open handle names (it follows renames), else the one at ``path``."""
        node = self.handles.get(fh) if fh else None
        return node if node is not None else self._lookup(path)

    def truncate(self, path, length, fh=None):
        with self.mu:
            self._tick("truncate")
            node = self._fh_node(path, fh) if fh else self._lookup(path)
            if len(node.data) > length:
                del node.data[length:]
            else:
                node.data.extend(b"\0" * (length - len(node.data)))
            return 0

    def unlink(self, path):
        with self.mu:
            self._tick("unlink")
            parent, name = self._parent(path)
            node = parent.entries.pop(name, None)
            if node is None:
                raise fuse.FuseOSError(errno.ENOENT)
            node.nlink -= 1
            return 0

    def rename(self, old, new):
        with self.mu:
            self._tick("rename")
            op, oname = self._parent(old)
            np_, nname = self._parent(new)
            node = op.entries.get(oname)
            if node is None:
                raise fuse.FuseOSError(errno.ENOENT)
            target = np_.entries.get(nname)
            if target is not None and target.is_dir and target.entries:
                raise fuse.FuseOSError(errno.ENOTEMPTY)
            del op.entries[oname]
            np_.entries[nname] = node
            return 0

    def link(self, target, source):
        with self.mu:
            self._tick("link")
            node = self._lookup(source)
            parent, name = self._parent(target)
            if name in parent.entries:
                raise fuse.FuseOSError(errno.EEXIST)
            parent.entries[name] = node
            node.nlink += 1
            return 0

    def fsync(self, path, datasync, fh):
        with self.mu:
            self._tick("fsync")
            node = self._fh_node(path, fh)
            self.durable[node.ino] = ("file", bytes(node.data), node.mode)
            return 0

    def fsyncdir(self, path, datasync, fh):
        with self.mu:
            self._tick("fsyncdir")
            node = self._lookup(path)
            self.durable[node.ino] = ("dir", {n: (c.ino, c.is_dir, c.mode) for n, c in node.entries.items()},
                                      node.mode)
            return 0

    def flush(self, path, fh):
        return 0

    def release(self, path, fh):
        return 0

    def chmod(self, path, mode):
        with self.mu:
            self._tick("chmod")
            self._lookup(path).mode = mode & 0o7777
            return 0

    def utimens(self, path, times=None):
        with self.mu:
            self._tick("utimens")
            node = self._lookup(path)
            node.mtime = (times[1] / 1e9) if times else time.time()
            return 0

    def destroy(self, path):
        if self.count_out:
            with open(self.count_out, "w") as f:
                f.write(str(self.ops))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mountpoint")
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--state-out")
    ap.add_argument("--state-in")
    ap.add_argument("--count-out")
    a = ap.parse_args(argv)
    ops = LazyFS(a.crash_at, a.state_out, a.state_in, a.count_out)
    # no kernel caching of data, attributes or names: every read sees this process's current state
    fuse.FUSE(ops, a.mountpoint, foreground=True, nothreads=True, direct_io=True, entry_timeout=0,
              attr_timeout=0, negative_timeout=0, fsname="lazyfs", subtype="lazyfs")


if __name__ == "__main__":
    sys.exit(main())
