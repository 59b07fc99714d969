"""Simulated ranks for the commit agreement at scale (issue 19): one real c10d ``TCPStore`` (libuv), one client
connection and one thread per simulated rank, ckptstore's own agreement code on every rank.

Each rank holds the manifest of a Llama-shaped FSDP2 + AdamW state (parameters, ``exp_avg`` and ``exp_avg_sq``
as DTensor shards on a 1-D mesh of all ranks, ``Shard(0)``, their boxes as torch computes them; a plain 0-d
``step`` per parameter, equal on every rank; a per-rank RNG state and data position, rank-local; a replicated
``progress/epoch``), built from ckptstore's own dataclasses. Rank 0 runs :func:`ckptstore.distributed.commit.commit_across_ranks`,
the function ``Store.save`` runs, whose marker and shard map land in memory (``SimJob.files``). The other ranks
run it too (``full=True``), or, to simulate thousands of ranks on one machine, send the part it computes for
them (the parts of a sample of ranks are computed from real manifests and checked equal in layout).

Used by ``tests/distributed/test_agreement_scale.py`` (256 ranks, in ``make test``) and
``benchmarks/bench_agreement.py`` (64 ... 10,000 ranks, by hand).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch.distributed as dist

from ckptstore.distributed.collective import StoreCoordinator
from ckptstore.distributed.commit import agree_commit, commit_across_ranks, make_part, part_extra, root_identity
from ckptstore.format.blobs import digest_bytes
from ckptstore.format.layout import table_path
from ckptstore.format.manifest import ArrayEntry, ChunkRef, Commit, Manifest, ManifestNode, decode_commit
from ckptstore.format.mtable import encode_rows
from ckptstore.state.sharding import ShardInfo

# (layers, hidden, kv dim, ffn, vocab): the shapes of Llama-2 7B and Llama-2 70B (grouped-query attention)
SHAPES = {"7b": (32, 4096, 4096, 11008, 32000), "70b": (80, 8192, 1024, 28672, 32000),
          "tiny": (2, 64, 64, 128, 256)}


def llama_params(shape: str) -> List[tuple]:
    """``[(name, global shape), ...]`` of a Llama-shaped model (9 parameters a layer + 3)."""
    layers, h, kv, ffn, vocab = SHAPES[shape]
    out = [("tok_embeddings.weight", (vocab, h))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "attention.wq.weight", (h, h)), (p + "attention.wk.weight", (kv, h)),
                (p + "attention.wv.weight", (kv, h)), (p + "attention.wo.weight", (h, h)),
                (p + "feed_forward.w1.weight", (ffn, h)), (p + "feed_forward.w2.weight", (h, ffn)),
                (p + "feed_forward.w3.weight", (ffn, h)), (p + "attention_norm.weight", (h,)),
                (p + "ffn_norm.weight", (h,))]
    return out + [("norm.weight", (h,)), ("output.weight", (vocab, h))]


def _blob(*what) -> str:
    return hashlib.blake2b(repr(what).encode(), digest_size=32).hexdigest()


def llama_manifest(shape: str, rank: int, world: int, grid: bytes, step: int = 1) -> Manifest:
    """Rank ``rank``'s manifest of a Llama-shaped FSDP2 + AdamW state on a mesh of ``world`` ranks."""
    from torch.distributed.tensor import Shard
    nodes = [ManifestNode((), "dict", None)]

    def add(path, kind, payload=None):
        nodes.append(ManifestNode(tuple(path), kind, payload))

    def dt(path, g):
        sz, off = Shard.local_shard_size_and_offset(g[0], world, rank)
        local = (int(sz),) + tuple(g[1:])
        offset = (int(off) if sz else g[0],) + (0,) * (len(g) - 1)
        info = ShardInfo(tuple(g), offset, (world,), ("S(0)",), grid)
        chunks = [ChunkRef(_blob(path, rank, step), int(np.prod(local)) * 4, "raw")] if np.prod(local) else []
        add(path, "dtensor", ArrayEntry("float32", local, chunks, "cpu", False, info))

    def plain(path, dtype, value_id):
        add(path, "tensor", ArrayEntry(dtype, (), [ChunkRef(_blob(value_id), 8, "raw")]))
    params = llama_params(shape)
    add(["model"], "dict")
    for name, g in params:
        dt(["model", name], g)
    add(["optimizer"], "dict")
    add(["optimizer", "state"], "dict")
    for name, g in params:
        add(["optimizer", "state", name], "dict")
        plain(["optimizer", "state", name, "step"], "float32", ("step", step))
        dt(["optimizer", "state", name, "exp_avg"], g)
        dt(["optimizer", "state", name, "exp_avg_sq"], g)
    add(["optimizer", "param_groups"], "list", 1)
    add(["optimizer", "param_groups", 0], "dict")
    add(["optimizer", "param_groups", 0, "lr"], "value", 3e-4)
    add(["rng"], "dict")
    plain(["rng", "torch"], "uint8", ("rng", rank, step))
    add(["progress"], "dict")
    add(["progress", "epoch"], "value", 0)
    add(["progress", "position"], "value", rank * 1000 + step)
    return Manifest(step=step, rank=rank, world_size=world, stateful=["model", "optimizer"], nodes=nodes)


