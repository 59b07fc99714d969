"""The background uploader: committed local steps -> remote store, in commit order, crash-safe.

Per step: blobs the remote lacks (in parallel; each verified against its id before it leaves), then the
manifests, then the commit marker, then the remote latest pointer (moved forward only, with conditional
writes). A remote reader therefore never sees a committed step with a missing blob.

Crash safety: nothing about pending uploads or deletions lives only in memory. At start-up the steps to upload
are derived from the two stores: every local committed step newer than the remote's newest committed step. A
process killed mid-upload leaves at most blobs and manifests without a commit marker on the remote (invisible,
and reused by the next attempt since blobs are content-addressed); reopening the store finishes the upload.
The steps to delete from the remote (``Store.delete_step``) are recorded in the local root before the call
returns (:mod:`ckptstore.format.intents`) and read back by the same derivation; the remote's retention is applied
again once the work is derived (the ``on_derived`` callback), so a restarted writer converges the remote to
what the policy and the trainer's deletions say.

Backlog policy: uploads never block training. When steps are committed faster than they upload, the queue
keeps the step being uploaded plus the newest ``max_backlog`` waiting steps; older waiting steps are dropped
from the queue (they stay on local disk) and logged, so the remote always converges to the newest step and
memory and lag stay bounded. Failures (after retries, or past the deadline) stop the uploader and are raised
once by the store's next ``save()``, ``wait_for_uploads()`` or ``close()``; after that the pending steps are
derived again and uploading resumes.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

from ..format import intents
from ..lifecycle import retention
from ..format.blobs import BlobStore
from ..format.catalog import Catalog
from ..util.errors import CheckpointError, UploadError
from ..format.layout import STEPS, manifest_path, parse_step_dir
from ..format.mtable import rows_here
from ..lifecycle.gc import GCReport, collect
from ..lifecycle.lease import acquire_writer
from ..format.pointers import advance_latest, read_latest, rewind_latest
from ..lifecycle.rewind import set_aside
from ..util.retry import RetryPolicy
from ..util.threads import lower_priority
from .transfer import StepCopier, TransferStats

log = logging.getLogger("ckptstore")


# seconds a save may wait for the one listing of the remote its rewind check needs before the uploader has
# listed it (issue 17: a save under network faults stalled training for the whole op_timeout, 4-6 s; with the
# default 120 s op_timeout, up to two minutes against a remote that accepts connections and never answers)
REWIND_LIST_SECONDS = 2.0
#: how old (seconds) a listing made before the uploader started may be for its first _derive to take it: the
#: derive lists before it takes the writer lease either way; this bounds how much older its view may be
LISTING_REUSE_SECONDS = 10.0


class Uploader:
    """Uploads the committed steps of one local root. ``parts_only``: the root of a node other than rank 0's
    (node-local disks): upload its ranks' parts only (chunks, then manifests); rank 0's uploader writes the
    remote commit marker and pointer once every rank's part is there. Rank 0's uploader copies the parts its
    own root holds and then waits for the others' (see :meth:`StepCopier.copy_step`). An object several roots
    hold is uploaded by one of them (issue 29; FORMAT.md "Distributed saves": one uploader per object).
    ``codec``: ``Remote.codec`` (``"auto"``: float blobs are encoded on their way up, see :class:`StepCopier`).

    Callbacks, on the uploader's thread (the uploader counts as busy while they run): ``on_uploaded(step)``
    after each upload; ``on_derived()`` once the work is derived from the two stores (at start-up, and again
    after a failure), with :meth:`pending` already holding the derived backlog."""

    def __init__(self, local, remote, *, workers: int = 8, retry: Optional[RetryPolicy] = None,
                 max_backlog: int = 8, on_uploaded: Optional[Callable[[int], None]] = None,
                 on_derived: Optional[Callable[[], None]] = None, parts_only: bool = False, start: bool = True,
                 every: int = 1, codec: str = "raw"):
        self.local, self.remote = local, remote
        self.every = max(1, int(every))              # only steps that are multiples of it are uploaded
        self.parts_only = parts_only
        self.copier = StepCopier(local, remote, workers=workers, retry=retry, mark_src=True, codec=codec)
        self.retry = self.copier.retry
        self.max_backlog = max(1, max_backlog)
        self.on_uploaded = on_uploaded
        self.on_derived = on_derived
        self.uploaded: List[TransferStats] = []      # history, newest last
        self._queue: List[int] = []
        self._current: Optional[int] = None
        self._error: Optional[BaseException] = None
        self._derived = False
        self._listed: Optional[Tuple[Optional[int]]] = None      # newest_remote's one listing before _derived
        # that listing when it succeeded: (newest[:1], step directories seen, when); the first _derive takes it
        # instead of listing again, if at most LISTING_REUSE_SECONDS old (3 requests of a first save's 20 on S3)
        self._listing: Optional[Tuple[List[int], List[int], float]] = None
        self._prefetching = False                    # prefetch()'s listing is under way
        self._cond = threading.Condition()
        self._closing = False
        self._lease = None                           # the remote's writer lease (see ckptstore.lifecycle.lease)
        self._paused = 0                             # > 0: start no new upload (a truncation is under way)
        self._deriving = False
        self._settling = False                       # on_derived is running
        # steps the trainer deleted (each recorded in the local root: ckptstore.format.intents) -> the newest step
        # queued or committed before the deletion: it runs once no queued upload is at or below that step
        self._deletes: Dict[int, int] = {}
        self._deferred: Set[int] = set()             # deletions of the remote's newest step: after the next upload
        # (step, upto): a resume continued from step (None: a fresh start) after trying the remote's steps up to
        # upto: those in between are set aside before anything else (see set_aside_after)
        self._aside: Optional[Tuple[Optional[int], int]] = None
        self._deleting = False
        #: newest committed step on the remote as far as this uploader knows (None: none, or not derived yet)
        self.remote_newest: Optional[int] = None
        # Steps above this one are "fresh": their remote prefix did not exist when the remote was listed, and no
        # upload of them failed, nor was anything truncated or deleted since, so whatever is under them was
        # written by this job's uploaders for the step's current commit (rank 0 then trusts a listing of the
        # other ranks' manifests, see StepCopier._await_other_parts). None: not derived yet (nothing is fresh).
        self._verify_upto: Optional[int] = None
        self._highest = -1                           # the newest step this uploader was ever given
        self._thread = threading.Thread(target=self._run, name="ckptstore-upload", daemon=True)
        self._start_lock = threading.Lock()
        if start:
            self.start()

    # -- public ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the uploader's thread (idempotent): it lists the remote, takes its writer lease, and uploads
        the local steps the remote lacks. ``Store`` starts it after ``resume`` (or at the first ``save``,
        ``wait_for_uploads`` or ``close``), so that leftover uploads never compete with a restart's resume
        for the network and the interpreter: measured, they made a small state's remote resume 1.5-2x
        slower (benchmarks/bench_packs.py)."""
        with self._start_lock:
            if not self.started:
                self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def prefetch(self) -> None:
        """Start listing the remote's newest committed step now, in a daemon thread (one attempt of at most
        ``min(retry.op_timeout, REWIND_LIST_SECONDS)`` seconds), so that the first save's rewind check
        (:meth:`newest_remote`) finds it listed instead of listing it then. That listing is also the object
        store client's first request, which pays its set-up (session, credentials, first connection: 0.22 s of
        a first save's 0.56 s against moto on 127.0.0.1, measured). ``Store`` calls it when it opens a root that
        uploads; it does nothing once the uploader has started or the remote has been listed."""
        with self._cond:
            if self._listed is not None or self._prefetching or self.started:
                return
            self._prefetching = True
        threading.Thread(target=self._prefetch, name="ckptstore-remote-list", daemon=True).start()

    def _prefetch(self) -> None:
        try:
            self._list_newest()
        finally:
            with self._cond:
                self._prefetching = False
                self._cond.notify_all()

    def newest_remote(self) -> Optional[int]:
        """The remote's newest committed step: :attr:`remote_newest` once the uploader has listed the remote;
        before that, the listing :meth:`prefetch` or the uploader's start is making (waited for), else one
        listing now; each given at most ``min(retry.op_timeout, REWIND_LIST_SECONDS)`` seconds. A save judges a
        rewind by it: with ``keep_local`` the remote may hold newer steps than the local root, and a step saved
        at or below them would never be uploaded. An unreachable remote is logged and answers ``None`` (the
        local root alone decides, as before this listing existed)."""
        if self._derived:
            return self.remote_newest
        budget = min(self.copier.retry.op_timeout, REWIND_LIST_SECONDS)
        with self._cond:                             # a listing under way: the prefetch's, or the uploader's start
            self._cond.wait_for(lambda: self._listed is not None or self._derived or self._error is not None
                                or not (self._prefetching or self.started), timeout=budget)
            if self._derived:
                return self.remote_newest
            if self._listed is not None:             # listed (or failed to) before, by this process
                return self._after_aside(self._listed[0])
            waited = self._prefetching or self.started
        if waited:
            log.warning("%s was not listed within %.0f s: the step is judged against the local root only until "
                        "the uploader has listed it", self.remote.url, budget)
            self._listed = (None,)
            return None
        return self._after_aside(self._list_newest())

    def _list_newest(self) -> Optional[int]:
        """One listing of the remote's newest committed step (:meth:`newest_remote`'s), remembered in
        ``_listed``; kept for the uploader's first ``_derive`` too while the uploader has not started."""
        budget = min(self.copier.retry.op_timeout, REWIND_LIST_SECONDS)
        once = RetryPolicy(deadline=budget, op_timeout=budget)
        seen: List[int] = []
        try:
            steps = self.copier.call(lambda: Catalog(self.remote).newest_committed(_cleared(seen))[0][:1],
                                     f"list steps of {self.remote.url}", policy=once)
        except Exception as e:
            if not self._closing:
                log.warning("could not list %s within %.0f s to check the step against its newest (%s: %s): "
                            "judged against the local root only until the uploader has listed it",
                            self.remote.url, budget, type(e).__name__, e)
            with self._cond:
                self._listed = (None,)
                self._cond.notify_all()
            return None
        with self._cond:
            self._listed = (steps[0] if steps else None,)
            if not self.started:                     # listed before the uploader's first _derive: it may take this
                self._listing = (steps, seen, time.monotonic())
            self._cond.notify_all()
        return self._listed[0]

    def _after_aside(self, newest: Optional[int]) -> Optional[int]:
        """The remote's newest committed step once the steps waiting to be set aside are (the step resumed
        stands for the newest that remains: a bound from above, which is what a rewind check needs)."""
        aside = self._aside
        if aside is not None and newest is not None and (aside[0] is None or newest > aside[0]) \
                and newest <= aside[1]:
            return aside[0]
        return newest

    def set_aside_after(self, step: Optional[int], upto: int) -> None:
        """A resume continued from ``step`` (``None``: a fresh start) after trying every remote step up to
        ``upto`` (none of those above ``step`` loaded on every rank): drop waiting uploads of steps above
        ``step``, and, before anything else this uploader does (under the remote's writer lease), set aside the
        remote's committed steps in ``(step, upto]`` and move its latest pointer back
        (:func:`set_aside_remote`). Until then :meth:`newest_remote` answers as if it were done. A failure is
        raised like an upload's, and the work is tried again when the uploader goes on."""
        with self._cond:
            self._aside = (step, upto)
            self._queue = [s for s in self._queue if step is not None and s <= step]
            self._derived = False
            self._cond.notify_all()

    def enqueue(self, step: int) -> None:
        """Queue committed ``step`` for upload; a step that is not a multiple of ``every`` is not uploaded. A
        remote deletion of ``step`` still to do is void: the step was committed again since (a rewind)."""
        with self._cond:
            void = self._deletes.pop(step, None) is not None or step in self._deferred
            self._deferred.discard(step)
        if void:
            intents.forget(self.local, step)
            log.info("step %d was committed again: its deletion from %s is void", step, self.remote.url)
        if step % self.every:
            return
        self.start()
        with self._cond:
            self._highest = max(self._highest, step)
            if step not in self._queue and step != self._current:
                self._queue.append(step)
                self._queue.sort()
                while len(self._queue) > self.max_backlog:
                    dropped = self._queue.pop(0)
                    log.warning("upload backlog: step %d will not be uploaded (newer steps are waiting; it "
                                "stays on local disk)", dropped)
            self._cond.notify_all()

    def delete_after_uploads(self, step: int) -> None:
        """Remove ``step`` from the remote once the uploads of every step committed or queued before this call
        are done (a waiting upload of ``step`` itself is dropped): :func:`delete_steps` on the uploader's
        thread, in commit order with the uploads; uploads queued later do not hold it back. The deletion is
        first recorded in the local root (:mod:`ckptstore.format.intents`, fsynced), so it survives a SIGKILL and the
        next writer finishes it; the caller deletes its local copy only after this returns. When ``step`` is
        the remote's newest committed step (never deleted) it waits for the next upload. A failure is raised
        like an upload's (next ``save`` / ``wait_for_uploads`` / ``close``). Raises ``OSError`` when the
        intent cannot be written (nothing is deleted then)."""
        local_steps = Catalog(self.local).committed_steps()
        with self._cond:
            after = max([self._highest, -1] + local_steps[-1:])
        intents.record(self.local, intents.DeleteIntent(step, after, self.remote.url))
        self.start()
        with self._cond:
            self._taint(step)
            if step in self._queue:
                self._queue.remove(step)
            self._deferred.discard(step)
            self._deletes[step] = after
            self._cond.notify_all()

    def busy_deriving(self) -> bool:
        """Whether the work to do is still being (or yet to be) derived from the two stores."""
        with self._cond:
            return self._deriving or not self._derived

    def pending(self) -> List[int]:
        """Steps waiting or being uploaded."""
        with self._cond:
            return sorted(self._queue + ([self._current] if self._current is not None else []))

    def raise_if_failed(self) -> None:
        """Raise the upload failure once, then let the uploader derive its work again and go on."""
        with self._cond:
            err, self._error = self._error, None
            if err is not None:
                self._derived = False
                self._cond.notify_all()
        if err is not None:
            raise err

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until nothing is pending; raise :class:`UploadError` on failure or timeout."""
        self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (self._queue or self._current is not None or not self._derived or self._deletes
                   or self._deleting or self._deriving or self._settling) and self._error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise UploadError(f"uploads still pending after {timeout} s: steps {self.pending()}")
                self._cond.wait(left if left is not None else 1.0)
        self.raise_if_failed()

    @contextlib.contextmanager
    def paused(self, drop_after: Optional[int] = None):
        """Hold the uploader still: drop waiting steps newer than ``drop_after``, wait for the step being
        uploaded (and its ``on_uploaded`` callback) to finish, and start nothing new until the block exits.
        Used to rewind a run (``Store(on_rewind="truncate")``): the remote is then changed by the caller alone."""
        with self._cond:
            self._paused += 1
            if drop_after is not None:
                self._queue = [s for s in self._queue if s <= drop_after]
            while self._current is not None or self._deriving or self._deleting or self._settling:
                self._cond.wait()
        try:
            yield self
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def truncate_remote(self, after: int) -> List[int]:
        """Delete the remote's committed steps newer than ``after`` and move its latest pointer back (see
        :func:`truncate_steps`), each request under the retry policy. Call inside :meth:`paused`. Deletions
        still to do of steps after ``after`` are done by it; one of ``after`` itself (about to be saved again)
        is done first; the others now wait for uploads up to ``after`` at most."""
        self._taint()
        recorded = set(intents.read_all(self.local, self.remote.url))     # also before the uploader derived
        with self._cond:
            mine = sorted(s for s in set(self._deletes) | self._deferred | recorded if s >= after)
        if after in mine:
            delete_steps(self.remote, [after], call=self.copier.call)
        dropped, newest = truncate_steps(self.remote, after, call=self.copier.call)
        self.remote_newest = newest
        with self._cond:
            self._listing = None                     # listed before the truncation: the derive lists again
            if self._listed is not None:
                self._listed = (newest,)
            for s in mine:
                self._deletes.pop(s, None)
                self._deferred.discard(s)
            lowered = {s: after for s, a in self._deletes.items() if a > after}
            self._deletes.update(lowered)
        for s in mine:
            intents.forget(self.local, s)
        for s in lowered:
            intents.record(self.local, intents.DeleteIntent(s, after, self.remote.url))
        return dropped

    def close(self, timeout: Optional[float] = None) -> None:
        try:
            self.wait(timeout)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            if self.started:
                self._thread.join(timeout=5)
            self.copier.close()
            if self._lease is not None:
                self._lease.release()

    # -- the thread -----------------------------------------------------------------------------------------
    def _derive(self) -> None:
        """Pending steps = local committed steps newer than the remote's newest committed step (found from the
        remote's latest pointer: :meth:`Catalog.newest_committed`, a few requests whatever the number of steps).
        Pending deletions = the intents in the local root for this remote (:mod:`ckptstore.format.intents`), except
        those of a step committed locally: that deletion never returned (killed before the local commit marker
        went) or the step was committed again since; the intent is void and removed."""
        with self._cond:                             # set only before the uploader started: the first derive's
            listing, self._listing = self._listing, None
        if listing is not None and time.monotonic() - listing[2] <= LISTING_REUSE_SECONDS:
            newest, seen, _ = listing                # listed just before the uploader started (newest_remote)
        else:
            seen = []
            newest = self.copier.call(lambda: Catalog(self.remote).newest_committed(_cleared(seen))[0][:1],
                                      "list remote steps", fresh=True)   # after a reported failure: a whole deadline
            with self._cond:
                if self._listed is None:             # a save waiting in newest_remote takes it
                    self._listed = (newest[0] if newest else None,)
                    self._cond.notify_all()
        if self._lease is None and not self.parts_only:
            # one job uploads into a remote root: a second is refused, naming us (the other nodes of this job
            # upload parts only, under rank 0's lease)
            self._lease = acquire_writer(self.remote, job=self.local.url)
        aside = self._aside
        if aside is not None and not self.parts_only:
            with self._cond:
                self._taint()                        # the set-aside steps' directories stay (gc removes them)
            set_aside_remote(self.remote, *aside, call=self.copier.call)
            seen.clear()
            newest = self.copier.call(lambda: Catalog(self.remote).newest_committed(seen)[0][:1],
                                      "list remote steps")
            with self._cond:
                if self._aside == aside:
                    self._aside = None
        newest_remote = newest[0] if newest else None
        self.remote_newest = newest_remote
        if newest_remote is not None:
            # what the remote holds of the parts this root uploads (its own ranks' manifests: not every rank's)
            self.copier.remember_dst_step(newest_remote, ranks="present")
        local_steps = Catalog(self.local).committed_steps()
        todo = [s for s in local_steps if (newest_remote is None or s > newest_remote) and s % self.every == 0]
        found = intents.read_all(self.local, self.remote.url) if not self.parts_only else {}
        with self._cond:
            asked = set(self._deletes) | self._deferred      # by this process: their local copy is going
        for s in (set(found) & set(local_steps)) - asked:
            log.info("step %d is committed in %s: its remote-deletion intent is void", s, self.local.url)
            intents.forget(self.local, found.pop(s).step)
        with self._cond:
            for s, intent in found.items():
                if s not in self._deferred:
                    self._deletes.setdefault(s, intent.after)
            self._highest = max([self._highest] + todo)
            self._verify_upto = max(seen + [self._highest if self._verify_upto is not None else -1,
                                            self._verify_upto if self._verify_upto is not None else -1])
            for s in todo:
                if s not in self._queue:
                    self._queue.append(s)
            self._queue.sort()
            del self._queue[:-self.max_backlog]
            self._derived = True
        if todo:
            log.info("uploads pending from %s to %s: steps %s", self.local.url, self.remote.url, self._queue)
        if found:
            log.info("deletions pending on %s: steps %s", self.remote.url, sorted(found))

    def _run(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                while not self._closing and (self._error is not None or self._paused
                                             or (self._derived and not self._queue and not self._deletes)):
                    self._cond.wait()
                if self._closing:
                    return
                need_derive = not self._derived
                self._deriving = need_derive
            if need_derive:
                derived = False
                try:
                    self._derive()
                    derived = True
                except BaseException as e:
                    self._fail(e)
                finally:
                    settle = derived and self.on_derived is not None
                    with self._cond:
                        self._deriving = False
                        self._settling = settle
                        self._cond.notify_all()
                if settle:
                    self._settle()
                continue
            with self._cond:
                # deletions whose uploads (those queued or committed before them) are done; later ones wait
                doomed = {s: a for s, a in self._deletes.items() if not any(q <= a for q in self._queue)}
                for s in doomed:
                    del self._deletes[s]
                self._deleting = bool(doomed)
            if doomed:
                self._delete(doomed)
                continue
            with self._cond:
                if not self._queue:
                    continue
                step = self._current = self._queue.pop(0)
            try:
                if self._lease is not None:
                    self._lease.check()
                if not Catalog(self.local).is_committed(step):
                    log.info("step %d is no longer committed locally; not uploading it", step)
                else:
                    if self.parts_only:
                        stats = self.copier.copy_step(step, ranks="present", marker="skip")
                    else:
                        fresh = self._verify_upto is not None and step > self._verify_upto
                        stats = self.copier.copy_step(step, ranks="present", marker="after_all", fresh=fresh)
                        self.copier.call(lambda: advance_latest(self.remote, step),
                                         f"advance remote latest to {step}")
                    self.uploaded.append(stats)
                    self.remote_newest = max(step, self.remote_newest if self.remote_newest is not None else step)
                    log.info("uploaded step %d: %d/%d blobs, %d bytes in %.2f s", step, stats.blobs_copied,
                             stats.blobs_total, stats.bytes_copied, stats.seconds)
                    if self.on_uploaded is not None:
                        self.on_uploaded(step)
                    with self._cond:                 # the remote's newest is no longer what they would delete
                        self._deletes.update((s, -1) for s in self._deferred)
                        self._deferred.clear()
                with self._cond:
                    self._current = None
                    self._cond.notify_all()
            except BaseException as e:
                self._fail(e, step)

    def _settle(self) -> None:
        """Run ``on_derived`` (logged, never raised: the work is derived); the uploader is busy meanwhile."""
        try:
            self.on_derived()
        except Exception as e:
            log.error("after deriving the uploads to %s: %s: %s", self.remote.url, type(e).__name__, e)
        finally:
            with self._cond:
                self._settling = False
                self._cond.notify_all()

    def _delete(self, doomed: Dict[int, int]) -> None:
        """Delete ``doomed`` (step -> its ``after``) from the remote, then forget their intents; the remote's
        newest committed step is kept and its deletion deferred to after the next upload. On failure they go
        back to the pending deletions and the failure is raised like an upload's."""
        try:
            if self._lease is not None:
                self._lease.check()                  # a writer that lost the remote's lease deletes nothing
            _, kept, _ = delete_steps(self.remote, sorted(doomed), call=self.copier.call)
            for s in doomed:
                if s not in kept:
                    intents.forget(self.local, s)
            with self._cond:
                self._deferred.update(kept)
        except BaseException as e:
            with self._cond:
                for s, a in doomed.items():
                    self._deletes.setdefault(s, a)
            self._fail(e, what=f"deletion of steps {sorted(doomed)}")
        finally:
            with self._cond:
                self._deleting = False
                self._cond.notify_all()

    def _taint(self, step: Optional[int] = None) -> None:
        """No step this uploader has been given so far (nor ``step``) is fresh any more: a failed, truncated or
        deleted upload may have left parts under its prefix that a later commit of the same step would not
        name. Their manifests are then read back and checked against the marker's digests."""
        self._verify_upto = max(self._highest, step if step is not None else -1,
                                self._verify_upto if self._verify_upto is not None else -1)

    def _fail(self, e: BaseException, step: Optional[int] = None, what: Optional[str] = None) -> None:
        what = what or (f"upload of step {step}" if step is not None else "upload start-up")
        detail = str(e) if isinstance(e, UploadError) else f"{type(e).__name__}: {e}"
        err = UploadError(f"{what} to {self.remote.url} failed: {detail}")
        err.__cause__ = e
        e = err
        log.error("%s", e)
        self.copier.forget_dst()
        with self._cond:
            self._taint(step)
            self._error = e
            if step is not None and step not in self._queue:
                self._queue.insert(0, step)
            self._current = None
            self._cond.notify_all()


