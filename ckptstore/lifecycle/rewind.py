"""Rewinding a run: what ``save`` does with a step not newer than the newest committed one, and what ``resume``
does with the steps newer than the one it continues from.

``Store(on_rewind="error")`` (default) refuses it; ``"truncate"`` first drops every later step, locally and on
the remote (FORMAT.md "Rewinding a run"), so a run rolled back after a loss spike continues on a clean
timeline. The newest committed step is judged over the local root and the remote this store uploads to (with
``keep_local`` the local root may hold fewer steps than the remote).

A resume that continues from step S while some root still holds a committed step newer than S (a node-local disk
whose peers lost their parts, a step damaged on some rank) *sets those steps aside* (:func:`set_aside`,
FORMAT.md "Steps set aside after a resume"): none of them loads on every rank, so none is a checkpoint of the
job, and left committed it would make the run's next saves rewinds. Setting aside keeps them (gc removes them
a grace period later) instead of deleting what may be the only copy of a node's part.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

from ..format.blobs import digest_bytes
from ..util.errors import CorruptCheckpointError, IncompatibleCheckpointError
from ..format.layout import (ASIDE_NAME, COMMIT_NAME, STEPS, aside_dir, commit_path, manifest_path, parse_aside_dir,
                     shards_path, step_dir)
from ..format.manifest import MAX_COMMIT_BYTES, decode_commit, decode_manifest
from ..format.mtable import MAX_ROWS_FILE_BYTES, names_file, rows_here

log = logging.getLogger("ckptstore")

ON_REWIND = ("error", "truncate")


def newest_of(local: List[int], remote_newest: Optional[int]) -> Optional[int]:
    """The newest committed step over the local steps (ascending) and the remote's newest (``None``: none)."""
    newest = local[-1] if local else None
    if remote_newest is not None and (newest is None or remote_newest > newest):
        newest = remote_newest
    return newest


def must_truncate(step: int, newest: Optional[int], on_rewind: str) -> bool:
    """Whether saving ``step`` first needs the steps after it dropped. Raises ``IncompatibleCheckpointError``
    naming both steps (``.step``, ``.latest``) when ``step`` is not newer than ``newest`` and ``on_rewind`` is
    ``"error"``."""
    if newest is None or step > newest:
        return False
    if on_rewind == "error":
        what = "re-saving" if step == newest else "rewinding to"
        err = IncompatibleCheckpointError(
            f"{what} step {step}: the newest committed step is {newest}; a save must be newer. Pass "
            f"Store(..., on_rewind=\"truncate\") to drop the steps after {step} and continue from it")
        err.step, err.latest = step, newest
        raise err
    return True


def _leave_after(catalog, step: Optional[int], point_away_from: Callable[[int], None],
                 leave: Callable[[int], None]) -> List[int]:
    """``leave(s)`` for every committed step ``s`` of ``catalog`` newer than ``step`` (``None``: every one),
    newest first, each after the latest pointer was moved away from it (it never names an uncommitted step).
    Returns them, ascending."""
    gone = sorted((s for s in catalog.committed_steps() if step is None or s > step), reverse=True)
    for s in gone:
        point_away_from(s)
        leave(s)
    return sorted(gone)


def drop_local_after(catalog, step: int, point_away_from: Callable[[int], None]) -> List[int]:
    """Delete the committed steps of ``catalog`` newer than ``step``, newest first, each after the latest
    pointer was moved away from it (it never names an uncommitted step). Returns them, ascending."""
    dropped = _leave_after(catalog, step, point_away_from, catalog.delete_step)
    if dropped:
        log.warning("on_rewind=truncate: dropped local steps %s of %s to save step %d", dropped,
                    catalog.storage.url, step)
    return dropped


# -- steps set aside after a resume ----------------------------------------------------------------------------
MAX_ASIDE_RECORD_BYTES = 4096


def set_aside_after(catalog, step: Optional[int], point_away_from: Callable[[int], None]) -> List[int]:
    """After a resume continued from ``step`` (``None``: a fresh start): set aside (:func:`set_aside`) every
    committed step of ``catalog`` newer than it, newest first, each after the latest pointer was moved away
    from it. Logged (WARNING). Returns them, ascending. Raises ``OSError`` from the storage."""
    gone = _leave_after(catalog, step, point_away_from, lambda s: set_aside(catalog.storage, s, step))
    if gone:
        log.warning("%s: committed step(s) %s set aside (under %s/<step>.aside-*): the run continues from %s, "
                    "and they do not load on every rank (e.g. another node lost its parts); gc removes them a "
                    "grace period from now", catalog.storage.url, gone, STEPS,
                    f"step {step}" if step is not None else "a fresh start")
    return gone


