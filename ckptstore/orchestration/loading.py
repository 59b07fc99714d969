"""Loading: which committed step to read (``resolve``, ``find``, the newest valid one) and reading it, into a
nested dict (``load``) or into ``state`` in place (``restore``, ``resume``), from the local root, the remote or
``load_path``.

:class:`Loader` wires the pure pieces to one store's parts: the candidate walk and the ranks' agreement
(:mod:`ckptstore.distributed.resume`), the tiers (:mod:`ckptstore.remote.resolve`), reading a step for any world
size and mesh (:mod:`ckptstore.io.restore`), Hub-format weights (:mod:`ckptstore.io.hub`). A remote step is pulled
through the ``pull`` callable it is given (:meth:`ckptstore.orchestration.maintenance.Maintenance.pull_step`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterable, List, MutableMapping, Optional, Tuple, TypeVar

from ..io import hub
from ..lifecycle import retention as _retention
from ..format.blobs import BlobStore
from ..format.catalog import Catalog
from ..distributed.commit import root_identity
from ..util.errors import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, TransferError
from ..distributed.fanout import PeerReadError, ReadOnce
from ..format.layout import check_step, manifest_path
from ..format.manifest import Commit
from ..format.mtable import rows_here
from .parts import Parts, quiet
from ..format.pointers import point_away_from, read_latest
from ..io.reader import MapLocation, read_nodes
from ..remote.resolve import candidates, split_load_path
from ..io.restore import StepLoader
from ..distributed.resume import agree_outcome, first_valid_step, parts_needed, restore_into
from ..lifecycle.rewind import set_aside_after
from ..state.runconfig import differences
from ..state.flatten import gc_paused
from ..storage import open_storage
from ..storage.retrying import RetryingStorage, with_retries

log = logging.getLogger("ckptstore")
T = TypeVar("T")

Tier = Tuple[int, str]          # (step, "local" | "remote")


class Loader:
    """Reads of one store (see :class:`~ckptstore.store.Store`'s ``load`` / ``find`` / ``resolve`` /
    ``restore`` / ``resume`` / ``best_step`` for the contracts). ``resumed_from``: where the last resume or
    restore came from."""

    def __init__(self, parts: Parts, *, config_may_change: Iterable[str] = (), load_path: Optional[str] = None,
                 load_components: Optional[Iterable[str]] = None,
                 pull: Callable[..., None]):
        self.p = parts
        self.config_may_change = tuple(config_may_change)
        self.load_path = load_path
        self.load_components = tuple(load_components) if load_components is not None else None
        self.pull = pull
        self.resumed_from: Optional[Dict[str, Any]] = None
        self._manifests_read = 0
        self._touched = False                       # DTensor targets written in place by a resume attempt
        self.read_once = ReadOnce(parts.rank, parts.world_size, parts.collective_timeout)
        # rank 0, during a resume: the newest step its candidate listing saw when that listing reached the remote
        # (None: no remote, or unreachable); the remote's steps above it were never tried, and are left alone
        self._listed_upto: Optional[int] = None
        # the step resolve() chose, and the newest remote step its listing saw (for restore's set-aside)
        self._resolved: Optional[Tuple[int, Optional[int]]] = None

    # -- listing and choosing -----------------------------------------------------------------------------
    def remote_reader(self) -> Tuple[Catalog, BlobStore]:
        """The remote's catalog and blobs for reading a step in place (its calls retried, see
        :mod:`ckptstore.storage.retrying`)."""
        remote = with_retries(self.p.remote_storage, self.p.retry)
        auto = self.p.remote is not None and self.p.remote.codec == "auto"     # its float blobs: <id>.bpl
        return Catalog(remote, self.p.decoded), BlobStore(remote, quarantine=False,
                                                           prefer={"raw": "planes"} if auto else None)

    def _catalog(self, tier: str) -> Catalog:
        return self.p.catalog if tier == "local" else self.remote_reader()[0]

    def tier_of(self, step: int) -> Optional[str]:
        """Where committed ``step`` is: ``"local"``, else ``"remote"``, else ``None``."""
        if self.p.catalog.is_committed(step):
            return "local"
        if self.p.remote_storage is not None and quiet(lambda: self._catalog("remote").is_committed(step)):
            return "remote"
        return None

    def candidates(self) -> List[Tier]:
        """``(step, tier)`` newest first over the local root and the remote (see :meth:`_listing`)."""
        p = self.p
        return self._listing(Catalog(p.remote_storage, p.decoded) if p.remote_storage else None)[0]

    def _listing(self, remote_catalog: Optional[Catalog], newest_only: bool = False) -> Tuple[List[Tier], bool]:
        """``(candidates newest first, remote reachable)`` (:func:`ckptstore.remote.resolve.candidates`). The
        remote is listed in ONE attempt while local steps exist: an unreachable remote is logged and the local
        steps alone are listed (it must not hold up a local resume for the whole deadline). With no local
        step, the listing is retried for the retry policy's whole deadline and, failing that, raises
        :class:`~ckptstore.util.errors.TransferError`: the remote may hold the run's steps, so resume never
        starts the run fresh because the remote could not be listed (README "Resume order")."""
        def listing():
            return list(candidates(self.p.catalog, remote_catalog, newest_only=newest_only))
        try:
            return self._listed_once(listing), True
        except Exception as e:
            if remote_catalog is None:
                raise
            local = [(s, "local") for s in reversed(self.p.catalog.committed_steps())]
            if not local:
                return self._listed_within_deadline(listing), True
            log.warning("remote %s unreachable (%s: %s): local steps only", self.p.remote_storage.url,
                        type(e).__name__, e)
            return local, False

    def _listed_once(self, fn: Callable[[], T], attempts: Optional[int] = 1) -> T:
        """``fn()``, which lists the remote, as ONE attempt abandoned after the retry policy's ``op_timeout``
        seconds (:meth:`RetryingStorage.call <ckptstore.storage.retrying.RetryingStorage.call>`): an unreachable
        or silent remote must not hold up a resume from local steps for the whole deadline. ``attempts=None``:
        retried for the policy's deadline (counted from the start of the outage) instead."""
        remote = self.p.remote_storage
        if not isinstance(remote, RetryingStorage):
            return fn()
        return remote.call(fn, f"list the steps of {remote.url}", attempts=attempts)

    def _listed_within_deadline(self, fn: Callable[[], T]) -> T:
        """:meth:`_listed_once` retried for the deadline; raises :class:`~ckptstore.util.errors.TransferError`
        naming the remote when it never answers, or at once when it refuses (e.g. denied credentials)."""
        try:
            return self._listed_once(fn, attempts=None)
        except Exception as e:
            raise self._unlisted(e) from e

    def _unlisted(self, e: BaseException) -> TransferError:
        return TransferError(f"cannot list the steps of the remote {self.p.remote_storage.url} ({type(e).__name__}: "
                             f"{e}), and no local step of {self.p.root} loads: resume does not start the run "
                             "fresh while the remote may hold its steps; run it again once the object store "
                             "answers (or open the store without its remote to start fresh)")

    def steps(self) -> List[int]:
        """The local root's committed steps, ascending (see :meth:`ckptstore.store.Store.steps`)."""
        return self.p.catalog.committed_steps()

    def commit_info(self, step: int) -> Commit:
        """The local commit marker of ``step``. Raises ``CorruptCheckpointError``."""
        return self.p.catalog.read_commit(step)

    def step_tiers(self) -> Dict[int, List[str]]:
        """Committed step -> the tiers holding it, ``"local"`` before ``"remote"`` (see
        :meth:`ckptstore.store.Store.step_tiers`): one listing of each; a remote that cannot be listed in one
        attempt is logged and left out."""
        out: Dict[int, List[str]] = {s: ["local"] for s in self.p.catalog.committed_steps()}
        if self.p.remote_storage is not None:
            try:
                remote = self._listed_once(lambda: Catalog(self.p.remote_storage, self.p.decoded).committed_steps())
            except Exception as e:
                log.warning("step_tiers: remote %s unreachable (%s: %s): local steps only", self.p.remote_storage.url,
                            type(e).__name__, e)
                remote = []
            for s in remote:
                out.setdefault(s, []).append("remote")
        return dict(sorted(out.items()))

    def latest_step(self) -> Optional[int]:
        """The newest local committed step, or ``None`` (see :meth:`ckptstore.store.Store.latest_step`)."""
        steps = self.p.catalog.committed_steps()
        pointed = read_latest(self.p.storage)
        if pointed is not None and pointed in steps and pointed == steps[-1]:
            return pointed
        return steps[-1] if steps else None

    def find(self, name: str) -> Optional[int]:
        for s, tier in self.candidates():
            try:
                if name in self._catalog(tier).read_commit(s).names:
                    return s
            except TransferError:
                raise                 # unread, not damaged: an older step of that name would be the wrong one
            except CheckpointError:
                continue
        return None

    def best_step(self, more: Optional[Dict[int, Commit]] = None) -> Optional[int]:
        """See ``Store.best_step``; ``more``: commit markers of another tier (the memory tier's) judged too."""
        p = self.p
        metric, mode = (p.keep.metric, p.keep.mode) if p.keep is not None and p.keep.metric else (None, None)
        commits = {**(more or {}), **p.catalog.readable_commits()}
        if p.remote_storage is not None:
            remote = Catalog(p.remote_storage)

            def remote_commits():
                found = {}
                for s in remote.committed_steps():
                    if s not in commits:
                        try:
                            found[s] = remote.read_commit(s)
                        except CheckpointError:
                            continue
                return found
            try:
                commits.update(self._listed_once(remote_commits))
            except Exception as e:
                log.warning("best_step: remote %s unreachable (%s: %s): local steps only", p.remote_storage.url,
                            type(e).__name__, e)
        return _retention.best_step(commits.values(), metric=metric, mode=mode)

    def resolve(self) -> Optional[Tuple[Optional[int], str]]:
        """See :meth:`Store.resolve <ckptstore.store.Store.resolve>`. The run's steps are judged by every rank
        against its own root (its manifest there, else the remote's copy) and agreed as resume agrees
        (:func:`~ckptstore.distributed.resume.first_valid_step`): a step that some node's disk lacks is not
        chosen for the whole job. The answer is remembered: :meth:`restore` of that step then sets aside the
        newer steps it skipped, as :meth:`resume` does."""
        p = self.p
        self._resolved = None

        def usable(s, tier) -> bool:
            try:
                commit = self._catalog(tier).read_commit(s)
                rank = p.rank if commit.world_size == p.world_size else 0
                if tier == "local" and rank in commit.manifests and not p.storage.exists(
                        manifest_path(s, rank, commit.manifests[rank][2])):
                    raise CorruptCheckpointError(f"manifest of rank {rank} missing", step=s)
                return True
            except TransferError:
                raise                 # unread, not damaged: never an older step instead (README "Resume order")
            except CheckpointError as e:
                log.warning("step %d (%s) is not usable on rank %d: %s", s, tier, p.rank, e)
                return False

        def check(s, tier) -> str:
            if usable(s, tier):
                return tier
            if tier == "local" and p.remote_storage is not None and usable(s, "remote"):
                return "remote"                   # resume repairs a damaged local step from the remote
            raise CorruptCheckpointError(f"not usable on rank {p.rank}", step=s)
        listed: List[int] = []

        def listing() -> List[Tier]:
            found = self.candidates()
            listed.extend(s for s, tier in found if tier == "remote")
            return found
        found = first_valid_step(listing, check, coord=p.coord, timeout=p.collective_timeout,
                                 tag=p.coord.next_tag("resolve") if p.coord is not None else None)
        if found is not None:
            self._resolved = (found[0], max(listed) if listed else None)
            return found
        return self._resolve_load_path()

    def _resolve_load_path(self) -> Optional[Tuple[Optional[int], str]]:
        """``(step, "load_path")`` (``step`` ``None`` for Hub-format weights) or ``None``: decided by rank 0 and
        broadcast."""
        p = self.p

        def decide():
            if self.load_path is None:
                return None
            url, step = split_load_path(self.load_path)
            if step is None and hub.open_weights(url, p.storage_options) is not None:
                return [None, "load_path"]
            catalog = Catalog(open_storage(url, p.storage_options, retry=p.retry))
            for s in ([step] if step is not None else reversed(catalog.committed_steps())):
                if quiet(lambda: catalog.read_commit(s) is not None):
                    return [s, "load_path"]
            return None
        if p.coord is None:
            found = decide()
        else:                         # rank 0 decides; a TransferError there is raised on every rank
            tag = p.coord.next_tag("resolve")
            answer, error = None, None
            if p.rank == 0:
                try:
                    answer = {"found": decide()}
                except TransferError as e:
                    error, answer = e, {"transfer": e.reason, "step": e.step, "blob": e.blob}
            answer = p.coord.broadcast(f"{tag}/found", answer, p.collective_timeout)
            if "transfer" in answer:
                raise error or TransferError(answer["transfer"], step=answer["step"], blob=answer["blob"])
            found = answer["found"]
        return None if found is None else (found[0], str(found[1]))

    # -- load: a step as a nested dict --------------------------------------------------------------------------
    def load(self, step: Optional[int], map_location: MapLocation, rank: Optional[int]) -> Dict[str, Any]:
        if step is not None:
            check_step(step)
            tier = self.tier_of(step)
            if tier is None:
                raise FileNotFoundError(f"step {step} is not committed in {self.p.where()}")
            return self.read_step(step, map_location=map_location, rank=rank, tier=tier)
        for s, tier in self.candidates():
            try:
                return self.read_step(s, map_location=map_location, rank=rank, tier=tier)
            except CorruptCheckpointError as e:
                log.warning("step %d (%s) is corrupt, trying an older one: %s", s, tier, e)
        raise FileNotFoundError(f"no valid committed step in {self.p.where()}")

    def read_step(self, step: int, *, map_location: MapLocation, rank: Optional[int] = None,
              tier: str = "local") -> Dict[str, Any]:
        """One rank's part of a committed step as a nested dict, sharded values as full tensors, read from the
        local root or (``tier="remote"``) straight from the remote. A single-process store may read any rank's
        part (inspection); a rank of a run reads its own part only if the world size matches."""
        p = self.p
        catalog, blobs = (p.catalog, p.blobs) if tier == "local" else self.remote_reader()
        commit = catalog.read_commit(step)
        rank = p.rank if rank is None else rank
        if commit.world_size != p.world_size and rank == p.rank and p.world_size != 1:
            raise IncompatibleCheckpointError(
                f"checkpoint was written by world_size={commit.world_size}, this run has "
                f"world_size={p.world_size}: load() reads one rank's part; resume() reshards", step=commit.step)
        if not 0 <= rank < commit.world_size:
            raise CheckpointError(f"step {step} was written by world_size={commit.world_size}: no rank {rank}")
        loader = StepLoader(catalog, blobs, commit, rank=rank, world_size=commit.world_size,
                            executor=p.pool, read_nodes=self._read_nodes)
        with gc_paused():
            return loader.load(loader.saved_keys(), {}, map_location=map_location)

    def _read_nodes(self, blobs, manifest, **kw):
        """:func:`read_nodes`; a chunk of this store found damaged is dropped from the chunk index, so the next
        save writes a good copy instead of referencing it."""
        try:
            return read_nodes(blobs, manifest, executor=self.p.pool, **kw)
        except CorruptCheckpointError as e:
            if blobs is self.p.blobs and e.blob and len(e.blob) == 64:
                self.p.index.forget(chunk_ids=[e.blob])
            raise

    # -- restore / resume: a step into state, in place -------------------------------------------------------
    def restore(self, state: MutableMapping[str, Any], step: Optional[int], *,
                keys: Optional[Iterable[str]], strict: bool, rank_local: str) -> int:
        if step is not None:
            check_step(step)
        try:
            found = self._load_newest(state, strict, rank_local, step=step,
                                      keys=tuple(keys) if keys is not None else None)
        finally:
            self._start_uploads()
        if found is None:
            raise FileNotFoundError(f"step {step} is not committed in {self.p.where()}" if step is not None else
                                    f"no valid committed step in {self.p.where()}")
        resolved, self._resolved = self._resolved, None
        if resolved is not None and resolved[0] == found[0]:
            # the step resolve() chose for this run (a trainer's resume: resolve, then restore in stages):
            # the newer steps it skipped load on no rank, so they are set aside as resume sets them aside
            self._listed_upto = resolved[1]
            self.set_aside_newer(found[0])
        return found[0]

    def resume(self, state: MutableMapping[str, Any], *, strict: bool, rank_local: str) -> Optional[int]:
        try:
            found = self._load_newest(state, strict, rank_local)
            if found is None and self._touched:
                raise CheckpointError(f"no valid step left in {self.p.root} to load into the sharded (DTensor) "
                                      "values that a damaged step partly overwrote: refusing a fresh start with "
                                      "them")
            self.set_aside_newer(found[0] if found is not None else None)
            if found is not None:
                return found[0]
            if self.load_path is not None:
                return self._resume_from_load_path(state, strict)
            log.info("no valid checkpoint in %s: fresh start", self.p.where())
            return None
        finally:
            self._start_uploads()

    def set_aside_newer(self, step: Optional[int]) -> None:
        """After a resume chose ``step`` on every rank (``None``: none of the run's steps loads): the leader of
        each root (its lowest rank) sets aside the root's committed steps newer than ``step``
        (:func:`ckptstore.lifecycle.rewind.set_aside_after`; none of them loaded on every rank, and left committed each
        would make the run's next save of that step number a rewind), its uploader first held still and its
        waiting uploads of them dropped; rank 0's uploader is told to set aside the remote's committed steps in
        ``(step, newest step this resume listed]`` before anything else it does (only when the listing reached
        the remote: steps the resume never saw are left alone). Only the job that writes the roots changes
        them: when any root holds such a step, rank 0 first takes its writer lease (``CheckpointError`` on
        every rank, naming the holder, when another live job has it). Collective under torch.distributed, like
        ``resume`` (one gather, one broadcast, then the ranks' agreement, before any rank saves); a failure
        raises on every rank. Nothing on a read-only store."""
        p = self.p
        if p.read_only:
            return
        newer = any(step is None or s > step for s in p.catalog.committed_steps())
        leader, tag = p.rank == 0, None          # without a process group the ranks share rank 0's root
        if p.coord is not None:
            tag = p.coord.next_tag("set-aside")
            where = root_identity(p.storage.local_path(""))
            reports = p.coord.gather(f"{tag}/roots", {"where": where, "newer": newer}, p.collective_timeout)
            verdict = None
            if p.rank == 0:
                first: Dict[bytes, int] = {}
                for r, rep in enumerate(reports):
                    first.setdefault(bytes(rep["where"]), r)
                verdict = {"leaders": sorted(first.values()), "error": None}
                if any(rep["newer"] for rep in reports):
                    try:
                        p.hold_writer_lease()
                    except CheckpointError as e:
                        verdict["error"] = str(e)[:2000]
            verdict = p.coord.broadcast(f"{tag}/leaders", verdict, p.collective_timeout)
            if verdict["error"] is not None:
                raise CheckpointError(f"resume from step {step}: cannot set aside the newer steps: "
                                      f"{verdict['error']}")
            leader = p.rank in verdict["leaders"]
        error: Optional[BaseException] = None
        try:
            if leader and newer:
                self._set_aside_local(step)
            if p.writes_remote and self._listed_upto is not None and (step is None or self._listed_upto > step):
                p.uploader.set_aside_after(step, self._listed_upto)
        except Exception as e:
            error = e
        if p.coord is not None:
            error, _ = agree_outcome(p.coord, tag, step if step is not None else 0, error, error is not None,
                                     p.collective_timeout)
        if error is not None:
            raise error

    def _set_aside_local(self, step: Optional[int]) -> None:
        p = self.p
        p.hold_writer_lease()                   # rank 0: only the job that writes this root changes its timeline
        uploader = p.uploader
        with (uploader.paused(drop_after=step if step is not None else -1) if uploader is not None
              else contextlib.nullcontext()):
            with p.maint:
                for s in set_aside_after(p.catalog, step, lambda s: point_away_from(p.storage, p.catalog, s)):
                    p.metrics_cache.pop(s, None)

    def _start_uploads(self) -> None:
        if self.p.uploader is not None:        # held back until the restart's reads are done: Uploader.start
            self.p.uploader.start()

    def _load_newest(self, state, strict: bool, rank_local: str, *, step: Optional[int] = None,
                     keys: Optional[Tuple[str, ...]] = None) -> Optional[Tier]:
        """Load the newest valid step (or exactly ``step``: then its failure is raised, not skipped) into
        ``state``, agreed by every rank (:func:`~ckptstore.distributed.resume.first_valid_step`); sets ``resumed_from``.
        Returns ``(step, tier)`` or ``None`` when no step loads."""
        p = self.p
        self.resumed_from = None
        self._touched = False
        self._listed_upto = None
        self.read_once.stats = None
        remote_catalog = Catalog(p.remote_storage, p.decoded) if p.remote_storage is not None else None
        pulled: set = set()
        unreachable: List[Catalog] = []               # the remote's catalog, once its listing gave up

        def list_candidates(newest_only=True):
            nonlocal remote_catalog
            if step is not None:                      # an empty list: restore raises FileNotFoundError
                tier = self.tier_of(step)
                return [(step, tier)] if tier is not None else []
            # discovery (rank 0 only, broadcast): the remote's latest pointer and the steps after it, a few
            # requests whatever the number of steps and ranks (issue 19); the whole listing only if none loads
            if unreachable:              # every local step failed and the remote's listing gave up: list it
                listed = self._listed_within_deadline(   # for the whole deadline, or raise TransferError
                    lambda: list(candidates(p.catalog, unreachable[0])))
                remote_catalog = unreachable.pop()
                return listed
            listed, reachable = self._listing(remote_catalog, newest_only=newest_only)
            if not reachable:
                unreachable.append(remote_catalog)
                remote_catalog = None                 # no repairs from an unreachable remote either
            elif remote_catalog is not None and listed:          # newest first
                self._listed_upto = max(listed[0][0], -1 if self._listed_upto is None else self._listed_upto)
            return listed

        def attempt(s, tier):
            with self.read_once.session() as share:      # every rank takes part once per attempt
                return self._resume_step(state, s, tier, remote_catalog, pulled, strict, rank_local, keys,
                                         share=share)
        more = (lambda: list_candidates(newest_only=False)) if step is None and remote_catalog is not None \
            else None
        found = first_valid_step(list_candidates, attempt, coord=p.coord, timeout=p.collective_timeout,
                                 tag=p.coord.next_tag("resume") if p.coord is not None else None,
                                 substitute=step is None, more=more)
        if found is not None:
            s, tier = found
            self.resumed_from = {"tier": tier, "step": s, "url": p.root if tier == "local" else
                                 p.remote_storage.url, "manifests_read": self._manifests_read}
            if keys is not None:
                self.resumed_from["keys"] = list(keys)
            if self.read_once.stats is not None:
                self.resumed_from["read_once"] = dict(self.read_once.stats)
            log.info("restored step %d (%s)%s", s, tier, f", keys {list(keys)}" if keys is not None else "")
        return found

    def _resume_step(self, state, step, tier, remote_catalog, pulled, strict, rank_local, keys=None,
                     share=None) -> str:
        """Load ``step`` into ``state`` for this rank: pull it first when this root lacks it, repair it from
        the remote when the local copy is damaged. ``share``: the attempt's read-once session
        (:mod:`ckptstore.distributed.fanout`). Returns the tier it came from; raises CheckpointError."""
        p = self.p
        load = dict(strict=strict, check_config=True, rank_local=rank_local, components=keys, share=share)
        if remote_catalog is not None and self._partial_other_layout(step) \
                and quiet(lambda: remote_catalog.is_committed(step)):
            # A node-local root of a job that ran with another number of ranks holds only its old ranks' parts:
            # that is no damage (issue 19: every node but rank 0's logged "local step is damaged (manifest
            # missing)" and pulled the whole step). Read straight from the remote only the ranges this rank's
            # targets overlap, as a root without the step does.
            step_catalog, step_blobs = self.remote_reader()
            saved = step_catalog.read_commit_bytes(step)
            self._restore(state, step_catalog, step_blobs, step, commit=saved[1], **load)
            p.adopt_run_id(saved[1].run_id)
            return "remote"
        if not p.catalog.is_committed(step):
            if remote_catalog is None:
                raise CorruptCheckpointError("not committed in this rank's root and no remote to pull from",
                                             step=step)
            # reads of the step chosen are retried (the listing is not: an unreachable remote must not hold
            # up a resume from local steps); a failed read would otherwise count as damage
            step_catalog, step_blobs = self.remote_reader()
            saved = step_catalog.read_commit_bytes(step)
            if (saved[1].world_size != p.world_size and saved[1].world_size > 1) or p.read_only:
                # Written by another layout of ranks: its parts are not this rank's to keep. Each rank reads
                # straight from the remote only the ranges its targets overlap (through the step's shard map),
                # instead of every node pulling every rank's part.
                self._restore(state, step_catalog, step_blobs, step, commit=saved[1], **load)
                p.adopt_run_id(saved[1].run_id)
                return "remote"
            self.pull(step, ranks=parts_needed(saved[1].world_size, p.world_size, p.rank), source=saved)
            pulled.add(step)
            tier = "remote"
        try:
            commit = self._restore(state, p.catalog, p.blobs, step, **load)
        except CorruptCheckpointError as e:
            if remote_catalog is None or step in pulled or not quiet(lambda: remote_catalog.is_committed(step)):
                raise
            if isinstance(e, PeerReadError):
                if e.origin != "CorruptCheckpointError":
                    raise
                # another rank's copy is damaged and it repairs it from the remote: this rank's copy is
                # fine, read it here (the session is spent: every chunk read by this rank itself)
                commit = self._restore(state, p.catalog, p.blobs, step, **load)
            else:
                if p.read_only:
                    log.warning("local step %d is damaged (%s): reading it from %s", step, e,
                                p.remote_storage.url)
                    catalog, blobs = self.remote_reader()
                else:
                    log.warning("local step %d is damaged (%s): repairing it from %s", step, e,
                                p.remote_storage.url)
                    self.pull(step)
                    catalog, blobs = p.catalog, p.blobs
                commit = self._restore(state, catalog, blobs, step, **load)
                tier = "remote"
        p.adopt_run_id(commit.run_id)  # this run's id is the one the resumed step's commit marker records
        return tier

    def _partial_other_layout(self, step: int) -> bool:
        """Whether ``step`` is committed in this rank's root by a job with another world size (more than one
        rank) and the root lacks some of its ranks' manifests (node-local disks: each holds its own ranks')."""
        p = self.p
        if p.world_size <= 1 or not p.catalog.is_committed(step):
            return False
        try:
            commit = p.catalog.read_commit(step)
        except CheckpointError:
            return False
        if commit.world_size == p.world_size or commit.world_size <= 1:
            return False
        try:                # a table's rows: a node-local root without the table holds rows files of its ranks
            rows = rows_here(commit.manifests)
        except CheckpointError:
            return True
        return len(rows) < commit.world_size or not all(p.storage.exists(manifest_path(step, r, g))
                                                         for r, (_, _, g) in rows.items())

    def _restore(self, state, catalog, blobs, step, *, strict, check_config, components=None,
                 rank_local: str = "error", commit: Optional[Commit] = None, share=None) -> Commit:
        """Load ``step`` from ``catalog`` / ``blobs`` into ``state``
        (:func:`ckptstore.distributed.resume.restore_into`), checking the run config first; ``commit``: its marker,
        when the caller read it already (else read once here). Returns the marker. Raises
        Corrupt/IncompatibleCheckpointError."""
        p = self.p
        commit = commit if commit is not None else catalog.read_commit(step)
        if check_config:
            diffs = differences(commit.config, p.config, self.config_may_change)
            if diffs:
                raise IncompatibleCheckpointError("run config differs from the checkpoint's", step=step,
                                                  differing=diffs)
        loader = StepLoader(catalog, blobs, commit, rank=p.rank, world_size=p.world_size,
                            executor=p.pool, read_nodes=self._read_nodes, share=share)
        try:
            restore_into(state, loader, strict=strict, components=components, rank_local=rank_local)
        finally:
            self._touched = self._touched or loader.touched
            self._manifests_read = loader.manifests_read
        return commit

    # -- load_path ----------------------------------------------------------------------------------------------
    def _resume_from_load_path(self, state, strict) -> Optional[int]:
        p = self.p
        url, step = split_load_path(self.load_path)
        if step is None:
            weights = hub.open_weights(url, p.storage_options, wrap=lambda s: with_retries(s, p.retry))
            if weights is not None:                  # Hub-format weights (safetensors): a weights-only start
                return self._start_from_weights(state, *weights)
        storage = open_storage(url, p.storage_options, retry=p.retry)
        catalog, blobs = Catalog(storage), BlobStore(storage, quarantine=False)
        steps = [step] if step is not None else list(reversed(catalog.committed_steps()))
        if step is not None and not catalog.is_committed(step):
            raise CheckpointError(f"load_path {storage.url}: step {step} is not committed")
        components = self.load_components
        for s in steps:
            try:
                self._restore(state, catalog, blobs, s, strict=strict, check_config=False, components=components)
            except CorruptCheckpointError as e:
                if step is not None:
                    raise
                log.warning("load_path %s: step %d is damaged, trying an older one: %s", storage.url, s, e)
                continue
            self.resumed_from = {"tier": "load_path", "step": s, "url": storage.url,
                                 "components": list(components) if components else None}
            log.info("no checkpoint of this run yet: initialised from %s step %d%s", storage.url, s,
                     f" (components {list(components)})" if components else "")
            return None if components is not None else s
        raise CheckpointError(f"load_path {storage.url} holds no valid committed step")

    def _start_from_weights(self, state, storage, files, weight_map) -> None:
        """``load_path`` names safetensors weights (see :mod:`ckptstore.io.hub`): load them into one top-level
        key of ``state``; the run starts fresh (returns ``None``), ``resumed_from`` says what was loaded."""
        key = hub.target_key(state, self.load_components, storage.url)
        hub.apply_weights(state, hub.read_weights(storage, files, weight_map), key, storage.url)
        self.resumed_from = {"tier": "load_path", "step": None, "url": storage.url, "components": [key],
                             "files": list(files)}
        log.info("no checkpoint of this run yet: initialised state[%r] from %s (%d safetensors file(s))", key,
                 storage.url, len(files))
        return None