# -- the remote side of retention and of a rewind ----------------------------------------------------------------
def _cleared(seen: List[int]) -> List[int]:
    """``seen`` emptied (a listing retried starts its record of the step directories anew)."""
    seen.clear()
    return seen


def _direct(fn, what):
    return fn()


def truncate_steps(storage, after: int, call=_direct) -> Tuple[List[int], Optional[int]]:
    """Delete every committed step of ``storage`` newer than ``after``, newest first (each: commit marker first,
    then its files), then move the latest pointer back to the newest remaining committed step (or remove it):
    :func:`ckptstore.format.pointers.rewind_latest`, the one backwards move FORMAT.md allows. A crash part way leaves
    a prefix of the old timeline (never a gap), and the next truncation finishes the work. Returns
    ``(dropped steps, newest remaining committed step or None)``."""
    catalog = Catalog(storage)
    steps = call(catalog.committed_steps, f"list steps of {storage.url}")
    dropped = sorted((s for s in steps if s > after), reverse=True)
    for s in dropped:
        call(lambda s=s: catalog.delete_step(s), f"delete step {s} of {storage.url}")
    remaining = [s for s in steps if s <= after]
    newest = remaining[-1] if remaining else None
    call(lambda: rewind_latest(storage, newest, catalog.is_committed), f"rewind latest of {storage.url}")
    if dropped:
        log.info("%s: dropped steps %s (rewound to step %s)", storage.url, sorted(dropped), after)
    return sorted(dropped), newest


