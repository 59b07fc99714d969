#!/usr/bin/env python
"""Multi-rank benchmark (issue 9): FSDP2 save / resume through ckptstore vs torch.distributed.checkpoint
(DCP), resharding resume, and the per-save coordination cost of the collective commit at 2..16 ranks.

    python benchmarks/bench_distributed.py                         # 64mb state, 4 ranks -> 2, coord at 2,4,8,16
    python benchmarks/bench_distributed.py --size 256mb --repeat 3 --json dist.json
    python benchmarks/bench_distributed.py --sections coord --coord-ranks 2,4,8,16 --coord-saves 10

Ranks are subprocesses of this script launched like torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT), on CPU with the gloo backend, as tests/dist.py does.
See benchmarks/README.md ("bench_distributed.py") for what every row means.

Sections (``--sections``):
  fsdp     ``--world`` (4) ranks, FSDP2 (fully_shard per block + root) over a GPT-ish stack of Linear layers
           + AdamW after one real step, wrapped in the DCP tutorial's AppState (get_state_dict /
           set_state_dict). Round-robin repeats: ``Store(root).save({"app": app}, 1)`` into a fresh store vs
           ``dcp.save({"app": app}, checkpoint_id=dir)`` into a fresh folder; then, with the files evicted from
           the page cache and one byte of every live local shard flipped, ``Store(root).resume(...)`` vs
           ``dcp.load(...)`` in place. Peak extra RSS per rank for each operation.
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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # ckptstore from the checkout

import common as C  # noqa: E402  (imports torch)
from ckptstore import Remote

warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")

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
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist

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
    mesh = None if ddp else init_device_mesh("cpu", (dist.get_world_size(),))
    for b in ([] if ddp else model.blocks):
        fully_shard(b, mesh=mesh)
    if not ddp:
        fully_shard(model.emb, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, vocab, (1, 9), generator=g)
    logits = model(idx[:, :-1])
    F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1)).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    del logits
    gc.collect()
    return model, optim


class AppState:
    """The DCP tutorial's pattern: model + optimizer through get_state_dict / set_state_dict."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def local_tensors(model, optim) -> list:
    """This rank's live local shards (model params/buffers + optimizer state)."""
    from torch.distributed.tensor import DTensor
    return [t.to_local() if isinstance(t, DTensor) else t for t in C.state_tensors(model, optim)]


def full_crcs(app) -> Dict[str, list]:
    """Key -> [nbytes, crc32] of every full (unsharded) tensor: a collective (full_tensor per entry)."""
    import torch
    from torch.distributed.tensor import DTensor
    from ckptstore.state import flatten  # noqa: F401  (only to be sure the package imports)
    out: Dict[str, list] = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k in sorted(obj, key=str):
                walk(f"{prefix}/{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}/{i}", v)
        elif torch.is_tensor(obj):
            t = obj.full_tensor() if isinstance(obj, DTensor) else obj
            if t.numel() > 1:
                out[prefix] = [C.nbytes(t), C.crc(t)]
    walk("", app.state_dict())
    return out


class Mem:
    """Peak RSS above the RSS at start(), per rank: VmHWM reset through /proc/self/clear_refs ("5")."""

    def start(self):
        gc.collect()
        C.malloc_trim()
        self.base = C.rss_bytes()
        self.ok = C.reset_peak_rss()

    def peak(self) -> Optional[int]:
        return max(0, C.peak_rss_bytes() - self.base) if self.ok else None


class Counters:
    """Wraps StoreCoordinator.gather / broadcast / decide (ckptstore's agreement over the c10d key-value
    store) and the process-group collectives of torch.distributed, counting calls, seconds and bytes."""

    def __init__(self):
        import msgpack
        import torch.distributed as dist
        from ckptstore.collective import StoreCoordinator
        self.orig = {}
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

        for n in ("gather", "broadcast", "decide"):
            wrap_coord(n)

        def wrap_pg(name):
            fn = getattr(dist, name)
            self.orig[name] = fn

            def w(*a, **kw):
                me.pg[name] = me.pg.get(name, 0) + 1
                return fn(*a, **kw)
            setattr(dist, name, w)

        for n in PG_COLLECTIVES:
            if hasattr(dist, n):
                wrap_pg(n)

    def reset(self):
        self.coord: Dict[str, int] = {}
        self.pg: Dict[str, int] = {}
        self.coord_s = 0.0
        self.gather_bytes = 0
        self.bcast_bytes = 0

    def snap(self) -> Dict[str, Any]:
        return {"coord": dict(self.coord), "pg": dict(self.pg), "coord_s": self.coord_s,
                "gather_bytes": self.gather_bytes, "bcast_bytes": self.bcast_bytes}

    def barrier(self):
        self.orig["barrier"]()


