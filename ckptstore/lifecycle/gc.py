"""Garbage collection: mark every blob and pack referenced by a committed step, sweep the rest.

Who may delete (FORMAT.md, "Writers and deleters"): every sweep runs under :class:`ckptstore.lifecycle.lease.Deleter`:
it holds the store's gc lease and starts only once no save or copy is in flight (in-flight markers), so it
never removes an object that a live writer has decided to reuse, however old that object's mtime. When the
writers do not finish within ``wait`` seconds the sweep is deferred (``GCReport.deferred``), never forced.
It never follows a symbolic link: a linked ``objects/``, ``packs/`` or ``steps/`` directory (another store's
files, or files outside the root) is left alone.

A pack is live while any committed step references any chunk in it; ``repack`` rewrites the live chunks of a
mostly dead pack into a new one (see :mod:`ckptstore.lifecycle.repack`). A pack replaced by a repack is deleted once it
has been retired for ``grace_seconds`` (readers that opened the old manifest still find it meanwhile).

Also removes what crashes leave behind: uncommitted step directories, manifests their commit marker no longer
names (replaced by a re-save or a repack), and temp files, each once older than ``grace_seconds``; and steps a
resume set aside (:mod:`ckptstore.lifecycle.rewind`) once they were set aside ``grace_seconds`` ago and at least
``ASIDE_SECONDS`` ago, the blobs and packs they reference being kept until then. If any
committed step's metadata cannot be read, no blob is swept (we cannot know what that step references) unless
``force`` is given.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Set, Tuple

from ..util.errors import CheckpointError
from ..format.layout import (OBJECTS, PACKS, RETIRED, STEPS, check_blob_id, commit_path, manifest_path, pack_path,
                     parse_blob_name, parse_manifest_name, parse_pack_name, parse_shards_name, parse_table_name,
                     shards_path, step_dir)
from ..format.mtable import names_file, rows_here
from .lease import Deleter
from .rewind import aside_refs, asides

log = logging.getLogger("ckptstore")

# seconds a step set aside by a resume is kept at least, whatever the grace period of the sweep (retention's
# sweeps use short ones: the remote's after each upload none at all), so an operator can still look at it
ASIDE_SECONDS = 3600.0


@dataclass
class GCReport:
    blobs_deleted: int = 0
    packs_deleted: int = 0
    bytes_freed: int = 0
    steps_removed: List[int] = field(default_factory=list)      # uncommitted step directories
    temp_files_removed: int = 0
    unreadable_steps: List[int] = field(default_factory=list)
    dry_run: bool = False
    packs_repacked: int = 0          # packs whose live chunks were rewritten into new packs (then retired)
    bytes_repacked: int = 0          # live bytes rewritten by repack
    packs_written: int = 0           # new packs written by repack
    steps_rewritten: List[int] = field(default_factory=list)    # steps whose commit now names new manifests
    manifests_removed: int = 0       # manifests no commit marker names any more
    deferred: List[str] = field(default_factory=list)           # who kept this gc from deleting anything
    asides_removed: List[str] = field(default_factory=list)     # set-aside step directories (steps/<name>)


def referenced(catalog, committed: List[int], report: GCReport):
    """``(blob ids, pack ids)`` referenced by the readable committed steps; unreadable ones go to ``report``.

    A manifest that is absent references nothing here: a node-local root holds its own ranks' parts only (see
    FORMAT.md, "Distributed saves"). One that is present but unreadable stops the sweep, as before."""
    live: Set[str] = set()
    packs: Set[str] = set()
    for step in committed:
        try:
            commit = catalog.read_commit(step)
            rows = rows_here(commit.manifests)        # a table's rows: those this root can name
            for rank in sorted(rows):
                if not catalog.storage.exists(manifest_path(step, rank, rows[rank][2])):
                    continue
                m = catalog.read_manifest(commit, rank)
                live |= m.blob_ids()
                packs |= m.pack_ids()
        except CheckpointError as e:
            log.warning("gc: cannot read step %d (%s)", step, e)
            report.unreadable_steps.append(step)
    return live, packs


def collect(storage, catalog, blobs, *, grace_seconds: float = 3600.0, dry_run: bool = False,
            force: bool = False, keep_steps: Optional[Set[int]] = None, index=None, exclude: Iterable[str] = (),
            wait: float = 600.0, repack: Optional[float] = None, buffers=None) -> GCReport:
    """Delete unreferenced blobs and packs, uncommitted step directories, unnamed manifests and stale temp files
    older than ``grace_seconds``; with ``repack`` (a fraction, e.g. 0.5) first rewrite every pack whose live
    bytes are below that fraction of its size.

    ``exclude``: in-flight tokens not to wait for (the save this gc runs inside). ``wait``: seconds to wait for
    saves in flight / another gc before deferring. ``index``: a :class:`~ckptstore.format.index.ChunkIndex` told which
    packs are gone."""
    report = GCReport(dry_run=dry_run)
    if dry_run:
        _collect(storage, catalog, blobs, report, None, grace_seconds, force, keep_steps, index, None, buffers)
        return report
    with Deleter(storage, wait=wait, exclude=exclude) as d:
        if not d.clear:
            report.deferred = d.busy
            log.warning("gc of %s deferred (nothing deleted): %s", storage.url, "; ".join(d.busy))
            return report
        _collect(storage, catalog, blobs, report, d, grace_seconds, force, keep_steps, index, repack, buffers)
    return report


def _collect(storage, catalog, blobs, report, deleter, grace_seconds, force, keep_steps, index, repack,
             buffers) -> None:
    dry_run = deleter is None
    now = time.time()

    def old(path: str) -> bool:
        m = storage.mtime(path)
        return m is None or now - m >= grace_seconds

    def delete(path: str) -> None:
        if not dry_run:
            deleter.check()
            deleter.deleted = True
            storage.discard(path)           # gone from its name now; a large file's space comes back shortly

    committed = catalog.committed_steps()
    kept_asides = []
    if not _linked(storage, STEPS):
        for a in asides(storage):
            path = f"{STEPS}/{a.name}"
            if _linked(storage, path):
                continue
            if a.since is not None and now - a.since < max(grace_seconds, ASIDE_SECONDS):
                kept_asides.append(a)
                continue
            report.asides_removed.append(a.name)
            if not dry_run:
                deleter.check()
                deleter.deleted = True
                storage.rmtree(path)
        for step in catalog.step_dirs():
            if step in committed or (keep_steps and step in keep_steps):
                continue
            sd = step_dir(step)
            if _linked(storage, sd):
                continue
            names = storage.listdir(sd)
            if all(old(f"{sd}/{n}") for n in names) and old(sd):
                report.steps_removed.append(step)
                if not dry_run:
                    deleter.check()
                    deleter.deleted = True
                    storage.rmtree(sd)
    def live_sets(report):
        """What the committed steps reference, and the set-aside steps gc keeps still."""
        blobs_, packs_ = referenced(catalog, committed, report)
        for a in kept_asides:
            try:
                b, p = aside_refs(storage, a)
            except (CheckpointError, OSError) as e:     # not a checkpoint: it never stops the sweep
                log.warning("gc: set-aside step %s/%s/%s is unreadable (%s): its blobs are not kept", storage.url,
                            STEPS, a.name, e)
                continue
            blobs_ |= b
            packs_ |= p
        return blobs_, packs_

    live, live_packs = live_sets(report)
    sweep = not report.unreadable_steps or force
    if not sweep:
        log.warning("gc: not sweeping blobs: steps %s are unreadable (repair or delete them, or use force)",
                    report.unreadable_steps)
    if repack is not None and not dry_run and not report.unreadable_steps:
        from .repack import repack_packs
        repack_packs(storage, catalog, committed, threshold=repack, report=report, deleter=deleter,
                     buffers=buffers)
        if report.packs_repacked:
            live, live_packs = live_sets(GCReport())
            now = time.time()                     # the packs retired just now count as retired for 0 s

    # manifests and shard maps a commit marker no longer names (a re-save or repack replaced them), once the
    # marker is old
    if not _linked(storage, STEPS):
        for step in committed:
            sd = step_dir(step)
            if _linked(storage, sd) or not old(commit_path(step)):
                continue
            try:
                commit = catalog.read_commit(step)
            except CheckpointError:
                continue
            try:
                named = {manifest_path(step, r, g) for r, (_, _, g) in rows_here(commit.manifests).items()}
            except CheckpointError:
                continue
            if commit.shards is not None:
                named.add(shards_path(step, commit.shards[2]))
            for name in storage.listdir(sd):
                path = f"{sd}/{name}"
                replaced = parse_manifest_name(name) is not None or parse_shards_name(name) is not None \
                    or (parse_table_name(name) is not None and not names_file(commit, name))
                if ((replaced and path not in named) or ".tmp-" in name) \
                        and old(path) and not storage.is_link(path):
                    report.manifests_removed += ".tmp-" not in name
                    report.temp_files_removed += ".tmp-" in name
                    delete(path)

    retired = {}
    for name in storage.listdir(RETIRED):
        try:
            retired[check_blob_id(name)] = storage.mtime(f"{RETIRED}/{name}") or 0.0
        except ValueError:
            continue

    def spare(path: str, obj_id: str) -> bool:
        """Unreferenced but kept still: younger than the grace, or a pack a repack replaced too recently
        (readers in flight may still read it)."""
        return not old(path) or (obj_id in retired and now - retired[obj_id] < grace_seconds)

    dead_blobs, gone = sweep_objects(storage, report, live, live_packs, delete, sweep=sweep, spare=spare,
                                     stale_temp=old)
    if not dry_run:
        for pack_id in retired:                   # notes of packs that are gone (now or before)
            if pack_id in gone or not storage.exists(pack_path(pack_id)):
                delete(f"{RETIRED}/{pack_id}")
        for blob_id in dead_blobs:
            blobs.forget(blob_id)
    if gone and index is not None and not dry_run:
        index.forget(packs=gone)


def sweep_objects(storage, report: GCReport, live: Set[str], live_packs: Set[str], delete, *, sweep: bool = True,
                  spare=None, stale_temp=None) -> Tuple[List[str], List[str]]:
    """Delete, through ``delete(path)``, the blobs under ``objects/`` whose id is not in ``live`` and the packs
    under ``packs/`` whose id is not in ``live_packs`` (none when ``sweep`` is false); count them (and their
    bytes) into ``report``. ``spare(path, id)``: whether an unreferenced file is kept still (gc: its grace
    period, retired packs); ``stale_temp(path)``: whether a temp file found there is deleted (``None``: temp
    files are left alone). A symbolic link is never followed nor deleted. Returns the ids deleted
    ``(blobs, packs)``. Used by :func:`collect` and by the memory tier's sweep
    (:func:`ckptstore.memtier.memory.sweep`)."""

    def sweep_dir(top: str, parse, live_ids: Set[str]) -> List[str]:
        deleted: List[str] = []
        if _linked(storage, top):
            return deleted
        for prefix in storage.listdir(top):
            if _linked(storage, f"{top}/{prefix}"):
                continue
            for name in storage.listdir(f"{top}/{prefix}"):
                path = f"{top}/{prefix}/{name}"
                if storage.is_link(path):
                    continue
                obj_id = parse(name)
                if obj_id is None:
                    if stale_temp is not None and ".tmp-" in name and stale_temp(path):
                        report.temp_files_removed += 1
                        delete(path)
                    continue
                if not sweep or obj_id in live_ids or (spare is not None and spare(path, obj_id)):
                    continue
                report.bytes_freed += storage.size(path) or 0
                deleted.append(obj_id)
                delete(path)
        return deleted

    dead_blobs = sweep_dir(OBJECTS, lambda n: (parse_blob_name(n) or (None,))[0], live)
    report.blobs_deleted += len(dead_blobs)
    dead_packs = sweep_dir(PACKS, parse_pack_name, live_packs)
    report.packs_deleted += len(dead_packs)
    return dead_blobs, dead_packs


def _linked(storage, path: str) -> bool:
    """Whether ``path`` is a symbolic link (logged: nothing under it is followed or deleted)."""
    if storage.is_link(path):
        log.warning("gc: %s/%s is a symbolic link: not following it (nothing under it is deleted)", storage.url, path)
        return True
    return False
