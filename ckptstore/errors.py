"""Exceptions raised by ckptstore.

Every error that concerns a checkpoint names the step, and where it applies the key path and the blob, so a
user can find the file at fault. ``CheckpointError`` is the base of all of them.
"""
from __future__ import annotations

from typing import Iterable, Optional


class CheckpointError(Exception):
    """Base class of every error ckptstore raises about a checkpoint or a store. Its message never holds a
    credential (see :mod:`ckptstore.redact`)."""

    def __init__(self, *args):
        from .redact import redact
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's bytes are missing, truncated or do not match their hash.

    Attributes:
        step: the step whose checkpoint is at fault (``None`` when not tied to one step).
        key: the key path (``"model/fc.weight"``) whose tensor could not be read, if any.
        blob: the blob id (BLAKE3 hex digest) or store-relative file at fault, if any.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, key: Optional[str] = None,
                 blob: Optional[str] = None):
        parts = [message]
        if step is not None:
            parts.append(f"step={step}")
        if key is not None:
            parts.append(f"key={key!r}")
        if blob is not None:
            parts.append(f"blob={blob}")
        super().__init__(" | ".join(parts))
        self.step, self.key, self.blob = step, key, blob


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


class UploadError(CheckpointError):
    """A background upload to the remote store failed (after its retries or past its deadline)."""
