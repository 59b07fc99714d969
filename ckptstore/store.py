"""``Store``: the facade training code calls. It wires the parts and owns no format and no orchestration of its
own: the option objects are checked by :mod:`ckptstore.orchestration.options`, the shared parts are one
:class:`~ckptstore.orchestration.parts.Parts`, and each concern runs in the module that owns it (saving, loading,
maintenance in :mod:`ckptstore.orchestration`; the memory tier in :mod:`ckptstore.memtier`; the layers: the
:mod:`ckptstore` docstring). Public methods check once that the store is open (and writable) and delegate.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Dict, Iterable, List, Mapping, MutableMapping, Optional, Tuple, Union

from .util.errors import CheckpointError
from .lifecycle.gc import GCReport
from .orchestration.loading import Loader
from .orchestration.maintenance import Maintenance
from .format.manifest import Commit
from .memtier.memory import Memory, check_memory_option
from .orchestration.options import Remote, Writing, store_options
from .orchestration.parts import Parts, default_rank_world
from .io.reader import MapLocation
from .lifecycle.retention import Retention
from .orchestration.saving import SaveHandle, SaveResult, Saver
from .storage import Storage, open_storage
from .memtier.tiering import MemoryTier

log = logging.getLogger("ckptstore")

__all__ = ["Store", "SaveHandle", "SaveResult"]


def _guard(write: Optional[str] = None):
    """The check a public method of :class:`Store` makes first, written once: the store is open, and for a
    method that writes (``write``: its name), not ``read_only``. Raises ``CheckpointError``."""
    def decorate(method):
        @functools.wraps(method)
        def guarded(self: "Store", *args, **kwargs):
            if self._closed:
                raise CheckpointError(f"store {self.root} is closed")
            if write is not None and self.read_only:
                raise CheckpointError(f"store {self.root} was opened read_only: {write} is not allowed")
            return method(self, *args, **kwargs)
        return guarded
    return decorate


class Store:
    """A checkpoint store rooted at a local directory.

    Args:
        root: local directory (a path or ``file://`` URL); created if missing.
        config: mapping describing the run (hyperparameters), recorded with every step; ``resume`` raises
            ``IncompatibleCheckpointError`` listing each differing key when it differs, except keys named in
            ``config_may_change`` (dotted names; a name covers the keys below it).
        rank, world_size: default from ``torch.distributed`` when initialised, else ``RANK`` / ``WORLD_SIZE``
            environment variables, else 0 / 1. Each rank writes its own manifest, rank 0 the commit marker once
            every part is durable. Under a process group of this world size ``save`` and ``resume`` are collective
            (:mod:`ckptstore.distributed.commit`, :mod:`ckptstore.io.restore`); without one, rank 0 polls the shared
            root for the other ranks' manifests. To save from one process alone while a process group exists
            (e.g. a consolidated export on rank 0), pass ``rank=0, world_size=1``.
        collective_timeout: seconds a rank waits for the others in a collective save / resume (default
            600) before raising ``CommitError`` naming the ranks that did not arrive.
        writing: a :class:`~ckptstore.orchestration.options.Writing`: how saves write (chunk size, codec, threads,
            O_DIRECT, packing, opt-in change detection).
        keep: a :class:`~ckptstore.lifecycle.retention.Retention`: the steps to keep, and those never deleted
            whatever the policy (the newest, the best (:meth:`best_step`), a step whose upload is pending, the
            step being saved). Applied after every commit (rank 0, and the leader of each other root), then a
            sweep of what no kept step references; with ``remote``, to the remote too after each upload
            (``Remote(keep_local=)`` may keep fewer locally). The rules: FORMAT.md "Retention".
        on_rewind: what ``save`` does with a step lower than or equal to the newest committed one (locally, or
            on the remote this store uploads to): ``"error"`` (default) raises ``IncompatibleCheckpointError``
            naming both steps; ``"truncate"`` first drops the later steps (locally and on the remote; the
            latest pointers move back, see FORMAT.md "Rewinding a run") and re-saves the step as a new manifest
            generation if it was committed: a run rolled back after a loss spike continues on a clean timeline.
        storage_options: fsspec options (endpoint, credentials, ...) for ``remote``, ``load_path`` and a
            ``root`` given as a URL. Credentials are never written to manifests, logs or error messages.
        create: create a missing local root (``False``: raise ``FileNotFoundError``).
        remote: an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``, ``file://...``) to
            which every committed step is uploaded in the background, in commit order, or a
            :class:`~ckptstore.orchestration.options.Remote` with its upload knobs (workers, retries, backlog,
            read-only use, ``keep_local``).
        load_path: where to start from when the run has no checkpoint of its own: a store URL (its newest
            valid step), ``<store URL>/steps/<step>`` (that step, zero-padded to 12 digits or not), or Hub-format
            weights, never unpickled (a ``.safetensors`` file, or a ``save_pretrained`` directory: see
            :mod:`ckptstore.io.hub`), loaded into ``state["model"]`` (or the one key ``load_components`` names).
        load_components: take only these top-level keys from ``load_path`` (e.g. ``("model",)`` for
            weights-only fine-tuning); the other entries of ``state`` keep their fresh values.
        memory: a :class:`~ckptstore.memtier.memory.Memory`: a RAM-backed tier in front of ``root`` (the disk)
            and the remote, with its own cadence, capacity, promotion to disk and peer replication (its docstring;
            FORMAT.md "The memory tier"). ``save`` of a step due for no tier returns ``None``; every read looks at
            memory first (:meth:`step_tiers`). Collective to construct when it replicates (a gloo group of its
            own). Not with ``read_only`` (``ValueError``).
        read_only: open the store to read only (a rank that only loads, a second process inspecting a run):
            no uploader, no writer lease, no retention; a step only the remote holds is read straight from it,
            never pulled into ``root``. :meth:`save`, :meth:`pull`, :meth:`gc` and :meth:`delete_step` raise
            ``CheckpointError``.
    """

    def __init__(self, root, *, config: Optional[Mapping[str, Any]] = None,
                 config_may_change: Iterable[str] = (), rank: Optional[int] = None,
                 world_size: Optional[int] = None, remote: Union[str, Remote, None] = None,
                 storage_options: Optional[Mapping[str, Any]] = None, keep: Optional[Retention] = None,
                 writing: Optional[Writing] = None, load_path: Optional[str] = None,
                 load_components: Optional[Iterable[str]] = None, collective_timeout: float = 600.0,
                 on_rewind: str = "error", read_only: bool = False, create: bool = True,
                 memory: Optional[Memory] = None):
        writing, remote = store_options(writing, remote, keep, on_rewind)
        check_memory_option(memory, read_only)
        self.rank, self.world_size = default_rank_world(rank, world_size)
        storage = open_storage(root, storage_options, direct_io=writing.direct_io, create=create)
        self._closed = False
        p = self._parts = Parts(storage, rank=self.rank, world_size=self.world_size, writing=writing,
                                remote=remote, storage_options=storage_options, keep=keep, config=config,
                                collective_timeout=collective_timeout, read_only=bool(read_only))
        self._maintenance = Maintenance(p)
        self._saver = Saver(p, on_rewind=on_rewind, retain=self._maintenance.after_commit)
        self._loader = Loader(p, config_may_change=config_may_change, load_path=load_path,
                              load_components=load_components, pull=self._maintenance.pull_step)
        # what callers and tools read (the options as given, the parts this store opened)
        self.storage: Storage = storage
        self.root = p.root
        self.catalog, self.blobs, self.remote_storage = p.catalog, p.blobs, p.remote_storage
        self.config, self.config_may_change = p.config, self._loader.config_may_change
        self.writing, self.remote, self.keep, self.on_rewind = writing, remote, keep, on_rewind
        self.read_only, self.collective_timeout, self.storage_options = p.read_only, p.collective_timeout, \
            p.storage_options
        self.load_path, self.load_components = load_path, self._loader.load_components
        self.pulled = self._maintenance.pulled      # what each pull into this root did, oldest first
        self._maintenance.open_uploader()
        self.memory = memory
        self._tier: Optional[MemoryTier] = None if memory is None else MemoryTier(
            memory, disk=p, disk_saver=self._saver, disk_loader=self._loader, writing=writing, config=config,
            config_may_change=config_may_change, on_rewind=on_rewind, disk_maintenance=self._maintenance)
        # saves and reads go to the memory tier when there is one (it falls back to disk)
        self._saves = self._saver if self._tier is None else self._tier
        self._reads = self._loader if self._tier is None else self._tier

    @property
    def resumed_from(self) -> Optional[Dict[str, Any]]:
        """Where the last :meth:`resume` / :meth:`restore` came from: ``{"tier": "memory"|"local"|"remote"|"load_path",
        "step": int, "url": str, "manifests_read": how many saved ranks' manifests this rank read (1 with an
        unchanged world size; with another, rank 0's and those whose shards overlap this rank's, see
        ckptstore.format.shardmap)}`` (``"keys"`` for a restore of some keys, ``"components"`` for ``load_path``; for
        ``"memory"`` also ``"peer_bytes"`` / ``"peer_objects"``: stored bytes and objects this rank received from
        peers to rebuild its node's parts, ``"peer_bytes_sent"``, and ``"rebuild_seconds"``), or ``None``."""
        return self._loader.resumed_from

    @property
    def run_id(self) -> str:
        """The run's stable id (uuid4 hex): created with the run's first commit, recorded in every commit
        marker, and the same after any resume (local or remote), so ``wandb.init(id=store.run_id,
        resume="allow")`` continues the same run after a restart. Before the first commit it is the id that
        commit will carry. Read from the newest local committed step when this process has neither resumed
        nor saved yet; ``resume`` adopts the resumed step's id (local or remote), on every rank."""
        return self._parts.run_id

    # -- saving -------------------------------------------------------------------------------------------
    @_guard(write="save")
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
        optimizer and scheduler under DDP: DDP's own guarantee; the saver's promise, not checked). Only rank 0
        calls their ``state_dict()`` and writes them; any rank and world size loads them from rank 0's manifest
        (FORMAT.md, manifest ``replicated``). Every rank must pass the same keys (else ``CommitError``); a
        replicated key may not hold DTensors (``ValueError``: they are sharded). Ignored by a store of one rank.

        ``blocking=True`` (default): returns a :class:`SaveResult` once the step is committed and durable on
        local disk. ``blocking=False``: returns a :class:`SaveHandle` as soon as every changed tensor is copied
        into reused staging memory (the *stall*); hashing, writing and the commit run in a background thread,
        and training may change its tensors right away. At most one save is in flight per store: a new
        ``save`` first waits for the previous one. A background failure is raised by the handle's
        ``result()``, else by the next ``save``, :meth:`wait` or :meth:`close` (whichever comes first, once).

        Under an initialised process group the save is collective (every rank calls it with the same step;
        DTensors are saved as their local shards): if any rank fails (in a Stateful, in flatten, in a write) or
        does not arrive within ``collective_timeout``, every rank raises the same ``CommitError`` naming the
        ranks and their errors (chained to its own), and nothing is committed (:mod:`ckptstore.distributed.commit`).

        Raises ``TypeError`` naming the key path of an unsupported value before anything is written;
        ``OSError`` from the disk (the step then stays invisible); ``CommitError`` as above.
        """
        return self._saves.save(state, step, metrics=metrics, blocking=blocking, names=names, replicated=replicated)

    def wait(self, timeout: Optional[float] = None) -> Optional[SaveResult]:
        """Wait for the non-blocking save in flight, if any (with ``memory``: the memory save; promotions go on
        as uploads do: :meth:`wait_for_uploads`), and return its result or ``None``; raise its unseen error."""
        return self._saves.wait(timeout)

    @_guard()
    def wait_for_uploads(self, timeout: Optional[float] = None) -> None:
        """Block until every committed step is on the remote (including a non-blocking save in flight).

        Raises :class:`~ckptstore.util.errors.UploadError` when an upload failed (after its retries / deadline) or
        ``timeout`` seconds passed. A no-op without ``remote``."""
        self.wait(timeout)
        if self._tier is not None:
            self._tier.wait_for_promotions(timeout)
        if self._parts.uploader is not None:
            self._parts.uploader.wait(timeout)

    # -- reading ------------------------------------------------------------------------------------------
    def steps(self) -> List[int]:
        """Committed steps of the local root and, with ``memory``, of the memory root: ascending, each once (not
        the remote's: :meth:`step_tiers`). Contents are verified when loaded, not here (README "Memory tier")."""
        return self._reads.steps()

    def step_tiers(self) -> Dict[int, List[str]]:
        """Committed step -> the tiers holding it, fastest first: ``"memory"``, ``"local"``, ``"remote"``."""
        return self._reads.step_tiers()

    def latest_step(self) -> Optional[int]:
        """The newest of :meth:`steps`, or ``None``."""
        return self._reads.latest_step()

    def commit_info(self, step: int) -> Commit:
        """The commit marker of ``step`` (memory's first): metrics, config, sizes. Raises CorruptCheckpointError."""
        return self._reads.commit_info(step)

    @_guard()
    def best_step(self) -> Optional[int]:
        """The best committed step of the run, derived from the commit markers (so it survives restarts): by
        ``keep``'s metric / mode when set, else by the criterion the newest commit marker records; local steps
        and, with ``remote``, the remote's (``keep_local`` may hold fewer locally). ``None``: no criterion,
        or no step has the metric. With ``memory``, the memory root's steps count too."""
        return self._reads.best_step()

    @_guard()
    def load(self, step: Optional[int] = None, map_location: MapLocation = "cpu", *,
             rank: Optional[int] = None) -> Dict[str, Any]:
        """Load a committed step into a nested dict of tensors, arrays and plain values (Stateful objects'
        ``state_dict()`` as saved). ``step=None``: the newest *valid* step over memory, the local root and the
        remote (another copy, then older steps are tried, with a warning, when one is corrupt); an explicit
        ``step`` is never substituted (its memory copy is read first, another tier's if that is damaged). A step
        only the remote holds is read straight from it (nothing is written locally). Not collective. Raises
        ``CorruptCheckpointError`` (naming step, key and blob), ``IncompatibleCheckpointError``, or
        ``FileNotFoundError`` when no tier holds a committed step / this step."""
        return self._reads.load(step, map_location, rank)

    def find(self, name: str) -> Optional[int]:
        """The newest committed step (memory, local, remote) whose commit marker carries ``name`` (see ``save(...,
        names=)``), or ``None``. Reads one commit marker per step, newest first; damaged markers are skipped."""
        return self._reads.find(name)

    @_guard()
    def resolve(self) -> Optional[Tuple[Optional[int], str]]:
        """The step :meth:`resume` would start from, without loading it: ``(step, tier)`` with ``tier`` one of
        ``"memory"`` (with ``memory=``: a step the nodes' memory roots hold whole), ``"local"``, ``"remote"``,
        ``"load_path"`` (``step`` is ``None`` when ``load_path`` names Hub-format weights), or ``None`` for a
        fresh start. A candidate counts when its commit marker reads and checks (digest, format) and, for the
        local root, this rank's manifest is there: one listing and about one marker read per tier; chunks are
        verified by the load itself (:meth:`restore` still falls back to an older step if they are damaged).
        Under torch.distributed it is collective: rank 0 decides and every rank gets its answer."""
        return self._reads.resolve()

    @_guard()
    def restore(self, state: MutableMapping[str, Any], step: Optional[int] = None, *,
                keys: Optional[Iterable[str]] = None, strict: bool = True, rank_local: str = "error") -> int:
        """Load a chosen committed step into ``state`` in place and return it: ``step=None`` is the step
        :meth:`resume` would take (memory first; an older one is taken, logged, when it is damaged); an explicit
        ``step`` is never substituted (a memory copy the nodes hold whole first, else the disk's or remote's).
        Unlike :meth:`resume` it never falls back to ``load_path`` or to a fresh start.

        ``keys``: restore only these top-level keys of ``state`` (each must be in the step and in ``state``;
        the others keep their values): a trainer that restores model, optimizer and RNG at different moments
        calls it once per group. ``strict`` (without ``keys``): the top-level keys of ``state`` and the step
        must match. Values are applied as by :meth:`resume` (DTensor targets resharded to this run's mesh); a
        step only the remote holds is pulled (read straight from the remote by a ``read_only`` store).
        Collective under torch.distributed, as ``resume`` is. ``resumed_from`` tells where it came from.

        Raises ``FileNotFoundError`` (no such committed step / none at all), ``CorruptCheckpointError`` (the
        explicit step is damaged, or every step is), ``IncompatibleCheckpointError`` (keys, shapes, config)."""
        self.wait()
        return self._reads.restore(state, step, keys=keys, strict=strict, rank_local=rank_local)

    @_guard()
    def resume(self, state: MutableMapping[str, Any], *, strict: bool = True,
               rank_local: str = "error") -> Optional[int]:
        """Restore ``state`` from the freshest valid checkpoint; return its step, or ``None`` (fresh start).

        Tiers, each fallback logged with its reason (FORMAT.md "Read order (resume)"): (1) local and (2) remote
        committed steps, newest first across both (a step held by both is read locally; a remote step is pulled
        into the local root, verified, unless another world size wrote it: each rank then reads the shards it
        needs straight from the remote; a damaged local step is repaired from the remote when it holds it);
        (3) ``load_path`` (with ``load_components``: then ``None`` is returned, as the run starts fresh); (4) fresh
        start. The run's own checkpoints always win over ``load_path``. Details of the choice: ``resumed_from``.

        Stateful values get ``load_state_dict``; other entries of ``state`` are replaced by the loaded values
        (tensors go back to the device they were saved from when it exists here, else CPU). ``strict=False``
        loads only the top-level keys present in both ``state`` and the checkpoint.

        **Under torch.distributed** ``resume`` is collective: the ranks agree on each candidate, so a step damaged
        for one rank falls back for all (:mod:`ckptstore.distributed.resume`). DTensor targets are filled in place
        for their current sharding, whatever world size and mesh saved the step (:mod:`ckptstore.io.restore`).
        Values that differ between the saved ranks and are not DTensors are *rank-local*: with another world size,
        ``rank_local="error"`` (default) raises ``IncompatibleCheckpointError`` naming them and both world sizes;
        ``rank_local="fresh"`` keeps this run's values for them (logged) and loads the rest.

        Raises ``IncompatibleCheckpointError`` when the run config differs (see ``config_may_change``), the
        top-level keys differ (``strict``), rank-local values meet another world size, or the format is newer
        than this library; ``CheckpointError`` when DTensor targets were partly filled from a step found
        damaged and no valid step remains to load into them; ``TransferError`` (naming the step) when a step
        cannot be read from the remote within ``Remote.retry``'s deadline (it may be intact: no fallback).
        """
        self.wait()
        return self._reads.resume(state, strict=strict, rank_local=rank_local)

    # -- maintenance --------------------------------------------------------------------------------------
    @_guard(write="pull")
    def pull(self, step: Optional[int] = None) -> int:
        """Copy a committed step of ``remote`` (default: its newest committed step) into the local root,
        verifying every blob. A pack the step reads little of is pulled by range into new local packs (see
        FORMAT.md "Ranged pulls"); ``pulled`` records what each pull fetched. Returns the step. Raises
        ``FileNotFoundError`` if the remote has none."""
        return self._maintenance.pull(step)

    @_guard(write="gc")
    def gc(self, *, grace_seconds: float = 3600.0, dry_run: bool = False, force: bool = False,
           repack: Optional[float] = 0.5, wait_seconds: float = 600.0) -> GCReport:
        """Garbage-collect unreferenced blobs and packs, uncommitted step directories, replaced manifests and
        temp files older than ``grace_seconds``; first repack every pack whose live bytes are below ``repack``
        (a fraction of its size; ``None``: no repack). See :func:`ckptstore.lifecycle.gc.collect`.

        Waits for this store's save in flight, then takes the gc lease and waits up to ``wait_seconds`` for
        saves in flight elsewhere (other ranks, other processes); past that, nothing is deleted and
        ``GCReport.deferred`` says who was in the way."""
        return self._maintenance.gc(grace_seconds=grace_seconds, dry_run=dry_run, force=force, repack=repack,
                                    wait_seconds=wait_seconds)

    @_guard()
    def verify(self, step: Optional[int] = None) -> Dict[int, Optional[str]]:
        """Check every blob of the given step (default: all committed steps) by reading and hashing it.
        Returns step -> ``None`` (valid) or the error message (``memory: ...`` for a damaged copy in the memory
        root, whose steps ``memory`` adds). Reads every byte; nothing is loaded."""
        return (self._tier or self._maintenance).verify(step)

    @_guard(write="delete_step")
    def delete_step(self, step: int, *, remote: bool = True, force: bool = False) -> None:
        """Remove a step the trainer no longer wants (Lightning's top-k rotation, torchtitan's
        ``keep_latest_k``): locally at once (commit marker first; its blobs are freed by the next retention
        sweep or :meth:`gc`), from this node's memory root with ``memory``, and with ``remote=True`` from the
        remote, on the uploader's thread once the uploads of the steps committed before this call are done (a
        waiting upload of the step is dropped, for good; a failure is raised like an upload's). Durable once it
        returns (recorded in the local root first; after a SIGKILL the next writer finishes it). A missing step
        is a no-op. Raises ``CheckpointError`` for the newest committed step of any tier (``force=True`` deletes
        it locally all the same, an operator's choice; the remote's newest step goes only once a newer one is
        uploaded), for a step being saved or promoted, and on a ``read_only`` store; ``OSError`` when the
        deletion cannot be recorded (nothing is deleted)."""
        (self._tier or self._maintenance).delete_step(step, remote=remote, force=force)

    # -- lifecycle ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight, uploads and remote deletions; apply ``keep`` to the local steps that
        waited for their upload; release threads and staging memory. Idempotent.

        Raises the in-flight save's or an upload's error if nobody has seen it yet (the store is closed all
        the same; committed steps not yet uploaded are uploaded when the store is opened again)."""
        if self._closed:
            return
        try:
            try:
                if self._tier is not None:
                    self._tier.close()
                self.wait()
            finally:
                try:
                    self._maintenance.close()       # uploads, remote deletions, then local retention
                finally:
                    self._saver.close()
        finally:
            self._closed = True
            self._parts.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception as e:
            if exc_type is None:
                raise
            log.error("while closing %s after an error: %s", self.root, e)   # do not mask the one propagating

    def __repr__(self) -> str:
        return f"Store({self.root!r}, rank={self.rank}, world_size={self.world_size})"