def set_aside_remote(storage, step: Optional[int], upto: int, call=_direct) -> List[int]:
    """Set aside (:func:`ckptstore.lifecycle.rewind.set_aside`; the step's directory is left to gc) every committed step
    of ``storage`` in ``(step, upto]``, newest first, then move the latest pointer back when it names a step
    above ``step``: to ``step`` when it is committed there, else to the newest committed step below it (or
    remove it), the one backwards move FORMAT.md allows (the step it named is no longer committed). Steps above
    ``upto`` (committed after the resume listed them) are left alone. Returns the steps set aside."""
    catalog = Catalog(storage)
    after = f"{step:012d}" if step is not None else ""
    names = call(lambda: storage.listdir_after(STEPS, after), f"list steps of {storage.url}")
    dirs = sorted((s for s in map(parse_step_dir, names)
                   if s is not None and (step is None or s > step) and s <= upto), reverse=True)
    gone = []
    for s in dirs:
        if call(lambda s=s: catalog.is_committed(s), f"look up step {s} of {storage.url}"):
            call(lambda s=s: set_aside(storage, s, step, remove_rest=False), f"set aside step {s} of {storage.url}")
            gone.append(s)
    latest = call(lambda: read_latest(storage), f"read latest of {storage.url}")
    if latest is not None and (step is None or latest > step):
        if step is not None and call(lambda: catalog.is_committed(step), f"look up step {step} of {storage.url}"):
            to: Optional[int] = step
        else:
            older = [s for s in call(catalog.committed_steps, f"list steps of {storage.url}")
                     if step is not None and s < step]
            to = older[-1] if older else None
        call(lambda: rewind_latest(storage, to, catalog.is_committed), f"rewind latest of {storage.url}")
    if gone:
        log.warning("%s: committed step(s) %s set aside (under %s/<step>.aside-*): the run continues from %s, "
                    "and they did not load on every rank", storage.url, sorted(gone), STEPS,
                    f"step {step}" if step is not None else "a fresh start")
    return sorted(gone)


