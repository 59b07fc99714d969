"""Remote-deletion intents: the durable record of a ``Store.delete_step(step, remote=True)`` not yet done on the
remote (FORMAT.md "Writers and deleters", *Deletion decided by the trainer*).

``locks/remote-deletes/<step:012d>.json`` in the local root of the store whose uploader writes the remote's
steps (rank 0's), written atomically and durably before the step's local commit marker is deleted, so before
``delete_step`` returns; removed once the remote holds nothing of the step. The uploader reads them when it
derives its work (at start-up, and after a failure), so a deletion that returned survives a SIGKILL and the
next writer finishes it, in commit order with the uploads (see :class:`ckptstore.remote.upload.Uploader`).

Body (JSON): ``{"step": int, "after": int, "remote": str, "time": float}``. ``after``: the newest step committed
or given to the uploader when the deletion was asked (-1: none); uploads of steps up to it were queued before
the deletion and run first. ``remote``: the URL of the remote it is for (an intent for another remote is left
alone). ``time``: seconds since the epoch, for people. The file name alone says the step: a body that does not
decode is logged and the intent kept, for this remote, to run after every upload derived with it.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Dict

from .layout import REMOTE_DELETES, check_step, parse_remote_delete_name, remote_delete_path

log = logging.getLogger("ckptstore")

MAX_BYTES = 4096          # an intent body is ~100 bytes; a larger file is not one


@dataclass(frozen=True)
class DeleteIntent:
    """A step to delete from ``remote`` once the uploads of steps up to ``after`` are done."""
    step: int
    after: int
    remote: str

    def encode(self) -> bytes:
        return (json.dumps({"step": self.step, "after": self.after, "remote": self.remote,
                            "time": round(time.time(), 3)}) + "\n").encode()


def record(storage, intent: DeleteIntent) -> None:
    """Write ``intent`` into ``storage`` (the local root) atomically and durably (write, fsync, rename, fsync the
    directory); raises ``OSError`` from the disk, and then the deletion must not go on."""
    storage.write_atomic(remote_delete_path(intent.step), intent.encode())


def forget(storage, step: int) -> None:
    """Remove the intent of ``step`` (its remote deletion is done, or no longer wanted); missing is no error."""
    storage.delete(remote_delete_path(step))


def read_all(storage, remote: str) -> Dict[int, DeleteIntent]:
    """The intents in ``storage`` for ``remote``, by step. An intent for another remote is logged and left in
    place; one whose body does not decode is logged and kept (its file name says the step) with ``after=-1``.
    Never raises for a bad file (only ``OSError`` from listing)."""
    out: Dict[int, DeleteIntent] = {}
    for name in storage.listdir(REMOTE_DELETES):
        step = parse_remote_delete_name(name)
        if step is None:
            continue
        path = f"{REMOTE_DELETES}/{name}"
        try:
            intent = _decode(storage.read_bytes(path, limit=MAX_BYTES + 1), step)
        except FileNotFoundError:
            continue                                # done by a concurrent forget
        except (OSError, ValueError, TypeError) as e:
            log.warning("remote-deletion intent %s/%s is unreadable (%s): deleting step %d from %s all the same",
                        storage.url, path, e, step, remote)
            intent = DeleteIntent(step, -1, remote)
        if intent.remote != remote:
            log.info("remote-deletion intent %s/%s is for %s, not %s: left alone", storage.url, path,
                     intent.remote, remote)
            continue
        out[step] = intent
    return out


def _decode(data: bytes, step: int) -> DeleteIntent:
    """Decode an intent body; ``ValueError`` / ``TypeError`` when it is not one for ``step``."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    obj = json.loads(data.decode())
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    after, remote = obj.get("after"), obj.get("remote")
    if check_step(obj.get("step")) != step:
        raise ValueError(f"names step {obj.get('step')}, not {step}")
    if isinstance(after, bool) or not isinstance(after, int) or after < -1:
        raise ValueError(f"bad 'after' {after!r}")
    if not isinstance(remote, str):
        raise ValueError(f"bad 'remote' {remote!r}")
    return DeleteIntent(step, after, remote)