class CountingCoordinator(StoreCoordinator):
    """A StoreCoordinator that also records the largest value it set (bytes)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.largest_value = 0
        self.largest_lead = 0                 # the largest message to a leader (bytes)

    def _set(self, key, data):
        self.largest_value = max(self.largest_value, len(data))
        if "/lead" in key:
            self.largest_lead = max(self.largest_lead, len(data))
        super()._set(key, data)


class MemRoot:
    """A root held in memory (``SimJob.files[root]``), read through the storage calls a commit marker's manifest
    table is read with (:class:`ckptstore.format.mtable.ManifestTable`); counts the bytes read."""

    def __init__(self, files: Dict[str, bytes]):
        self.files, self.bytes_read = files, 0

    def read_range_bytes(self, path: str, offset: int, length: int) -> bytes:
        if path not in self.files:
            raise FileNotFoundError(path)
        out = self.files[path][offset:offset + length]
        self.bytes_read += len(out)
        return out

    def read_bytes(self, path: str, limit: Optional[int] = None) -> bytes:
        return self.read_range_bytes(path, 0, len(self.files.get(path, b"")) if limit is None else limit)

    def exists(self, path: str) -> bool:
        return path in self.files

    def listdir(self, path: str) -> List[str]:
        return sorted({k[len(path) + 1:].split("/")[0] for k in self.files if k.startswith(path + "/")})

    def local_path(self, path: str) -> Optional[str]:
        return path


@dataclass
class Outcome:
    committed: Optional[bool] = None          # None: the rank did not take part
    wrote_marker: bool = False
    error: Optional[str] = None
    seconds: float = 0.0
    received: int = 0                         # bytes this rank received in this save
    sent: int = 0
    finished: float = 0.0                     # time.perf_counter() when the rank returned


@dataclass
class SimJob:
    """``n`` simulated ranks on one TCPStore; ``roots``: rank -> root path (ranks sharing a path share a root:
    node-local disks); ``full``: every rank computes its part from its own manifest."""
    n: int
    shape: str = "7b"
    ranks_per_root: int = 0                   # 0: one shared root; k: node-local roots of k ranks
    full: bool = True
    sample: int = 8
    server_process: bool = False              # run the TCPStore server in a child process (thousands of ranks)
    files: Dict[str, Dict[str, bytes]] = field(default_factory=dict)    # root -> file name -> bytes

    def __post_init__(self):
        if self.server_process:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "import sys, time, torch.distributed as d; "
                 "s = d.TCPStore('127.0.0.1', 0, 1, True, use_libuv=True, wait_for_workers=False); "
                 "print(s.port, flush=True); time.sleep(1e9)"], stdout=subprocess.PIPE, text=True)
            port = int(self._proc.stdout.readline())
            self.server = dist.TCPStore("127.0.0.1", port, 1, False, use_libuv=True)
        else:
            self._proc = None
            self.server = dist.TCPStore("127.0.0.1", 0, 1, True, use_libuv=True, wait_for_workers=False)
        port = self.server.port
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(64) as pool:          # a connection takes ~0.1 s (the client's backoff): overlap
            self.clients = list(pool.map(lambda _: dist.TCPStore("127.0.0.1", port, 1, False, use_libuv=True),
                                         range(self.n)))
        self.coords = [CountingCoordinator(r, self.n, kv_store=c, instance=0) for r, c in enumerate(self.clients)]
        self.grid = np.arange(self.n, dtype="<i4").tobytes()
        self.roots = [self.root_of(r) for r in range(self.n)]
        self._parts: Dict[int, Dict[str, Any]] = {}

    def root_of(self, r: int) -> str:
        return "/shared" if not self.ranks_per_root else f"/node{r // self.ranks_per_root}"

    def close(self):
        self.clients.clear()
        self.coords.clear()
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def keys(self) -> int:
        return int(self.server.num_keys())

    # -- one rank -----------------------------------------------------------------------------------------------
    def _writers(self, r: int, step: int):
        root = self.files.setdefault(self.roots[r], {})

        def new_commit(manifests, total):
            return Commit(step=step, world_size=self.n, manifests=manifests, created=time.time(),
                          bytes_total=total, run_id="sim")

        def write_marker(data, table=None):
            if table is not None:                   # before the marker, as Store.save writes it
                root[table_path(step, bytes.fromhex(digest_bytes(table)))] = table
            root[f"{step}/COMMIT"] = data

        def write_rows(digest, rows, refs=None):
            path, data = encode_rows(step, digest, rows, refs)
            root[path] = data

        def write_map(gen, data):
            root[f"{step}/shards"] = data
            return bytes.fromhex(digest_bytes(data)), len(data), gen
        return new_commit, write_marker, write_map, write_rows

    def part_of(self, r: int, step: int, error: Optional[BaseException] = None) -> Dict[str, Any]:
        """The part rank ``r`` sends (computed from its manifest when ``full`` or sampled)."""
        m = llama_manifest(self.shape, r, self.n, self.grid, step)
        return make_part((_blob("manifest", r, step)[:32].encode(), 4096 + r, 0), m.bytes_total, error,
                         root_identity(None) + self.roots[r].encode(), part_extra(step, self.n, m, owners=True)[0])

    def run_rank(self, r: int, step: int, timeout: float, out: Outcome, error: Optional[BaseException] = None,
                 ready: Optional[threading.Barrier] = None):
        coord = self.coords[r]
        tag = coord.next_tag(f"save/{step}")
        rx, tx = coord.bytes_received, coord.bytes_sent
        new_commit, write_marker, write_map, write_rows = self._writers(r, step)
        m = llama_manifest(self.shape, r, self.n, self.grid, step) if r == 0 or self.full else None
        if ready is not None:               # every rank has its manifest: the deadlines start together
            ready.wait()
        t0 = time.perf_counter()
        try:
            if m is not None:
                out.wrote_marker = commit_across_ranks(
                    coord, tag, step, manifest=None if error else m, own_digest=None if error else (
                        _blob("manifest", r, step)[:32].encode(), 4096 + r, 0),
                    bytes_total=m.bytes_total, error=error, where=root_identity(None) + self.roots[r].encode(),
                    timeout=timeout, new_commit=new_commit, write_marker=write_marker, write_map=write_map,
                    write_rows=write_rows, gen=0, adopt_run_id=lambda rid: None, owners=True)
            else:
                part = (make_part(None, 0, error, root_identity(None) + self.roots[r].encode()) if error
                        else self._parts.get(r) or self.part_of(r, step))

                def write_copy(message):
                    if message.get("rows"):             # a marker naming a table: this root's rows
                        table = decode_commit(message["commit"], step=step, what="COMMIT").table
                        write_rows(table.digest, {q: (d, s, g) for q, d, s, g in message["rows"]},
                                   {q: (d, s, g) for q, d, s, g in message.get("refs") or []})
                    write_marker(message["commit"])
                out.wrote_marker = agree_commit(coord, tag, step, part, timeout=timeout,
                                                write_commit=None, write_copy=write_copy)
            out.committed = True
        except Exception as e:
            out.committed, out.error = False, f"{type(e).__name__}: {e}"
        out.finished = time.perf_counter()
        out.seconds = out.finished - t0
        out.received, out.sent = coord.bytes_received - rx, coord.bytes_sent - tx

    def resume_reads(self, step: int, rank: int, world: int, root: Optional[str] = None) -> Dict[str, int]:
        """The metadata rank ``rank`` of a job of ``world`` ranks reads to resume ``step`` (from ``root``, default
        rank 0's, which holds what the remote does): the commit marker, the shard map, and the manifest rows of
        rank 0 (plain values) and of the saved ranks whose shards overlap its own (through the map), by page.
        Bytes of each, and how many saved ranks it reads."""
        from torch.distributed.tensor import Shard
        from ckptstore.format.shardmap import ShardMap
        files = MemRoot(self.files[root or self.roots[0]])
        marker = files.files[f"{step}/COMMIT"]
        commit = decode_commit(marker, step=step, what="COMMIT")
        if commit.table is not None:
            commit.manifests.bind(files)
        smap_bytes = files.files[f"{step}/shards"]
        smap = ShardMap.decode(smap_bytes, step=step, world_size=self.n, what="shards")
        need = {0}
        for name, g in llama_params(self.shape):
            sz, off = (int(x) for x in Shard.local_shard_size_and_offset(g[0], world, rank))
            if sz:
                box = ((off,) + (0,) * (len(g) - 1), (sz,) + tuple(g[1:]))
                need |= set(smap.ranks(("model", name), tuple(g), box, prefer=rank))
        for q in sorted(need):
            commit.manifests[q]
        return {"marker_B": len(marker), "map_B": len(smap_bytes), "rows_B": files.bytes_read,
                "ranks": len(need), "total_B": len(marker) + len(smap_bytes) + files.bytes_read}

    def precompute(self, step: int) -> None:
        """Without ``full``: compute the parts of a sample of ranks from real manifests (checked alike in layout)
        and derive the others' from them (only the rank's digest, size and root differ)."""
        rng = np.random.default_rng(step)
        sample = sorted({1, self.n - 1, *rng.integers(1, self.n, self.sample).tolist()})
        real = {r: self.part_of(r, step) for r in sample}
        base = real[sample[0]]
        assert all(p["layout"] == base["layout"] and p["rule"] for p in real.values()), "layouts differ"
        for r in range(1, self.n):
            p = real.get(r)
            if p is None:
                p = dict(base, digest=_blob("manifest", r, step)[:32].encode(), size=4096 + r,
                         where=root_identity(None) + self.roots[r].encode())
            self._parts[r] = p

    # -- one save -----------------------------------------------------------------------------------------------
    def save(self, step: int, *, timeout: float = 60.0, absent: Sequence[int] = (),
             failing: Sequence[int] = ()) -> List[Outcome]:
        """Every rank but ``absent`` saves ``step`` (``failing`` ranks report an error); each rank's outcome."""
        if not self.full and not self._parts:
            self.precompute(step)
        outs = [Outcome() for _ in range(self.n)]
        threads = []
        sent0 = [c.bytes_sent for c in self.coords]
        ready = threading.Barrier(self.n - len(set(absent)) - (0 not in absent))      # the ranks but rank 0
        for r in range(self.n):
            if r in absent:
                self.coords[r].next_tag(f"save/{step}")         # its sequence stays aligned with the others
                continue
            err = RuntimeError(f"rank {r} could not write its manifest") if r in failing else None
            t = threading.Thread(target=self.run_rank, args=(r, step, timeout, outs[r], err, ready if r else None),
                                 daemon=True)
            threads.append((r, t))
        for r, t in threads:
            if r != 0:
                t.start()
        # rank 0 starts once every other rank has sent its part: its time is then the agreement's own work
        waiting = [r for r, _ in threads if r != 0]
        deadline = time.monotonic() + 600
        while waiting and time.monotonic() < deadline:
            waiting = [r for r in waiting if self.coords[r].bytes_sent == sent0[r]]
            time.sleep(0.01)
        self.started = time.perf_counter()
        for r, t in threads:
            if r == 0:
                t.start()
        for _, t in threads:
            t.join()
        self._parts.clear()
        return outs


