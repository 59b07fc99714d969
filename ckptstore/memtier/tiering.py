"""The memory tier in front of the disk and the remote: saves at their own cadence, peer replication before a
memory commit, promotion to disk in commit order, capacity, and resume across every tier.

Data still flows one way: state -> memory root (chunks, packs, manifest) -> peers' memory roots (replicas) ->
memory commit marker -> (every ``disk_every``-th step) disk root, copied as stored -> disk commit marker ->
(every ``Remote.every``-th disk step) the remote, by the uploader. A :class:`MemoryTier` owns the memory root's
:class:`~ckptstore.orchestration.parts.Parts`, its :class:`~ckptstore.orchestration.saving.Saver` (with replication
as its ``before_commit`` step) and :class:`~ckptstore.orchestration.loading.Loader`; the disk store's saver
promotes, the disk store's loader is the fallback of :meth:`MemoryTier.resume` and :meth:`MemoryTier.resolve`.

Resume order (FORMAT.md "The memory tier"): the newest memory step that the nodes' memory roots hold whole
between them (every saved rank's part in some root, under one commit marker) and that is not older than any
rank's newest disk step; the parts a root lacks are rebuilt from the roots that hold them (every object
verified by its id), then every rank loads it from its own memory root. Any failure (a corrupt or missing
replica, a dead peer, a damaged chunk found while loading) is agreed by every rank and resume goes on, once,
to the disk and remote tiers and ``load_path``: never a restart loop, never a fresh start while an older valid
step exists. The remote is not read at all when memory holds the step.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from ..format.blobs import digest_bytes
from ..distributed.commit import root_identity
from ..util.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError
from ..format.layout import check_step, manifest_path, step_dir
from ..format.mtable import rows_here
from ..lifecycle.lease import read_epoch
from ..orchestration.loading import Loader
from ..orchestration.maintenance import Maintenance
from .memory import (FULL_SWEEP_EVERY, Memory, NodeLock, dropped_chunks, next_to_drop, over_keep, root_usage,
                     sweep)
from ..orchestration.options import Writing
from ..orchestration.parts import Parts, local_path
from ..format.pointers import point_away_from
from .replication import Link, ReplicationStats, Ring, rebuild, replicate, write_marker
from ..distributed.resume import agree_outcome
from ..orchestration.saving import Saver
from ..storage import open_storage

log = logging.getLogger("ckptstore")

# memory steps each rank reports when the ranks choose where to resume from
INVENTORY = 8


class MemoryTier:
    """The memory tier of one :class:`~ckptstore.store.Store` (see the module docstring). ``disk``: the store's
    parts, ``disk_saver`` promotes, ``disk_loader`` is the fallback of ``resume`` and ``resolve``,
    ``disk_maintenance`` verifies and deletes the disk's copies."""

    def __init__(self, memory: Memory, *, disk: Parts, disk_saver: Saver, disk_loader: Loader, writing: Writing,
                 config, config_may_change: Iterable[str], on_rewind: str, disk_maintenance: Maintenance):
        self.m = memory
        self.disk, self.disk_saver, self.disk_loader = disk, disk_saver, disk_loader
        self.disk_maintenance = disk_maintenance
        rank, world = disk.rank, disk.world_size
        storage = open_storage(local_path(memory.root), None, direct_io=False)
        self.p = Parts(storage, rank=rank, world_size=world, writing=writing, remote=None, storage_options=None,
                       keep=None, config=config, collective_timeout=disk.collective_timeout, read_only=False)
        self.ring = Ring(rank, world, memory.ranks_per_node(world), memory.replicas)
        self.link: Optional[Link] = None
        if self.ring.replicas > 0:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world):
                raise ValueError(f"Memory(replicas={memory.replicas}) across {self.ring.nodes} nodes needs an "
                                 "initialised torch.distributed process group of this world size")
            self.link = Link(memory.timeout)                 # collective: every rank, at Store construction
        self.lock = NodeLock(storage.local_path(""))
        self.saver = Saver(self.p, on_rewind=on_rewind, retain=self._retain,
                           before_commit=self._replicate if self.link is not None else None,
                           write_lock=self._write_phase)
        self._replica_rows: Dict[int, Dict[int, Tuple[bytes, int, int]]] = {}
        if self.link is not None:
            self.saver.after_table = self._write_replica_rows
        self._epoch = read_epoch(storage)
        self.loader = Loader(self.p, config_may_change=config_may_change, pull=self._no_pull)
        self.where = root_identity(storage.local_path("")).hex()
        self.p.adopt_run_id(disk.run_id)             # one run id for both tiers' commit markers
        self.replicated = ReplicationStats()         # what this rank's replication moved, in all
        self._lock = threading.Lock()
        self._promoting: Dict[int, Optional[Future]] = {}   # memory steps waiting for promotion (protected)
        self._promote_error: Optional[BaseException] = None
        self._capacity_warned = False
        self._sweeps = 0                             # memory sweeps this process ran (a full one every so often)
        self._resolved: Optional[int] = None         # the memory step resolve() chose (restore drops newer ones)
        self.failed: Optional[BaseException] = None  # why the last memory step tried did not load

    # -- saving ---------------------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, *, metrics, blocking: bool, names, replicated):
        """``Store.save`` with a memory tier: ``None`` when ``step`` is due for no tier; else the memory save's
        :class:`~ckptstore.orchestration.saving.SaveResult` / :class:`~ckptstore.orchestration.saving.SaveHandle`. A
        disk step is queued for promotion once its memory commit succeeded. Raises a failed promotion's error
        once."""
        self.raise_if_failed()
        if not self.m.due(step):
            return None
        promote = self.m.promoted(step)
        if promote:
            with self._lock:
                self._promoting[step] = None         # protected from memory retention from now on
        try:
            out = self.saver.save(state, step, metrics=metrics, blocking=blocking, names=names,
                                  replicated=replicated)
        except BaseException:
            self._unprotect(step)
            raise
        if promote:
            fields = (dict(metrics or {}), tuple(names))
            if blocking:
                self._queue_promotion(step, *fields)
            else:
                out._future.add_done_callback(lambda f, s=step: self._queue_promotion(s, *fields)
                                              if f.exception() is None else self._unprotect(s))
        return out

    @contextlib.contextmanager
    def _write_phase(self):
        """A memory save's write phase (see :class:`~ckptstore.memtier.memory.NodeLock`): the node lock shared, and what
        this rank believed present dropped when a sweep ran since it last looked."""
        with self.lock.shared():
            epoch = read_epoch(self.p.storage)
            if epoch != self._epoch:
                self.p.blobs.forget_all()
                self._epoch = epoch
            # Small chunks are never taken from an earlier save's pack: each memory save packs its own, so every
            # pack a part names is whole in it, and a peer rebuilding the part receives its chunks and nothing
            # else (an old pack reused for one unchanged chunk would cross whole, stale chunks and all)
            self.p.index.clear()
            yield

    def _replicate(self, step: int, gen: int, manifest) -> None:
        rows: Dict[int, Tuple[bytes, int, int]] = {}
        with self._lock:
            self._replica_rows = {step: rows}        # a save that did not commit leaves nothing behind
        stats = replicate(self.link, self.ring, self.p.storage, step, gen, manifest, rows=rows)
        self.replicated.add(stats)

    def _write_replica_rows(self, step: int, table_digest: bytes) -> None:
        """Once ``step`` is committed under a marker naming a manifest table: the rows of the replicas this rank
        took, in a rows file of this root (the leader's names this root's own ranks only), so that a rebuild
        or resume can find them (FORMAT.md "Manifest table")."""
        with self._lock:
            rows = self._replica_rows.pop(step, None)
        if rows:
            self.p.catalog.write_rows(step, table_digest, rows)

    def _queue_promotion(self, step: int, metrics: Dict[str, Any], names: Tuple[str, ...]) -> None:
        """Runs where the memory save of ``step`` ended (its thread): the promotion goes to the disk store's
        single background thread, so promotions run in commit order."""
        last = self.saver.last_committed
        if last is None or last[0] != step:
            self._unprotect(step)
            return
        _, _, manifest = last
        fut = self.disk.bg.submit(self._promote, step, manifest, metrics, names)
        with self._lock:
            if step in self._promoting:
                self._promoting[step] = fut

    def _promote(self, step: int, manifest, metrics, names) -> bool:
        try:
            return self.disk_saver.promote(step, self.p.storage, manifest, metrics=metrics, names=names)
        except BaseException as e:
            with self._lock:
                if self._promote_error is None:
                    self._promote_error = e
            log.error("promoting memory step %d to %s failed: %s: %s", step, self.disk.root, type(e).__name__, e)
            raise
        finally:
            self._unprotect(step)

    def _unprotect(self, step: int) -> None:
        with self._lock:
            self._promoting.pop(step, None)

    def raise_if_failed(self) -> None:
        """Raise a failed promotion's error, once."""
        with self._lock:
            e, self._promote_error = self._promote_error, None
        if e is not None:
            raise e

    def wait(self, timeout: Optional[float] = None):
        """The memory save in flight's result (see ``Store.wait``)."""
        return self.saver.wait(timeout)

    def wait_for_promotions(self, timeout: Optional[float] = None) -> None:
        """Block until every queued promotion ran; raise a failed one's error once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.saver.wait(timeout)
        while True:
            with self._lock:
                entries = list(self._promoting.values())
            if not entries:
                break
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"promotions to {self.disk.root} still running after {timeout} s")
            futs = [f for f in entries if f is not None]
            if len(futs) < len(entries):
                # a memory save has finished and its promotion is being queued on the save's thread (its
                # future's callbacks run after waiters are woken): look again in a moment
                time.sleep(0.005)
            for f in futs:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    f.result(left)
                except Exception:
                    pass
        self.raise_if_failed()

    # -- memory retention: keep and capacity ----------------------------------------------------------------
    def _retain(self, step: int, since: float, exclude: Optional[str]) -> bool:
        """After a memory commit this rank wrote (rank 0, the leader of each other node's root): drop the steps
        beyond ``keep``, then the oldest steps while the root holds more than ``capacity`` bytes; never the
        newest committed step, nor one waiting for promotion. Each drop is swept at once (content addressing:
        chunks a kept step references stay)."""
        p = self.p
        with self._lock:
            protected = set(self._promoting) | {step}
        committed = p.catalog.committed_steps()
        doomed = over_keep(committed, self.m.keep, protected)
        swept = False
        if doomed:
            candidates = dropped_chunks(p.catalog, doomed)
            for s in doomed:
                self._drop(s)
            swept = self._sweep(step, exclude, candidates)
        if self.m.capacity is None:
            return swept
        root = p.storage.local_path("")
        while root_usage(root) > self.m.capacity:
            s = next_to_drop(p.catalog.committed_steps(), protected)
            candidates = None if s is None else dropped_chunks(p.catalog, [s])
            if s is None:
                if not self._capacity_warned:
                    self._capacity_warned = True
                    log.warning("memory tier %s holds %d bytes, over its capacity of %d, with nothing left to drop "
                                "(the newest step and steps waiting for promotion stay)", p.root, root_usage(root),
                                self.m.capacity)
                break
            self._drop(s)
            if not self._sweep(step, exclude, candidates):
                break                                # deferred: another rank is saving; the next commit retries
            swept = True
        return swept

    def _drop(self, s: int) -> None:
        p = self.p
        point_away_from(p.storage, p.catalog, s)
        p.catalog.delete_step(s)
        log.debug("memory tier %s: dropped step %d", p.root, s)

    def _sweep(self, step: int, exclude: Optional[str], candidates=None) -> bool:
        """Sweep the memory root after a drop: the dropped steps' chunks (``candidates``, see
        :func:`~ckptstore.memtier.memory.sweep`), or every file on this process's first sweep and every
        :data:`~ckptstore.memtier.memory.FULL_SWEEP_EVERY`-th (what failed or killed saves left)."""
        p = self.p
        self._sweeps += 1
        if self._sweeps % FULL_SWEEP_EVERY == 1:
            candidates = None
        try:
            sweep(p.storage, p.catalog, self.lock, candidates)
        except Exception as e:
            log.error("memory tier %s: sweep after step %d failed: %s: %s", p.root, step, type(e).__name__, e)
            return False
        p.blobs.forget_all()                           # what this rank believed present may be gone
        return True

    # -- resume ---------------------------------------------------------------------------------------------
    def _no_pull(self, *a, **k):                       # pragma: no cover - the memory loader has no remote
        raise CheckpointError("the memory tier has no remote to pull from")

    def _inventory(self, only: Optional[int] = None) -> Dict[str, Any]:
        """This rank's memory root as the ranks' choice needs it: per committed step (newest ``INVENTORY``, or
        ``only`` that step), the commit marker's digest, its world size and the saved ranks whose manifest this
        root holds; plus this rank's newest disk step."""
        p = self.p
        steps: Dict[str, Any] = {}
        listed = p.catalog.committed_steps()[-INVENTORY:] if only is None else (
            [only] if p.catalog.is_committed(only) else [])
        for s in reversed(listed):
            try:
                data, commit = p.catalog.read_commit_bytes(s)
            except CheckpointError as e:
                log.warning("memory step %d is not usable here: %s", s, e)
                continue
            try:                        # a manifest table's rows: those this root holds
                rows = rows_here(commit.manifests)
            except CheckpointError as e:
                log.warning("memory step %d is not usable here: %s", s, e)
                continue
            held = [r for r, (_, size, g) in rows.items() if p.storage.size(manifest_path(s, r, g)) == size]
            rep = False                 # rank 0's manifest holds keys every rank reads (save(replicated=))
            if 0 in held:
                try:
                    rep = bool(p.catalog.read_manifest(commit, 0).replicated)
                except CheckpointError:
                    held.remove(0)
            steps[str(s)] = {"marker": digest_bytes(data), "world": commit.world_size, "held": held,
                             "rep": rep}
        disk = self.disk.catalog.committed_steps()
        return {"where": self.where, "steps": steps, "disk": disk[-1] if disk else None}

    def _choose_local(self, reports: List[Dict[str, Any]], only: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Rank 0: the memory step to resume from and the rebuild plan, or ``None`` (see the module
        docstring). ``only``: that step or ``None`` (a newer disk step does not count then)."""
        world = self.p.world_size
        roots: Dict[str, List[int]] = {}
        for r, rep in enumerate(reports):
            roots.setdefault(rep["where"], []).append(r)
        disk_newest = max([rep["disk"] for rep in reports if rep.get("disk") is not None], default=None)
        steps = sorted({int(s) for rep in reports for s in rep["steps"]}, reverse=True)
        for s in steps:
            if only is None and disk_newest is not None and s < disk_newest:
                log.info("memory steps are older than disk step %d: resuming from disk or remote", disk_newest)
                return None
            markers: Dict[str, Dict[str, set]] = {}
            worlds: Dict[str, int] = {}
            replicated: Dict[str, bool] = {}
            for where, ranks in roots.items():
                rep = reports[ranks[0]]["steps"].get(str(s))
                if rep is None:
                    continue
                markers.setdefault(rep["marker"], {})[where] = set(rep["held"])
                worlds[rep["marker"]] = rep["world"]
                replicated[rep["marker"]] = replicated.get(rep["marker"], False) or bool(rep.get("rep"))
            if not markers:
                continue
            marker = max(markers, key=lambda m: (len(markers[m]), m))
            held = markers[marker]
            saved_world = worlds[marker]
            if not all(any(r in h for h in held.values()) for r in range(saved_world)):
                log.warning("memory step %d: no node holds every saved rank's part (%s): not usable", s,
                            {w[:8]: sorted(h) for w, h in held.items()})
                continue
            holders = sorted(held, key=lambda w: roots[w][0])
            plan: List[List[int]] = []
            for where, ranks in sorted(roots.items(), key=lambda kv: kv[1][0]):
                have = held.get(where, set())
                # a rank reads its own part (and rank 0's replicated keys); another world size reshards
                # from any part (ckptstore.distributed.resume.parts_needed)
                need = set(range(saved_world)) if saved_world != world else (
                    set(ranks) | ({0} if replicated[marker] else set()))
                missing = sorted(need - have)
                for i, part in enumerate(missing):
                    # the root's leader receives every part, one after the other, so a chunk two parts share
                    # (data-parallel replicas) crosses once: it is there when the next part asks; the holding
                    # roots and their ranks send in turn, and roots that lost their parts rebuild at once
                    # (items of disjoint pairs run concurrently, see ckptstore.memtier.replication.rebuild)
                    srcs = [w for w in holders if part in held[w]]
                    src = roots[srcs[i % len(srcs)]]
                    plan.append([src[part % len(src)], ranks[0], part])
                if where not in held and not any(item[1] == ranks[0] for item in plan):
                    plan.append([roots[holders[0]][0], ranks[0], -1])     # the leader needs the marker
            return {"step": s, "marker": marker, "plan": plan,
                    "leaders": [ranks[0] for ranks in roots.values()]}
        return None

    def choose(self, only: Optional[int] = None) -> Optional[Dict[str, Any]]:
        """Collective: every rank's inventory to rank 0, its choice to every rank (``only``: of that step)."""
        rep = self._inventory(only)
        coord = self.p.coord
        if coord is None:
            return self._choose_local([rep], only)
        tag = coord.next_tag("memory-resume")
        reports = coord.gather(f"{tag}/inventory", rep, self.p.collective_timeout)
        choice = None
        if coord.rank == 0:
            choice = {"found": self._choose_local(reports, only), "leaders": sorted(_leaders(reports))}
        return coord.broadcast(f"{tag}/choice", choice, self.p.collective_timeout)

    def resume(self, state, *, strict: bool, rank_local: str) -> Optional[int]:
        """``Store.resume`` with a memory tier (see the module docstring): the newest memory step held whole by
        the nodes, rebuilt where a node lost it; else the disk store's resume (``disk_loader``: it sets aside the
        disk roots' committed steps newer than the step it resumed, see
        :meth:`~ckptstore.orchestration.loading.Loader.set_aside_newer`). Either way memory steps newer than the
        step resumed are dropped (a new timeline starts there: none of them is whole on the nodes)."""
        self.saver.wait()
        self.wait_for_promotions()           # they use the disk store's collectives: none may run beside resume
        choice = self.choose()
        found = choice.get("found") if self.p.coord is not None else choice
        leaders = choice.get("leaders", [0]) if self.p.coord is not None else [0]
        if found is not None:
            got = self._resume_memory(state, found, leaders, strict=strict, rank_local=rank_local)
            if got is not None:
                # no disk root holds a newer step (the choice refuses memory steps older than any rank's disk)
                self._drop_newer(got, leaders)
                return got
        step = self.disk_loader.resume(state, strict=strict, rank_local=rank_local)
        if step is None and self.loader._touched and self.disk_loader.resumed_from is None:
            raise CheckpointError(f"memory step {found['step'] if found else '?'} partly overwrote sharded (DTensor) "
                                  "values before it was found damaged, and no other step loads into them: "
                                  "refusing a fresh start with them")
        self._drop_newer(step, leaders)
        return step

    def _drop_newer(self, step: Optional[int], leaders: List[int]) -> None:
        """The leaders drop their memory root's step directories newer than ``step`` (``None``: all), logged;
        then every rank agrees, so no rank saves before they are gone. Memory steps are dropped, not set aside:
        a memory root is bounded RAM, and a step that did not load on every rank is no checkpoint of the job.
        Raises a leader's failure on every rank."""
        error: Optional[BaseException] = None
        if self.p.rank in leaders:
            try:
                newer = [s for s in self.p.catalog.step_dirs() if step is None or s > step]
                committed = [s for s in newer if self.p.catalog.is_committed(s)]
                for s in newer:
                    self._drop(s)
                if newer:             # an uncommitted one is a save the kill interrupted: routine
                    log.log(logging.WARNING if committed else logging.INFO, "memory tier %s: dropped steps %s "
                            "(committed: %s), newer than the step resumed from (%s)", self.p.root, newer,
                            committed, step)
            except Exception as e:
                error = e
        if self.p.coord is not None:            # no rank saves before every leader has dropped them
            error, _ = agree_outcome(self.p.coord, self.p.coord.next_tag("memory-drop"), step or 0, error,
                                     error is not None, self.p.collective_timeout)
        if error is not None:
            raise error

    def _agree(self, step: int, error: Optional[BaseException]) -> Optional[BaseException]:
        """Every rank's outcome -> the same verdict on every rank (``None``: all succeeded)."""
        if self.p.coord is None:
            return error
        error, _ = agree_outcome(self.p.coord, self.p.coord.next_tag("memory-rebuild"), step, error, False,
                                 self.p.collective_timeout)
        return error

    def _resume_memory(self, state, found: Dict[str, Any], leaders: List[int], *, strict: bool,
                       rank_local: str, keys: Optional[Iterable[str]] = None) -> Optional[int]:
        """Rebuild memory step ``found`` where a root lacks parts, then load it into ``state``: its step, or
        ``None`` (the failure, agreed by every rank, logged and kept in ``self.failed``)."""
        self.failed = None
        step, plan = int(found["step"]), [tuple(int(v) for v in item) for item in found["plan"]]
        t0 = time.perf_counter()
        stats = ReplicationStats()
        error: Optional[BaseException] = None
        marker = None
        if plan:
            try:
                if self.link is None:
                    raise CheckpointError(f"memory step {step}: parts are missing and no peers are set up "
                                          "(Memory.replicas=0)")
                stats, marker = rebuild(self.link, self.p.storage, self.p.catalog, step, found["marker"], plan,
                                        self.p.rank)
            except Exception as e:
                error = e
            error = self._agree(step, error)
            if error is None and marker is not None and self.p.rank in leaders:
                try:
                    write_marker(self.p.storage, step, marker)      # every part of this root is here now
                except Exception as e:
                    error = e
            error = self._agree(step, error)
        if error is not None:
            log.warning("memory step %d could not be rebuilt from peers (%s): trying disk and remote", step, error)
            self.failed = error
            return None
        try:
            got = self.loader.restore(state, step, keys=keys, strict=strict, rank_local=rank_local)
        except IncompatibleCheckpointError:
            raise
        except (CheckpointError, FileNotFoundError) as e:
            log.warning("memory step %d does not load (%s): trying disk and remote", step, e)
            self.failed = e
            return None
        self.disk_loader.resumed_from = dict(self.loader.resumed_from or {}, tier="memory", url=self.p.root,
                                             peer_bytes=stats.bytes_received, peer_objects=stats.objects_received,
                                             peer_bytes_sent=stats.bytes_sent,
                                             rebuild_seconds=time.perf_counter() - t0)
        self.disk.adopt_run_id(self.p.run_id)
        self.disk_loader._start_uploads()
        log.info("resumed memory step %d (%d bytes rebuilt from peers)", got, stats.bytes_received)
        return got

    def restore(self, state, step: Optional[int], *, keys: Optional[Iterable[str]], strict: bool,
                rank_local: str) -> int:
        """``Store.restore`` with a memory tier, once the memory save in flight and the promotions queued are
        done (they use the disk store's collectives, as restore does). The memory step ``resume`` would take
        (``step=None``: the newest the nodes hold whole, unless a disk step is newer) or ``step`` when the nodes
        hold it whole, rebuilt from peers where a node lacks parts; when there is none or it fails on any rank
        (logged), the disk store's ``restore`` of the same ``step`` (or of the newest valid disk / remote step).
        After :meth:`resolve` chose a memory step, restoring it drops the memory steps newer than it, as
        ``resume`` does."""
        if step is not None:
            check_step(step)
        self.saver.wait()
        self.wait_for_promotions()
        resolved, self._resolved = self._resolved, None
        choice = self.choose(step)
        found = choice.get("found") if self.p.coord is not None else choice
        leaders = choice.get("leaders", [0]) if self.p.coord is not None else [0]
        if found is not None:
            got = self._resume_memory(state, found, leaders, strict=strict, rank_local=rank_local, keys=keys)
            if got is not None:
                if resolved == got:
                    self._drop_newer(got, leaders)
                return got
        try:
            return self.disk_loader.restore(state, step, keys=keys, strict=strict, rank_local=rank_local)
        except FileNotFoundError as e:
            failed = self.failed if found is not None else None
            if step is None or failed is None:
                raise
            # the step is committed in memory, damaged there, and no other tier holds it: say so
            raise CorruptCheckpointError(f"memory copy does not load ({type(failed).__name__}: {failed}) and "
                                         f"no other tier holds the step ({e})", step=step) from failed

    def resolve(self):
        """``Store.resolve`` with a memory tier: ``(step, "memory")`` when resume would take a memory step
        (whole between the nodes; its chunks are verified by the load), else the disk store's ``resolve()``."""
        self._resolved = None
        choice = self.choose()
        found = choice.get("found") if self.p.coord is not None else choice
        if found is not None:
            self._resolved = int(found["step"])
            self.disk_loader._resolved = None       # restore of this step is the memory tier's
            return int(found["step"]), "memory"
        return self.disk_loader.resolve()

    # -- what one rank sees: steps, markers, load (not collective) --------------------------------------------
    def steps(self) -> List[int]:
        """Committed steps of the memory root and the disk root, ascending, each once."""
        return sorted(set(self.p.catalog.committed_steps()) | set(self.disk_loader.steps()))

    def latest_step(self) -> Optional[int]:
        """The newest committed step of the memory root and the disk root, or ``None``."""
        mem = self.p.catalog.committed_steps()
        disk = self.disk_loader.latest_step()
        return max([s for s in (mem[-1] if mem else None, disk) if s is not None], default=None)

    def step_tiers(self) -> Dict[int, List[str]]:
        """Committed step -> ``["memory", "local", "remote"]``, the tiers holding it (fastest first)."""
        out = {s: ["memory"] for s in self.p.catalog.committed_steps()}
        for s, tiers in self.disk_loader.step_tiers().items():
            out.setdefault(s, []).extend(tiers)
        return dict(sorted(out.items()))

    def commit_info(self, step: int):
        """The commit marker of ``step``: the memory root's, else (none, or damaged: logged) the disk root's."""
        if self.p.catalog.is_committed(step):
            try:
                return self.p.catalog.read_commit(step)
            except CheckpointError as e:
                if not self.disk.catalog.is_committed(step):
                    raise
                log.warning("memory step %d: commit marker damaged (%s): reading the disk's", step, e)
        return self.disk_loader.commit_info(step)

    def find(self, name: str) -> Optional[int]:
        """The newest committed step of any tier whose commit marker carries ``name`` (memory markers newest
        first, then the disk store's ``find``); damaged markers are skipped."""
        for s in reversed(self.p.catalog.committed_steps()):
            try:
                if name in self.p.catalog.read_commit(s).names:
                    disk = self.disk_loader.find(name)
                    return s if disk is None else max(s, disk)
            except CheckpointError:
                continue
        return self.disk_loader.find(name)

    def load(self, step: Optional[int], map_location, rank: Optional[int]) -> Dict[str, Any]:
        """``Store.load`` with a memory tier. ``step``: read from the memory root when it holds the step, else
        (not there, or damaged / this rank's part missing there: logged) from the disk store's tiers; ``None``:
        the newest step across memory, disk and remote, newest first, the memory copy of a step first; a copy
        that does not read (verified) is logged and the next one tried. Raises as ``Store.load``."""
        def read(s: int, tier: str) -> Dict[str, Any]:
            if tier == "memory":
                return self.loader.read_step(s, map_location=map_location, rank=rank)
            return self.disk_loader.read_step(s, map_location=map_location, rank=rank, tier=tier)
        if step is not None:
            check_step(step)
            if self.p.catalog.is_committed(step):
                try:
                    return read(step, "memory")
                except CorruptCheckpointError as e:
                    if self.disk_loader.tier_of(step) is None:
                        raise
                    log.warning("memory step %d does not read here (%s): reading another tier's copy", step, e)
            return self.disk_loader.load(step, map_location, rank)
        tried = [(s, "memory") for s in self.p.catalog.committed_steps()] + self.disk_loader.candidates()
        for s, tier in sorted(tried, key=lambda c: (-c[0], c[1] != "memory")):
            try:
                return read(s, tier)
            except CorruptCheckpointError as e:
                log.warning("step %d (%s) is corrupt, trying another copy or an older step: %s", s, tier, e)
        raise FileNotFoundError(f"no valid committed step in {self.p.root}, {self.disk.where()}")

    # -- what Store's best_step, verify and delete_step do with a memory tier -----------------------------------
    def best_step(self) -> Optional[int]:
        """``Store.best_step`` over the memory root's commit markers too (they carry the step's metrics)."""
        return self.disk_loader.best_step(self.p.catalog.readable_commits())

    def verify(self, step: Optional[int]) -> Dict[int, Optional[str]]:
        """``Store.verify`` of the disk root's steps and the memory root's (``step``: the copies of that step
        the two hold, or the disk's answer when neither does). A step both hold is valid when both copies
        are; a damaged memory copy's error starts with ``memory:``."""
        mem = self.p.catalog.committed_steps()
        wanted = mem if step is None else [s for s in mem if s == step]
        out: Dict[int, Optional[str]] = {}
        disk = set(self.disk.catalog.committed_steps())
        if step is None or step in disk or not wanted:
            out.update(self.disk_maintenance.verify(step))
        for s, err in Maintenance(self.p).verify_steps(wanted).items():
            if err is not None or s not in out:
                out[s] = out.get(s) or (None if err is None else f"memory: {err}")
        return dict(sorted(out.items()))

    def delete_step(self, step: int, *, remote: bool, force: bool) -> None:
        """``Store.delete_step`` with a memory tier: the disk root's and the remote's copies as without one,
        then this node's memory copy (before: a resume took the newest memory step, one the trainer had
        deleted, e.g. Lightning's top-k). Refused (``CheckpointError``, nothing deleted) for the newest step
        of any tier unless ``force``, and while a save or a promotion of the step is in flight (a promotion
        would write it to disk again)."""
        check_step(step)
        inflight = self.p.inflight
        if inflight is not None and not inflight.done() and inflight.step == step:
            raise CheckpointError(f"step {step} is being saved to the memory tier: it cannot be deleted now")
        with self._lock:
            promoting = step in self._promoting
        if promoting:
            raise CheckpointError(f"step {step} is being promoted from the memory tier to {self.disk.root}: it "
                                  "cannot be deleted now (Store.wait_for_uploads() or a later save lets it)")
        if step == self.latest_step() and not force:
            raise CheckpointError(f"step {step} is the newest committed step of {self.p.root} and "
                                  f"{self.disk.root}: it is never deleted (save a newer one first)")
        self.disk_maintenance.delete_step(step, remote=remote, force=force)
        if self.p.catalog.is_committed(step) or self.p.storage.exists(step_dir(step)):
            candidates = dropped_chunks(self.p.catalog, [step])
            self._drop(step)
            self._sweep(step, None, candidates)

    # -- lifecycle --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the memory save in flight and the promotions (raising the first error nobody saw), then
        release the memory store's parts and the replication group."""
        try:
            try:
                self.saver.wait()
            finally:
                self.wait_for_promotions()
        finally:
            self.saver.close()
            self.p.close()
            if self.link is not None:
                self.link.close()


def _leaders(reports: List[Dict[str, Any]]):
    seen = {}
    for r, rep in enumerate(reports):
        seen.setdefault(rep["where"], r)
    return seen.values()
