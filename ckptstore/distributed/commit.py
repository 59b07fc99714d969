"""The collective commit of a step: all ranks' parts durable, then one commit marker, or nothing.

Protocol for one ``save`` under ``torch.distributed`` (``tag`` is the save's key in the coordinator):

1. Every rank writes its chunks and its manifest (or fails doing so, or fails earlier: in a Stateful's
   ``state_dict``, in flatten) and sends rank 0 a *part* of fixed size whatever its state holds (~250 bytes):
   ``ok``, its manifest's digest / size / generation, its bytes, its error text, a 16-byte hash of where its
   root is (host, path, device and inode of the root directory), and what the step's shard map needs
   (:mod:`ckptstore.format.shardmap`: an 8-byte layout digest, one bit, 16 bytes per plain-value group).
2. Rank 0 folds the parts rank by rank as they are read (it never holds them all: O(N) time, O(N) x 40 bytes of
   manifest table). If every part is ok, it settles the save as ``"commit"`` (an atomic first-writer-wins
   decision in the key-value store), writes the shard map, then the commit marker into its root and moves its
   latest pointer; otherwise it settles ``"abort"``. It leaves each *leader* (the lowest rank of every other
   root: node-local disks) a message with the commit marker's bytes, what it needs to build the same shard
   map and, when the marker names a manifest table (:mod:`ckptstore.format.mtable`, more than 512 ranks), the
   manifest rows of that root's ranks only (issue 29: it was the whole marker, 41 bytes a rank), then
   broadcasts the verdict, the same small message to every rank (< 1 KB: committed or not, at most
   :data:`MAX_LISTED` failing ranks with their errors and how many more, the run id).
3. A rank whose verdict does not come within the deadline (plus a slack: rank 0 may have started later) tries
   to settle the save as aborted by itself. If rank 0 settled first (commit or abort), the rank waits for the
   verdict after all (it is coming); otherwise the save is aborted and rank 0, settling later, finds ``"abort"``
   and does not commit. So no rank ever reports a failure for a step that gets committed, or success for one
   that does not.
4. After the verdict, a leader takes its message and writes the shard map, its root's rows (a rows file, when the
   marker names a table) and the marker into its own root.
   Nothing the agreement put in the key-value store outlives it (:mod:`ckptstore.distributed.collective`).

Every rank raises the same :class:`CommitError` (naming the failing ranks and their errors) when the step was
not committed, and no commit marker exists anywhere then. Messages are plain msgpack values, never pickles.
"""
from __future__ import annotations

import hashlib
import logging
import os
import socket
from typing import Any, Callable, Dict, List, Optional, Tuple

import msgpack

from ..format import mtable, shardmap
from ..format.blobs import digest_bytes
from .collective import CollectiveTimeout, Coordinator
from ..util.errors import CheckpointError
from ..format.manifest import Commit, Manifest, decode_commit, encode_commit_files

log = logging.getLogger("ckptstore")


class CommitError(CheckpointError):
    """A collective save was not committed. ``failures``: rank -> what went wrong there (its exception, or
    that it did not arrive within ``collective_timeout``). ``step``: the step."""

    def __init__(self, step: int, failures: Dict[int, str]):
        self.step, self.failures = step, dict(failures)
        what = "; ".join(f"rank {r}: {msg}" for r, msg in sorted(self.failures.items()))
        super().__init__(f"step {step} was not committed (nothing was made visible): {what}")


MAX_OWNERS = 16                  # owner ranks one part may name (shardmap.owner_ranks' limit)
MAX_OWNERS_PER_ROOT = 256        # owner ranks of one root whose rows its leader gets (48 bytes each)
MAX_LISTED = 4                   # failing ranks a verdict names (with their errors); the rest are counted
MAX_ERROR = 160                  # characters of each listed error in the verdict (the part carries 2000)