def _bcast_path(path: Optional[str]) -> str:
    import torch.distributed as dist
    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _fresh(base: str, prefix: str, rank: int, counters: Counters) -> str:
    """A fresh folder made by rank 0, its name sent to every rank (outside every timing)."""
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix=prefix, dir=base) if rank == 0 else None]
    fn = counters.orig.get("broadcast_object_list", dist.broadcast_object_list)
    fn(box, src=0)
    return box[0]


def _store(path: str, cfg: dict):
    from ckptstore import Packing, Store
    kw = {} if cfg.get("threshold") is None else {"packing": Packing(threshold=cfg["threshold"])}
    return Store(path, collective_timeout=cfg["timeout"], **kw)


def _perturb(model, optim):
    """Flip one byte of every live local shard (kept flipped: the load under test must write it back)."""
    for t in local_tensors(model, optim):
        b = C.as_bytes(t)
        if b.numel() and b.data_ptr() == t.data_ptr():
            b[0] = (int(b[0]) + 1) % 256


def _evict(rank: int, counters: Counters, *paths: str):
    counters.barrier()
    if rank == 0:
        for p in paths:
            C.evict(Path(p))
    counters.barrier()


def _timed(counters: Counters, mem: Mem, fn) -> Dict[str, Any]:
    counters.barrier()
    counters.reset()
    mem.start()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    rec = {"s": dt, "peak": mem.peak(), **counters.snap()}
    counters.barrier()
    return rec


