#!/usr/bin/env python
"""Multi-rank benchmark (issue 9): FSDP2 save / resume through ckptstore vs torch.distributed.checkpoint
(DCP), resharding resume, and the per-save coordination cost of the collective commit at 2..16 ranks.

    python benchmarks/bench_distributed.py                         # 64mb state, 4 ranks -> 2, coord at 2,4,8,16
    python benchmarks/bench_distributed.py --size 256mb --repeat 3 --json dist.json
    python benchmarks/bench_distributed.py --sections coord --coord-ranks 2,4,8,16 --coord-saves 10

Ranks are subprocesses of this script launched like torchrun (harness.launch: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT), on CPU with the gloo backend. Inside each job the ranks alternate their
contenders (harness.alternated); every timing starts after a barrier and is the slowest rank's.
See benchmarks/README.md ("bench_distributed.py") for what every row means.

Sections (``--sections``):
  fsdp     ``--world`` (4) ranks, FSDP2 (fully_shard per block + root) over a GPT-ish stack of Linear layers
           + AdamW after one real step, wrapped in the DCP tutorial's AppState (common.AppState).
           ``Store(root).save({"app": app}, 1)`` into a fresh store vs ``dcp.save({"app": app},
           checkpoint_id=dir)`` into a fresh folder; then, with the files evicted from the page cache and one
           byte of every live local shard flipped, ``Store(root).resume(...)`` vs ``dcp.load(...)`` in place.
           Peak extra RSS per rank for each operation.
  reshard  ``--reshard-to`` (2) ranks: the same model, sharded 2 ways, saves its own step (ckptstore + DCP),
           then resumes (cold, in place) from it ("same-size") and from the ``--world``-rank checkpoints of the
           fsdp section ("resharding"), for both libraries.
  remote   (with fsdp) the fsdp section's checkpoints are put on a moto S3 server on 127.0.0.1 (ckptstore: its
           uploader; DCP: the folder copied with fsspec), then ``--reshard-to`` ranks, each with an empty local
           root, resume from S3: ckptstore's resume (a step of another world size is read straight from the
           remote, only each rank's overlaps) vs ``Store.pull`` of the whole step into each rank's root then
           resume (what every node did before) vs ``dcp.load`` through DCP's ``FsspecReader``. Use a 64mb or
           256mb state: every byte goes through moto on the same 2 cores.
  ddp      ``--world`` ranks of DDP (every rank holds the whole model + AdamW): ckptstore with every rank saving
           its copy, ckptstore with ``save(replicated=["app"])``, and ``dcp.save`` (which saves replicated
           items once); seconds (slowest rank), bytes on disk, bytes each rank saved.
  coord    tiny state (one ``--coord-elems`` fp32 tensor per rank) at each of ``--coord-ranks``: seconds per
           collective ckptstore save, per-rank ckptstore save into its own root without coordination
           (``world_size=1``), and ``dcp.save``; coordinator calls, bytes gathered to rank 0, and
           process-group collectives per save (counted by wrapping them in the ranks).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402  (imports torch)

C.quiet_dcp()

# d_model, vocab per size; the number of blocks is chosen to reach the target state bytes
SIZES = {"64mb": (512, 4096, 64 << 20), "256mb": (768, 8192, 256 << 20), "1gb": (1024, 16384, 1 << 30)}
PG_COLLECTIVES = ("barrier", "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
                  "gather", "gather_object", "broadcast", "broadcast_object_list", "scatter",
                  "scatter_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                  "monitored_barrier")


# =========================================================================== rank side

def _layers(d: int, vocab: int, target: int) -> int:
    per_block = 12 * (8 * d * d + 5 * d)          # fp32 weight + exp_avg + exp_avg_sq (two Linear + biases)
    rest = 12 * (2 * vocab * d + 2 * d)
    return max(1, round((target - rest) / per_block))


def build(size: str, seed: int = 0, ddp: bool = False):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    d, vocab, target = SIZES[size]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                        for _ in range(_layers(d, vocab, target)))
            self.norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, vocab, bias=False)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = x + b(x)
            return self.head(self.norm(x))

    torch.manual_seed(seed)
    model = Net()
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for part in [*model.blocks, model.emb, model.head, model]:
            fully_shard(part, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(seed + 1))
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    del logits
    gc.collect()
    return model, optim


def local_tensors(model, optim) -> list:
    """This rank's live local shards (model params/buffers + optimizer state)."""
    from torch.distributed.tensor import DTensor
    return [t.to_local() if isinstance(t, DTensor) else t for t in C.state_tensors(model, optim)]


