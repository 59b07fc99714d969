"""The collective commit of a step: all ranks' parts durable, then one commit marker, or nothing.

Protocol for one ``save`` under ``torch.distributed`` (``tag`` is the save's key in the coordinator):

1. Every rank writes its chunks and its manifest (or fails doing so, or fails earlier: in a Stateful's
   ``state_dict``, in flatten) and sends rank 0 a *part*: ``ok``, its manifest's digest / size / generation,
   its bytes, its error text, where its root is (host, path, device and inode of the root directory), and its
   entry for the step's shard map (:mod:`ckptstore.shardmap`: the boxes of its sharded values, hashes of its
   plain ones).
2. Rank 0 gathers the parts (deadline ``collective_timeout``). If every part is ok, it settles the save as
   ``"commit"`` (an atomic first-writer-wins decision in the key-value store), writes the shard map, then the
   commit marker into its root and moves its latest pointer; otherwise it settles ``"abort"``. It broadcasts
   the verdict: committed or not, each failing rank with its error, the commit marker's bytes, and the
   *leaders*: the lowest rank of every other root (node-local disks), which write the same shard map (its
   bytes under a key of their own, read by the leaders only) and commit marker into their own root.
3. A rank whose verdict does not come within the deadline (plus a slack: rank 0 may have started later) tries
   to settle the save as aborted by itself. If rank 0 settled first (commit or abort), the rank waits for the
   verdict after all (it is coming);
   otherwise the save is aborted and rank 0, settling later, finds ``"abort"`` and does not commit. So no rank
   ever reports a failure for a step that gets committed, or success for one that does not.

Every rank raises the same :class:`CommitError` (naming the failing ranks and their errors) when the step was
not committed, and no commit marker exists anywhere then. Messages are plain msgpack values, never pickles.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable, Dict, List, Optional, Tuple

from .collective import CollectiveTimeout, Coordinator
from .errors import CheckpointError

log = logging.getLogger("ckptstore")


class CommitError(CheckpointError):
    """A collective save was not committed. ``failures``: rank -> what went wrong there (its exception, or
    that it did not arrive within ``collective_timeout``). ``step``: the step."""

    def __init__(self, step: int, failures: Dict[int, str]):
        self.step, self.failures = step, dict(failures)
        what = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(self.failures.items()))
        super().__init__(f"step {step} was not committed (nothing was made visible): {what}")


def root_identity(local_path: Optional[str]) -> List[Any]:
    """Where a rank's store root is: ``[host, path, st_dev, st_ino]``. Ranks with equal identities share a
    root (one commit marker there); ``None`` path (a remote root) -> identified by its URL alone."""
    if local_path is None:
        return [socket.gethostname(), "", 0, 0]
    try:
        st = os.stat(local_path)
        return [socket.gethostname(), os.path.realpath(local_path), st.st_dev, st.st_ino]
    except OSError:
        return [socket.gethostname(), os.path.realpath(local_path), 0, 0]


def make_part(digest=None, bytes_total: int = 0, error: Optional[BaseException] = None,
              where: Optional[List[Any]] = None, shard_entry: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """This rank's message to rank 0: its manifest's ``(digest, size, generation)`` and shard map entry
    (:func:`ckptstore.shardmap.local_entry`), or its error."""
    part: Dict[str, Any] = {"ok": error is None, "bytes": int(bytes_total), "where": where or []}
    if shard_entry is not None:
        part["map"] = shard_entry
    if digest is not None:
        part["digest"], part["size"], part["gen"] = digest
    if error is not None:
        part["error"] = f"{type(error).__name__}: {error}"[:2000]
    return part


def agree_commit(coord: Coordinator, tag: str, step: int, part: Dict[str, Any], *, timeout: float,
                 write_commit: Callable[[List[Dict[str, Any]]], Tuple[bytes, Optional[bytes]]],
                 write_copy: Callable[[bytes, Optional[bytes]], None],
                 on_committed: Optional[Callable[[bytes], None]] = None) -> bool:
    """Run the protocol above for this rank. ``write_commit(parts) -> (marker bytes, shard map bytes or None)``
    (rank 0) writes the shard map, the commit marker and the pointer in rank 0's root; ``write_copy(marker
    bytes, shard map bytes or None)`` (a leader of another root) writes them in this rank's root. Returns, once
    the step is committed, whether this rank wrote a commit marker (rank 0, a leader): it then applies
    retention to its root. Raises :class:`CommitError`."""
    failures: Dict[int, str] = {}
    verdict: Optional[Dict[str, Any]] = None
    try:
        parts = coord.gather(f"{tag}/parts", part, timeout)
    except CollectiveTimeout as e:                  # rank 0 only
        parts = None
        for r in e.missing or ["?"]:
            failures[r] = f"did not reach the commit within {timeout:.0f} s (stalled or dead)"
    if coord.rank == 0:
        if parts is not None:
            for r, p in enumerate(parts):
                if not p.get("ok"):
                    failures[r] = str(p.get("error", "failed"))
        marker = shard_map = None
        if not failures:
            settled = coord.decide(tag, "commit")
            if settled != "commit":                 # "abort:<rank>": that rank gave up first
                failures[_rank(settled.partition(":")[2])] = "gave up waiting for the verdict (rank 0 was late)"
            else:
                try:
                    marker, shard_map = write_commit(parts)
                except Exception as e:
                    failures[0] = f"writing the commit marker: {type(e).__name__}: {e}"
        else:
            coord.decide(tag, "abort:0")
        leaders = _leaders(parts) if parts is not None and not failures else []
        if leaders and shard_map is not None:       # only the leaders read it: not in every rank's verdict
            coord.broadcast(f"{tag}/shards", {"data": shard_map}, timeout)
        verdict = {"committed": not failures, "failures": {str(k): v for k, v in failures.items()},
                   "commit": marker, "leaders": leaders, "shards": shard_map is not None}
        coord.broadcast(f"{tag}/verdict", verdict, timeout)
    else:
        verdict = _await_verdict(coord, tag, timeout)
    if verdict.get("committed"):
        if on_committed is not None and verdict.get("commit"):
            on_committed(verdict["commit"])         # every rank learns what rank 0 committed (e.g. the run id)
        if coord.rank in verdict.get("leaders", []):
            shard_map = coord.broadcast(f"{tag}/shards", None, timeout)["data"] if verdict.get("shards") else None
            write_copy(verdict["commit"], shard_map)
            return True
        return coord.rank == 0
    raise CommitError(step, {_rank(k): v for k, v in verdict.get("failures", {}).items()})


def _await_verdict(coord: Coordinator, tag: str, timeout: float) -> Dict[str, Any]:
    # rank 0 may start gathering later than this rank did and waits ``timeout`` itself: allow it that, plus
    # the time to write the marker, before suspecting rank 0
    slack = max(5.0, 0.25 * timeout)
    try:
        return coord.broadcast(f"{tag}/verdict", None, timeout + slack)
    except CollectiveTimeout:
        mine = f"abort:{coord.rank}"
        try:
            settled = coord.decide(tag, mine)
        except Exception as e:                      # the key-value store itself is gone (rank 0's process)
            return {"committed": False, "failures": {"0": f"unreachable ({type(e).__name__}: {e})"[:500]}}
        if settled == mine:
            return {"committed": False,
                    "failures": {"0": f"gave no verdict within {timeout + slack:.0f} s (stalled or dead)"}}
        log.warning("rank 0 has settled the save: waiting for its verdict")
        return coord.broadcast(f"{tag}/verdict", None, timeout + slack)


def _leaders(parts: List[Dict[str, Any]]) -> List[int]:
    """The lowest rank of each root other than rank 0's (those roots need their own commit marker)."""
    first: Dict[tuple, int] = {}
    for r, p in enumerate(parts):
        first.setdefault(tuple(p.get("where") or ()), r)
    own = tuple(parts[0].get("where") or ())
    return sorted(r for w, r in first.items() if w != own)


def _rank(k: str):
    try:
        return int(k)
    except ValueError:
        return k