def rank_fsdp(cfg: dict, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from ckptstore import Store
    counters = Counters()
    mem = Mem()
    t_build = time.perf_counter()
    model, optim = build(cfg["size"], cfg["seed"])
    app = AppState(model, optim)
    t_build = time.perf_counter() - t_build
    loc = local_tensors(model, optim)
    local_bytes = sum(C.nbytes(t) for t in loc)
    ref = C.fingerprint(loc) if cfg["verify"] else None
    del loc
    crcs = full_crcs(app) if cfg["verify"] else None
    if rank == 0 and crcs is not None:
        with open(Path(cfg["out"]) / "full_crcs.json", "w") as f:
            json.dump(crcs, f)
    out: Dict[str, Any] = {"rank": rank, "local_bytes": local_bytes, "build_s": t_build, "samples": {},
                           "wrong": []}
    base = cfg["dir"]
    keep = {}
    for rep in range(cfg["repeat"]):
        methods = ["ckptstore", "dcp"] if rep % 2 == 0 else ["dcp", "ckptstore"]
        dirs = {m: _fresh(base, f"{m}_{world}r_", rank, counters) for m in methods}
        for m in methods:                                             # saves
            if m == "ckptstore":
                store = _store(dirs[m], cfg)
                rec = _timed(counters, mem, lambda: store.save({"app": app}, 1))
                store.close()
            else:
                rec = _timed(counters, mem, lambda: dcp.save({"app": app}, checkpoint_id=dirs[m]))
            out["samples"].setdefault(f"{m} save", []).append(rec)
        _evict(rank, counters, *dirs.values())
        for m in methods:                                             # cold resumes, in place
            _perturb(model, optim)
            if m == "ckptstore":
                def load():
                    with _store(dirs[m], cfg) as s:
                        assert s.resume({"app": app}) == 1
                rec = _timed(counters, mem, load)
            else:
                rec = _timed(counters, mem, lambda: dcp.load({"app": app}, checkpoint_id=dirs[m]))
            out["samples"].setdefault(f"{m} resume", []).append(rec)
            if rep == 0 and ref is not None and C.fingerprint(local_tensors(model, optim)) != ref:
                out["wrong"].append(f"{m} resume")
        counters.barrier()
        if rank == 0:
            out["disk"] = {m: C.disk_bytes(Path(d)) for m, d in dirs.items()}
            for m, d in keep.items():
                shutil.rmtree(d, ignore_errors=True)
        keep = dirs
    out["kept"] = keep
    return out


def rank_ddp(cfg: dict, rank: int, world: int) -> dict:
    """DDP: every rank holds the whole model and optimizer. ckptstore with every rank saving its copy, with
    ``save(replicated=["app"])`` (rank 0 saves it), and dcp.save (which dedups replicated items itself)."""
    import torch.distributed.checkpoint as dcp
    counters = Counters()
    mem = Mem()
    model, optim = build(cfg["size"], cfg["seed"], ddp=True)
    app = AppState(model, optim)
    out: Dict[str, Any] = {"rank": rank, "local_bytes": sum(C.nbytes(t) for t in local_tensors(model, optim)),
                           "samples": {}, "wrong": [], "disk": {}}
    methods = ["ckptstore all ranks", "ckptstore replicated", "dcp"]
    for rep in range(cfg["repeat"]):
        order = methods if rep % 2 == 0 else methods[::-1]
        dirs = {m: _fresh(cfg["dir"], f"ddp_{m.split()[-1]}_", rank, counters) for m in order}
        for m in order:
            if m == "dcp":
                rec = _timed(counters, mem, lambda: dcp.save({"app": app}, checkpoint_id=dirs[m]))
            else:
                store = _store(dirs[m], cfg)
                rep_keys = ["app"] if m.endswith("replicated") else []
                res = {}
                rec = _timed(counters, mem, lambda: res.update(r=store.save({"app": app}, 1, replicated=rep_keys)))
                rec["bytes_total"] = res["r"].bytes_total
                store.close()
            out["samples"].setdefault(m, []).append(rec)
        counters.barrier()
        if rank == 0:
            out["disk"] = {m: C.disk_bytes(Path(d)) for m, d in dirs.items()}
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
        counters.barrier()
    return out


def report_ddp(res: List[dict], world: int) -> tuple:
    rows, js = [], {}
    dcp_xs = per_repeat_max(res, "dcp")
    base_xs = per_repeat_max(res, "ckptstore all ranks")
    for m in ("dcp", "ckptstore all ranks", "ckptstore replicated"):
        xs = per_repeat_max(res, m)
        hashed = [r["samples"][m][-1].get("bytes_total") for r in res]
        rows.append([f"{m} ({world} ranks)", *fmt_s(xs), f"{med(xs) / med(dcp_xs):.2f}",
                     f"{med(xs) / med(base_xs):.2f}", C.fmt_bytes(res[0]["disk"][m]),
                     " / ".join(C.fmt_bytes(h) for h in hashed) if hashed[0] is not None else "n/a"])
        js[m] = dict(seconds=xs, median=med(xs), disk=res[0]["disk"][m], bytes_per_rank=hashed)
    head = ["save", "median s", "min-max s", "x DCP", "x all ranks", "on disk", "bytes saved per rank"]
    return table(head, rows), js


def rank_reshard(cfg: dict, rank: int, world: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from ckptstore import Store
    counters = Counters()
    mem = Mem()
    model, optim = build(cfg["size"], cfg["seed"])
    app = AppState(model, optim)
    loc = local_tensors(model, optim)
    local_bytes = sum(C.nbytes(t) for t in loc)
    ref = C.fingerprint(loc) if cfg["verify"] else None
    del loc
    src_crcs = None
    if cfg["verify"] and (Path(cfg["out"]) / "full_crcs.json").exists():
        src_crcs = json.loads((Path(cfg["out"]) / "full_crcs.json").read_text())
    own = {m: _fresh(cfg["dir"], f"{m}_{world}r_", rank, counters) for m in ("ckptstore", "dcp")}
    with _store(own["ckptstore"], cfg) as s:
        s.save({"app": app}, 1)
    dcp.save({"app": app}, checkpoint_id=own["dcp"])
    src = cfg["src"]                                     # the fsdp section's checkpoints (world ranks)
    out: Dict[str, Any] = {"rank": rank, "local_bytes": local_bytes, "samples": {}, "wrong": [],
                           "checked_full_crcs": len(src_crcs or {})}
    cases = [("ckptstore", "same"), ("ckptstore", "reshard"), ("dcp", "same"), ("dcp", "reshard")]
    for rep in range(cfg["repeat"]):
        order = cases if rep % 2 == 0 else cases[::-1]
        for m, kind in order:
            path = own[m] if kind == "same" else src[m]
            _evict(rank, counters, path)
            _perturb(model, optim)
            if m == "ckptstore":
                def load():
                    with _store(path, cfg) as s:
                        assert s.resume({"app": app}) == 1
                        out[f"manifests_read {kind}"] = s.resumed_from.get("manifests_read")
                rec = _timed(counters, mem, load)
            else:
                rec = _timed(counters, mem, lambda: dcp.load({"app": app}, checkpoint_id=path))
            out["samples"].setdefault(f"{m} {kind}", []).append(rec)
            if rep == 0 and cfg["verify"]:
                if kind == "same":
                    ok = C.fingerprint(local_tensors(model, optim)) == ref
                else:
                    got = full_crcs(app)
                    ok = src_crcs is None or got == src_crcs
                    if not ok and src_crcs is not None:
                        out.setdefault("mismatch", {})[f"{m} {kind}"] = sorted(
                            k for k in set(got) | set(src_crcs) if got.get(k) != src_crcs.get(k))[:20]
                if not ok:
                    out["wrong"].append(f"{m} {kind}")
    counters.barrier()
    if rank == 0:
        for d in own.values():
            shutil.rmtree(d, ignore_errors=True)
    return out


def rank_remote(cfg: dict, rank: int, world: int) -> dict:
    """Resume the fsdp section's checkpoints, put on S3, on ``world`` ranks with empty local roots."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from ckptstore import Store
    counters = Counters()
    mem = Mem()
    model, optim = build(cfg["size"], cfg["seed"])
    app = AppState(model, optim)
    local_bytes = sum(C.nbytes(t) for t in local_tensors(model, optim))
    src_crcs = None
    if cfg["verify"] and (Path(cfg["out"]) / "full_crcs.json").exists():
        src_crcs = json.loads((Path(cfg["out"]) / "full_crcs.json").read_text())
    opts, url = cfg["so"], cfg["url"]
    import fsspec                       # the S3 client is imported and connected before any timing (the
    fsspec.filesystem("s3", **opts).ls(url.split("://", 1)[1])   # Store and FsspecReader reuse this instance)
    out: Dict[str, Any] = {"rank": rank, "local_bytes": local_bytes, "samples": {}, "wrong": []}
    cases = ["ckptstore", "ckptstore pull all", "dcp"]
    for rep in range(cfg["repeat"]):
        for m in (cases if rep % 2 == 0 else cases[::-1]):
            root = _fresh(cfg["dir"], "remote_", rank, counters) + f"/rank{rank}"   # a node-local root each
            _perturb(model, optim)
            if m.startswith("ckptstore"):
                def load():
                    with Store(root, remote=Remote(f"{url}/ckpt", upload=False), storage_options=opts,
                               collective_timeout=cfg["timeout"]) as s:
                        if m.endswith("pull all"):
                            s.pull(1)
                        assert s.resume({"app": app}) == 1
                        out[f"manifests_read {m}"] = s.resumed_from.get("manifests_read")
                rec = _timed(counters, mem, load)
                rec["local_files"] = sum(1 for _ in Path(root).rglob("*.pack"))
            else:
                rec = _timed(counters, mem, lambda: dcp.load({"app": app},
                                                             storage_reader=FsspecReader(f"{url}/dcp", **opts)))
            out["samples"].setdefault(m, []).append(rec)
            shutil.rmtree(root, ignore_errors=True)
            if rep == 0 and src_crcs is not None and full_crcs(app) != src_crcs:
                out["wrong"].append(m)
    return out


def rank_coord(cfg: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp
    from ckptstore import Store
    counters = Counters()
    t = torch.full((cfg["elems"],), float(rank))
    shared = _fresh(cfg["dir"], f"coord{world}_", rank, counters)
    own_root = os.path.join(shared, "own", str(rank))
    store = Store(os.path.join(shared, "store"), collective_timeout=cfg["timeout"])
    own = Store(own_root, rank=0, world_size=1, collective_timeout=cfg["timeout"])
    samples: Dict[str, list] = {}
    from ckptstore.collective import StoreCoordinator
    from ckptstore.commit import make_part, root_identity
    coord = StoreCoordinator(rank, world)                 # the same kind of agreement, alone
    part = make_part(("0" * 64, 1000, 0), 1024, None, root_identity(shared))

    def agreement(i):
        tag = coord.next_tag(f"bench/{i}")
        coord.gather(f"{tag}/parts", part, cfg["timeout"])
        if rank == 0:
            coord.decide(tag, "commit")
        coord.broadcast(f"{tag}/verdict", {"committed": True, "failures": {}, "commit": b"x" * 300, "leaders": []}
                        if rank == 0 else None, cfg["timeout"])
    methods = ["ckptstore", "ckptstore own root (no coordination)", "agreement alone (gather+decide+bcast)",
               "dcp.save", "gloo barrier"]
    for i in range(cfg["warmup"] + cfg["saves"]):
        for m in (methods if i % 2 == 0 else methods[::-1]):
            t.add_(1)
            if m == "ckptstore":
                fn = lambda: samples.setdefault("_res", []).append(store.save({"t": t}, i + 1))  # noqa: E731
            elif m.startswith("ckptstore own"):
                fn = lambda: own.save({"t": t}, i + 1)  # noqa: E731
            elif m.startswith("agreement"):
                fn = lambda: agreement(i)  # noqa: E731
            elif m == "dcp.save":
                d = os.path.join(shared, "dcp", str(i))
                fn = lambda: dcp.save({f"t{rank}": t}, checkpoint_id=d)  # noqa: E731
            else:
                fn = counters.barrier
            counters.barrier()
            counters.reset()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            rec = {"s": dt, **counters.snap()}
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


def rank_main(mode: str, cfg: dict) -> None:
    import torch.distributed as dist
    torch_threads = cfg.get("threads")
    if torch_threads:
        import torch
        torch.set_num_threads(torch_threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        out = {"fsdp": rank_fsdp, "reshard": rank_reshard, "remote": rank_remote,
               "coord": rank_coord, "ddp": rank_ddp}[mode](cfg, rank, world)
        print("RESULT " + json.dumps(out), flush=True)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)   # see tests/dist_worker.py: interpreter teardown after destroy_process_group may abort


# =========================================================================== launcher


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, mode: str, cfg: dict, timeout: float) -> List[dict]:
    """Run ``world`` ranks of this script like torchrun; return each rank's RESULT dict (raise on failure)."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
               OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, "-u", __file__, "--rank-mode", mode, "--cfg", json.dumps(cfg)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=str(HERE.parent))
             for r in range(world)]
    deadline = time.monotonic() + timeout
    outs: List[str] = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(text)
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        raise RuntimeError(f"{mode} at {world} ranks: no result within {timeout:.0f} s")
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        raise RuntimeError(f"{mode} at {world} ranks: ranks {bad} failed:\n" +
                           "\n".join(f"--- rank {r}\n{outs[r][-3000:]}" for r in bad))
    res = []
    for r, text in enumerate(outs):
        found = [ln[len("RESULT "):] for ln in text.splitlines() if ln.startswith("RESULT ")]
        if not found:
            raise RuntimeError(f"{mode}: rank {r} printed no result:\n{text[-3000:]}")
        res.append(json.loads(found[-1]))
    return res


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def per_repeat_max(results: List[dict], name: str, key: str = "s") -> List[float]:
    """For each repeat: the slowest rank's value (all ranks start together, after a barrier)."""
    n = len(results[0]["samples"][name])
    return [max(r["samples"][name][i][key] for r in results) for i in range(n)]