def delete_steps(remote, steps: List[int], *, call=_direct, grace_seconds: float = 0.0, wait: float = 5.0
                 ) -> Tuple[List[int], List[int], Optional[GCReport]]:
    """Delete ``steps`` from ``remote`` (each: commit marker first, then its files), never its newest
    committed step (kept, logged: FORMAT.md "Writers and deleters"), then collect the remote's unreferenced
    blobs and packs under its gc lease as retention does (what any committed step or a copy in flight
    references stays). Returns the deleted steps, the steps kept as the newest, and the gc report (``None``
    when nothing was deleted)."""
    catalog = Catalog(remote)
    committed = call(catalog.committed_steps, f"list steps of {remote.url}")
    newest = committed[-1] if committed else None
    gone, kept = [], []
    for s in sorted(set(steps)):
        if s == newest:
            log.info("not deleting step %d from %s yet: it is the newest committed step there (deleted after "
                     "a newer one is uploaded)", s, remote.url)
            kept.append(s)
            continue
        if s in committed or s in call(catalog.step_dirs, f"list steps of {remote.url}"):
            call(lambda s=s: catalog.delete_step(s), f"delete step {s} of {remote.url}")
            gone.append(s)
    if not gone:
        return gone, kept, None
    log.info("deleted steps %s from %s", gone, remote.url)
    report = call(lambda: collect(remote, catalog, BlobStore(remote, quarantine=False),
                                  grace_seconds=grace_seconds, wait=wait), f"gc of {remote.url}")
    return gone, kept, report


