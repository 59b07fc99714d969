"""Step metadata on a storage: which steps exist, their manifests and commit markers.

The commit protocol, as seen from here: manifests are written first (one per rank), the commit marker last.
A step is *committed* iff its commit marker exists; only committed steps are listed by
:meth:`Catalog.committed_steps`. Deleting a step removes its commit marker first, so a crash halfway through a
deletion leaves an uncommitted (invisible) directory, never a committed step with missing parts.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

from .blobs import digest_bytes, read_verified
from ..util.errors import CheckpointError, CorruptCheckpointError, DamagedRead, IncompatibleCheckpointError
from ..state.flatten import gc_paused
from .layout import STEPS, commit_path, manifest_path, parse_step_dir, shards_path, step_dir
from .manifest import (MAX_COMMIT_BYTES, Commit, Manifest, decode_commit, decode_manifest, encode_commit_files,
                       encode_manifest)
from . import mtable
from .shardmap import MAX_SHARD_MAP_BYTES, ShardMap

log = logging.getLogger("ckptstore")


class ManifestCache:
    """Decoded manifests by ``(digest, size, step, rank)``, shared by the catalogs of one ``Store`` (its local
    root, its remote, a pull between them). A hit is exactly what decoding would give, since the digest is
    checked on the bytes just read: a pull decodes a remote step's manifests and the restore that follows
    reads the same bytes from the local root (decoding was a third of a small state's remote resume, measured
    with benchmarks/bench_packs.py). Holds ``entries`` manifests of at most ``max_bytes`` encoded bytes each;
    cached manifests are read-only. Thread-safe."""

    def __init__(self, entries: int = 8, max_bytes: int = 16 << 20):
        self.entries, self.max_bytes = entries, max_bytes
        self._items: "OrderedDict[tuple, Manifest]" = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Optional[Manifest]:
        with self._lock:
            m = self._items.get(key)
            if m is not None:
                self._items.move_to_end(key)
            return m

    def put(self, key: tuple, size: int, manifest: Manifest) -> None:
        if size > self.max_bytes:
            return
        with self._lock:
            self._items[key] = manifest
            while len(self._items) > self.entries:
                self._items.popitem(last=False)


class Catalog:
    def __init__(self, storage, decoded: Optional[ManifestCache] = None):
        self.storage = storage
        self.decoded = decoded

    # -- listing ------------------------------------------------------------------------------------------
    def step_dirs(self) -> List[int]:
        """Every step directory, committed or not, ascending."""
        return sorted(s for s in (parse_step_dir(n) for n in self.storage.listdir(STEPS)) if s is not None)

    def is_committed(self, step: int) -> bool:
        return self.storage.exists(commit_path(step))

    def committed_steps(self) -> List[int]:
        """Steps that have a commit marker, ascending (their contents are not verified here)."""
        return [s for s in self.step_dirs() if self.is_committed(s)]

    def newest_committed(self, seen: Optional[List[int]] = None) -> Tuple[List[int], bool]:
        """``(committed steps newest first, complete)`` found at a cost that grows with neither the number of
        steps nor of ranks (issue 19): when the latest pointer names a committed step ``p`` (one GET, one HEAD),
        the committed step directories newer than ``p`` (one LIST from ``p`` on, :meth:`Storage.listdir_after`,
        one HEAD each: none unless a writer died between a commit marker and its pointer move) and ``p``, with
        ``complete=False`` (older steps were not listed). Without a usable pointer: every committed step, from
        one listing of the step directories and a HEAD of each marker newest first until one is found
        (``complete=False`` too: older steps are not checked; :meth:`committed_steps` does that). ``seen``: a
        list that gets every step directory listed on the way (committed or not)."""
        from .pointers import read_latest
        pointed = read_latest(self.storage)
        if pointed is not None and self.is_committed(pointed):
            dirs = [s for s in (parse_step_dir(n) for n in self.storage.listdir_after(STEPS, f"{pointed:012d}"))
                    if s is not None and s > pointed]
            if seen is not None:
                seen.extend(dirs + [pointed])
            return [s for s in sorted(dirs, reverse=True) if self.is_committed(s)] + [pointed], False
        dirs = self.step_dirs()
        if seen is not None:
            seen.extend(dirs)
        for s in reversed(dirs):
            if self.is_committed(s):
                return [s], False
        return [], True

    # -- reading ------------------------------------------------------------------------------------------
    def read_commit(self, step: int) -> Commit:
        """Raises ``CorruptCheckpointError`` when the marker is missing, truncated or invalid."""
        return self.read_commit_bytes(step)[1]

    def read_commit_bytes(self, step: int) -> Tuple[bytes, Commit]:
        """The commit marker's bytes (to copy them verbatim) and its decoded, validated contents. Bytes that do
        not decode are judged by :func:`~ckptstore.format.blobs.read_verified` (from an object store: read again;
        :class:`~ckptstore.util.errors.TransferError` when they differ each time until the retry deadline)."""
        path = commit_path(step)

        def once() -> Tuple[bytes, Commit]:
            try:
                data = self.storage.read_bytes(path, limit=MAX_COMMIT_BYTES + 1)    # one request, bounded
            except FileNotFoundError:
                raise CorruptCheckpointError("commit marker missing", step=step, blob=path) from None
            except OSError as e:                      # e.g. not a regular file, EIO
                raise CorruptCheckpointError(f"commit marker unreadable ({e.strerror or e})", step=step,
                                             blob=path) from None
            got = (len(data), digest_bytes(data))
            if len(data) > MAX_COMMIT_BYTES:
                raise DamagedRead(f"commit marker larger than {MAX_COMMIT_BYTES} bytes", got=got, step=step,
                                  blob=path)
            try:
                commit = decode_commit(data, step=step, what=path)
                if isinstance(commit.manifests, mtable.ManifestTable):
                    commit.manifests.bind(self.storage)        # rows read by range, page by page, when asked
                return data, commit
            except IncompatibleCheckpointError as e:  # a newer format, or a flipped byte in the format field
                raise DamagedRead(str(e), got=got, step=step, blob=path, final=e) from None
            except CorruptCheckpointError as e:
                raise DamagedRead(e.reason, got=got, step=step, blob=path) from None
        return read_verified(self.storage, path, once)

    def read_manifest(self, commit: Commit, rank: int) -> Manifest:
        """Read one rank's manifest and check it against the digest its commit marker recorded."""
        return self.read_manifest_bytes(commit, rank)[1]

    def read_manifest_bytes(self, commit: Commit, rank: int) -> Tuple[bytes, Manifest]:
        """The manifest's bytes (to copy them verbatim) and its decoded contents, checked against the digest
        and size its commit marker recorded. Raises ``CorruptCheckpointError``."""
        if rank not in commit.manifests:
            raise CorruptCheckpointError(f"commit marker names no manifest for rank {rank}", step=commit.step,
                                         blob=manifest_path(commit.step, rank))
        want_digest, want_size, gen = commit.manifests[rank]
        path = manifest_path(commit.step, rank, gen)
        # one request, bounded: never read more than the commit recorded (+1 byte to see "too long")
        data = self._read_named(path, "manifest", want_digest, want_size, want_size + 1, commit.step)
        key = (want_digest, want_size, commit.step, rank)
        cached = self.decoded.get(key) if self.decoded is not None else None
        if cached is not None:
            return data, cached
        with gc_paused():                        # ~100k small objects for a manifest of 4000 tensors
            manifest = decode_manifest(data, step=commit.step, rank=rank, what=path)
        if self.decoded is not None:
            self.decoded.put(key, want_size, manifest)
        return data, manifest

    def read_shard_map_bytes(self, commit: Commit) -> bytes:
        """The shard map the commit marker names (``commit.shards`` must be set), checked against its digest
        and size: one bounded read. Raises ``CorruptCheckpointError``."""
        want_digest, want_size, gen = commit.shards
        return self._read_named(shards_path(commit.step, gen), "shard map", want_digest, want_size,
                                min(want_size, MAX_SHARD_MAP_BYTES) + 1, commit.step)

    def _read_named(self, path: str, what: str, want_digest: bytes, want_size: int, limit: int,
                    step: int) -> bytes:
        """The bytes of a file its commit marker names by digest and size (at most ``limit`` read), judged by
        :func:`~ckptstore.format.blobs.read_verified`. Raises ``CorruptCheckpointError`` /
        :class:`~ckptstore.util.errors.TransferError`."""
        def once() -> bytes:
            try:
                data = self.storage.read_bytes(path, limit=limit)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{what} missing", step=step, blob=path) from None
            except OSError as e:
                raise CorruptCheckpointError(f"{what} unreadable ({e.strerror or e})", step=step, blob=path) from None
            digest = digest_bytes(data)
            if len(data) != want_size or digest != want_digest.hex():
                raise DamagedRead(f"{what} does not match its commit marker ({len(data)} bytes, expected "
                                  f"{want_size})", got=(len(data), digest), step=step, blob=path)
            return data
        return read_verified(self.storage, path, once)

    def read_table_bytes(self, commit: Commit) -> bytes:
        """The whole manifest table ``commit`` names (``commit.table`` must be set), checked against its digest
        and size: one bounded read (a copy of the whole step). Raises ``CorruptCheckpointError``."""
        ref = commit.table
        return self._read_named(commit.manifests.path, "manifest table", ref.digest, ref.size, ref.size + 1,
                                commit.step)

    def read_shard_map(self, commit: Commit) -> ShardMap:
        """The decoded shard map of ``commit`` (see :mod:`ckptstore.format.shardmap`). Raises
        ``CorruptCheckpointError``."""
        data = self.read_shard_map_bytes(commit)
        with gc_paused():
            return ShardMap.decode(data, step=commit.step, world_size=commit.world_size,
                                   what=shards_path(commit.step, commit.shards[2]))

    def write_shard_map(self, step: int, gen: int, data: bytes) -> Tuple[bytes, int, int]:
        """Write a shard map atomically (before the commit marker naming it); return its (digest, size,
        generation) for the marker."""
        self.storage.write_atomic(shards_path(step, gen), data)
        return bytes.fromhex(digest_bytes(data)), len(data), gen

    def manifest_digest(self, step: int, rank: int, gen: int = 0) -> Tuple[bytes, int, int]:
        """(digest, size, generation) of a rank's freshly written manifest, for the commit marker."""
        data = self.storage.read_bytes(manifest_path(step, rank, gen))
        return bytes.fromhex(digest_bytes(data)), len(data), gen

    # -- writing ------------------------------------------------------------------------------------------
    def write_manifest(self, manifest: Manifest, gen: int = 0) -> Tuple[bytes, int, int]:
        """Write a manifest atomically; return its (digest, size, generation) for the commit marker."""
        data = encode_manifest(manifest)
        self.storage.write_atomic(manifest_path(manifest.step, manifest.rank, gen), data)
        return bytes.fromhex(digest_bytes(data)), len(data), gen

    def write_commit(self, commit: Commit) -> None:
        """Write the commit marker (its manifest table first, when it names one): from this moment the step is
        visible."""
        data, table = encode_commit_files(commit)
        mtable.write_files(self.storage, commit.step, table)
        self.storage.write_atomic(commit_path(commit.step), data)

    def write_table(self, step: int, table: Optional[bytes]) -> None:
        """Write a manifest table (before the marker naming it); ``None``: nothing to write."""
        mtable.write_files(self.storage, step, table)

    def readable_commits(self) -> Dict[int, Commit]:
        """Committed step -> its decoded commit marker; a marker that does not decode is left out (a caller
        judging steps by their markers, e.g. ``best_step``, skips that step)."""
        out = {}
        for s in self.committed_steps():
            try:
                out[s] = self.read_commit(s)
            except CheckpointError:
                continue
        return out

    def write_rows(self, step: int, digest: bytes, rows, refs=None) -> None:
        """Write a rows file: ``rows`` (rank -> (digest, size, generation)) of the table ``digest`` names, into
        a root holding those ranks' parts but not the table (before the marker), and ``refs``: rows of owner
        ranks whose parts it does not hold (see :func:`mtable.encode_rows`). A rows file of the same name
        (named by its lowest rank: a leader's, then the same rank's pull or rebuild) keeps its other rows: the
        file becomes the union, never fewer rows than the root could name before."""
        rows = dict(rows)
        path, _ = mtable.encode_rows(step, digest, rows)
        try:
            old, old_refs = mtable.decode_rows_file(self.storage.read_bytes(path, limit=mtable.MAX_ROWS_FILE_BYTES),
                                                    step, digest, 1 << 31, path)
        except (FileNotFoundError, CorruptCheckpointError):
            old, old_refs = {}, {}                      # none, or damaged: replaced by what is known now
        rows = {**old, **rows}                          # the same lowest rank: the same name
        self.storage.write_atomic(*mtable.encode_rows(step, digest, rows, {**old_refs, **(refs or {})}))

    def write_commit_bytes(self, step: int, data: bytes) -> None:
        """Write a commit marker given as bytes (rank 0's, copied into another rank's root); checked first."""
        decode_commit(data, step=step, what=commit_path(step))
        self.storage.write_atomic(commit_path(step), data)

    def uncommit(self, step: int) -> None:
        self.storage.delete(commit_path(step))

    def delete_step(self, step: int) -> None:
        """Remove a step: commit marker first, then the rest."""
        self.uncommit(step)
        self.storage.rmtree(step_dir(step))