def fmt_s(xs: List[float]) -> tuple:
    return (f"{med(xs):.3f}", f"{min(xs):.3f}-{max(xs):.3f}") if xs else ("n/a", "n/a")


def table(head: List[str], rows: List[List[str]]) -> str:
    return C.align_table([head] + rows)


def _mem_cells(results: List[dict], name: str) -> tuple:
    """(max peak RSS+ over ranks and repeats, that as % of the biggest rank's local state)."""
    peaks = [s["peak"] for r in results for s in r["samples"][name] if s.get("peak") is not None]
    if not peaks:
        return "n/a", "n/a", None
    worst = max(peaks)
    local = max(r["local_bytes"] for r in results)
    return C.fmt_bytes(worst), f"{100 * worst / local:.1f}%", worst / local


def _calls(results: List[dict], name: str) -> str:
    s = results[0]["samples"][name][-1]
    parts = [f"{k} {v}" for k, v in sorted(s["coord"].items())]
    pg = sum(s["pg"].values())
    return (", ".join(parts) or "none") + f"; pg collectives {pg}"


def report_fsdp(fs: List[dict], rs: Optional[List[dict]], args, world: int, to: int) -> tuple:
    state = sum(r["local_bytes"] for r in fs)
    rows, js = [], {}
    anchors = {"ckptstore save": "dcp save", "ckptstore resume": "dcp resume"}
    for name in ("dcp save", "ckptstore save", "dcp resume", "ckptstore resume"):
        xs = per_repeat_max(fs, name)
        ref = anchors.get(name)
        ratio = med(xs) / med(per_repeat_max(fs, ref)) if ref else None
        peak, pct, frac = _mem_cells(fs, name)
        label = {"dcp save": "dcp.save", "ckptstore save": "ckptstore save",
                 "dcp resume": "dcp.load cold (in place)", "ckptstore resume": "ckptstore resume cold (in place)"}[name]
        wrong = any(name in r["wrong"] for r in fs)
        rows.append([f"{label} {world}->{world}" if "resume" in name else f"{label} {world} ranks", *fmt_s(xs),
                     f"{state / med(xs) / 1e9:.2f}", f"{ratio:.2f}" if ratio else "", "", peak, pct,
                     ("WRONG DATA; " if wrong else "") + _calls(fs, name)])
        js[rows[-1][0]] = dict(seconds=xs, median=med(xs), x_dcp=ratio, peak_frac_of_rank_state=frac,
                               peaks=[[s["peak"] for s in r["samples"][name]] for r in fs], wrong=wrong,
                               calls=fs[0]["samples"][name][-1])
    if rs:
        for m, label in (("dcp", "dcp.load cold"), ("ckptstore", "ckptstore resume cold")):
            same = per_repeat_max(rs, f"{m} same")
            for kind, xs in (("same", same), ("reshard", per_repeat_max(rs, f"{m} reshard"))):
                dcp_xs = per_repeat_max(rs, f"dcp {kind}")
                ratio = med(xs) / med(dcp_xs) if m == "ckptstore" else None
                peak, pct, frac = _mem_cells(rs, f"{m} {kind}")
                wrong = any(f"{m} {kind}" in r["wrong"] for r in rs)
                name = f"{label} {to if kind == 'same' else world}->{to}"
                rows.append([name, *fmt_s(xs), f"{state / med(xs) / 1e9:.2f}", f"{ratio:.2f}" if ratio else "",
                             f"{med(xs) / med(same):.2f}" if kind == "reshard" else "", peak, pct,
                             ("WRONG DATA; " if wrong else "") + _calls(rs, f"{m} {kind}")])
                js[name] = dict(seconds=xs, median=med(xs), x_dcp=ratio,
                                x_same_size=med(xs) / med(same) if kind == "reshard" else None,
                                peak_frac_of_rank_state=frac,
                                peaks=[[s["peak"] for s in r["samples"][f"{m} {kind}"]] for r in rs], wrong=wrong,
                                calls=rs[0]["samples"][f"{m} {kind}"][-1])
    head = ["operation", "median s", "min-max s", "GB/s", "x DCP", "x same-size", "peak RSS+/rank",
            "% rank state", "coordinator calls (rank 0, last repeat)"]
    return table(head, rows), js


