"""Garbage collection: mark every blob and pack referenced by a committed step, sweep the rest.

A pack is live while any committed step references any chunk in it (it is kept whole: its other bytes are
dead weight until a repack rewrites its live chunks).

Also removes what crashes leave behind: uncommitted step directories and temp files. Anything younger than
``grace_seconds`` is kept, so a save that is in flight in another process (its blobs and manifests exist,
its commit marker not yet) is never swept. If any committed step's metadata cannot be read, no blob is swept
(we cannot know what that step references) unless ``force`` is given.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import List, Optional, Set

from .errors import CheckpointError
from .layout import OBJECTS, PACKS, parse_blob_name, parse_pack_name, step_dir

log = logging.getLogger("ckptstore")


@dataclass
class GCReport:
    blobs_deleted: int = 0
    packs_deleted: int = 0
    bytes_freed: int = 0
    steps_removed: List[int] = field(default_factory=list)      # uncommitted step directories
    temp_files_removed: int = 0
    unreadable_steps: List[int] = field(default_factory=list)
    dry_run: bool = False


def referenced(catalog, committed: List[int], report: GCReport):
    """``(blob ids, pack ids)`` referenced by the readable committed steps; unreadable ones go to ``report``."""
    live: Set[str] = set()
    packs: Set[str] = set()
    for step in committed:
        try:
            commit = catalog.read_commit(step)
            for rank in sorted(commit.manifests):
                m = catalog.read_manifest(commit, rank)
                live |= m.blob_ids()
                packs |= m.pack_ids()
        except CheckpointError as e:
            log.warning("gc: cannot read step %d (%s)", step, e)
            report.unreadable_steps.append(step)
    return live, packs


def collect(storage, catalog, blobs, *, grace_seconds: float = 3600.0, dry_run: bool = False,
            force: bool = False, keep_steps: Optional[Set[int]] = None, index=None) -> GCReport:
    """Delete unreferenced blobs and packs, uncommitted step directories and stale temp files older than
    ``grace_seconds``. ``index``: a :class:`~ckptstore.index.ChunkIndex` told which packs are gone."""
    report = GCReport(dry_run=dry_run)
    now = time.time()

    def old(path: str) -> bool:
        m = storage.mtime(path)
        return m is None or now - m >= grace_seconds

    committed = catalog.committed_steps()
    for step in catalog.step_dirs():
        if step in committed or (keep_steps and step in keep_steps):
            continue
        sd = step_dir(step)
        names = storage.listdir(sd)
        if all(old(f"{sd}/{n}") for n in names) and old(sd):
            report.steps_removed.append(step)
            if not dry_run:
                storage.rmtree(sd)
    live, live_packs = referenced(catalog, committed, report)
    sweep = not report.unreadable_steps or force
    if not sweep:
        log.warning("gc: not sweeping blobs: steps %s are unreadable (repair or delete them, or use force)",
                    report.unreadable_steps)
    def sweep_dir(top: str, parse, live_ids: Set[str]) -> List[str]:
        """Delete stale temp files under ``top/<prefix>/`` and, when sweeping, files whose id (``parse(name)``
        -> id or None) is not live and older than the grace. Returns the ids of the deleted files."""
        deleted = []
        for prefix in storage.listdir(top):
            for name in storage.listdir(f"{top}/{prefix}"):
                path = f"{top}/{prefix}/{name}"
                obj_id = parse(name)
                if obj_id is None:
                    if ".tmp-" in name and old(path):
                        report.temp_files_removed += 1
                        if not dry_run:
                            storage.delete(path)
                    continue
                if not sweep or obj_id in live_ids or not old(path):
                    continue
                report.bytes_freed += storage.size(path) or 0
                deleted.append(obj_id)
                if not dry_run:
                    storage.delete(path)
        return deleted

    dead_blobs = sweep_dir(OBJECTS, lambda n: (parse_blob_name(n) or (None,))[0], live)
    report.blobs_deleted = len(dead_blobs)
    gone = sweep_dir(PACKS, parse_pack_name, live_packs)
    report.packs_deleted = len(gone)
    if not dry_run:
        for blob_id in dead_blobs:
            blobs.forget(blob_id)
    if gone and index is not None and not dry_run:
        index.forget(packs=gone)
    return report
