"""Exceptions raised by ckptstore.

Every error that concerns a checkpoint names the step, and where it applies the key path and the blob, so a
user can find the file at fault. ``CheckpointError`` is the base of all of them.
"""
from __future__ import annotations

from typing import Iterable, Optional


class CheckpointError(Exception):
    """Base class of every error ckptstore raises about a checkpoint or a store. Its message never holds a
    credential (see :mod:`ckptstore.util.redact`)."""

    def __init__(self, *args):
        from .redact import redact
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


def _reason(message: str) -> str:
    from .redact import redact
    return redact(message)


def _naming(message: str, step: Optional[int], key: Optional[str], blob: Optional[str]) -> str:
    parts = [message]
    if step is not None:
        parts.append(f"step={step}")
    if key is not None:
        parts.append(f"key={key!r}")
    if blob is not None:
        parts.append(f"blob={blob}")
    return " | ".join(parts)


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes are missing, truncated or do not match their hash, where they are stored: damage
    that reading again does not cure (an object store's object counts as damaged only once two reads in a row
    brought back the same bad bytes; bad bytes that change from read to read are a :class:`TransferError`,
    FORMAT.md "Read verification"). Resume falls back to an older step on it.

    Attributes:
        step: the step whose checkpoint is at fault (``None`` when not tied to one step).
        key: the key path (``"model/fc.weight"``) whose tensor could not be read, if any.
        blob: the blob id (BLAKE3 hex digest) or store-relative file at fault, if any.
        reason: the message alone, without the names above.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, key: Optional[str] = None,
                 blob: Optional[str] = None):
        super().__init__(_naming(message, step, key, blob))
        self.step, self.key, self.blob, self.reason = step, key, blob, _reason(message)


class DamagedRead(CorruptCheckpointError):
    """Bytes just read that fail their check (hash, length, codec), before anyone has said where the damage
    is: at rest, or in transfer. ``got``: what came back (e.g. the wrong digest, a short length), so that two
    reads can be compared. Raised inside a read and judged by :func:`ckptstore.format.blobs.read_verified`, which turns
    it into a :class:`CorruptCheckpointError` (damage at rest: a local file, or the same bad bytes twice in a
    row from an object store) or a :class:`TransferError`; anywhere else it is the damage it is a subclass of.
    ``final``: the error to raise once the damage is verified, when it is not a plain
    ``CorruptCheckpointError`` (a commit marker that reads as a newer format twice is incompatible)."""

    def __init__(self, message: str, *, got, step: Optional[int] = None, key: Optional[str] = None,
                 blob: Optional[str] = None, final: Optional[CheckpointError] = None):
        super().__init__(message, step=step, key=key, blob=blob)
        self.got, self.final = got, final


class TransferError(CheckpointError):
    """Bytes could not be moved between ckptstore and an object store within the retry policy's deadline
    (:class:`~ckptstore.util.retry.RetryPolicy`): the calls kept failing, or every read of an object brought back
    bad bytes (failing their hash, or shorter than recorded), different ones each time. A fault of the network
    or of the service, not of the checkpoint: the stored object may well be intact (FORMAT.md "Read
    verification"). Resume raises it rather than taking the step for damaged (no fallback to an older step, no
    fresh start; README "Resume order"): run it again once the object store answers.

    Attributes: ``step``, ``key``, ``blob`` (the object at fault), as :class:`CorruptCheckpointError`'s, each
    ``None`` when unknown; ``reason``: the message alone.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, key: Optional[str] = None,
                 blob: Optional[str] = None):
        super().__init__(_naming(message, step, key, blob))
        self.step, self.key, self.blob, self.reason = step, key, blob, _reason(message)


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint that is intact but cannot be loaded into what the caller asked for.

    Raised for a newer format version, a world size that differs, a ``state`` whose keys differ from the
    checkpoint's (``missing``: in ``state`` but not in the checkpoint; ``unexpected``: the reverse), or a run
    config that differs (``differing``: key -> (checkpoint value, new value)).
    """

    def __init__(self, message: str, *, step: Optional[int] = None, missing: Iterable[str] = (),
                 unexpected: Iterable[str] = (), differing: Optional[dict] = None):
        self.step = step
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.differing = dict(differing or {})
        parts = [message if step is None else f"{message} (step {step})"]
        if self.missing:
            parts.append("missing from checkpoint: " + ", ".join(self.missing))
        if self.unexpected:
            parts.append("unexpected in checkpoint: " + ", ".join(self.unexpected))
        for k, (old, new) in sorted(self.differing.items()):
            parts.append(f"config {k!r}: checkpoint has {old!r}, run has {new!r}")
        super().__init__("; ".join(parts))


class UploadError(TransferError):
    """A background upload to the remote store failed (after its retries or past its deadline); also what
    :meth:`~ckptstore.util.retry.RetryPolicy.call` raises for any remote call, reads included, still failing when
    the deadline passes (a :class:`TransferError`: resume raises it, never skips the step on it)."""
