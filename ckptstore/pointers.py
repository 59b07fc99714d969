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


def encode_pointer(step: int) -> bytes:
    return (json.dumps({"step": check_step(step), "format": POINTER_FORMAT}) + "\n").encode()


def decode_pointer(data: bytes) -> Optional[int]:
    """The step a pointer names, or ``None`` for a garbled pointer (it is only a hint)."""
    try:
        obj = json.loads(data.decode())
        return check_step(obj["step"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None


def read_latest(storage) -> Optional[int]:
    try:
        return decode_pointer(storage.read_bytes(LATEST))
    except FileNotFoundError:
        return None


def write_latest(storage, step: int) -> None:
    storage.write_atomic(LATEST, encode_pointer(step))


def clear_latest(storage) -> None:
    storage.delete(LATEST)
