"""The latest pointer: a small JSON file ``latest`` naming the newest committed step.

It is a hint that saves a listing, never the only truth: readers check that the step it names is committed
and fall back to listing the committed steps. Writers replace it atomically (write-temp, fsync, rename), and
only after the step's commit marker is durable, so it never names a step that was not committed.
"""
from __future__ import annotations

import json
from typing import Optional

from .layout import LATEST, check_step

POINTER_FORMAT = 1
MAX_POINTER_BYTES = 4096          # a pointer is ~30 bytes; anything much longer is garbage, not parsed


def encode_pointer(step: int) -> bytes:
    return (json.dumps({"step": check_step(step), "format": POINTER_FORMAT}) + "\n").encode()


def decode_pointer(data: bytes) -> Optional[int]:
    """The step a pointer names, or ``None`` for a garbled pointer (it is only a hint)."""
    if len(data) > MAX_POINTER_BYTES:
        return None
    try:
        obj = json.loads(data.decode())
        return check_step(obj["step"])
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, RecursionError, OverflowError):
        return None


def read_latest(storage) -> Optional[int]:
    """The step the local pointer names, or ``None`` when it is missing, garbled, or not a regular file."""
    try:
        return decode_pointer(storage.read_bytes(LATEST))
    except OSError:
        return None


def write_latest(storage, step: int) -> None:
    storage.write_atomic(LATEST, encode_pointer(step))


def advance_latest(storage, step: int, attempts: int = 20) -> bool:
    """Move the latest pointer forward to ``step``; never backwards.

    Compare-and-swap loop over :meth:`Storage.read_versioned` / :meth:`Storage.write_if_match`: S3 ``If-Match``
    (``If-None-Match: *`` to create), GCS ``ifGenerationMatch``, a ``flock`` locally. On backends without
    conditional writes (``memory://``, plain HTTP, ...) two concurrent writers can race and the pointer can
    briefly name the older of two steps; readers never trust it alone (they list committed steps).
    Returns True if the pointer now names ``step``, False if it already named a newer or equal step.
    """
    data = encode_pointer(step)
    for _ in range(attempts):
        current, token = storage.read_versioned(LATEST)
        cur = decode_pointer(current) if current is not None else None
        if cur is not None and cur >= step:
            return cur == step
        if storage.write_if_match(LATEST, data, token):
            return True
    raise RuntimeError(f"latest pointer of {storage.url}: gave up after {attempts} conflicting writers")


def clear_latest(storage) -> None:
    storage.delete(LATEST)


def rewind_latest(storage, to: Optional[int], is_committed, attempts: int = 20) -> bool:
    """Move the latest pointer *back* to ``to`` (``None``: remove it), the one exception to "forward only",
    used when a run truncates its later steps (``Store(on_rewind="truncate")``).

    The rule (FORMAT.md, "Rewinding a run"): the pointer may move back only once the step it names is no longer
    committed (its commit marker, deleted first, is gone), and only to a committed step (or nowhere). The
    write is conditional on the version read (compare-and-swap), so a concurrent forward move wins and this
    returns False. ``is_committed(step) -> bool`` checks the storage's commit markers. Returns True when the
    pointer now names ``to`` (or is gone for ``None``)."""
    for _ in range(attempts):
        current, token = storage.read_versioned(LATEST)
        cur = decode_pointer(current) if current is not None else None
        if current is None:
            return to is None
        if cur == to:
            return True
        if cur is not None and (cur < (to if to is not None else -1) or is_committed(cur)):
            return False                    # it names a newer live step (or an older one): not ours to move
        if to is None:
            storage.delete(LATEST)          # no conditional delete; a remote root has one writer (its lease)
            return True
        if storage.write_if_match(LATEST, encode_pointer(to), token):
            return True
    raise RuntimeError(f"latest pointer of {storage.url}: gave up after {attempts} conflicting writers")


def point_away_from(storage, catalog, step: int) -> None:
    """Before ``step`` stops being committed in ``catalog``: if the latest pointer names it, move the pointer to
    the newest other committed step (or remove it), so it never names an uncommitted step."""
    if read_latest(storage) != step:
        return
    older = [s for s in catalog.committed_steps() if s != step]
    if older:
        write_latest(storage, older[-1])
    else:
        clear_latest(storage)


def point_to_if_newest(storage, catalog, step: int) -> None:
    """After ``step`` is committed: move the latest pointer to it unless it already names a newer committed
    step."""
    latest = read_latest(storage)
    if latest is None or latest <= step or not catalog.is_committed(latest):
        write_latest(storage, step)