def report_remote(res: List[dict], state: int, world: int, to: int) -> tuple:
    rows, js = [], {}
    dcp_med = med(per_repeat_max(res, "dcp"))
    labels = {"dcp": "dcp.load (FsspecReader)", "ckptstore": "ckptstore resume (reads from S3)",
              "ckptstore pull all": "ckptstore pull whole step + resume"}
    for m in ("dcp", "ckptstore", "ckptstore pull all"):
        xs = per_repeat_max(res, m)
        peak, pct, frac = _mem_cells(res, m)
        files = max(s.get("local_files", 0) for r in res for s in r["samples"][m])
        wrong = any(m in r["wrong"] for r in res)
        rows.append([f"{labels[m]} {world}->{to}", *fmt_s(xs), f"{state / med(xs) / 1e9:.2f}",
                     f"{med(xs) / dcp_med:.2f}" if m != "dcp" else "", peak, pct,
                     ("WRONG DATA; " if wrong else "") + (f"packs in each local root: {files}"
                                                          if m != "dcp" else "")])
        js[m] = dict(seconds=xs, median=med(xs), x_dcp=med(xs) / dcp_med, peak_frac_of_rank_state=frac,
                     local_packs=files, wrong=wrong,
                     manifests_read=[r.get(f"manifests_read {m}") for r in res] if m != "dcp" else None)
    head = ["operation (from S3, empty local roots)", "median s", "min-max s", "GB/s", "x DCP", "peak RSS+/rank",
            "% rank state", "note"]
    return table(head, rows), js