def full_crcs(app) -> Dict[str, list]:
    """Key -> [nbytes, crc32] of every full (unsharded) tensor: a collective (full_tensor per entry)."""
    from torch.distributed.tensor import DTensor
    out: Dict[str, list] = {}
    for key, t in C.tree_items(app.state_dict()):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        if t.numel() > 1:
            out[key] = [C.nbytes(t), C.crc(t)]
    return out


class Counters:
    """Wraps StoreCoordinator.gather / broadcast / decide (ckptstore's agreement over the c10d key-value
    store) and the process-group collectives of torch.distributed, counting calls, seconds and bytes."""

    def __init__(self):
        import msgpack
        import torch.distributed as dist
        from ckptstore.distributed.collective import StoreCoordinator
        self.orig: Dict[str, Callable] = {}
        self.reset()
        me = self

        def wrap_coord(name):
            fn = getattr(StoreCoordinator, name)

            def w(self_, op, message, *a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(self_, op, message, *a, **kw)
                finally:
                    me.coord[name] = me.coord.get(name, 0) + 1
                    me.coord_s += time.perf_counter() - t0
                    if name == "gather":
                        me.gather_bytes += len(msgpack.packb(message, use_bin_type=True))
                    elif name == "broadcast" and message is not None:
                        me.bcast_bytes += len(msgpack.packb(message, use_bin_type=True))
            setattr(StoreCoordinator, name, w)

        def wrap_pg(name):
            fn = self.orig[name] = getattr(dist, name)

            def w(*a, **kw):
                me.pg[name] = me.pg.get(name, 0) + 1
                return fn(*a, **kw)
            setattr(dist, name, w)

        for n in ("gather", "broadcast", "decide"):
            wrap_coord(n)
        for n in PG_COLLECTIVES:
            if hasattr(dist, n):
                wrap_pg(n)

    def reset(self):
        self.coord: Dict[str, int] = {}
        self.pg: Dict[str, int] = {}
        self.coord_s, self.gather_bytes, self.bcast_bytes = 0.0, 0, 0

    def snap(self) -> Dict[str, Any]:
        return {"coord": dict(self.coord), "pg": dict(self.pg), "coord_s": self.coord_s,
                "gather_bytes": self.gather_bytes, "bcast_bytes": self.bcast_bytes}

    def barrier(self):
        self.orig["barrier"]()

    def timed(self, fn: Callable[[], Any], mem: Optional[C.PeakRSS] = None) -> Dict[str, Any]:
        """``fn`` after a barrier, with the calls it made and its peak RSS+ (``mem``)."""
        self.barrier()
        self.reset()
        if mem:
            mem.start()
        t0 = time.perf_counter()
        fn()
        rec = {"s": time.perf_counter() - t0, "peak": mem.peak() if mem else None, **self.snap()}
        self.barrier()
        return rec

    def fresh(self, base: str, prefix: str, rank: int) -> str:
        """A fresh folder made by rank 0, its name sent to every rank (outside every timing)."""
        box = [tempfile.mkdtemp(prefix=prefix, dir=base) if rank == 0 else None]
        self.orig["broadcast_object_list"](box, src=0)
        return box[0]

    def evict(self, rank: int, *paths: str):
        self.barrier()
        if rank == 0:
            for p in paths:
                C.evict(Path(p))
        self.barrier()


class Rank:
    """What every rank-side section starts with: its counters, peak-RSS probe, model, optimizer, AppState."""

    def __init__(self, cfg: dict, rank: int, world: int, ddp: bool = False):
        self.cfg, self.rank, self.world = cfg, rank, world
        self.counters, self.mem = Counters(), C.PeakRSS()
        self.model, self.optim = build(cfg["size"], cfg["seed"], ddp=ddp)
        self.app = C.AppState(self.model, self.optim)
        loc = self.local()
        self.out: Dict[str, Any] = {"rank": rank, "local_bytes": sum(C.nbytes(t) for t in loc), "samples": {},
                                    "wrong": []}
        self.ref = C.fingerprint(loc) if cfg["verify"] else None

    def local(self) -> list:
        return local_tensors(self.model, self.optim)

    def store(self, path: str, **kw):
        from ckptstore import Packing, Store
        if self.cfg.get("threshold") is not None:
            kw["packing"] = Packing(threshold=self.cfg["threshold"])
        return Store(path, collective_timeout=self.cfg["timeout"], **kw)

    def perturb(self):
        """Flip one byte of every live local shard (kept flipped: the load under test must write it back)."""
        for t in self.local():
            b = C.as_bytes(t)
            if b.numel() and b.data_ptr() == t.data_ptr():
                b[0] = (int(b[0]) + 1) % 256

    def record(self, name: str, fn: Callable[[], Any], **extra) -> Dict[str, Any]:
        rec = dict(self.counters.timed(fn, self.mem), **extra)
        self.out["samples"].setdefault(name, []).append(rec)
        return rec

    def src_crcs(self) -> Optional[dict]:
        p = Path(self.cfg["out"]) / "full_crcs.json"
        return json.loads(p.read_text()) if self.cfg["verify"] and p.exists() else None

    def verify(self, name: str, same: bool, src: Optional[dict]) -> None:
        """After a load: the local shards match this job's state (same-size), or the full tensors match the
        saving job's (resharding, a collective)."""
        if same:
            ok = C.fingerprint(self.local()) == self.ref
        else:
            got = full_crcs(self.app)
            ok = src is None or got == src
            if not ok:
                self.out.setdefault("mismatch", {})[name] = sorted(k for k in set(got) | set(src)
                                                                   if got.get(k) != src.get(k))[:20]
        if not ok:
            self.out["wrong"].append(name)


def rank_fsdp(cfg: dict, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    r = Rank(cfg, rank, world)
    crcs = full_crcs(r.app) if cfg["verify"] else None
    if rank == 0 and crcs is not None:
        (Path(cfg["out"]) / "full_crcs.json").write_text(json.dumps(crcs))
    keep: Dict[str, str] = {}
    for rep in range(cfg["repeat"]):
        methods = H.order(["ckptstore", "dcp"], rep)
        dirs = {m: r.counters.fresh(cfg["dir"], f"{m}_{world}r_", rank) for m in methods}
        for m in methods:                                             # saves
            if m == "ckptstore":
                with r.store(dirs[m]) as store:
                    r.record("ckptstore save", lambda: store.save({"app": r.app}, 1))
            else:
                r.record("dcp save", lambda: dcp.save({"app": r.app}, checkpoint_id=dirs[m]))
        r.counters.evict(rank, *dirs.values())
        for m in methods:                                             # cold resumes, in place
            r.perturb()
            if m == "ckptstore":
                def load():
                    with r.store(dirs[m]) as s:
                        assert s.resume({"app": r.app}) == 1
                r.record("ckptstore resume", load)
            else:
                r.record("dcp resume", lambda: dcp.load({"app": r.app}, checkpoint_id=dirs[m]))
            if rep == 0 and cfg["verify"]:
                r.verify(f"{m} resume", True, None)
        r.counters.barrier()
        if rank == 0:
            r.out["disk"] = {m: C.disk_bytes(Path(d)) for m, d in dirs.items()}
            for d in keep.values():
                shutil.rmtree(d, ignore_errors=True)
        keep = dirs
    r.out["kept"] = keep
    return r.out


def rank_ddp(cfg: dict, rank: int, world: int) -> dict:
    """DDP: every rank holds the whole model and optimizer. ckptstore with every rank saving its copy, with
    ``save(replicated=["app"])`` (rank 0 saves it), and dcp.save (which dedups replicated items itself)."""
    import torch.distributed.checkpoint as dcp
    r = Rank(cfg, rank, world, ddp=True)
    r.out["disk"] = {}
    methods = ["ckptstore all ranks", "ckptstore replicated", "dcp"]
    for rep in range(cfg["repeat"]):
        order = H.order(methods, rep)
        dirs = {m: r.counters.fresh(cfg["dir"], f"ddp_{m.split()[-1]}_", rank) for m in order}
        for m in order:
            if m == "dcp":
                r.record(m, lambda: dcp.save({"app": r.app}, checkpoint_id=dirs[m]))
                continue
            with r.store(dirs[m]) as store:
                got = {}
                rec = r.record(m, lambda: got.update(r=store.save({"app": r.app}, 1,
                                                                  replicated=["app"] if "replicated" in m else [])))
            rec["bytes_total"] = got["r"].bytes_total
        r.counters.barrier()
        if rank == 0:
            r.out["disk"] = {m: C.disk_bytes(Path(d)) for m, d in dirs.items()}
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
        r.counters.barrier()
    return r.out


def rank_reshard(cfg: dict, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    r = Rank(cfg, rank, world)
    src_crcs = r.src_crcs()
    own = {m: r.counters.fresh(cfg["dir"], f"{m}_{world}r_", rank) for m in ("ckptstore", "dcp")}
    with r.store(own["ckptstore"]) as s:
        s.save({"app": r.app}, 1)
    dcp.save({"app": r.app}, checkpoint_id=own["dcp"])
    src = cfg["src"]                                     # the fsdp section's checkpoints (world ranks)
    r.out["checked_full_crcs"] = len(src_crcs or {})
    cases = [("ckptstore", "same"), ("ckptstore", "reshard"), ("dcp", "same"), ("dcp", "reshard")]
    for rep, (m, kind) in H.alternated(cases, cfg["repeat"]):
        path = own[m] if kind == "same" else src[m]
        r.counters.evict(rank, path)
        r.perturb()
        if m == "ckptstore":
            def load():
                with r.store(path) as s:
                    assert s.resume({"app": r.app}) == 1
                    r.out[f"manifests_read {kind}"] = s.resumed_from.get("manifests_read")
            r.record(f"{m} {kind}", load)
        else:
            r.record(f"{m} {kind}", lambda: dcp.load({"app": r.app}, checkpoint_id=path))
        if rep == 0 and cfg["verify"]:
            r.verify(f"{m} {kind}", kind == "same", src_crcs)
    r.counters.barrier()
    if rank == 0:
        for d in own.values():
            shutil.rmtree(d, ignore_errors=True)
    return r.out


def rank_remote(cfg: dict, rank: int, world: int) -> dict:
    """Resume the fsdp section's checkpoints, put on S3, on ``world`` ranks with empty local roots."""
    import fsspec
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from ckptstore import Remote
    r = Rank(cfg, rank, world)
    src_crcs = r.src_crcs()
    opts, url = cfg["so"], cfg["url"]
    fsspec.filesystem("s3", **opts).ls(url.split("://", 1)[1])  # the S3 client is connected before any timing
    for rep, m in H.alternated(["ckptstore", "ckptstore pull all", "dcp"], cfg["repeat"]):
        root = r.counters.fresh(cfg["dir"], "remote_", rank) + f"/rank{rank}"   # a node-local root each
        r.perturb()
        if m.startswith("ckptstore"):
            def load():
                with r.store(root, remote=Remote(f"{url}/ckpt", upload=False), storage_options=opts) as s:
                    if m.endswith("pull all"):
                        s.pull(1)
                    assert s.resume({"app": r.app}) == 1
                    r.out[f"manifests_read {m}"] = s.resumed_from.get("manifests_read")
            rec = r.record(m, load)
            rec["local_files"] = sum(1 for _ in Path(root).rglob("*.pack"))
        else:
            r.record(m, lambda: dcp.load({"app": r.app}, storage_reader=FsspecReader(f"{url}/dcp", **opts)))
        shutil.rmtree(root, ignore_errors=True)
        if rep == 0 and src_crcs is not None:
            r.verify(m, False, src_crcs)
    return r.out


COORD_METHODS = ("ckptstore", "ckptstore own root (no coordination)", "agreement alone (gather+decide+bcast)",
                 "dcp.save", "gloo barrier")


def rank_coord(cfg: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from ckptstore import Store
    from ckptstore.distributed.collective import StoreCoordinator
    from ckptstore.distributed.commit import make_part, root_identity
    counters = Counters()
    t = torch.full((cfg["elems"],), float(rank))
    shared = counters.fresh(cfg["dir"], f"coord{world}_", rank)
    store = Store(os.path.join(shared, "store"), collective_timeout=cfg["timeout"])
    own = Store(os.path.join(shared, "own", str(rank)), rank=0, world_size=1, collective_timeout=cfg["timeout"])
    coord = StoreCoordinator(rank, world)                 # the same kind of agreement, alone
    part = make_part(("0" * 64, 1000, 0), 1024, None, root_identity(shared))
    samples: Dict[str, list] = {}

    def agreement(i):
        tag = coord.next_tag(f"bench/{i}")
        coord.gather(f"{tag}/parts", part, cfg["timeout"])
        if rank == 0:
            coord.decide(tag, "commit")
        coord.broadcast(f"{tag}/verdict", {"committed": True, "failures": {}, "commit": b"x" * 300, "leaders": []}
                        if rank == 0 else None, cfg["timeout"])
    methods = {COORD_METHODS[0]: lambda i: samples.setdefault("_res", []).append(store.save({"t": t}, i + 1)),
               COORD_METHODS[1]: lambda i: own.save({"t": t}, i + 1),
               COORD_METHODS[2]: agreement,
               COORD_METHODS[3]: lambda i: dcp.save({f"t{rank}": t}, checkpoint_id=os.path.join(shared, "dcp", str(i))),
               COORD_METHODS[4]: lambda i: counters.barrier()}
    for i, m in H.alternated(list(methods), cfg["warmup"] + cfg["saves"]):
        t.add_(1)
        rec = counters.timed(lambda: methods[m](i))
        if m == "ckptstore":
            rec["commit_s"] = samples["_res"][-1].phases.get("commit")
        if i >= cfg["warmup"]:
            samples.setdefault(m, []).append(rec)
    samples.pop("_res", None)
    store.close()
    own.close()
    counters.barrier()
    if rank == 0:
        shutil.rmtree(shared, ignore_errors=True)
    return {"rank": rank, "samples": samples}


# =========================================================================== driver


def launch(world: int, mode: str, cfg: dict, timeout: float) -> List[dict]:
    """``world`` ranks of this script in ``mode``, with fixed malloc thresholds (peak RSS, as bench_save
    --memory); each rank's result."""
    return H.launch(world, __file__, "--rank-mode", mode, "--cfg", json.dumps(cfg), env=C.MALLOC_ENV, timeout=timeout)


MEM_COLS = [("peak RSS+/rank", lambda r: C.fmt_bytes(max(r.values("peak"))) if r.values("peak") else "n/a"),
            ("% rank state", lambda r: f"{100 * max(r.values('peak')) / r.samples[0]['local']:.1f}%"
             if r.values("peak") else "n/a")]   # the worst rank and repeat; % of the biggest rank's local state


def calls(ranks: List[dict]) -> Callable[[List[dict]], Dict[str, Any]]:
    """A sample's extra metrics: rank 0's coordinator calls and process-group collectives, the largest local
    state of the job's ranks."""
    local = max(r["local_bytes"] for r in ranks)
    return lambda recs: {"local": local, "calls": (", ".join(f"{k} {v}" for k, v in sorted(recs[0]["coord"].items()))
                                                   or "none") + f"; pg collectives {sum(recs[0]['pg'].values())}"}


def report_fsdp(fs: List[dict], rs: Optional[List[dict]], world: int, to: int) -> H.Results:
    res = H.Results()
    labels = {"dcp save": f"dcp.save {world} ranks", "ckptstore save": f"ckptstore save {world} ranks",
              "dcp resume": f"dcp.load cold (in place) {world}->{world}",
              "ckptstore resume": f"ckptstore resume cold (in place) {world}->{world}"}
    for name, label in labels.items():
        H.fold(res, fs, name, label, calls(fs))
    anchors = {labels["ckptstore save"]: labels["dcp save"], labels["ckptstore resume"]: labels["dcp resume"]}
    same_size = {}
    for m, label in (("dcp", "dcp.load cold"), ("ckptstore", "ckptstore resume cold")):
        for kind in ("same", "reshard") if rs else ():
            H.fold(res, rs, f"{m} {kind}", f"{label} {to if kind == 'same' else world}->{to}", calls(rs))
            if m == "ckptstore":
                anchors[f"{label} {to if kind == 'same' else world}->{to}"] = \
                    f"dcp.load cold {to if kind == 'same' else world}->{to}"
            if kind == "reshard":
                same_size[f"{label} {world}->{to}"] = f"{label} {to}->{to}"
    res.ratios = {"x DCP": lambda r: anchors.get(r.name), "x same-size": lambda r: same_size.get(r.name)}
    state = sum(r["local_bytes"] for r in fs)
    res.columns = [("GB/s", lambda r: f"{state / r.median() / 1e9:.2f}"), *MEM_COLS,
                   ("coordinator calls (rank 0, last repeat)", lambda r: r.samples[-1]["calls"])]
    return res


def report_remote(ranks: List[dict], state: int, world: int, to: int) -> H.Results:
    res = H.Results()
    labels = {"dcp": "dcp.load (FsspecReader)", "ckptstore": "ckptstore resume (reads from S3)",
              "ckptstore pull all": "ckptstore pull whole step + resume"}
    local = max(r["local_bytes"] for r in ranks)
    for m, label in labels.items():
        H.fold(res, ranks, m, f"{label} {world}->{to}", lambda recs: {"local": local} | (
            {"note": f"packs in each local root: {max(x['local_files'] for x in recs)}"} if "local_files" in recs[0]
            else {}))
    dcp_row = f"{labels['dcp']} {world}->{to}"
    res.ratios = {"x DCP": lambda r: dcp_row if r.name != dcp_row else None}
    res.columns = [("GB/s", lambda r: f"{state / r.median() / 1e9:.2f}"), *MEM_COLS]
    return res


def report_ddp(ranks: List[dict], world: int) -> H.Results:
    res = H.Results()
    for m in ("dcp", "ckptstore all ranks", "ckptstore replicated"):
        H.fold(res, ranks, m, f"{m} ({world} ranks)",
               lambda recs: {"bytes_per_rank": [x.get("bytes_total") for x in recs]})
    res.ratios = {"x DCP": f"dcp ({world} ranks)", "x all ranks": f"ckptstore all ranks ({world} ranks)"}
    res.columns = [("on disk", lambda r: C.fmt_bytes(ranks[0]["disk"][r.name.rsplit(" (", 1)[0]])),
                   ("bytes saved per rank", lambda r: " / ".join(C.fmt_bytes(b) for b in r.samples[-1]["bytes_per_rank"])
                    if r.samples[-1]["bytes_per_rank"][0] is not None else "n/a")]
    return res


def report_coord(per_world: Dict[int, List[dict]]) -> H.Results:
    res = H.Results()

    def extra(recs):
        return dict(commit_s=max((x.get("commit_s") or 0) for x in recs), coord_s=max(x["coord_s"] for x in recs),
                    gathered=sum(x["gather_bytes"] for x in recs), bcast=recs[0]["bcast_bytes"],
                    pg=sum(recs[0]["pg"].values()), coord=recs[0]["coord"])
    for world, ranks in per_world.items():
        for n in COORD_METHODS:
            H.fold(res, ranks, n, f"{world} ranks: {n}", extra)

    def own_root(r):
        return r.name.split(": ")[0] + ": ckptstore own root (no coordination)"

    def med(key):
        return lambda r: f"{r.median(key):,.0f}" if sum(r.samples[-1]["coord"].values()) else ""
    res.ratios = {"x dcp": lambda r: r.name.split(": ")[0] + ": dcp.save" if ": ckptstore" in r.name else None}
    res.columns = [("+ms vs own root", lambda r: f"{1000 * (r.median() - res.rows[own_root(r)].median()):.1f}"
                    if r.name.endswith(": ckptstore") else ""),
                   ("commit ms", lambda r: f"{1000 * r.median('commit_s'):.1f}" if r.name.endswith(": ckptstore") else ""),
                   ("coord ms", lambda r: f"{1000 * r.median('coord_s'):.1f}" if sum(r.samples[-1]["coord"].values()) else ""),
                   ("coordinator calls/save", lambda r: ", ".join(f"{k} {v}" for k, v in sorted(r.samples[-1]["coord"].items()))
                    or "-"), ("gathered B", med("gathered")), ("bcast B", med("bcast")),
                   ("pg colls", lambda r: f"{r.median('pg'):g}")]
    return res


def show(res: H.Results, head: str = "operation", unit: str = "s") -> str:
    return "\n" + res.table(head=head, unit=unit)


def put_on_s3(kept: Dict[str, str], work: Path):
    """Start moto on 127.0.0.1 and put the fsdp section's checkpoints there (not timed)."""
    import fsspec
    from backends.launcher import S3Server
    from ckptstore import Store
    server = S3Server(workdir=work / "moto").start()
    url, opts = server.new_bucket_url("dist"), server.storage_options()
    with Store(kept["ckptstore"], remote=f"{url}/ckpt", storage_options=opts, rank=0, world_size=1) as s:
        s.wait_for_uploads()
    fsspec.filesystem("s3", **opts).put(kept["dcp"].rstrip("/") + "/", f"{url}/dcp/".split("://", 1)[1], recursive=True)
    return server, url, opts


def main() -> int:
    ap = H.parser(__doc__, repeat=3, sizes=SIZES, size="64mb", verify=True)
    ap.add_argument("--sections", default="fsdp,reshard,coord", help="from fsdp,reshard,remote,ddp,coord")
    ap.add_argument("--world", type=int, default=4, help="ranks of the fsdp section")
    ap.add_argument("--reshard-to", type=int, default=2, help="ranks of the reshard section")
    ap.add_argument("--coord-ranks", default="2,4,8,16")
    ap.add_argument("--coord-saves", type=int, default=10, help="timed saves per method (after warmup)")
    ap.add_argument("--coord-warmup", type=int, default=2)
    ap.add_argument("--coord-elems", type=int, default=256, help="fp32 elements of each rank's tensor")
    ap.add_argument("--timeout", type=float, default=300.0, help="ckptstore collective_timeout (s)")
    ap.add_argument("--job-timeout", type=float, default=1800.0, help="seconds per launched job")
    ap.add_argument("--packing-threshold", type=int, default=None,
                    help="fsdp/reshard: Store(packing=Packing(threshold=N)) bytes (default: ckptstore's 4 MiB)")
    ap.add_argument("--rank-mode", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_mode:
        modes = {"fsdp": rank_fsdp, "reshard": rank_reshard, "remote": rank_remote, "coord": rank_coord,
                 "ddp": rank_ddp}
        H.rank_main(lambda rank, world: modes[args.rank_mode](json.loads(args.cfg), rank, world))
        return 0

    sections = set(args.sections.split(","))
    work = Path(tempfile.mkdtemp(prefix="bench_dist_", dir=H.scratch_dir(args.dir)))
    t_all = time.perf_counter()
    print(H.banner(scratch=f"{work} ({C.fs_type(work)})"), flush=True)
    cfg = dict(size=args.size, seed=args.seed, verify=args.verify, repeat=args.repeat, timeout=args.timeout,
               dir=str(work), out=str(work), threshold=args.packing_threshold)
    result: Dict[str, Any] = {"size": args.size, "world": args.world, "reshard_to": args.reshard_to}
    note = (f"\nseconds = the slowest rank, ranks start after a barrier; median of {args.repeat}. x DCP = / the DCP "
            "row of the same operation. x same-size = resharding resume / resume of a checkpoint saved by "
            f"{args.reshard_to} ranks, same job. peak RSS+/rank = max over ranks of VmHWM - RSS before the "
            "operation; % of that rank's local state.")
    try:
        fs = rs = None
        if sections & {"fsdp", "reshard", "remote"}:
            t0 = time.perf_counter()
            fs = launch(args.world, "fsdp", cfg, args.job_timeout)
            state = result["state_bytes"] = sum(r["local_bytes"] for r in fs)
            d, vocab, target = SIZES[args.size]
            print(f"fsdp: {args.world} ranks, state {C.fmt_bytes(state)} (d_model {d}, vocab {vocab}, "
                  f"{_layers(d, vocab, target)} blocks), {time.perf_counter() - t0:.0f} s", flush=True)
            if "reshard" in sections:
                t0 = time.perf_counter()
                rs = launch(args.reshard_to, "reshard", dict(cfg, src=fs[0]["kept"]), args.job_timeout)
                print(f"reshard: {args.reshard_to} ranks, {time.perf_counter() - t0:.0f} s; verification "
                      + (f"of {rs[0]['checked_full_crcs']} full tensors (CRC32) against the {args.world}-rank "
                         "state" if args.verify else "off"), flush=True)
            res = report_fsdp(fs, rs, args.world, args.reshard_to)
            print(show(res))
            if rs:
                result["manifests_read_reshard"] = [r.get("manifests_read reshard") for r in rs]
                print(f"\nckptstore {args.world}->{args.reshard_to}: manifests read per rank "
                      f"{result['manifests_read_reshard']} of {args.world} saved (through the step's shard map)")
            print(note, flush=True)
            result.update(fsdp=res.to_json(), fsdp_raw=fs, reshard_raw=rs)
        if "remote" in sections and fs:
            t0 = time.perf_counter()
            server, url, opts = put_on_s3(fs[0]["kept"], work)
            try:
                t1 = time.perf_counter()
                ranks = launch(args.reshard_to, "remote", dict(cfg, url=url, so=opts), args.job_timeout)
            finally:
                server.stop()
            print(f"\nremote: put on moto in {t1 - t0:.0f} s; {args.reshard_to} ranks, "
                  f"{time.perf_counter() - t1:.0f} s", flush=True)
            res = report_remote(ranks, result["state_bytes"], args.world, args.reshard_to)
            print(show(res, "operation (from S3, empty local roots)"))
            print(f"\nckptstore from S3: manifests read per rank {[r.get('manifests_read ckptstore') for r in ranks]}; "
                  f"seconds = the slowest rank, median of {args.repeat}; each rank resumes into an empty root of its "
                  "own (node-local disks).", flush=True)
            result.update(remote=res.to_json(), remote_raw=ranks)
        if "ddp" in sections:
            t0 = time.perf_counter()
            ranks = launch(args.world, "ddp", cfg, args.job_timeout)
            res = report_ddp(ranks, args.world)
            print(f"\nddp: {args.world} ranks, {time.perf_counter() - t0:.0f} s, state per rank "
                  f"{C.fmt_bytes(ranks[0]['local_bytes'])}" + show(res, "save"), flush=True)
            result["ddp"] = res.to_json()
        if "coord" in sections:
            per_world = {}
            for w in (int(x) for x in args.coord_ranks.split(",")):
                t0 = time.perf_counter()
                per_world[w] = launch(w, "coord", dict(cfg, elems=args.coord_elems, saves=args.coord_saves,
                                                       warmup=args.coord_warmup), args.job_timeout)
                print(f"coord: {w} ranks, {time.perf_counter() - t0:.0f} s", flush=True)
            res = report_coord(per_world)
            print(show(res, "ranks: method", "s/save"))
            print(f"\nmedian over {args.coord_saves} saves (after {args.coord_warmup} warmup) of the slowest "
                  "rank's time; ranks start each save after a barrier. +ms vs own root = collective save - "
                  "the same save into each rank's own root with world_size=1 (no agreement). commit ms = "
                  "SaveResult.phases['commit'] (slowest rank). coord ms = time inside the coordinator's calls "
                  "(slowest rank; rank 0's gather includes waiting for the last rank). gathered B = msgpack bytes "
                  "of every rank's part, summed. pg colls = collectives on the gloo process group.", flush=True)
            result.update(coord=res.to_json(), coord_raw={str(k): v for k, v in per_world.items()})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"total {time.perf_counter() - t_all:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    H.write_json(args.json, args, **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