def set_aside(storage, step: int, resumed: Optional[int], *, remove_rest: bool = True) -> Optional[str]:
    """Move committed ``step`` out of the run's timeline, keeping it (FORMAT.md "Steps set aside after a
    resume"): an ``ASIDE`` record (JSON: the step, the step resumed, when, in unix seconds) is written into
    ``steps/<step>.aside-<tag>/`` (``tag``: the first 16 hex digits of the BLAKE3 of the step's commit marker,
    so doing it again after a crash reuses the same directory and its first record), then the manifests and the
    shard map the marker names are copied there (each read with the bound of the size it records; one that
    cannot be read is not copied: a node-local root holds its own ranks' manifests only, and a damaged step may
    hold anything), then the marker itself, and only then is the marker deleted from the step: from that moment
    the step is uncommitted, invisible to readers, resume, uploads and retention. A crash before leaves it
    committed (the next resume sets it aside again); after, an uncommitted directory gc removes. With
    ``remove_rest`` the step's directory is then removed (a local root); on an object store it is left to gc,
    since an upload of the new timeline's step of the same number may be writing there. Returns the set-aside
    directory, or ``None`` when ``step`` is not committed. Raises ``OSError`` from writing or deleting."""
    sd = step_dir(step)
    what = commit_path(step)
    try:
        marker: Optional[bytes] = storage.read_bytes(what, limit=MAX_COMMIT_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError:                                 # not a regular file, unreadable: nothing of it to keep
        marker = None
    named: Dict[str, int] = {}                      # file name -> the size the marker records
    if marker is not None and len(marker) <= MAX_COMMIT_BYTES:
        try:
            commit = decode_commit(marker, step=step, what=what)
            if commit.shards is not None:
                named[shards_path(step, commit.shards[2]).rsplit("/", 1)[1]] = commit.shards[1]
            if commit.table is not None:             # its manifest table or rows files (FORMAT.md "Manifest table")
                for name in storage.listdir(sd):
                    if names_file(commit, name):
                        named[name] = commit.table.size if name.endswith(".tbl") else MAX_ROWS_FILE_BYTES
            for rank, (_, size, gen) in rows_here(commit.manifests.bind(storage) if commit.table else
                                                  commit.manifests).items():
                named[manifest_path(step, rank, gen).rsplit("/", 1)[1]] = size
        except CorruptCheckpointError:
            pass                                    # a damaged marker: it is kept, the files it names are not known
    dst = aside_dir(step, digest_bytes(marker if marker is not None else b"")[:16])
    record = f"{dst}/{ASIDE_NAME}"
    if not storage.exists(record):
        storage.write_atomic(record, json.dumps({"step": step, "resumed": resumed, "since": time.time(),
                                                 "format": 1}).encode() + b"\n")
    for name, size in sorted(named.items()):
        try:
            data = storage.read_bytes(f"{sd}/{name}", limit=size + 1)
        except OSError:
            continue
        storage.write_atomic(f"{dst}/{name}", data)
    if marker is not None:
        storage.write_atomic(f"{dst}/{COMMIT_NAME}", marker)
    storage.delete(what)
    if remove_rest:
        storage.rmtree(sd)
    return dst


@dataclass(frozen=True)
class Aside:
    """A step set aside (see :func:`set_aside`): its directory name under ``steps/``, the step, the step the
    resume continued from (``None``: a fresh start) and when it was set aside (unix seconds; ``None``: unknown,
    no readable record)."""
    name: str
    step: int
    resumed: Optional[int]
    since: Optional[float]


def asides(storage) -> List[Aside]:
    """The steps set aside in ``storage``, by step then name. Their records are untrusted: a missing or garbled
    one gives ``since=None`` (gc then treats the directory as old)."""
    out = []
    for name in storage.listdir(STEPS):
        step = parse_aside_dir(name)
        if step is None:
            continue
        resumed = since = None
        try:
            rec = json.loads(storage.read_bytes(f"{STEPS}/{name}/{ASIDE_NAME}", limit=MAX_ASIDE_RECORD_BYTES + 1))
            since = float(rec["since"])
            resumed = rec.get("resumed")
            resumed = int(resumed) if isinstance(resumed, int) and not isinstance(resumed, bool) else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            pass
        out.append(Aside(name, step, resumed, since))
    return sorted(out, key=lambda a: (a.step, a.name))


def aside_refs(storage, aside: Aside) -> Tuple[Set[str], Set[str]]:
    """``(blob ids, pack ids)`` the manifests of a set-aside step reference (those present: a node-local root
    holds its own ranks' parts), each checked against the digest and size its commit marker records. Raises
    ``CorruptCheckpointError`` / ``OSError`` for what cannot be read."""
    d = f"{STEPS}/{aside.name}"
    what = f"{d}/{COMMIT_NAME}"
    try:
        commit = decode_commit(storage.read_bytes(what, limit=MAX_COMMIT_BYTES + 1), step=aside.step, what=what)
    except FileNotFoundError:
        raise CorruptCheckpointError("set-aside commit marker missing", step=aside.step, blob=what) from None
    blobs: Set[str] = set()
    packs: Set[str] = set()
    rows = rows_here(commit.manifests.bind(storage, d) if commit.table is not None else commit.manifests)
    for rank, (digest, size, gen) in sorted(rows.items()):
        path = f"{d}/{manifest_path(aside.step, rank, gen).rsplit('/', 1)[1]}"
        try:
            data = storage.read_bytes(path, limit=size + 1)
        except FileNotFoundError:
            continue
        if len(data) != size or digest_bytes(data) != digest.hex():
            raise CorruptCheckpointError("set-aside manifest does not match its commit marker", step=aside.step,
                                         blob=path)
        m = decode_manifest(data, step=aside.step, rank=rank, what=path)
        blobs |= m.blob_ids()
        packs |= m.pack_ids()
    return blobs, packs