def put_on_s3(kept: Dict[str, str], work: Path):
    """Start moto on 127.0.0.1 and put the fsdp section's checkpoints there (not timed)."""
    import fsspec
    from backends.launcher import S3Server
    from ckptstore import Store
    server = S3Server(workdir=work / "moto").start()
    url, opts = server.new_bucket_url("dist"), server.storage_options()
    with Store(kept["ckptstore"], remote=f"{url}/ckpt", storage_options=opts, rank=0, world_size=1) as s:
        s.wait_for_uploads()
    fs = fsspec.filesystem("s3", **opts)
    fs.put(kept["dcp"].rstrip("/") + "/", f"{url}/dcp/".split("://", 1)[1], recursive=True)
    return server, url, opts


def report_coord(per_world: Dict[int, List[dict]]) -> tuple:
    rows, js = [], {}
    for world, res in per_world.items():
        names = list(res[0]["samples"])
        base = {n: med(per_repeat_max(res, n)) for n in names}
        for n in names:
            xs = per_repeat_max(res, n)
            s0 = res[0]["samples"][n]
            calls = s0[-1]["coord"]
            n_coord = sum(calls.values())
            gathered = med([sum(r["samples"][n][i]["gather_bytes"] for r in res) for i in range(len(s0))])
            bcast = med([x["bcast_bytes"] for x in s0])
            pg = med([sum(x["pg"].values()) for x in s0])
            coord_s = med([max(r["samples"][n][i]["coord_s"] for r in res) for i in range(len(s0))])
            commit = med([max((r["samples"][n][i].get("commit_s") or 0) for r in res) for i in range(len(s0))]) \
                if n == "ckptstore" else None
            extra = med(xs) - base["ckptstore own root (no coordination)"] if n == "ckptstore" else None
            rows.append([str(world), n, *fmt_s(xs),
                         f"{med(xs) / base['dcp.save']:.2f}" if n.startswith("ckptstore") else "",
                         f"{1000 * extra:.1f}" if extra is not None else "",
                         f"{1000 * commit:.1f}" if commit is not None else "",
                         f"{1000 * coord_s:.1f}" if n_coord else "",
                         ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "-",
                         f"{gathered:,.0f}" if n_coord else "", f"{bcast:,.0f}" if n_coord else "", f"{pg:g}"])
            js[f"{world}/{n}"] = dict(world=world, seconds=xs, median=med(xs), coord_calls=calls,
                                      gathered_bytes=gathered, broadcast_bytes=bcast, pg_collectives=pg,
                                      coord_seconds_slowest_rank=coord_s, commit_phase_s=commit,
                                      extra_vs_own_root_s=extra, x_dcp=med(xs) / base["dcp.save"])
    head = ["ranks", "method", "median s/save", "min-max s", "x dcp", "+ms vs own root", "commit ms",
            "coord ms", "coordinator calls/save", "gathered B", "bcast B", "pg colls"]
    return table(head, rows), js


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=tuple(SIZES), default="64mb", help="FSDP state size (weights + AdamW)")
    ap.add_argument("--sections", default="fsdp,reshard,coord", help="from fsdp,reshard,remote,ddp,coord")
    ap.add_argument("--world", type=int, default=4, help="ranks of the fsdp section")
    ap.add_argument("--reshard-to", type=int, default=2, help="ranks of the reshard section")
    ap.add_argument("--repeat", type=int, default=3, help="round-robin repeats (median, min-max)")
    ap.add_argument("--coord-ranks", default="2,4,8,16")
    ap.add_argument("--coord-saves", type=int, default=10, help="timed saves per method (after warmup)")
    ap.add_argument("--coord-warmup", type=int, default=2)
    ap.add_argument("--coord-elems", type=int, default=256, help="fp32 elements of each rank's tensor")
    ap.add_argument("--timeout", type=float, default=300.0, help="ckptstore collective_timeout (s)")
    ap.add_argument("--job-timeout", type=float, default=1800.0, help="seconds per launched job")
    ap.add_argument("--dir", default=str(C.default_bench_dir()), help="scratch parent (not tmpfs)")
    ap.add_argument("--packing-threshold", type=int, default=None,
                    help="fsdp/reshard: Store(packing=Packing(threshold=N)) bytes (default: ckptstore's 4 MiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", dest="verify", action="store_false")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--rank-mode", help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_mode:
        rank_main(args.rank_mode, json.loads(args.cfg))
        return 0

    sections = set(args.sections.split(","))
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_dist_", dir=base))
    t_all = time.perf_counter()
    print(f"torch {__import__('torch').__version__}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.2f}, scratch {work} ({C.fs_type(work)})", flush=True)
    cfg = dict(size=args.size, seed=args.seed, verify=args.verify, repeat=args.repeat, timeout=args.timeout,
               dir=str(work), out=str(work), threshold=args.packing_threshold)
    result: Dict[str, Any] = {"size": args.size, "world": args.world, "reshard_to": args.reshard_to,
                              "repeat": args.repeat, "packing_threshold": args.packing_threshold,
                              "loadavg_start": os.getloadavg()}
    try:
        fs = rs = None
        if sections & {"fsdp", "reshard", "remote"}:
            t0 = time.perf_counter()
            fs = launch(args.world, "fsdp", cfg, args.job_timeout)
            state = sum(r["local_bytes"] for r in fs)
            d, vocab, target = SIZES[args.size]
            print(f"fsdp: {args.world} ranks, state {C.fmt_bytes(state)} (d_model {d}, vocab {vocab}, "
                  f"{_layers(d, vocab, target)} blocks), {time.perf_counter() - t0:.0f} s", flush=True)
            result["state_bytes"] = state
            if "reshard" in sections:
                t0 = time.perf_counter()
                rs = launch(args.reshard_to, "reshard", dict(cfg, src=fs[0]["kept"]), args.job_timeout)
                print(f"reshard: {args.reshard_to} ranks, {time.perf_counter() - t0:.0f} s; verification "
                      + (f"of {rs[0]['checked_full_crcs']} full tensors (CRC32) against the {args.world}-rank "
                         "state" if args.verify else "off"), flush=True)
            text, js = report_fsdp(fs, rs, args, args.world, args.reshard_to)
            print("\n" + text)
            if rs:
                reads = [r.get("manifests_read reshard") for r in rs]
                print(f"\nckptstore {args.world}->{args.reshard_to}: manifests read per rank {reads} of "
                      f"{args.world} saved (through the step's shard map)", flush=True)
                js["manifests_read_reshard"] = reads
            print(f"\nseconds = the slowest rank, ranks start after a barrier; median of {args.repeat}. "
                  "x DCP = / the DCP row of the same operation. x same-size = resharding resume / resume of a "
                  f"checkpoint saved by {args.reshard_to} ranks, same job. peak RSS+/rank = max over ranks of "
                  "VmHWM - RSS before the operation; % of that rank's local state.", flush=True)
            result["fsdp"] = js
            result["fsdp_raw"] = fs
            result["reshard_raw"] = rs
        if "remote" in sections and fs:
            t0 = time.perf_counter()
            server, url, opts = put_on_s3(fs[0]["kept"], work)
            try:
                t1 = time.perf_counter()
                res = launch(args.reshard_to, "remote", dict(cfg, url=url, so=opts), args.job_timeout)
            finally:
                server.stop()
            print(f"\nremote: put on moto in {t1 - t0:.0f} s; {args.reshard_to} ranks, "
                  f"{time.perf_counter() - t1:.0f} s", flush=True)
            text, js = report_remote(res, result["state_bytes"], args.world, args.reshard_to)
            print("\n" + text)
            reads = [r.get("manifests_read ckptstore") for r in res]
            print(f"\nckptstore from S3: manifests read per rank {reads}; seconds = the slowest rank, median of "
                  f"{args.repeat}; each rank resumes into an empty root of its own (node-local disks).", flush=True)
            result["remote"] = js
            result["remote_raw"] = res
        if "ddp" in sections:
            t0 = time.perf_counter()
            res = launch(args.world, "ddp", cfg, args.job_timeout)
            text, js = report_ddp(res, args.world)
            print(f"\nddp: {args.world} ranks, {time.perf_counter() - t0:.0f} s, state per rank "
                  f"{C.fmt_bytes(res[0]['local_bytes'])}\n" + text, flush=True)
            result["ddp"] = js
        if "coord" in sections:
            per_world = {}
            for w in (int(x) for x in args.coord_ranks.split(",")):
                t0 = time.perf_counter()
                per_world[w] = launch(w, "coord", dict(cfg, elems=args.coord_elems, saves=args.coord_saves,
                                                       warmup=args.coord_warmup), args.job_timeout)
                print(f"coord: {w} ranks, {time.perf_counter() - t0:.0f} s", flush=True)
            text, js = report_coord(per_world)
            print("\n" + text)
            print(f"\nmedian over {args.coord_saves} saves (after {args.coord_warmup} warmup) of the slowest "
                  "rank's time; ranks start each save after a barrier. +ms vs own root = collective save - "
                  "the same save into each rank's own root with world_size=1 (no agreement). commit ms = "
                  "SaveResult.phases['commit'] (slowest rank). coord ms = time inside the coordinator's calls "
                  "(slowest rank; rank 0's gather includes waiting for the last rank). gathered B = msgpack bytes "
                  "of every rank's part, summed. pg colls = collectives on the gloo process group.", flush=True)
            result["coord"] = js
            result["coord_raw"] = {str(k): v for k, v in per_world.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["loadavg_end"] = os.getloadavg()
    result["total_s"] = time.perf_counter() - t_all
    print(f"total {result['total_s']:.0f} s; load average now {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
