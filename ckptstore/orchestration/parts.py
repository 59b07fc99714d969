"""The parts of one store that its orchestration modules share: storage, catalog, blobs, the chunk index, the
thread pools, the coordinator of the ranks, the remote and its uploader, and the run's identity.

:class:`~ckptstore.store.Store` builds one :class:`Parts` and hands it to :class:`~.saving.Saver`,
:class:`~.loading.Loader` and :class:`~.maintenance.Maintenance`; none of them builds a part of its own, so each
part exists once per store and is released once, by :meth:`Parts.close`.
"""
from __future__ import annotations

import os
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, Mapping, Optional

from ..format.blobs import BlobStore
from ..format.catalog import Catalog, ManifestCache
from ..io.changes import VersionCache
from ..distributed.collective import default_coordinator
from ..util.errors import CheckpointError
from ..format.index import ChunkIndex
from ..lifecycle.lease import acquire_writer
from .options import Remote, Writing
from ..format.packs import PackBuffers
from ..lifecycle.retention import Retention
from ..util.retry import RetryPolicy
from ..lifecycle.rewind import newest_of
from ..state.runconfig import normalize
from ..io.snapshot import StagingPool
from ..storage import Storage, open_storage
from ..util.threads import background_pool
from ..remote.upload import Uploader


class Parts:
    """One store's shared parts (see the module docstring). Attributes, all read-only after construction except
    ``uploader`` (a node's parts uploader is made at its first commit), ``inflight`` (the non-blocking save in
    flight, set by the saver), ``writer_lease`` (see :meth:`hold_writer_lease`) and the run id."""

    def __init__(self, storage: Storage, *, rank: int, world_size: int, writing: Writing,
                 remote: Optional[Remote], storage_options: Mapping[str, Any], keep: Optional[Retention],
                 config: Optional[Mapping[str, Any]], collective_timeout: float, read_only: bool):
        self.storage, self.root = storage, storage.url
        self.rank, self.world_size = rank, world_size
        self.writing, self.remote, self.keep = writing, remote, keep
        self.config = normalize(config)
        self.storage_options = dict(storage_options or {})
        self.read_only = read_only
        self.collective_timeout = float(collective_timeout)
        if not self.collective_timeout > 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {collective_timeout!r}")
        self.decoded = ManifestCache()          # manifests decoded by this store's catalogs (a pull, then a read)
        self.catalog = Catalog(storage, self.decoded)
        self.blobs = BlobStore(storage)
        self.index = ChunkIndex(storage, self.blobs)
        self.pack_buffers = PackBuffers()
        self.versions = VersionCache()
        self.staging = StagingPool()
        self.coord = default_coordinator(rank, world_size)
        # The I/O pool serves blocking saves and loads too, which the caller waits for: normal priority. The
        # background save driver and the uploader run niced (see ckptstore.util.threads); a non-blocking save's
        # chunks go through a niced pool of their own.
        self.pool = ThreadPoolExecutor(max_workers=writing.workers, thread_name_prefix="ckptstore-io")
        self.bg_pool = background_pool(writing.workers, "ckptstore-bgio")
        self.bg = background_pool(1, "ckptstore-save")
        self.maint = threading.RLock()             # saves vs retention / gc: never sweep under a save
        self.metrics_cache: Dict[int, Mapping[str, Any]] = {}          # local step -> metrics (retention)
        self.remote_metrics_cache: Dict[int, Mapping[str, Any]] = {}   # remote step -> metrics (uploader)
        self.retry = remote.retry if remote is not None else RetryPolicy()   # remote and load_path calls
        self.remote_storage: Optional[Storage] = (open_storage(remote.url, self.storage_options, retry=self.retry)
                                                  if remote is not None else None)
        self.uploader: Optional[Uploader] = None
        self.upload_args: Optional[Dict[str, Any]] = None   # how to make a node's parts uploader, if any
        self.inflight = None                       # the non-blocking save in flight (a SaveHandle)
        self.writer_lease = None                   # locks/writer.json, once rank 0 holds it
        self._run_id: Optional[str] = None

    @property
    def writes_remote(self) -> bool:
        """Whether this store's uploader writes the remote's steps (rank 0's; a node's parts uploader does not)."""
        return self.uploader is not None and not self.uploader.parts_only

    def hold_writer_lease(self) -> None:
        """Rank 0: take this root's writer lease unless it holds it (at its first save, or before a resume sets
        steps aside: only the job that writes a root changes its timeline), then check it is still held.
        Raises ``CheckpointError`` naming another live holder, or when the lease was lost (FORMAT.md "Writers
        and deleters")."""
        if self.rank == 0 and self.writer_lease is None:
            self.writer_lease = acquire_writer(self.storage, job=self.root)
        if self.writer_lease is not None:
            self.writer_lease.check()

    # -- the run's identity ------------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        """See :attr:`ckptstore.store.Store.run_id`."""
        if self._run_id is None:
            self._run_id = self._recorded_run_id() or uuid.uuid4().hex
        return self._run_id

    def adopt_run_id(self, rid: Optional[str]) -> None:
        """This run continues the run ``rid`` (from a commit marker it resumed or committed); ``None``: no
        change (a marker written before run ids)."""
        if rid:
            self._run_id = rid

    def _recorded_run_id(self) -> Optional[str]:
        """The id in the newest readable local commit marker (never the remote's: this runs in the commit path,
        and a stalled server must not stall a save; a remote-only run adopts its id in ``resume``)."""
        for s in reversed(self.catalog.committed_steps()):
            try:
                rid = self.catalog.read_commit(s).run_id
            except CheckpointError:
                continue
            return rid or None                  # a marker written before run ids: a new id from now on
        return None

    def newest_committed(self) -> Optional[int]:
        """The newest committed step of this run: local, or on the remote this store uploads to (with
        ``keep_local`` the local root may hold fewer; before the uploader has listed the remote, it is listed
        here once, see :meth:`~ckptstore.remote.upload.Uploader.newest_remote`)."""
        remote = self.uploader.newest_remote() if self.writes_remote else None
        # the latest pointer and the step directories after it (Catalog.newest_committed), not a HEAD of every
        # step's marker: a store that keeps every step made each save's rewind check O(steps)
        return newest_of(self.catalog.newest_committed()[0][:1], remote)

    def where(self) -> str:
        """The root, and the remote if any: for messages."""
        return self.root + (f" or {self.remote_storage.url}" if self.remote_storage is not None else "")

    def close(self) -> None:
        """Release the threads, staging memory and storage (the store is closed)."""
        self.coord = None                          # holds the process group's key-value store: let it go
        self.bg.shutdown(wait=True)
        self.bg_pool.shutdown(wait=True)
        self.pool.shutdown(wait=True)
        self.staging.clear()
        self.pack_buffers.clear()
        self.storage.close()


def quiet(fn) -> bool:
    """``bool(fn())``, or ``False`` if it raises."""
    try:
        return bool(fn())
    except Exception:
        return False


def local_path(root) -> str:
    root = os.fspath(root)
    return root[len("file://"):] if root.startswith("file://") else root


def default_rank_world(rank: Optional[int], world_size: Optional[int]):
    """``(rank, world_size)``: the given ones, else ``torch.distributed``'s when initialised, else ``RANK`` /
    ``WORLD_SIZE``, else 0 / 1. Raises ``ValueError`` when rank is outside ``[0, world_size)``."""
    if rank is None or world_size is None:
        try:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
        except Exception:  # pragma: no cover - a broken dist install must not break a local store
            pass
    if rank is None:
        rank = int(os.environ.get("RANK", 0))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    return rank, world_size