def apply_remote_retention(remote, policy, protected=(), *, cache: Optional[Dict[int, Mapping[str, Any]]] = None,
                           grace_seconds: float = 0.0, wait: float = 5.0, call=_direct
                           ) -> Tuple[List[int], Optional[GCReport]]:
    """The remote's copy of the retention policy's result, applied by the uploader after it uploaded a step:
    delete the remote steps ``policy`` drops (:func:`ckptstore.lifecycle.retention.apply`: commit marker first, then the
    step's files; never the remote's newest or best step, nor ``protected``), then, if any went, collect the
    remote's unreferenced blobs and packs under its gc lease (FORMAT.md "Writers and deleters": waits up to
    ``wait`` seconds for copies in flight, else defers to a later upload or ``ckptstore gc``). Returns the
    deleted steps and the gc report (``None`` when nothing was deleted)."""
    catalog = Catalog(remote)
    doomed = call(lambda: retention.apply(catalog, policy, protected, cache=cache),
                  f"apply retention to {remote.url}")
    if not doomed:
        return doomed, None
    log.info("retention on %s: removed steps %s", remote.url, doomed)
    report = call(lambda: collect(remote, catalog, BlobStore(remote, quarantine=False),
                                  grace_seconds=grace_seconds, wait=wait), f"gc of {remote.url}")
    return doomed, report


def leads_other_root(catalog: Catalog, storage, rank: int) -> bool:
    """Whether ``storage`` is a node-local root without rank 0's parts and ``rank`` is the lowest rank whose parts
    it holds (judged from its newest readable committed step): that rank uploads the root's parts."""
    for step in reversed(catalog.committed_steps()):
        try:
            commit = catalog.read_commit(step)
            rows = rows_here(commit.manifests)      # a table's rows: this root's rows files when it lacks it
        except CheckpointError:
            continue
        here = [r for r, (_, _, g) in sorted(rows.items()) if storage.exists(manifest_path(step, r, g))]
        return bool(here) and 0 not in here and here[0] == rank
    return False
