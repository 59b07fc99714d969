"""``Store``: the facade training code calls. It wires the parts and owns no format of its own.

Data flows one way: state -> flatten (:mod:`.state`) -> byte views (:mod:`.snapshot`) -> chunks, ids, blobs
(:mod:`.writer`, :mod:`.blobs`) -> manifest -> commit marker (:mod:`.catalog`) -> latest pointer
(:mod:`.pointers`) -> retention (:mod:`.retention`, :mod:`.gc`).
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait as futures_wait
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, MutableMapping, Optional, Tuple

from . import __version__, hub
from .blobs import CODECS, BlobStore, stream_check
from .catalog import Catalog, ManifestCache
from .collective import default_coordinator
from .commit import agree_commit, make_part, root_identity
from .errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from .gc import GCReport, collect
from .index import ChunkIndex
from .lease import WriterOp, acquire_writer, read_epoch
from .layout import check_step, manifest_path, pack_path
from .manifest import Commit, Manifest, ManifestNode, ArrayEntry, check_names, decode_commit, encode_commit
from .packs import PackBuffers, Packing, ReadItem, read_chunks
from .pointers import read_latest, write_latest, clear_latest
from .reader import MapLocation, read_nodes, stored_sizes
from .restore import StepLoader
from .resume import first_valid_step, parts_needed, restore_into
from .resolve import candidates, split_load_path
from . import retention as _retention
from .retention import Retention, from_shorthand
from .retry import RetryPolicy
from .shardmap import build as build_shard_map, local_entry
from .rewind import ON_REWIND, drop_local_after, must_truncate, newest_of
from .runconfig import differences, normalize
from .changes import VersionCache
from .snapshot import ArraySpec, StagingPool, direct_view, spec_of
from .state import Node, flatten, gc_paused, path_str
from .storage import Storage, is_local, open_storage
from .storage.retrying import with_read_retries
from .threads import background_pool
from . import transfer
from .transfer import StepCopier, TransferStats
from .upload import Uploader, apply_remote_retention
from .writer import write_arrays

log = logging.getLogger("ckptstore")

DEFAULT_CHUNK_SIZE = 64 << 20
RETENTION_WAIT = 5.0      # seconds retention's sweep waits for other ranks' saves in flight before deferring


class SaveHandle:
    """A non-blocking save in flight. ``result(timeout=None)`` -> :class:`SaveResult` (raises the save's error);
    ``done()``; ``step``; ``stall_seconds`` (how long ``save`` blocked the caller)."""

    def __init__(self, step: int, future, stall_seconds: float):
        self.step, self._future, self.stall_seconds = step, future, stall_seconds
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> Optional["SaveResult"]:
        """The save's result. Raises its error the first time it is asked for (by this method, or by the
        store's next ``save`` / ``wait`` / ``close``); afterwards returns ``None``."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if not self._future.done():            # a timeout, not the save's own error
                raise
            if self._reported:
                return None
            self._reported = True
            raise

    def __repr__(self) -> str:
        return f"SaveHandle(step={self.step}, done={self.done()})"


@dataclass
class SaveResult:
    """What one ``save`` did. Sizes in bytes, times in seconds.

    ``bytes_total``: logical bytes of all tensors and arrays of this rank. ``bytes_written``: bytes of new
    blobs and packs actually written (after dedup and compression). ``blobs_total`` / ``blobs_new``: chunks
    referenced / chunks that were not in the store yet. ``objects_new``: files created (blobs + packs). ``bytes_unchanged``: bytes of tensors proven unchanged since the
    last save (neither copied nor hashed). ``seconds``: wall time of the whole save. ``stall_seconds``: time the
    caller was blocked (equal to ``seconds`` for a blocking save). ``phases``: seconds per phase.
    """
    step: int
    bytes_total: int
    bytes_written: int
    blobs_total: int
    blobs_new: int
    seconds: float
    stall_seconds: float = 0.0
    bytes_unchanged: int = 0
    phases: Dict[str, float] = field(default_factory=dict)
    committed: bool = True
    objects_new: int = 0


def _default_rank_world(rank, world_size):
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


class Store:
    """A checkpoint store rooted at a local directory.

    Args:
        root: local directory (a path or ``file://`` URL); created if missing.
        config: mapping describing the run (hyperparameters), recorded with every step; ``resume`` raises
            ``IncompatibleCheckpointError`` listing each differing key when it differs, except keys named in
            ``config_may_change`` (dotted names; a name covers the keys below it).
        rank, world_size: default from ``torch.distributed`` when initialised, else ``RANK`` / ``WORLD_SIZE``
            environment variables, else 0 / 1. Each rank writes its own manifest; rank 0 writes the commit
            marker once every rank's part is durable. Under an initialised process group of this world size,
            ``save`` and ``resume`` are collective (see :mod:`ckptstore.commit`, :mod:`ckptstore.restore`);
            without one, rank 0 polls the shared root for the other ranks' manifests. To save from one
            process alone while a process group exists (e.g. a consolidated export on rank 0), pass
            ``rank=0, world_size=1``.
        collective_timeout: seconds a rank waits for the others in a collective save / resume (default
            600) before raising ``CommitError`` naming the ranks that did not arrive. ``commit_timeout`` is
            its former name.
        chunk_size: maximum bytes per chunk (default 64 MiB).
        packing: a :class:`~ckptstore.packs.Packing`: chunks under ``threshold`` bytes (default 4 MiB) are
            appended to pack files of about ``target_size`` bytes (default 64 MiB) instead of being one file
            each; ``Packing(threshold=0)`` writes every chunk as a blob of its own (see FORMAT.md).
        codec: ``"raw"`` (default) or ``"zstd"`` for new blobs. zstd is kept only where it saves >= 3%;
            measured here it gains ~8% on fp32 at 0.4-0.5 GB/s per core, slower than the disk, so it is off
            by default (see benchmarks/README.md).
        workers: threads hashing / writing / reading chunks (default: 4).
        track_versions: opt-in (default ``False``: every tensor is hashed at every save, and content
            addressing alone skips writing unchanged bytes). ``True`` skips copying and hashing a tensor whose
            storage, autograd version counter and optimizer-step count are unchanged since the last save
            (frozen layers in fine-tuning). It cannot see writes through ``.data``, numpy views,
            ``untyped_storage()``, DLPack or extension kernels that leave the version counter alone: such a
            tensor is saved with its old bytes. Fused optimizers are seen (see :mod:`ckptstore.changes`);
            DTensor shards are always hashed.
        keep: a :class:`~ckptstore.retention.Retention` (``Retention(last=N, every=K, best=M, metric="loss",
            mode="min")``): the union of the newest N committed steps, every K-th step and the M best by
            ``metrics[metric]``. Never deleted whatever the policy: the newest committed step, the best step
            (:meth:`best_step`), a step whose upload is pending, the step being saved. Applied after every
            commit (rank 0, and the leader of each other root), followed by a sweep of the blobs and packs no
            kept step references; with ``remote``, applied to the remote too by the uploader after each upload
            (the remote keeps the policy's result; ``keep_local`` may keep fewer locally). The best criterion
            is recorded in every commit marker, so readers find "best" without the policy
            (:func:`ckptstore.retention.best_step`).
        keep_last, keep_every: shorthand for ``keep=Retention(last=keep_last, every=keep_every)``
            (``keep_every`` alone keeps everything); not together with ``keep``.
        on_rewind: what ``save`` does with a step lower than or equal to the newest committed one (locally, or
            on the remote this store uploads to): ``"error"`` (default) raises ``IncompatibleCheckpointError``
            naming both steps; ``"truncate"`` first drops the later steps (locally and on the remote; the
            latest pointers move back, see FORMAT.md "Rewinding a run") and re-saves the step as a new manifest
            generation if it was committed: a run rolled back after a loss spike continues on a clean timeline.
        direct_io: use O_DIRECT for large aligned writes where the filesystem supports it.
        storage_options: fsspec options (endpoint, credentials, ...) for ``remote``, ``load_path`` and a
            ``root`` given as a URL. Credentials are never written to manifests, logs or error messages.
        create: create a missing local root (``False``: raise ``FileNotFoundError``).
        remote: an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``, ``file://...``) to
            which every committed step is uploaded in the background, in commit order (see
            :mod:`ckptstore.upload` for the order, crash safety and backlog policy).
        load_path: where to start from when the run has no checkpoint of its own: a store URL (its newest
            valid step), ``<store URL>/steps/<step>`` (that step, zero-padded to 12 digits or not), or model
            weights in the Hub's format, never unpickled: a ``.safetensors`` file or a ``save_pretrained``
            directory (``model.safetensors`` or its index and shards), loaded into ``state["model"]`` (or the
            one key ``load_components`` names); see :mod:`ckptstore.hub`.
        load_components: take only these top-level keys from ``load_path`` (e.g. ``("model",)`` for
            weights-only fine-tuning); the other entries of ``state`` keep their fresh values.
        keep_local: keep at most this many committed steps on local disk once they are uploaded (the
            newest ones; a step not yet uploaded is never removed by this rule). ``0``: no local copy of an
            uploaded step is kept; ``resume`` then pulls from the remote.
        upload_workers: parallel blob uploads. upload_retry: a :class:`~ckptstore.retry.RetryPolicy`
            (deadline and per-attempt timeout in seconds). upload_backlog: steps allowed to wait for upload.
        upload: ``False`` to use ``remote`` only to read from (resume, :meth:`pull`), never to write to it.
        read_only: open the store to read only (a rank that only loads, a second process inspecting a run):
            no uploader, no writer lease, no retention; a step only the remote holds is read straight from it,
            never pulled into ``root``. :meth:`save`, :meth:`pull`, :meth:`gc` and :meth:`delete_step` raise
            ``CheckpointError``.
    """

    def __init__(self, root, *, config: Optional[Mapping[str, Any]] = None,
                 config_may_change: Iterable[str] = (), rank: Optional[int] = None,
                 world_size: Optional[int] = None, chunk_size: int = DEFAULT_CHUNK_SIZE, codec: str = "raw",
                 zstd_level: int = 1, workers: int = 4, keep_last: Optional[int] = None,
                 keep_every: Optional[int] = None, direct_io: bool = True, collective_timeout: float = 600.0,
                 storage_options: Optional[Mapping[str, Any]] = None, create: bool = True,
                 track_versions: bool = False, remote: Optional[str] = None, load_path: Optional[str] = None,
                 load_components: Optional[Iterable[str]] = None, keep_local: Optional[int] = None,
                 upload_workers: int = 8, upload_retry: Optional[RetryPolicy] = None, upload_backlog: int = 8,
                 upload: bool = True, packing: Optional[Packing] = None,
                 commit_timeout: Optional[float] = None, keep: Optional[Retention] = None,
                 on_rewind: str = "error", read_only: bool = False):
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {CODECS}, got {codec!r}")
        if not isinstance(chunk_size, int) or chunk_size < 4096:
            raise ValueError(f"chunk_size must be an int >= 4096 bytes, got {chunk_size!r}")
        self.rank, self.world_size = _default_rank_world(rank, world_size)
        if not create and is_local(root) and not os.path.isdir(_local_path(root)):
            raise FileNotFoundError(f"no store at {root}")
        self.storage: Storage = open_storage(root, storage_options, direct_io=direct_io)
        self.root = self.storage.url
        self._decoded = ManifestCache()          # manifests decoded by this store's catalogs (a pull, then a read)
        self.pulled: List[TransferStats] = []    # what each pull into this root did, oldest first
        self.catalog = Catalog(self.storage, self._decoded)
        self.blobs = BlobStore(self.storage)
        self.config = normalize(config)
        self.config_may_change = tuple(config_may_change)
        self.chunk_size, self.codec, self.zstd_level = chunk_size, codec, zstd_level
        self.packing = packing if packing is not None else Packing()
        if not isinstance(self.packing, Packing):
            raise TypeError(f"packing must be a ckptstore.Packing, got {type(packing).__name__}")
        self._index = ChunkIndex(self.storage, self.blobs)
        self._pack_buffers = PackBuffers()
        if keep is not None and (keep_last is not None or keep_every is not None):
            raise ValueError("pass keep=Retention(...) or keep_last / keep_every, not both")
        if keep is not None and not isinstance(keep, Retention):
            raise TypeError(f"keep must be a ckptstore.Retention, got {type(keep).__name__}")
        #: the retention policy (None: keep every step); keep_last / keep_every are mapped onto it
        self.keep: Optional[Retention] = keep if keep is not None else from_shorthand(keep_last, keep_every)
        self.retention = self.keep
        if on_rewind not in ON_REWIND:
            raise ValueError(f"on_rewind must be one of {ON_REWIND}, got {on_rewind!r}")
        self.on_rewind = on_rewind
        self._run_id: Optional[str] = None          # see run_id
        self._metrics_cache: Dict[int, Mapping[str, Any]] = {}          # local step -> metrics (retention)
        self._remote_metrics_cache: Dict[int, Mapping[str, Any]] = {}   # remote step -> metrics (uploader)
        self.collective_timeout = float(commit_timeout if commit_timeout is not None else collective_timeout)
        if not self.collective_timeout > 0:
            raise ValueError(f"collective_timeout must be > 0 seconds, got {collective_timeout!r}")
        self._coord = default_coordinator(self.rank, self.world_size)
        self.track_versions = track_versions
        # The I/O pool serves blocking saves and loads too, which the caller waits for: normal priority. The
        # background save driver and the uploader run niced (see ckptstore.threads); a non-blocking save's
        # chunks go through a niced pool of their own.
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="ckptstore-io")
        self._bg_pool = background_pool(max(1, workers), "ckptstore-bgio")
        self._bg = background_pool(1, "ckptstore-save")
        self._versions = VersionCache()
        self._staging = StagingPool()
        self._inflight: Optional[SaveHandle] = None
        self._maint = threading.RLock()             # saves vs retention / gc: never sweep under a save
        self._writer_lease = None                   # locks/writer.json, taken by rank 0 at its first save
        self._op: Optional[WriterOp] = None         # the save in flight's in-flight marker
        self._epoch = None                          # gc epoch seen at the last save (see ckptstore.lease)
        self._save_gen = 0                          # manifest generation the save in flight writes
        self._closed = False
        self.read_only = bool(read_only)
        self._save_names: Tuple[str, ...] = ()      # names the save in flight records in its commit marker
        self._save_replicated: List[str] = []       # its replicated keys (save(replicated=...))
        self.storage_options = dict(storage_options or {})
        self.load_path = load_path
        self.load_components = tuple(load_components) if load_components is not None else None
        if keep_local is not None and (isinstance(keep_local, bool) or not isinstance(keep_local, int)
                                       or keep_local < 0):
            raise ValueError(f"keep_local must be an int >= 0 or None, got {keep_local!r}")
        self.keep_local = keep_local
        #: where the last resume() came from: {"tier": "local"|"remote"|"load_path", "step": int, "url": str,
        #: "manifests_read": how many saved ranks' manifests this rank read (1 with an unchanged world size;
        #: with another, rank 0's and those whose shards overlap this rank's, see ckptstore.shardmap)}
        self.resumed_from: Optional[Dict[str, Any]] = None
        self._manifests_read = 0
        self._touched = False                       # DTensor targets written in place by a resume attempt
        self.remote_storage: Optional[Storage] = None
        self._uploader: Optional[Uploader] = None
        self._upload_args: Optional[Dict[str, Any]] = None
        self._upload_retry = upload_retry or RetryPolicy()
        if remote is not None:
            self.remote_storage = open_storage(remote, self.storage_options)
            upload = upload and not self.read_only
            self._upload_args = dict(workers=upload_workers, retry=self._upload_retry, max_backlog=upload_backlog,
                                     on_uploaded=self._after_upload) if upload else None
            # started after resume() (or at the first save / wait / close): see Uploader.start
            if self.rank == 0 and upload:           # one uploader per store root: rank 0's, and a parts-only
                self._uploader = Uploader(self.storage, self.remote_storage, start=False, **self._upload_args)
                # one for each other root, started by its lowest rank at its first commit (see _commit), or
                # now when this root already shows it is such a root (a restarted job finishing uploads)
            elif upload and self._leads_other_root():
                self._uploader = Uploader(self.storage, self.remote_storage, parts_only=True, start=False,
                                          **self._upload_args)

    def _leads_other_root(self) -> bool:
        """Whether this root is a node-local root without rank 0's parts and this rank is the lowest rank
        whose parts it holds (judged from its newest committed step): that rank uploads the root's parts."""
        for step in reversed(self.catalog.committed_steps()):
            try:
                commit = self.catalog.read_commit(step)
            except CheckpointError:
                continue
            here = [r for r, (_, _, g) in sorted(commit.manifests.items())
                    if self.storage.exists(manifest_path(step, r, g))]
            return bool(here) and 0 not in here and here[0] == self.rank
        return False

    # -- saving -------------------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, *, metrics: Optional[Mapping[str, Any]] = None,
             blocking: bool = True, names: Iterable[str] = (), replicated: Iterable[str] = ()):
        """Save ``state`` as ``step`` and commit it.

        ``state`` maps names to Stateful objects, tensors, numpy arrays, and nested dict/list/tuple of those and
        of int, float, bool, str, bytes, None. ``metrics``: plain values recorded in the commit marker.
        ``step`` must be newer than every committed step of the run (local, and the remote this store uploads
        to): else ``IncompatibleCheckpointError`` naming both steps, unless ``Store(on_rewind="truncate")``,
        which first drops the later steps and then saves (re-saving a committed step writes a new manifest
        generation; the old one stays intact until the new commit marker replaces it).

        ``names``: names for the step (a trainer's checkpoint paths, ``"best"``), recorded in its commit marker
        and shown by ``ckptstore ls / show``; :meth:`find` finds a step by name. Saving the newest committed
        step again *with names* is not a rewind: the step is re-saved (a new manifest generation, the values
        given now) and keeps the names it had plus the new ones, one commit with several names (Lightning saves
        one global step under its top-k path, then as ``last.ckpt``).

        ``replicated``: top-level keys of ``state`` whose values are the same on every rank (the model,
        optimizer and scheduler under DDP). Rank 0 saves them; the other ranks do not call their
        ``state_dict()``, copy, hash or write them, and their manifests name them as read from rank 0's; a
        step loads them from rank 0's manifest on any rank and any world size (values that differ between
        ranks, e.g. per-rank RNG, are rank-local instead). Every rank must pass the same keys (else the save
        raises ``CommitError``); a replicated key may not hold DTensors (``ValueError``: they are sharded, so
        not replicated). Ignored by a store of one rank. The rule comes from DDP's own guarantee that every
        replica holds the same parameters after each step; it is the saver's promise, not checked.

        ``blocking=True`` (default): returns a :class:`SaveResult` once the step is committed and durable on
        local disk. ``blocking=False``: returns a :class:`SaveHandle` as soon as every changed tensor is copied
        into reused staging memory (the *stall*); hashing, writing and the commit run in a background thread,
        and training may change its tensors right away. At most one save is in flight per store: a new
        ``save`` first waits for the previous one. A background failure is raised by the handle's
        ``result()``, else by the next ``save``, :meth:`wait` or :meth:`close` (whichever comes first, once).

        Under an initialised process group the save is collective (every rank calls it with the same step):
        DTensors are saved as their local shards, and the step is committed only when every rank's part is
        durable. If any rank fails (an exception in a Stateful, in flatten, in a write) or does not arrive
        within ``collective_timeout``, every rank raises the same :class:`~ckptstore.commit.CommitError`
        naming the ranks and their errors (chained to this rank's own error), and nothing is committed.

        Raises ``TypeError`` naming the key path of an unsupported value before anything is written;
        ``OSError`` from the disk (the step then stays invisible); ``CommitError`` as above.
        """
        self._check_open()
        self._check_writable("save")
        self.wait()        # one save in flight; surfaces an earlier failure (a collective one: on every rank)
        t0 = time.perf_counter()
        tag = self._coord.next_tag(f"save/{step}") if self._coord is not None else None
        op = None
        try:              # from here on, a failure on one rank is reported to the others (they raise too)
            if self._uploader is not None:
                self._uploader.raise_if_failed()      # an upload failure is never swallowed
            check_step(step)
            metrics = normalize(metrics or {}, "metrics")
            names = check_names(names)
            rep = self._replicated_keys(state, replicated)
            op = self._begin_write(step)               # before the index: see ckptstore.lease
            self._save_names = self._check_rewind(step, names)   # holds the writer lease: may truncate
            self._index.prepare(self.catalog, self.rank)   # before the snapshot: it decides what is unchanged
            self._save_replicated = rep
            own = state if not rep or self.rank == 0 else {k: v for k, v in state.items() if k not in rep}
            with gc_paused():     # the snapshot is short and allocation-heavy: no heap-wide GC pass mid-stall
                nodes, stateful, specs = self._snapshot(own, blocking)
            sharded = sorted({n.path[0] for n in nodes if n.path and n.path[0] in rep
                              and getattr(n, "shard", None) is not None})
            if sharded:
                raise ValueError(f"save(step {step}): replicated keys {sharded} hold DTensors (sharded values "
                                 "are saved by every rank: leave them out of replicated=)")
        except BaseException as e:
            self._end_write(op)
            if tag is not None:                       # the other ranks must learn it: they raise too
                self._commit(step, None, 0, {}, tag=tag, error=e)
            raise
        t_snap = time.perf_counter()
        job = functools.partial(self._write_and_commit, step, nodes, stateful, specs, metrics, t0,
                                None if blocking else t_snap - t0, self._pool if blocking else self._bg_pool, tag)
        if blocking:
            return job()
        handle = SaveHandle(step, self._bg.submit(job), stall_seconds=t_snap - t0)
        self._inflight = handle
        return handle

    def _replicated_keys(self, state: Mapping[str, Any], replicated: Iterable[str]) -> List[str]:
        """``save(replicated=...)`` checked against ``state``: sorted keys, or [] for a store of one rank."""
        if isinstance(replicated, (str, bytes)) or not isinstance(replicated, (list, tuple, set, frozenset)):
            raise ValueError(f"replicated must be a list of top-level keys, got {type(replicated).__name__}")
        missing = [k for k in replicated if not isinstance(k, str) or k not in state]
        if missing:
            raise ValueError(f"replicated keys {missing!r:.200} are not top-level keys of the state")
        return sorted(set(replicated)) if self.world_size > 1 else []

    def _snapshot(self, state, blocking: bool):
        """Flatten ``state`` and give every array a stable byte view (see :mod:`ckptstore.snapshot`)."""
        nodes, stateful = flatten(state)
        specs, to_copy = [], []
        for node in nodes:
            if node.kind not in ("tensor", "ndarray", "npscalar"):
                continue
            spec = spec_of(node)
            specs.append(spec)
            # A DTensor's local shard is never proven unchanged by its version counter: FSDP2 updates it
            # through views whose counters it does not share (measured: a stale shard was reused).
            if node.kind == "tensor" and self.track_versions and node.shard is None:
                spec.known = self._versions.lookup(spec, node.value, self._index)
            if spec.known is None:
                if blocking:
                    spec.view = direct_view(node)
                else:
                    to_copy.append((spec, node))
        if not blocking:
            self._staging.stage(to_copy, live_paths=[s.path for s in specs])
        return nodes, stateful, specs

    def _write_and_commit(self, step, nodes, stateful, specs, metrics, t0, stall, pool, tag=None) -> SaveResult:
        t_start = time.perf_counter()
        try:
            with self._maint:
                return self._write_and_commit_locked(step, nodes, stateful, specs, metrics, t0, stall, t_start,
                                                     pool, tag)
        finally:
            self._end_write(self._op)

    def _begin_write(self, step: int) -> WriterOp:
        """Rank 0 takes the writer lease at its first save (a second job is refused, naming the holder); every
        rank registers the save as in flight (waiting while a gc holds the store); after a gc elsewhere, what
        this store believed about existing blobs and packs is dropped. See FORMAT.md, "Writers and deleters"."""
        if self.rank == 0 and self._writer_lease is None:
            self._writer_lease = acquire_writer(self.storage, job=self.root)
        if self._writer_lease is not None:
            self._writer_lease.check()
        self._end_write(self._op)
        op = self._op = WriterOp(self.storage, "save", step=step, rank=self.rank).begin()
        epoch = read_epoch(self.storage)
        if epoch != self._epoch:
            self.blobs.forget_all()
            self._index.clear()
            self._epoch = epoch
        return op

    def _newest_committed(self) -> Optional[int]:
        """The newest committed step of this run: local, or on the remote this store uploads to (with
        ``keep_local`` the local root may hold fewer; before the uploader has listed the remote, it is listed
        here once, see :meth:`~ckptstore.upload.Uploader.newest_remote`)."""
        uploader = self._uploader        # rank 0's: a node's parts uploader never lists the bucket here
        remote = uploader.newest_remote() if uploader is not None and not uploader.parts_only else None
        return newest_of(self.catalog.committed_steps(), remote)

    def _check_rewind(self, step: int, names: Tuple[str, ...]) -> Tuple[str, ...]:
        """``save`` of a step not newer than the newest committed one: raise (``on_rewind="error"``) or drop
        the later steps first (``"truncate"``); see :mod:`ckptstore.rewind`. Under torch.distributed each rank
        checks its own root (and rank 0 the remote); a refusal reaches every rank as ``CommitError``. The
        newest committed step saved again with ``names`` is a re-save, not a rewind. Returns the names the new
        commit marker records: ``names`` plus those of the commit it replaces."""
        newest = self._newest_committed()
        if names and step == newest and self.catalog.is_committed(step):
            try:
                return tuple(sorted(set(names) | set(self.catalog.read_commit(step).names)))
            except CorruptCheckpointError:
                return names
        if must_truncate(step, newest, self.on_rewind):
            self._truncate_after(step)
        return names

    def _truncate_after(self, step: int) -> None:
        """Drop every committed step newer than ``step``: the uploader is held still (waiting steps newer than
        ``step`` are dropped), then the local steps go newest first, then the remote's (rank 0; its pointer
        moved back by compare-and-swap, see FORMAT.md "Rewinding a run")."""
        uploader = self._uploader
        with (uploader.paused(drop_after=step) if uploader is not None else _null()):
            with self._maint:
                for s in drop_local_after(self.catalog, step, self._point_away_from):
                    self._metrics_cache.pop(s, None)
            if uploader is not None:
                gone = uploader.truncate_remote(step)
                for s in gone:
                    self._remote_metrics_cache.pop(s, None)
                if gone:
                    log.warning("on_rewind=truncate: dropped remote steps %s of %s", gone, self.remote_storage.url)
        self._metrics_cache.pop(step, None)
        self._remote_metrics_cache.pop(step, None)

    def _end_write(self, op: Optional[WriterOp]) -> None:
        if op is not None:
            op.end()
            if self._op is op:
                self._op = None

    def _check_still_writer(self) -> None:
        """Just before a commit: the writer lease and this save's in-flight marker must still be ours."""
        if self._writer_lease is not None:
            self._writer_lease.check()
        if self._op is not None:
            self._op.check()

    def _write_and_commit_locked(self, step, nodes, stateful, specs, metrics, t0, stall, t_start, pool, tag):
        try:
            try:
                self._save_gen = self._prepare_step(step)
                # chunk references and manifest nodes: thousands of small objects, no cycles among them; a
                # collector pass here walked the whole heap (measured: 0.1 s of a 0.17 s small-state save)
                with gc_paused():
                    refs, stats = write_arrays(self.blobs, specs, chunk_size=self.chunk_size, codec=self.codec,
                                               level=self.zstd_level, executor=pool, packing=self.packing,
                                               index=self._index, buffers=self._pack_buffers)
                    t_blobs = time.perf_counter()
                    manifest = Manifest(step=step, rank=self.rank, world_size=self.world_size,
                                        stateful=stateful, nodes=self._manifest_nodes(nodes, specs, refs),
                                        replicated=self._save_replicated)
                    digest = self.catalog.write_manifest(manifest, self._save_gen)
                self._check_still_writer()
            except BaseException as e:
                if tag is not None:                   # tell the other ranks; raises CommitError from e
                    self._commit(step, None, 0, metrics, tag=tag, error=e)
                raise
            committed = self._commit(step, digest, manifest.bytes_total, metrics, tag=tag, manifest=manifest)
        except BaseException:
            self._versions.clear()
            self._index.clear()
            raise
        self._versions.record(specs, refs)
        self._index.replace(r for per_spec in refs for r in per_spec)
        t_commit = time.perf_counter()
        if committed and self._uploader is None and self._upload_args is not None:
            # the lowest rank of a root other than rank 0's (node-local disks) uploads that root's parts
            self._uploader = Uploader(self.storage, self.remote_storage, parts_only=True, **self._upload_args)
        if committed:
            try:
                self._apply_retention(step, since=t0)
            except Exception as e:          # the step is committed: a failed cleanup must not fail the save
                log.error("step %d is committed; retention / gc after it failed: %s: %s", step,
                          type(e).__name__, e)
            if self._uploader is not None:
                self._uploader.enqueue(step)
        t_end = time.perf_counter()
        return SaveResult(step=step, bytes_total=stats.bytes_total, bytes_written=stats.bytes_written,
                          blobs_total=stats.blobs_total, blobs_new=stats.blobs_new,
                          objects_new=stats.objects_new, seconds=t_end - t0,
                          stall_seconds=t_end - t0 if stall is None else stall, committed=committed,
                          bytes_unchanged=stats.bytes_unchanged,
                          phases={"snapshot": t_start - t0 if stall is None else stall,
                                  "blobs": t_blobs - t_start, "commit": t_commit - t_blobs,
                                  "retention": t_end - t_commit, "hash_cpu": stats.hash_seconds,
                                  "write_io": stats.write_seconds})

    def wait(self, timeout: Optional[float] = None) -> Optional["SaveResult"]:
        """Wait for the non-blocking save in flight, if any, and return its result (``None`` if there is none).
        Raises its error if nobody has seen it yet."""
        handle = self._inflight
        if handle is None:
            return None
        try:
            return handle.result(timeout)
        finally:
            if handle.done():
                self._inflight = None

    @staticmethod
    def _manifest_nodes(nodes: List[Node], specs: List[ArraySpec], refs) -> List[ManifestNode]:
        out, it = [], iter(zip(specs, refs))
        for n in nodes:
            kind = n.kind
            if kind in ("tensor", "ndarray", "npscalar"):
                spec, chunks = next(it)
                payload = ArrayEntry(spec.dtype, spec.shape, chunks, spec.device, spec.requires_grad, n.shard)
                kind = "dtensor" if n.shard is not None else kind
            else:
                payload = n.value
            out.append(ManifestNode(n.path, kind, payload))
        return out

    def _prepare_step(self, step: int) -> int:
        """The manifest generation this save of ``step`` writes: 0 for a new step; for a committed one, one more
        than any its commit marker names, so the old step stays intact (and loadable) until the new commit
        marker replaces the old one atomically. A failed re-save therefore costs nothing committed; its
        manifests and objects are unreferenced, and gc reclaims them."""
        if not self.catalog.is_committed(step):
            return 0
        try:
            commit = self.catalog.read_commit(step)
            gen = max(g for _, _, g in commit.manifests.values()) + 1
        except CorruptCheckpointError:
            gen = 1                                   # a damaged marker: replaced all the same
        if self.rank == 0:
            log.warning("step %d is already committed in %s: replacing it (manifest generation %d)", step,
                        self.root, gen)
        return gen

    def _point_away_from(self, step: int) -> None:
        """Before ``step`` stops being committed: if the local latest pointer names it, move the pointer to the
        newest other committed step (or remove it), so it never names an uncommitted step."""
        if read_latest(self.storage) != step:
            return
        older = [s for s in self.catalog.committed_steps() if s != step]
        if older:
            write_latest(self.storage, older[-1])
        else:
            clear_latest(self.storage)

    def _point_to_if_newest(self, step: int) -> None:
        """After ``step`` is committed locally: move the local latest pointer to it unless it already names a
        newer committed step."""
        latest = read_latest(self.storage)
        if latest is None or latest <= step or not self.catalog.is_committed(latest):
            write_latest(self.storage, step)

    def _commit(self, step: int, own_digest, bytes_total: int, metrics, *, tag=None,
                error: Optional[BaseException] = None, manifest: Optional[Manifest] = None) -> bool:
        """Make ``step`` visible. Returns whether this rank wrote a commit marker (and so applies retention to
        its root). Under ``torch.distributed`` the ranks agree first (see :mod:`ckptstore.commit`): rank 0
        commits only when every rank's part is durable, and every rank raises ``CommitError`` otherwise
        (``error``: this rank's own failure, re-raised as the cause); ``manifest`` (this rank's) gives its
        entry of the step's shard map. Without a process group, rank 0 waits for the other ranks' manifest
        files in the shared root (and writes no shard map: readers then read every manifest)."""
        if tag is not None:
            part = make_part(own_digest, bytes_total, error, root_identity(self.storage.local_path("")),
                             shard_entry=local_entry(manifest) if manifest is not None else None)

            def write_commit(parts):
                manifests = {r: (p["digest"], p["size"], p["gen"]) for r, p in enumerate(parts)}
                shard_map = ref = None
                if all("map" in p for p in parts):
                    shard_map = build_shard_map(step, [p["map"] for p in parts], manifest)
                    ref = self.catalog.write_shard_map(step, self._save_gen, shard_map)
                commit = self._new_commit(step, manifests, sum(p["bytes"] for p in parts), metrics)
                commit.shards = ref
                data = encode_commit(commit)
                self._write_commit_marker(step, data)
                self._point_to_committed(step)
                return data, shard_map

            def write_copy(data, shard_map):
                if shard_map is not None:
                    ref = decode_commit(data, step=step, what="commit verdict").shards
                    if ref is not None:
                        self.catalog.write_shard_map(step, ref[2], shard_map)
                self._write_commit_marker(step, data)
                self._point_to_committed(step)

            def adopt(data):                          # rank 0's run id, on every rank, from the first commit
                rid = decode_commit(data, step=step, what="commit verdict").run_id
                if rid:
                    self._run_id = rid
            try:
                return agree_commit(self._coord, tag, step, part, timeout=self.collective_timeout,
                                    write_commit=write_commit, write_copy=write_copy, on_committed=adopt)
            except CheckpointError as e:
                raise e from error
        if self.rank != 0:
            return False
        manifests = {0: own_digest}
        deadline = time.monotonic() + self.collective_timeout
        for r in range(1, self.world_size):
            while not self.storage.exists(manifest_path(step, r, self._save_gen)):
                if time.monotonic() > deadline:
                    raise CheckpointError(f"step {step}: rank {r} wrote no manifest within "
                                          f"{self.collective_timeout:.0f} s; the step is left uncommitted")
                time.sleep(0.05)
            manifests[r] = self.catalog.manifest_digest(step, r, self._save_gen)
        self._write_commit_marker(step, encode_commit(self._new_commit(step, manifests, bytes_total, metrics)))
        self._point_to_committed(step)
        return True

    def _write_commit_marker(self, step: int, data: bytes) -> None:
        """Write the commit marker. An ``OSError`` after which the marker is in place with these bytes (e.g.
        ENOSPC / EIO from the directory fsync after the rename) means the step IS committed, visible to every
        reader: the save must not report it as failed."""
        try:
            self.catalog.write_commit_bytes(step, data)
        except OSError as e:
            if not _quiet(lambda: self.catalog.read_commit_bytes(step)[0] == data):
                raise
            log.warning("step %d is committed, but writing its commit marker reported: %s", step, e)

    def _point_to_committed(self, step: int) -> None:
        """After the commit: the latest pointer is only a hint, so a failure to move it is logged, not raised."""
        try:
            self._point_to_if_newest(step)
        except Exception as e:
            log.warning("step %d is committed; moving the latest pointer failed (it is only a hint): %s", step, e)

    def _new_commit(self, step, manifests, bytes_total, metrics) -> Commit:
        return Commit(step=step, world_size=self.world_size, manifests=manifests, created=time.time(),
                      bytes_total=bytes_total, metrics=dict(metrics), config=self.config,
                      writer=f"ckptstore {__version__}", run_id=self.run_id,
                      best=self.keep.criterion if self.keep is not None else None, names=self._save_names)

    # -- run identity and the best step -------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        """The run's stable id (uuid4 hex): created with the run's first commit, recorded in every commit
        marker, and the same after any resume (local or remote), so ``wandb.init(id=store.run_id,
        resume="allow")`` continues the same run after a restart. Before the first commit it is the id that
        commit will carry. Read from the newest local committed step when this process has neither resumed
        nor saved yet; ``resume`` adopts the resumed step's id (local or remote), on every rank."""
        if self._run_id is None:
            self._run_id = self._recorded_run_id() or uuid.uuid4().hex
        return self._run_id

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

    def best_step(self) -> Optional[int]:
        """The best committed step of the run, derived from the commit markers (so it survives restarts): by
        ``keep``'s metric / mode when set, else by the criterion the newest commit marker records; local steps
        and, with ``remote``, the remote's (``keep_local`` may hold fewer locally). ``None``: no criterion,
        or no step has the metric."""
        self._check_open()
        metric, mode = (self.keep.metric, self.keep.mode) if self.keep is not None and self.keep.metric else \
            (None, None)
        commits = {}
        for s in self.catalog.committed_steps():
            try:
                commits[s] = self.catalog.read_commit(s)
            except CheckpointError:
                continue
        if self.remote_storage is not None:
            remote = Catalog(self.remote_storage)
            try:
                for s in remote.committed_steps():
                    if s not in commits:
                        try:
                            commits[s] = remote.read_commit(s)
                        except CheckpointError:
                            continue
            except Exception as e:
                log.warning("best_step: remote %s unreachable (%s: %s): local steps only", self.remote_storage.url,
                            type(e).__name__, e)
        return _retention.best_step(commits.values(), metric=metric, mode=mode)

    def _apply_retention(self, step: int, since: float) -> None:
        """After a commit (rank 0): delete the steps retention drops, then sweep under the gc lease (waiting a
        little for other ranks' saves in flight, else deferring the sweep to a later save). Step ``step`` is
        committed already: a failure here is logged, never raised (an exception from ``save`` means the step
        is not committed)."""
        try:
            protected = set(self._uploader.pending()) if self._uploader is not None else set()
            protected.add(step)
            doomed = _retention.apply(self.catalog, self.keep, protected, cache=self._metrics_cache,
                                      before_delete=self._point_away_from)
            stale = [s for s in self.catalog.step_dirs() if s < step and not self.catalog.is_committed(s)]
            if doomed or (stale and self.world_size == 1):
                # Blobs written before this save began and no longer referenced can go: no save is in flight
                # (the gc lease waits for in-flight markers). Uncommitted directories of older steps are crash
                # leftovers of this job (it holds the writer lease).
                r = collect(self.storage, self.catalog, self.blobs,
                            grace_seconds=max(0.0, time.perf_counter() - since) if self.world_size == 1 else 3600.0,
                            keep_steps={step}, index=self._index, exclude=[self._op.token if self._op else None],
                            wait=RETENTION_WAIT)
                if not r.deferred:
                    self._epoch = read_epoch(self.storage)
        except Exception as e:
            log.error("step %d is committed, but retention / gc after it failed (retried after the next save): "
                      "%s: %s", step, type(e).__name__, e)

    def _after_upload(self, step: int) -> None:
        """Uploader callback: apply retention to the remote (its own copy of the policy's result), then
        ``keep_local`` (local steps older than the newest uploaded one may go)."""
        self._apply_remote_retention(step)
        if self.keep_local is None:
            return
        with self._maint:
            pending = set(self._uploader.pending()) - {step} if self._uploader is not None else set()
            local = self.catalog.committed_steps()
            newest = set(local[-self.keep_local:]) if self.keep_local > 0 else set()
            keep = newest | pending | {s for s in local if s > step}
            doomed = [s for s in local if s not in keep]
            for s in doomed:
                self._point_away_from(s)
                self.catalog.delete_step(s)
                self._metrics_cache.pop(s, None)
            if doomed:
                collect(self.storage, self.catalog, self.blobs, grace_seconds=0.0, index=self._index, wait=0.0)
                log.info("keep_local=%d: removed local steps %s (uploaded)", self.keep_local, doomed)

    def _apply_remote_retention(self, step: int) -> None:
        """On the uploader's thread, after ``step`` is uploaded: delete the remote steps the policy drops, then
        gc the remote under its gc lease (see :func:`ckptstore.upload.apply_remote_retention`). Logged, never
        raised: the step is uploaded."""
        if self.keep is None or not self.keep.deletes or self._uploader is None:
            return
        try:
            apply_remote_retention(self.remote_storage, self.keep, {step}, cache=self._remote_metrics_cache,
                                   wait=RETENTION_WAIT, call=self._uploader.copier.call)
        except Exception as e:
            log.error("step %d is uploaded, but retention on %s failed (retried after the next upload): %s: %s",
                      step, self.remote_storage.url, type(e).__name__, e)

    def wait_for_uploads(self, timeout: Optional[float] = None) -> None:
        """Block until every committed step is on the remote (including a non-blocking save in flight).

        Raises :class:`~ckptstore.errors.UploadError` when an upload failed (after its retries / deadline) or
        ``timeout`` seconds passed. A no-op without ``remote``."""
        self._check_open()
        self.wait(timeout)
        if self._uploader is not None:
            self._uploader.wait(timeout)

    # -- reading ------------------------------------------------------------------------------------------
    def steps(self) -> List[int]:
        """Committed steps, ascending (their contents are verified when loaded, not here)."""
        return self.catalog.committed_steps()

    def latest_step(self) -> Optional[int]:
        """The newest committed step, or ``None``. Uses the latest pointer when it names a committed step
        at least as new as every listed one."""
        steps = self.catalog.committed_steps()
        pointed = read_latest(self.storage)
        if pointed is not None and pointed in steps and pointed == steps[-1]:
            return pointed
        return steps[-1] if steps else None

    def commit_info(self, step: int) -> Commit:
        """The commit marker of ``step`` (metrics, config, sizes). Raises ``CorruptCheckpointError``."""
        return self.catalog.read_commit(step)

    def _world_size_error(self, commit: Commit) -> IncompatibleCheckpointError:
        return IncompatibleCheckpointError(
            f"checkpoint was written by world_size={commit.world_size}, this run has "
            f"world_size={self.world_size}: load() reads one rank's part; resume() reshards", step=commit.step)

    def _read(self, step: int, *, map_location: MapLocation, rank: Optional[int] = None,
              tier: str = "local") -> Dict[str, Any]:
        """One rank's part of a committed step as a nested dict, sharded values as full tensors, read from the
        local root or (``tier="remote"``) straight from the remote. A single-process store may read any rank's
        part (inspection); a rank of a run reads its own part only if the world size matches."""
        catalog, blobs = (self.catalog, self.blobs) if tier == "local" else self._remote_reader()
        commit = catalog.read_commit(step)
        rank = self.rank if rank is None else rank
        if commit.world_size != self.world_size and rank == self.rank and self.world_size != 1:
            raise self._world_size_error(commit)
        if not 0 <= rank < commit.world_size:
            raise CheckpointError(f"step {step} was written by world_size={commit.world_size}: no rank {rank}")
        loader = StepLoader(catalog, blobs, commit, rank=rank, world_size=commit.world_size,
                            executor=self._pool, read_nodes=self._read_nodes)
        with gc_paused():
            return loader.load(loader.saved_keys(), {}, map_location=map_location)

    def _remote_reader(self) -> Tuple[Catalog, BlobStore]:
        """The remote's catalog and blobs for reading a step in place (its reads retried, see
        :func:`~ckptstore.storage.retrying.with_read_retries`)."""
        remote = with_read_retries(self.remote_storage, self._upload_retry)
        return Catalog(remote, self._decoded), BlobStore(remote, quarantine=False)

    def _tier_of(self, step: int) -> Optional[str]:
        """Where committed ``step`` is: ``"local"``, else ``"remote"``, else ``None``."""
        if self.catalog.is_committed(step):
            return "local"
        if self.remote_storage is not None and _quiet(lambda: Catalog(with_read_retries(
                self.remote_storage, self._upload_retry), self._decoded).is_committed(step)):
            return "remote"
        return None

    def load(self, step: Optional[int] = None, map_location: MapLocation = "cpu", *,
             rank: Optional[int] = None) -> Dict[str, Any]:
        """Load a committed step into a nested dict of tensors, arrays and plain values (Stateful objects'
        ``state_dict()`` as saved). ``step=None``: the newest *valid* step over the local root and the remote
        (older ones are tried, with a warning, when the newest is corrupt). An explicit ``step`` is never
        substituted. A step only the remote holds is read straight from it (nothing is written locally).
        Not collective: any rank may call it alone.

        Raises ``CorruptCheckpointError`` (naming step, key and blob), ``IncompatibleCheckpointError``, or
        ``FileNotFoundError`` when neither tier holds a committed step / this step.
        """
        self._check_open()
        if step is not None:
            check_step(step)
            tier = self._tier_of(step)
            if tier is None:
                raise FileNotFoundError(f"step {step} is not committed in {self.root}"
                                        + (f" or {self.remote_storage.url}" if self.remote_storage else ""))
            return self._read(step, map_location=map_location, rank=rank, tier=tier)
        for s, tier in self._candidates():
            try:
                return self._read(s, map_location=map_location, rank=rank, tier=tier)
            except CorruptCheckpointError as e:
                log.warning("step %d (%s) is corrupt, trying an older one: %s", s, tier, e)
        raise FileNotFoundError(f"no valid committed step in {self.root}"
                                + (f" or {self.remote_storage.url}" if self.remote_storage else ""))

    def _candidates(self) -> List[Tuple[int, str]]:
        """``(step, tier)`` newest first over the local root and the remote (see :meth:`_listing`)."""
        return self._listing(Catalog(self.remote_storage, self._decoded) if self.remote_storage else None)[0]

    def _listing(self, remote_catalog: Optional[Catalog]) -> Tuple[List[Tuple[int, str]], bool]:
        """``(candidates newest first, remote reachable)`` (:func:`ckptstore.resolve.candidates`); an unreachable
        remote is logged and the local steps alone are listed: it must not block a local resume."""
        try:
            return list(candidates(self.catalog, remote_catalog)), True
        except Exception as e:
            if remote_catalog is None:
                raise
            log.warning("remote %s unreachable (%s: %s): local steps only", self.remote_storage.url,
                        type(e).__name__, e)
            return [(s, "local") for s in reversed(self.catalog.committed_steps())], False

    def find(self, name: str) -> Optional[int]:
        """The newest committed step (local, else remote) whose commit marker carries ``name`` (see ``save(...,
        names=)``), or ``None``. Reads one commit marker per step, newest first; damaged markers are skipped."""
        for s, tier in self._candidates():
            catalog = self.catalog if tier == "local" else self._remote_reader()[0]
            try:
                if name in catalog.read_commit(s).names:
                    return s
            except CheckpointError:
                continue
        return None

    def resolve(self) -> Optional[Tuple[int, str]]:
        """The step :meth:`resume` would start from, without loading it: ``(step, tier)`` with ``tier`` one of
        ``"local"``, ``"remote"``, ``"load_path"`` (``step`` is ``None`` when ``load_path`` names Hub-format
        weights), or ``None`` for a fresh start. A candidate counts when its commit marker reads and checks
        (digest, format) and, for the local root, this rank's manifest is there: one listing and about one
        marker read per tier; chunks are verified by the load itself (:meth:`restore` still falls back to
        an older step if they are damaged). Under torch.distributed it is collective: rank 0 decides and every
        rank gets its answer."""
        self._check_open()

        def usable(s, tier) -> bool:
            catalog = self.catalog if tier == "local" else self._remote_reader()[0]
            try:
                commit = catalog.read_commit(s)
                rank = self.rank if commit.world_size == self.world_size else 0
                if tier == "local" and rank in commit.manifests and not self.storage.exists(
                        manifest_path(s, rank, commit.manifests[rank][2])):
                    raise CorruptCheckpointError(f"manifest of rank {rank} missing", step=s)
                return True
            except CheckpointError as e:
                log.warning("step %d (%s) is not usable: %s", s, tier, e)
                return False

        def decide():
            for s, tier in self._candidates():
                if usable(s, tier):
                    return [s, tier]
                if tier == "local" and self.remote_storage is not None and usable(s, "remote"):
                    return [s, "remote"]          # resume repairs a damaged local step from the remote
            if self.load_path is not None:
                url, step = split_load_path(self.load_path)
                if step is None and hub.open_weights(url, self.storage_options) is not None:
                    return [None, "load_path"]
                catalog = Catalog(with_read_retries(open_storage(url, self.storage_options), self._upload_retry))
                for s in ([step] if step is not None else reversed(catalog.committed_steps())):
                    if _quiet(lambda: catalog.read_commit(s) is not None):
                        return [s, "load_path"]
            return None
        if self._coord is None:
            found = decide()
        else:
            tag = self._coord.next_tag("resolve")
            found = self._coord.broadcast(f"{tag}/found", {"found": decide() if self.rank == 0 else None},
                                          self.collective_timeout)["found"]
        return None if found is None else (found[0], str(found[1]))

    def restore(self, state: MutableMapping[str, Any], step: Optional[int] = None, *,
                keys: Optional[Iterable[str]] = None, strict: bool = True, rank_local: str = "error") -> int:
        """Load a chosen committed step into ``state`` in place and return it: ``step=None`` is the newest
        valid step over the local root and the remote (an older one is taken, logged, when it is damaged);
        an explicit ``step`` is never substituted. Unlike :meth:`resume` it never falls back to ``load_path``
        or to a fresh start.

        ``keys``: restore only these top-level keys of ``state`` (each must be in the step and in ``state``;
        the others keep their values): a trainer that restores model, optimizer and RNG at different moments
        calls it once per group. ``strict`` (without ``keys``): the top-level keys of ``state`` and the step
        must match. Values are applied as by :meth:`resume`: Stateful objects get ``load_state_dict``, DTensor
        targets are filled in place and resharded to this run's mesh, a step only the remote holds is pulled
        (read straight from the remote by a ``read_only`` store). Collective under torch.distributed, as
        ``resume`` is. ``resumed_from`` tells where it came from.

        Raises ``FileNotFoundError`` (no such committed step / none at all), ``CorruptCheckpointError`` (the
        explicit step is damaged, or every step is), ``IncompatibleCheckpointError`` (keys, shapes, config)."""
        self._check_open()
        self.wait()
        if step is not None:
            check_step(step)
        try:
            found = self._load_newest(state, strict, rank_local, step=step,
                                      keys=tuple(keys) if keys is not None else None)
        finally:
            if self._uploader is not None:
                self._uploader.start()
        if found is None:
            where = self.root + (f" or {self.remote_storage.url}" if self.remote_storage else "")
            raise FileNotFoundError(f"step {step} is not committed in {where}" if step is not None else
                                    f"no valid committed step in {where}")
        return found[0]

    def resume(self, state: MutableMapping[str, Any], *, strict: bool = True,
               rank_local: str = "error") -> Optional[int]:
        """Restore ``state`` from the freshest valid checkpoint; return its step, or ``None`` (fresh start).

        Tiers, each fallback logged with its reason: (1) local committed steps and (2) remote committed steps,
        newest first across both (a step held by both is read locally; a remote step is first pulled into the
        local root, every blob verified by hash, except one written by another world size, which each rank
        reads straight from the remote, only the shards it needs); a damaged local step is repaired from the
        remote when the remote holds it; (3) ``load_path`` (only ``load_components`` if given: then the return
        value is ``None``, as the run itself starts fresh, and ``resumed_from`` tells what was loaded); (4) fresh
        start.
        The run's own checkpoints always win over ``load_path``. Details of the choice: ``self.resumed_from``.

        Stateful values get ``load_state_dict``; other entries of ``state`` are replaced by the loaded values
        (tensors go back to the device they were saved from when it exists here, else CPU). ``strict=False``
        loads only the top-level keys present in both ``state`` and the checkpoint.

        **Under torch.distributed** ``resume`` is collective: rank 0 lists the candidate steps once and
        broadcasts them; for each, every rank loads its part (pulling it from the remote when its own root
        lacks it) and the ranks agree: a step damaged for one rank falls back for all. DTensor targets (in
        what each Stateful's ``state_dict()`` returns) are filled in place with the bytes their current sharding
        needs, whatever world size and mesh saved the step (see :mod:`ckptstore.restore`). Values that differ
        between the saved ranks and are not DTensors are *rank-local*: with another world size, ``rank_local=
        "error"`` (default) raises ``IncompatibleCheckpointError`` naming them and both world sizes, and
        ``rank_local="fresh"`` keeps this run's values for them (logged) and loads the rest.

        Raises ``IncompatibleCheckpointError`` when the run config differs (see ``config_may_change``), the
        top-level keys differ (``strict``), rank-local values meet another world size, or the format is newer
        than this library; ``CheckpointError`` when DTensor targets were partly filled from a step found
        damaged and no valid step remains to load into them.
        """
        self._check_open()
        self.wait()
        try:
            return self._resume(state, strict, rank_local)
        finally:
            if self._uploader is not None:        # held back until now: see Uploader.start
                self._uploader.start()

    def _resume(self, state, strict: bool, rank_local: str) -> Optional[int]:
        found = self._load_newest(state, strict, rank_local)
        if found is not None:
            return found[0]
        if self._touched:
            raise CheckpointError(f"no valid step left in {self.root} to load into the sharded (DTensor) values "
                                  "that a damaged step partly overwrote: refusing a fresh start with them")
        if self.load_path is not None:
            return self._resume_from_load_path(state, strict)
        log.info("no valid checkpoint in %s%s: fresh start", self.root,
                 f" or {self.remote_storage.url}" if self.remote_storage is not None else "")
        return None

    def _load_newest(self, state, strict: bool, rank_local: str, *, step: Optional[int] = None,
                     keys: Optional[Tuple[str, ...]] = None) -> Optional[Tuple[int, str]]:
        """Load the newest valid step (or exactly ``step``: then its failure is raised, not skipped) into
        ``state``, agreed by every rank (:func:`~ckptstore.resume.first_valid_step`); sets ``resumed_from``.
        Returns ``(step, tier)`` or ``None`` when no step loads."""
        self.resumed_from = None
        self._touched = False
        remote_catalog = (Catalog(self.remote_storage, self._decoded) if self.remote_storage is not None
                          else None)
        pulled: set = set()

        def list_candidates():
            nonlocal remote_catalog
            if step is not None:                      # an empty list: restore raises FileNotFoundError
                tier = self._tier_of(step)
                return [(step, tier)] if tier is not None else []
            listed, reachable = self._listing(remote_catalog)
            if not reachable:
                remote_catalog = None                 # no repairs from an unreachable remote either
            return listed

        def attempt(s, tier):
            return self._resume_step(state, s, tier, remote_catalog, pulled, strict, rank_local, keys)
        found = first_valid_step(list_candidates, attempt, coord=self._coord, timeout=self.collective_timeout,
                                 tag=self._coord.next_tag("resume") if self._coord is not None else None,
                                 substitute=step is None)
        if found is not None:
            s, tier = found
            self.resumed_from = {"tier": tier, "step": s, "url": self.root if tier == "local" else
                                 self.remote_storage.url, "manifests_read": self._manifests_read}
            if keys is not None:
                self.resumed_from["keys"] = list(keys)
            log.info("restored step %d (%s)%s", s, tier, f", keys {list(keys)}" if keys is not None else "")
        return found

    def _resume_step(self, state, step, tier, remote_catalog, pulled, strict, rank_local, keys=None) -> str:
        """Load ``step`` into ``state`` for this rank: pull it first when this root lacks it, repair it from
        the remote when the local copy is damaged. Returns the tier it came from; raises CheckpointError."""
        if not self.catalog.is_committed(step):
            if remote_catalog is None:
                raise CorruptCheckpointError("not committed in this rank's root and no remote to pull from",
                                             step=step)
            # reads of the step chosen are retried (the listing is not: an unreachable remote must not hold
            # up a resume from local steps); a failed read would otherwise count as damage
            remote = with_read_retries(self.remote_storage, self._upload_retry)
            step_catalog = Catalog(remote, self._decoded)
            saved = step_catalog.read_commit_bytes(step)
            if (saved[1].world_size != self.world_size and saved[1].world_size > 1) or self.read_only:
                # Written by another layout of ranks: its parts are not this rank's to keep. Each rank reads
                # straight from the remote only the ranges its targets overlap (through the step's shard map),
                # instead of every node pulling every rank's part.
                self._restore(state, step_catalog, BlobStore(remote, quarantine=False), step,
                              strict=strict, check_config=True, rank_local=rank_local, commit=saved[1],
                              components=keys)
                self._run_id = saved[1].run_id or self._run_id
                return "remote"
            self._pull(step, ranks=parts_needed(saved[1].world_size, self.world_size, self.rank), source=saved)
            pulled.add(step)
            tier = "remote"
        try:
            self._restore(state, self.catalog, self.blobs, step, strict=strict, check_config=True,
                          rank_local=rank_local, components=keys)
        except CorruptCheckpointError as e:
            if remote_catalog is None or step in pulled or not _quiet(lambda: remote_catalog.is_committed(step)):
                raise
            if self.read_only:
                log.warning("local step %d is damaged (%s): reading it from %s", step, e, self.remote_storage.url)
                catalog, blobs = self._remote_reader()
            else:
                log.warning("local step %d is damaged (%s): repairing it from %s", step, e,
                            self.remote_storage.url)
                self._pull(step)
                catalog, blobs = self.catalog, self.blobs
            self._restore(state, catalog, blobs, step, strict=strict, check_config=True,
                          rank_local=rank_local, components=keys)
            tier = "remote"
        self._adopt_run_id(step)
        return tier

    def _adopt_run_id(self, step: int) -> None:
        """After resuming ``step``: this run's id is the one its commit marker records (every rank reads it)."""
        try:
            rid = self.catalog.read_commit(step).run_id
        except CheckpointError:
            return
        if rid:
            self._run_id = rid

    def _restore(self, state, catalog, blobs, step, *, strict, check_config, components=None,
                 rank_local: str = "error", commit: Optional[Commit] = None) -> None:
        """Load ``step`` from ``catalog`` / ``blobs`` into ``state`` (:func:`ckptstore.resume.restore_into`),
        checking the run config first; ``commit``: its marker, when the caller read it already. Raises
        Corrupt/IncompatibleCheckpointError."""
        commit = commit if commit is not None else catalog.read_commit(step)
        if check_config:
            diffs = differences(commit.config, self.config, self.config_may_change)
            if diffs:
                raise IncompatibleCheckpointError("run config differs from the checkpoint's", step=step,
                                                  differing=diffs)
        loader = StepLoader(catalog, blobs, commit, rank=self.rank, world_size=self.world_size,
                            executor=self._pool, read_nodes=self._read_nodes)
        try:
            restore_into(state, loader, strict=strict, components=components, rank_local=rank_local)
        finally:
            self._touched = self._touched or loader.touched
            self._manifests_read = loader.manifests_read

    def _read_nodes(self, blobs, manifest, **kw):
        """:func:`read_nodes`; a chunk of this store found damaged is dropped from the chunk index, so the next
        save writes a good copy instead of referencing it."""
        try:
            return read_nodes(blobs, manifest, executor=self._pool, **kw)
        except CorruptCheckpointError as e:
            if blobs is self.blobs and e.blob and len(e.blob) == 64:
                self._index.forget(chunk_ids=[e.blob])
            raise

    def _resume_from_load_path(self, state, strict) -> Optional[int]:
        url, step = split_load_path(self.load_path)
        if step is None:
            weights = hub.open_weights(url, self.storage_options,
                                       wrap=lambda s: with_read_retries(s, self._upload_retry))
            if weights is not None:                  # Hub-format weights (safetensors): a weights-only start
                return self._start_from_weights(state, *weights)
        storage = with_read_retries(open_storage(url, self.storage_options), self._upload_retry)
        catalog, blobs = Catalog(storage), BlobStore(storage, quarantine=False)
        steps = [step] if step is not None else list(reversed(catalog.committed_steps()))
        if step is not None and not catalog.is_committed(step):
            raise CheckpointError(f"load_path {storage.url}: step {step} is not committed")
        for s in steps:
            try:
                self._restore(state, catalog, blobs, s, strict=strict, check_config=False,
                              components=self.load_components)
            except CorruptCheckpointError as e:
                if step is not None:
                    raise
                log.warning("load_path %s: step %d is damaged, trying an older one: %s", storage.url, s, e)
                continue
            self.resumed_from = {"tier": "load_path", "step": s, "url": storage.url,
                                 "components": list(self.load_components) if self.load_components else None}
            log.info("no checkpoint of this run yet: initialised from %s step %d%s", storage.url, s,
                     f" (components {list(self.load_components)})" if self.load_components else "")
            return None if self.load_components is not None else s
        raise CheckpointError(f"load_path {storage.url} holds no valid committed step")

    def _start_from_weights(self, state, storage, files, weight_map) -> None:
        """``load_path`` names safetensors weights (see :mod:`ckptstore.hub`): load them into one top-level
        key of ``state``; the run starts fresh (returns ``None``), ``resumed_from`` says what was loaded."""
        key = hub.target_key(state, self.load_components, storage.url)
        hub.apply_weights(state, hub.read_weights(storage, files, weight_map), key, storage.url)
        self.resumed_from = {"tier": "load_path", "step": None, "url": storage.url, "components": [key],
                             "files": list(files)}
        log.info("no checkpoint of this run yet: initialised state[%r] from %s (%d safetensors file(s))", key,
                 storage.url, len(files))
        return None

    def pull(self, step: Optional[int] = None) -> int:
        """Copy a committed step of ``remote`` (default: its newest committed step) into the local root,
        verifying every blob. A pack the step reads little of is pulled by range into new local packs (see
        FORMAT.md "Ranged pulls"); ``pulled`` records what each pull fetched. Returns the step. Raises
        ``FileNotFoundError`` if the remote has none."""
        self._check_open()
        self._check_writable("pull")
        if self.remote_storage is None:
            raise CheckpointError("pull needs Store(..., remote=URL)")
        remote_catalog = Catalog(self.remote_storage)
        if step is None:
            steps = remote_catalog.committed_steps()
            if not steps:
                raise FileNotFoundError(f"no committed step in {self.remote_storage.url}")
            step = steps[-1]
        elif not remote_catalog.is_committed(check_step(step)):
            raise FileNotFoundError(f"step {step} is not committed in {self.remote_storage.url}")
        self._pull(step)
        return step

    def _pull(self, step: int, ranks: Optional[List[int]] = None,
              source: Optional[Tuple[bytes, Commit]] = None) -> None:
        """Copy a committed remote step (``ranks``' parts only, if given) into the local root (blobs
        verified), then mark it committed here. ``source``: its remote commit marker (bytes, decoded), when
        the caller read it already."""
        copier = StepCopier(self.remote_storage, self.storage, retry=self._upload_retry, decoded=self._decoded,
                            ranged=transfer.RANGED_PULL_THRESHOLD, pack_target=self.packing.target_size)
        try:
            with self._maint:
                stats = copier.copy_step(step, ranks=ranks, source=source)
                self._point_to_if_newest(step)
        finally:
            copier.close()
        log.info("pulled step %d from %s: %d objects, %d bytes written, %d bytes fetched (%d pack(s) whole, "
                 "%d by %d range(s)) in %.2f s", step, self.remote_storage.url, stats.blobs_copied,
                 stats.bytes_copied, stats.bytes_fetched, stats.packs_whole, stats.packs_ranged,
                 stats.ranges_fetched, stats.seconds)
        self.pulled.append(stats)

    # -- maintenance --------------------------------------------------------------------------------------
    def gc(self, *, grace_seconds: float = 3600.0, dry_run: bool = False, force: bool = False,
           repack: Optional[float] = 0.5, wait_seconds: float = 600.0) -> GCReport:
        """Garbage-collect unreferenced blobs and packs, uncommitted step directories, replaced manifests and
        temp files older than ``grace_seconds``; first repack every pack whose live bytes are below ``repack``
        (a fraction of its size; ``None``: no repack). See :func:`ckptstore.gc.collect`.

        Waits for this store's save in flight, then takes the gc lease and waits up to ``wait_seconds`` for
        saves in flight elsewhere (other ranks, other processes); past that, nothing is deleted and
        ``GCReport.deferred`` says who was in the way."""
        self._check_open()
        self._check_writable("gc")
        handle = self._inflight
        if handle is not None:
            futures_wait([handle._future])         # its error, if any, stays for wait() / the next save
        with self._maint:
            r = collect(self.storage, self.catalog, self.blobs, grace_seconds=grace_seconds, dry_run=dry_run,
                        force=force, index=self._index, repack=repack, wait=wait_seconds,
                        buffers=self._pack_buffers)
            if r.packs_repacked:
                self._index.clear()                  # its packs were retired: learn the new locations
                self._versions.clear()
            return r

    def verify(self, step: Optional[int] = None) -> Dict[int, Optional[str]]:
        """Check every blob of the given step (default: all committed steps) by reading and hashing it.
        Returns step -> ``None`` (valid) or the error message. Reads every byte; nothing is loaded."""
        self._check_open()
        steps = [step] if step is not None else self.catalog.committed_steps()
        out: Dict[int, Optional[str]] = {}
        for s in steps:
            try:
                commit = self.catalog.read_commit(s)
                if commit.shards is not None:
                    self.catalog.read_shard_map(commit)
                for rank in sorted(commit.manifests):
                    self._verify_manifest(self.catalog.read_manifest(commit, rank))
                out[s] = None
            except CheckpointError as e:
                out[s] = str(e)
        return out

    def _verify_manifest(self, manifest: Manifest, batch_bytes: int = 64 << 20) -> None:
        """Read and hash every distinct chunk of ``manifest`` in bounded memory: sizes are checked against the
        files first, at most ``batch_bytes`` of small packed chunks are held at once, and blobs and large
        chunks are hashed as streams. Read-only: nothing is quarantined. Raises ``CorruptCheckpointError`` for
        the first bad chunk."""
        stored_sizes(self.blobs, manifest, manifest.nodes, executor=self._pool, quarantine=False)
        seen, futures, batch, held = set(), [], [], 0

        def flush():
            nonlocal batch, held
            for f in read_chunks(self.storage, batch, executor=self._pool, gap=self.storage.coalesce_gap):
                f.result()
            batch, held = [], 0
        for node, entry in manifest.arrays():
            for c in entry.chunks:
                if c.blob_id in seen:
                    continue
                seen.add(c.blob_id)
                key = path_str(node.path)
                if c.pack is None:
                    futures.append(self._pool.submit(self.blobs.verify, c.blob_id, c.codec, c.nbytes,
                                                     step=manifest.step, key=key))
                elif c.nbytes > _STREAM_VERIFY_BYTES:
                    futures.append(self._pool.submit(_verify_packed_stream, self.storage, c, manifest.step, key))
                else:
                    batch.append(ReadItem(c, memoryview(bytearray(c.nbytes)), manifest.step, key))
                    held += c.nbytes
                    if held >= batch_bytes:
                        flush()
        flush()
        for f in futures:
            f.result()

    def delete_step(self, step: int, *, remote: bool = True, force: bool = False) -> None:
        """Remove a step the trainer no longer wants (Lightning's top-k rotation, torchtitan's
        ``keep_latest_k``): locally at once (commit marker first; its blobs are freed by the next retention
        sweep or :meth:`gc`), and with ``remote=True`` from the remote this store uploads to, on the uploader's
        thread once every upload queued before this call is done (a waiting upload of the step is dropped; a
        failure is raised like an upload's). Deleting a step that is not there is a no-op.

        Raises ``CheckpointError`` for the newest committed step (local or on the remote: the run must keep
        something to resume from; ``force=True`` deletes it locally all the same, an operator's choice, and the
        remote's newest step is never deleted) and for the step a save in flight writes; also on a
        ``read_only`` store."""
        self._check_open()
        self._check_writable("delete_step")
        check_step(step)
        inflight = self._inflight
        if inflight is not None and not inflight.done() and inflight.step == step:
            raise CheckpointError(f"step {step} is being saved: it cannot be deleted now")
        if step == self._newest_committed() and not force:
            raise CheckpointError(f"step {step} is the newest committed step of {self.root}: it is never deleted "
                                  "(save a newer one first)")
        uploader = self._uploader
        # An upload of this step in progress reads its local files, and a derivation of the uploader's work (at
        # its start) may queue it: hold the uploader still while the local copy goes (waits only then).
        busy = uploader is not None and (step in uploader.pending() or uploader.busy_deriving())
        with (uploader.paused() if busy else _null()):
            if remote and uploader is not None and not uploader.parts_only:
                uploader.delete_after_uploads(step)           # drops a waiting upload of the step
                self._remote_metrics_cache.pop(step, None)
            with self._maint:
                self._point_away_from(step)
                self.catalog.delete_step(step)
        self._metrics_cache.pop(step, None)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"store {self.root} is closed")

    def _check_writable(self, what: str) -> None:
        if self.read_only:
            raise CheckpointError(f"store {self.root} was opened read_only: {what} is not allowed")

    def close(self) -> None:
        """Wait for the save in flight and for uploads, release threads and staging memory. Idempotent.

        Raises the in-flight save's or an upload's error if nobody has seen it yet (the store is closed all
        the same; committed steps not yet uploaded are uploaded when the store is opened again)."""
        if self._closed:
            return
        try:
            try:
                self.wait()
            finally:
                try:
                    if self._uploader is not None:
                        self._uploader.close()
                finally:
                    self._end_write(self._op)
                    if self._writer_lease is not None:
                        self._writer_lease.release()
        finally:
            self._closed = True
            self._coord = None                      # holds the process group's key-value store: let it go
            self._bg.shutdown(wait=True)
            self._bg_pool.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self._staging.clear()
            self._pack_buffers.clear()
            self.storage.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:                                   # do not mask the exception already propagating
            self.close()
        except Exception as e:
            log.error("while closing %s after an error: %s", self.root, e)

    def __repr__(self) -> str:
        return f"Store({self.root!r}, rank={self.rank}, world_size={self.world_size})"


_STREAM_VERIFY_BYTES = 16 << 20


def _verify_packed_stream(storage, c, step, key) -> None:
    """Hash one large packed chunk as a stream (``verify`` holds at most a few MiB per chunk)."""
    import zstandard
    try:
        ok, got = stream_check(storage, pack_path(c.pack), c.codec, nbytes=c.nbytes, blob_id=c.blob_id,
                               offset=c.offset, stored=c.stored)
    except OSError as e:
        raise CorruptCheckpointError(f"pack unreadable ({e.strerror or e})", step=step, key=key,
                                     blob=c.blob_id) from None
    except (ValueError, zstandard.ZstdError) as e:
        raise CorruptCheckpointError(f"chunk unreadable ({e}) (pack {c.pack})", step=step, key=key,
                                     blob=c.blob_id) from None
    if not ok:
        raise CorruptCheckpointError(f"chunk content does not match its hash (pack {c.pack})", step=step,
                                     key=key, blob=c.blob_id)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _quiet(fn) -> bool:
    try:
        return bool(fn())
    except Exception:
        return False


def _local_path(root) -> str:
    root = os.fspath(root)
    return root[len("file://"):] if root.startswith("file://") else root
