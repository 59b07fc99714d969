"""The chunk index: chunk id -> where its bytes already are, so a save writes only chunks the store lacks.

Source of truth: the committed manifests, which record every chunk's location. The index is derived from
them and kept in memory by each writer: when a rank first saves, it reads its own manifest of the newest
committed step (one file) and hashes every pack it names once (a pack that survived a power loss by name only
may hold anything); before each save it checks that those packs still exist (one ``stat`` per pack); after each
commit it becomes exactly the chunks of the step just committed. It is not persisted: a persisted copy would be
one more file that gc, repack and crashes must keep consistent, and rebuilding it costs one manifest read.

Why only the newest step: a tensor that does not change keeps its chunks from step to step, so the newest
step holds every chunk worth deduplicating against; chunks of older steps only would be referenced again by
going back to older values, which training does not do. Bounding the index this way also bounds what a writer
trusts: it never deduplicates against a chunk that no committed step it has seen references (gc may delete
such orphans), and before every save it re-checks that the packs it will reference exist.

Large chunks (blobs of their own) are also found by name in ``objects/`` (see
:class:`ckptstore.format.blobs.BlobStore`), which is how replicated ranks share them.
"""
from __future__ import annotations

import logging
import threading
from typing import Dict, Iterable, Optional, Set, Tuple

from .blobs import pack_intact
from ..util.errors import CheckpointError
from .layout import pack_path
from .manifest import ChunkRef, Manifest

log = logging.getLogger("ckptstore")


class ChunkIndex:
    """chunk id -> :class:`ChunkRef` this rank may reference without writing the chunk again. Thread-safe."""

    def __init__(self, storage, blobs):
        self.storage, self.blobs = storage, blobs
        self._refs: Dict[str, ChunkRef] = {}
        self._packs_ok: Set[str] = set()          # packs checked to exist at the start of the current save
        self._bad: Set[str] = set()               # chunks found damaged on read: never reused, even after reload
        #: (key path, dtype, chunk index) -> the blob chunk of the parent step (the newest committed one this
        #: writer knows): what a delta (``Writing.deltas``) is made against
        self._parents: Dict[Tuple[tuple, str, int], ChunkRef] = {}
        self._loaded = False
        self._lock = threading.Lock()

    def get(self, chunk_id: str) -> Optional[ChunkRef]:
        with self._lock:
            return self._refs.get(chunk_id)

    def parent(self, path: tuple, dtype: str, index: int, nbytes: int) -> Optional[ChunkRef]:
        """The parent step's chunk ``index`` of the tensor at ``path`` when it had ``dtype`` and is a blob of
        ``nbytes`` raw bytes (what a delta may be made against), else ``None``."""
        with self._lock:
            ref = self._parents.get((path, dtype, index))
        return ref if ref is not None and ref.nbytes == nbytes and ref.blob_id not in self._bad else None

    @staticmethod
    def _parents_of(manifest: Optional[Manifest]) -> Dict[Tuple[tuple, str, int], ChunkRef]:
        if manifest is None:
            return {}
        return {(n.path, e.dtype, i): c for n, e in manifest.arrays() for i, c in enumerate(e.chunks)
                if c.pack is None}

    def has(self, ref: ChunkRef) -> bool:
        """Whether ``ref``'s bytes are known to be in the store (a pack checked this save, or a blob found)."""
        if ref.pack is not None:
            with self._lock:
                return ref.pack in self._packs_ok
        return self.blobs.locate(ref.blob_id) is not None

    def prepare(self, catalog, rank: int) -> None:
        """Before a save: load the index if this process has none yet, then keep only chunks whose pack still
        exists (another process's gc may have removed it since the last save)."""
        if not self._loaded:
            self._load(catalog, rank)
        with self._lock:
            packs = {r.pack for r in self._refs.values() if r.pack is not None}
        ok = {p for p in packs if self.storage.exists(pack_path(p))}
        with self._lock:
            self._packs_ok = ok
            if ok != packs:
                log.info("chunk index: %d packs are gone; their chunks will be written again", len(packs - ok))
                self._refs = {k: r for k, r in self._refs.items() if r.pack is None or r.pack in ok}

    def _load(self, catalog, rank: int) -> None:
        refs: Dict[str, ChunkRef] = {}
        manifest = None
        for step in reversed(catalog.committed_steps()):
            try:
                commit = catalog.read_commit(step)
                if rank not in commit.manifests:
                    break
                manifest = catalog.read_manifest(commit, rank)
                refs = {c.blob_id: c for c in manifest.chunk_refs() if c.blob_id not in self._bad}
                break
            except CheckpointError as e:                 # a damaged step is no source of truth: try older
                log.info("chunk index: not using step %d (%s)", step, e)
        # Read from disk, not written by this process: each pack is hashed once before any chunk of it is
        # reused (a pack whose name survived a power loss may hold anything; FORMAT.md "Write order").
        packs = {r.pack for r in refs.values() if r.pack is not None}
        bad = {p for p in packs if not pack_intact(self.storage, p, unreadable=OSError)}
        if bad:
            log.warning("chunk index: %d pack(s) do not hash to their names; their chunks will be written again",
                        len(bad))
            refs = {k: r for k, r in refs.items() if r.pack not in bad}
        with self._lock:
            self._refs, self._loaded = refs, True
            self._parents = self._parents_of(manifest)

    def replace(self, refs: Iterable[ChunkRef], manifest: Optional[Manifest] = None) -> None:
        """After a commit: the index becomes the chunks of the step just committed (``manifest``: that step's
        manifest of this rank, the parent of the next save's deltas)."""
        parents = self._parents_of(manifest)
        with self._lock:
            self._parents = parents
            new = {r.blob_id: r for r in refs if r.blob_id not in self._bad}
            self._refs = new
            self._packs_ok |= {r.pack for r in new.values() if r.pack is not None}
            self._loaded = True

    def forget(self, chunk_ids: Iterable[str] = (), packs: Iterable[str] = ()) -> None:
        """Drop chunks found damaged, or all chunks of packs deleted (gc) so they are written again."""
        ids, packs = set(chunk_ids), set(packs)
        with self._lock:
            self._bad |= ids
            self._refs = {k: r for k, r in self._refs.items() if k not in ids and r.pack not in packs}
            self._packs_ok -= packs

    def clear(self) -> None:
        """Forget everything (after a failed save); the next save reloads from the committed manifests."""
        with self._lock:
            self._refs, self._packs_ok, self._loaded, self._parents = {}, set(), False, {}