def summary(outs: List[Outcome]) -> Dict[str, Any]:
    taken = [o for o in outs if o.committed is not None]
    others = [o for o in outs[1:] if o.committed is not None and not o.wrote_marker]
    leaders = [o for o in outs[1:] if o.wrote_marker]
    return {"committed": sum(bool(o.committed) for o in taken), "ranks": len(taken),
            "rank0_seconds": outs[0].seconds, "rank0_received": outs[0].received,
            "max_received_other": max((o.received for o in others), default=0),
            "max_received_leader": max((o.received for o in leaders), default=0),
            "max_sent_other": max((o.sent for o in outs[1:] if o.committed is not None), default=0),
            "all_done_seconds": max(o.finished for o in taken) - min(o.finished - o.seconds for o in taken
                                                                      if o is outs[0]) if outs[0].committed is not None
            else None}


def run_threads(fns: Sequence[Callable[[], None]]) -> None:
    ts = [threading.Thread(target=f, daemon=True) for f in fns]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


if __name__ == "__main__":                     # a quick look: python tests/simranks.py 256 70b
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    job = SimJob(n, shape=sys.argv[2] if len(sys.argv) > 2 else "7b", full=n <= 256)
    before = job.keys()
    print(summary(job.save(1)), "keys", before, "->", job.keys(), "largest value",
          max(c.largest_value for c in job.coords), os.getpid())