def root_identity(local_path: Optional[str]) -> bytes:
    """Where a rank's store root is: 16 bytes hashing ``[host, path, st_dev, st_ino]``. Ranks with equal
    identities share a root (one commit marker there); ``None`` path (a remote root) -> the host alone."""
    if local_path is None:
        where = [socket.gethostname(), "", 0, 0]
    else:
        try:
            st = os.stat(local_path)
            where = [socket.gethostname(), os.path.realpath(local_path), st.st_dev, st.st_ino]
        except OSError:
            where = [socket.gethostname(), os.path.realpath(local_path), 0, 0]
    return hashlib.blake2b(msgpack.packb(where, use_bin_type=True), digest_size=16).digest()


def make_part(digest=None, bytes_total: int = 0, error: Optional[BaseException] = None,
              where: bytes = b"", extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """This rank's message to rank 0: its manifest's ``(digest, size, generation)``, where its root is, and
    ``extra`` (the shard map's inputs), or its error."""
    part: Dict[str, Any] = {"ok": error is None, "bytes": int(bytes_total), "where": where}
    if extra:
        part.update(extra)
    if digest is not None:
        part["digest"], part["size"], part["gen"] = digest
    if error is not None:
        part["error"] = f"{type(error).__name__}: {error}"[:2000]
    return part


class _Fold:
    """Rank 0's running view of the parts: the manifest table, the failures, the roots' leaders."""

    def __init__(self, check: Optional[Callable[[int, Dict[str, Any]], Optional[str]]]):
        self.check = check
        self.manifests: Dict[int, Tuple[bytes, int, int]] = {}
        self.failures: Dict[Any, str] = {}
        self.nfail = 0
        self.bytes = 0
        self.own: Optional[bytes] = None
        self.first: Dict[bytes, int] = {}
        self.roots: Dict[bytes, List[int]] = {}     # root -> its ranks (a leader gets their manifest rows)
        self.owners: Dict[bytes, Optional[set]] = {}   # root -> ranks owning chunks its ranks hold (None: too many)

    def fail(self, r, msg: str) -> None:
        self.nfail += 1
        if len(self.failures) < 64:
            self.failures[r] = msg

    def __call__(self, r: int, p: Dict[str, Any]) -> None:
        if not p.get("ok"):
            self.fail(r, str(p.get("error", "failed")))
            return
        problem = self.check(r, p) if self.check is not None else None
        if problem:
            self.fail(r, problem)
            return
        try:
            self.manifests[r] = (p["digest"], int(p["size"]), int(p["gen"]))
            self.bytes += int(p["bytes"])
        except (KeyError, TypeError, ValueError) as e:
            self.fail(r, f"malformed part ({type(e).__name__}: {e})")
            return
        where = bytes(p.get("where") or b"")
        if r == 0:
            self.own = where
        self.first.setdefault(where, r)
        self.roots.setdefault(where, []).append(r)
        owners = p.get("owners")
        held = self.owners.setdefault(where, set())
        if isinstance(owners, list) and held is not None:
            held.update(o for o in owners[:MAX_OWNERS] if isinstance(o, int) and not isinstance(o, bool))
            if len(held) > MAX_OWNERS_PER_ROOT:     # bounded message: past this, the root confirms nothing
                self.owners[where] = None

    def rows_of(self, leader: int, where: Optional[bytes] = None) -> List[List[Any]]:
        """The manifest rows ``[rank, digest, size, generation]`` of the ranks sharing ``leader``'s root."""
        if where is None:
            where = next(w for w, r in self.first.items() if r == leader)
        return [[q, *self.manifests[q]] for q in self.roots[where]]

    def owner_rows_of(self, leader: int, where: bytes) -> List[List[Any]]:
        """The manifest rows of the ranks owning chunks that ``leader``'s root holds too (their parts' uploads
        are left to those ranks' roots, which a node confirms by these rows), other than the root's own."""
        own = set(self.roots[where])
        return [[q, *self.manifests[q]] for q in sorted(self.owners.get(where) or ())
                if q not in own and q in self.manifests]

    def leaders(self) -> List[int]:
        """The lowest rank of each root other than rank 0's (those roots need their own commit marker)."""
        return sorted(r for w, r in self.first.items() if w != self.own)


def agree_commit(coord: Coordinator, tag: str, step: int, part: Dict[str, Any], *, timeout: float,
                 write_commit: Callable[[Dict[int, Tuple[bytes, int, int]], int], Tuple[bytes, Dict[str, Any]]],
                 write_copy: Callable[[Dict[str, Any]], None],
                 check: Optional[Callable[[int, Dict[str, Any]], Optional[str]]] = None,
                 on_committed: Optional[Callable[[Dict[str, Any]], None]] = None) -> bool:
    """Run the protocol above for this rank. Rank 0: ``check(rank, part)`` (called for each rank in order)
    returns why a part cannot be committed, or ``None``; ``write_commit(manifest table, bytes total) ->
    (marker bytes, what leaders need)`` writes the shard map, the commit marker and the pointer in rank 0's
    root. A leader of another root: ``write_copy(message)`` (the marker's bytes under ``"commit"``) writes them
    in its root. ``on_committed(verdict)``: every rank, once committed (the verdict carries rank 0's
    ``run_id``). Returns, once the step is committed, whether this rank wrote a commit marker (rank 0, a
    leader): it then applies retention to its root. Raises :class:`CommitError`."""
    verdict: Optional[Dict[str, Any]] = None
    if coord.rank == 0:
        fold = _Fold(check)
        try:
            coord.gather(f"{tag}/parts", part, timeout, fold=fold)
        except CollectiveTimeout as e:
            for r in e.missing or ["?"]:
                fold.fail(r, f"did not reach the commit within {timeout:.0f} s (stalled or dead)")
        run_id, table_digest = "", None
        if not fold.nfail:
            settled = coord.decide(tag, "commit")
            if settled != "commit":                 # "abort:<rank>": that rank gave up first
                fold.fail(_rank(settled.partition(":")[2]), "gave up waiting for the verdict (rank 0 was late)")
            else:
                try:
                    marker, extra = write_commit(fold.manifests, fold.bytes)
                    run_id = str(extra.get("run_id", ""))
                    table_digest = extra.pop("table_digest", None)
                except Exception as e:
                    fold.fail(0, f"writing the commit marker: {type(e).__name__}: {e}")
        else:
            coord.decide(tag, "abort:0")
        listed = sorted(fold.failures.items(), key=lambda kv: str(kv[0]))[:MAX_LISTED]
        verdict = {"committed": not fold.nfail, "failures": {str(k): v[:MAX_ERROR] for k, v in listed},
                   "more": max(0, fold.nfail - len(listed)), "run_id": run_id,
                   **({"table": table_digest} if table_digest is not None and not fold.nfail else {})}
        try:
            if not fold.nfail:
                table = extra.pop("table", False)
                by_leader = {r: w for w, r in fold.first.items()}
                for r in fold.leaders():            # before the verdict: a leader looks once it has it
                    # a marker naming a manifest table: the leader gets its own root's rows, not the table
                    # and the rows of the owners of chunks its ranks hold too (see commit_across_ranks)
                    rows = {"rows": fold.rows_of(r, by_leader[r]),
                            "refs": fold.owner_rows_of(r, by_leader[r])} if table else {}
                    coord.send_to(f"{tag}/lead", r, {"commit": marker, **extra, **rows})
            coord.broadcast(f"{tag}/verdict", verdict, timeout, drop=[f"{tag}/decision"])
        except Exception as e:
            if fold.nfail:
                raise
            # the marker is written: the step IS committed and rank 0 must not report otherwise; the other
            # ranks, without a verdict, wait and then raise (the key-value store is gone)
            log.error("step %d is committed, but telling the other ranks failed: %s: %s", step,
                      type(e).__name__, e)
    else:
        coord.gather(f"{tag}/parts", part, timeout)
        verdict = _await_verdict(coord, tag, timeout)
    if verdict.get("committed"):
        if on_committed is not None:
            on_committed(verdict)
        if coord.rank == 0:
            return True
        message = coord.receive(f"{tag}/lead", timeout)
        if message is not None:
            write_copy(message)
            return True
        return False
    failures = {_rank(k): v for k, v in verdict.get("failures", {}).items()}
    if verdict.get("more"):
        failures["more"] = f"{verdict['more']} more rank(s) failed"
    raise CommitError(step, failures)


def _await_verdict(coord: Coordinator, tag: str, timeout: float) -> Dict[str, Any]:
    # rank 0 may start gathering later than this rank did and waits ``timeout`` itself: allow it that, plus
    # the time to write the marker, before suspecting rank 0
    slack = max(5.0, 0.25 * timeout)
    drop = [f"{tag}/decision"]
    try:
        return coord.broadcast(f"{tag}/verdict", None, timeout + slack, drop=drop)
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
        return coord.broadcast(f"{tag}/verdict", None, timeout + slack, drop=drop)


def _row_map(rows: List[List[Any]]) -> Dict[int, Tuple[bytes, int, int]]:
    """``[[rank, digest, size, generation], ...]`` (a leader's message) -> rank -> row."""
    return {int(q): (d, int(sz), int(g)) for q, d, sz, g in rows}


def _rank(k: str):
    try:
        return int(k)
    except ValueError:
        return k


def part_extra(step: int, world_size: int, manifest: Manifest, *, owners: bool) -> Tuple[Dict[str, Any], List[Any]]:
    """What a rank's part carries from its manifest (the shard map's inputs: layout digest, rule bit, replicated
    keys' digest, plain-value groups; with ``owners`` (the job uploads) past ``mtable.INLINE_ROWS`` ranks, its
    owner ranks: see :meth:`_Fold.owner_rows_of`), and its plain-value groups (rank 0's fold starts from them)."""
    lay, rule = shardmap.layout(manifest, manifest.rank)
    groups, gk, gd = shardmap.plain_groups(manifest)
    extra = {"layout": lay, "rule": rule, "rep": shardmap.replicated_digest(manifest), "gk": gk, "gd": gd}
    if owners and rule and world_size > mtable.INLINE_ROWS:     # a marker naming a table: see owner_rows_of
        key = (lay, manifest.rank, world_size)      # the same layout (every save of a run): the same owners
        found = _OWNERS.get(key, False)
        if found is False:
            if len(_OWNERS) >= 16:
                _OWNERS.clear()
            found = _OWNERS[key] = shardmap.owner_ranks(step, world_size, manifest, MAX_OWNERS)
        if found:
            extra["owners"] = found
    return extra, groups


_OWNERS: Dict[Tuple[bytes, int, int], Optional[List[int]]] = {}    # part_extra's cache of owner_ranks


def commit_across_ranks(coord: Coordinator, tag: str, step: int, *, manifest: Optional[Manifest], own_digest,
                        bytes_total: int, error: Optional[BaseException], where: bytes, timeout: float,
                        new_commit: Callable[[Dict[int, Tuple[bytes, int, int]], int], Commit],
                        write_marker: Callable[[bytes, Optional[bytes]], None],
                        write_rows: Callable[..., None],
                        write_map: Callable[[int, bytes], Tuple[bytes, int, int]], gen: int,
                        adopt_run_id: Callable[[str], None],
                        on_table: Optional[Callable[[bytes], None]] = None, owners: bool = False) -> bool:
    """One rank's side of a collective save (what ``Store.save`` runs after writing its manifest): its part
    (with the shard map's inputs from ``manifest``, this rank's, ``None`` when it failed before having one),
    :func:`agree_commit`, and on rank 0 / a leader the shard map and commit marker through ``write_map(gen,
    bytes) -> ref`` and ``write_marker(bytes, table bytes or None)`` (the manifest table of a marker of more than
    ``mtable.INLINE_ROWS`` ranks, written before the marker); a leader writes its root's manifest rows through
    ``write_rows(table digest, rows, refs)`` before the marker (``refs``: the rows of the ranks owning chunks its
    ranks hold too, from :func:`shardmap.owner_ranks`, each rank's part naming its owners past
    ``mtable.INLINE_ROWS`` ranks: the root's uploader confirms the objects it leaves to them by those rows);
    ``new_commit(manifest table, bytes total)`` makes the marker's contents. ``on_table(table digest)``: every
    rank, once committed, when the marker names a manifest table (the verdict carries its digest: the memory
    tier writes the rows of the replicas this rank took).
    ``owners``: the roots upload to a remote (their leaders need the owner rows, see :func:`part_extra`).
    Returns whether this rank wrote a commit marker. Raises :class:`CommitError` (from ``error``)."""
    extra: Dict[str, Any] = {}
    groups: List[Any] = []
    if manifest is not None:
        extra, groups = part_extra(step, coord.world_size, manifest, owners=owners)
    part = make_part(own_digest, bytes_total, error, where, extra)
    fold = shardmap.RankLocalFold(groups, extra.get("gk"), extra.get("gd")) if coord.rank == 0 else None
    regular = [manifest is not None and extra["rule"]]     # every rank's boxes follow the rule, alike

    def check(r, q):
        if manifest is None:
            return None
        if q.get("rep") != extra["rep"]:
            # a step rank r could not load: refuse to commit it (the save raises CommitError)
            return (f"declared other replicated keys than rank 0 ({list(manifest.replicated)}): every rank "
                    "must pass the same save(replicated=...)")
        regular[0] = regular[0] and q.get("layout") == extra["layout"] and q.get("rule") is True
        fold.add(q.get("gk"), q.get("gd"))
        return None

    def write_commit(manifests, total):
        commit = new_commit(manifests, total)
        lead = {"run_id": commit.run_id}
        if regular[0]:
            rank_local = fold.rank_local()
            commit.shards = write_map(gen, shardmap.build_rule(step, coord.world_size, manifest, rank_local))
            lead["rank_local"] = None if rank_local is None else [list(x) for x in rank_local]
        elif manifest is not None and any(n.kind == "dtensor" for n in manifest.nodes):
            log.warning("step %d: the ranks' DTensor layouts differ or do not follow torch's sharding rule "
                        "(e.g. uneven _StridedShard placements): no shard map, a resume on another world size reads "
                        "every rank's manifest", step)
        data, table = encode_commit_files(commit)
        write_marker(data, table)
        if table is not None:
            lead["table"] = True
            lead["table_digest"] = bytes.fromhex(digest_bytes(table))
        return data, lead

    def write_copy(message):
        data = message["commit"]
        decoded = decode_commit(data, step=step, what="commit verdict")
        ref = decoded.shards
        if ref is not None and manifest is not None and "rank_local" in message:
            rl = message["rank_local"]
            built = shardmap.build_rule(step, coord.world_size, manifest,
                                        None if rl is None else [tuple(x) for x in rl])
            if bytes.fromhex(digest_bytes(built)) == ref[0] and len(built) == ref[1]:
                write_map(ref[2], built)
            else:                   # readers in this root then read every manifest (logged there)
                log.warning("step %d: this root's shard map differs from rank 0's: not written", step)
        rows = message.get("rows") or []
        if decoded.table is not None and rows:
            write_rows(decoded.table.digest, _row_map(rows), _row_map(message.get("refs") or []))
        write_marker(data, None)

    def adopt(verdict):                               # rank 0's run id, on every rank, from the first commit
        if verdict.get("run_id"):
            adopt_run_id(verdict["run_id"])
        if on_table is not None and isinstance(verdict.get("table"), bytes):
            on_table(verdict["table"])
    try:
        return agree_commit(coord, tag, step, part, timeout=timeout, check=check, write_commit=write_commit,
                            write_copy=write_copy, on_committed=adopt)
    except CheckpointError as e:
        raise e from error
