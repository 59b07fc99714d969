#!/usr/bin/env python
"""Checkpoint save/load benchmark: raw disk vs torch.save vs torch.distributed.checkpoint vs ckptstore, on ONE
deterministic GPT-like fp32 model + AdamW state, in one run.

    python benchmarks/bench_save.py --size small --repeat 1      # quick (~0.25 GB state)
    python benchmarks/bench_save.py                              # 1 GB state, 3 repeats
    python benchmarks/bench_save.py --size 3gb --memory --json out.json

Each case (``--only``) writes into a fresh folder per repeat and records its rows; ratios are against
``torch.save+fsync`` / ``torch.load`` and the raw O_DIRECT write / read. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import torch  # noqa: E402

C.quiet_dcp()

RAW_W, RAW_R = "raw write O_DIRECT+fsync", "raw read O_DIRECT"
TORCH_S, TORCH_COLD, TORCH_WARM = "torch.save+fsync", "torch.load cold", "torch.load warm"
TORCH_LSD = "torch.load+load_state_dict cold"
DCP_S, DCP_STALL, DCP_TOTAL = "dcp.save", "dcp.async_save stall", "dcp.async_save total"
DCP_COLD, DCP_WARM = "dcp.load cold (in place)", "dcp.load warm (in place)"
CK = ("ckptstore save", "ckptstore save again (dedup)", "ckptstore save again, track_versions=True",
      "ckptstore load cold", "ckptstore load warm", "ckptstore resume cold (in place)",
      "ckptstore resume warm (in place)")
NB = ("ckptstore save nonblocking stall", "ckptstore save nonblocking total")
STEADY = ("copy_ into reused buffers (stall floor)", "ckptstore nonblocking stall, buffers reused")
SAVES = [RAW_W, TORCH_S, DCP_S, DCP_STALL, DCP_TOTAL, *CK[:3], *NB, *STEADY]
LOADS = [RAW_R, TORCH_COLD, TORCH_WARM, TORCH_LSD, DCP_COLD, DCP_WARM, *CK[3:]]
# ratios: saves against torch.save / the raw write; loads against torch.load (cold, or warm) / the raw read
RATIOS = {"x torch": lambda r: TORCH_S if r.name in SAVES else TORCH_WARM if "warm" in r.name else TORCH_COLD,
          "x raw": lambda r: RAW_W if r.name in SAVES else RAW_R}


class Ctx:
    """The one state every case saves, and the run's options."""

    def __init__(self, args):
        self.args, self.memory = args, bool(args.child)
        self.base = H.scratch_dir(args.dir)
        self.direct = C.o_direct_supported(self.base)
        self.raw_block, self.all_loads = args.raw_block_mib * C.MiB, True
        t0 = time.perf_counter()
        self.model, self.opt = C.build_state(args.size, seed=args.seed)
        self.build_s = time.perf_counter() - t0
        ts = self.tensors()
        self.n_tensors, self.state_bytes = len(ts), sum(C.nbytes(t) for t in ts)
        self.ref = C.fingerprint(ts) if args.verify else None

    def tensors(self) -> list[torch.Tensor]:
        return C.state_tensors(self.model, self.opt)

    def check(self, res: H.Results, name: str, obj: Any = None) -> None:
        """First repeat only: what ``name`` loaded (``obj``, or the live state) matches the state as built."""
        if self.ref is not None and res.first and res.row(name).samples:
            got = C.tree_tensors(obj) if obj is not None else self.tensors()
            res.check(name, C.fingerprint(got) == self.ref)

    def timed(self, res: H.Results, name: str):
        return res.timed(name, memory=self.memory)

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt}

    def torch_obj(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}


def split(res: H.Results, ctx: Ctx, rows: tuple[str, str], start, wait) -> Any:
    """A call that returns before its work is done: rows[0] times ``start()``, rows[1] until ``wait(handle)``."""
    probe = C.PeakRSS() if ctx.memory else None
    if probe:
        probe.start()
    t0 = time.perf_counter()
    h = start()
    res.add(rows[0], time.perf_counter() - t0, **({"peak": probe.peak()} if probe else {}))
    out = wait(h)
    res.add(rows[1], time.perf_counter() - t0, **({"peak": probe.peak()} if probe else {}))
    return out


# --------------------------------------------------------------------------- cases


def case_raw(res: H.Results, ctx, d: Path) -> None:
    """Raw O_DIRECT write + fsync of every tensor's bytes, then the O_DIRECT read back (common.raw_write /
    raw_read: the disk's limit). ``ctx``: tensors(), raw_block, direct, timed(), check() (also bench_packs)."""
    ts, f = ctx.tensors(), d / "raw.bin"
    with ctx.timed(res, RAW_W) as m:
        n, io_s = C.raw_write(ts, f, block=ctx.raw_block, direct=ctx.direct)
        m.update(disk=f.stat().st_size, allocated=f.stat().st_blocks * 512,
                 note=f"write+fsync calls alone {io_s:.3f} s = {n / max(io_s, 1e-9) / 1e9:.2f} GB/s"
                 + ("" if ctx.direct else "; buffered: no O_DIRECT"))
    if not ctx.direct:
        C.evict(f)
    with ctx.timed(res, RAW_R) as m:
        out, io_s = C.raw_read(ts, f, block=ctx.raw_block, direct=ctx.direct)
        m["note"] = f"read calls alone {io_s:.3f} s = {n / max(io_s, 1e-9) / 1e9:.2f} GB/s"
    ctx.check(res, RAW_R, out)


def case_torch(res: H.Results, ctx, d: Path) -> None:
    """torch.save + fsync, then torch.load cold (and, with ``ctx.all_loads``, warm and + load_state_dict)."""
    f = d / "ckpt.pt"
    with ctx.timed(res, TORCH_S) as m:
        m["disk"] = C.torch_save_fsync(ctx.torch_obj(), f)
        m["allocated"] = f.stat().st_blocks * 512
    C.evict(f)
    with ctx.timed(res, TORCH_COLD):
        sd = torch.load(f, weights_only=True, map_location="cpu")
    ctx.check(res, TORCH_COLD, sd)
    sd = None
    if not ctx.all_loads:
        return
    with ctx.timed(res, TORCH_WARM):
        sd = torch.load(f, weights_only=True, map_location="cpu")
    sd = None
    C.evict(f)
    with C.perturbed(ctx.tensors()):
        with ctx.timed(res, TORCH_LSD):
            sd = torch.load(f, weights_only=True, map_location="cpu")
            ctx.model.load_state_dict(sd["model"])
            ctx.opt.load_state_dict(sd["optimizer"])
            sd = None
        ctx.check(res, TORCH_LSD)


def case_dcp(res: H.Results, ctx: Ctx, d: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    state, path = {"app": C.AppState(ctx.model, ctx.opt)}, d / "dcp"
    with ctx.timed(res, DCP_S) as m:
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
        m["disk"] = C.disk_bytes(path)
    C.evict(path)
    with C.perturbed(ctx.tensors()):
        with ctx.timed(res, DCP_COLD):
            dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
        ctx.check(res, DCP_COLD)
    with ctx.timed(res, DCP_WARM):
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)


def case_dcp_async(res: H.Results, ctx: Ctx, d: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    path = d / "dcp_async"

    def start():
        return dcp.async_save({"app": C.AppState(ctx.model, ctx.opt)}, storage_writer=FileSystemWriter(path),
                              no_dist=True)
    # AsyncSaveResponse (zero-overhead stager) has .upload_completion; else a plain Future
    split(res, ctx, (DCP_STALL, DCP_TOTAL), start, lambda fut: getattr(fut, "upload_completion", fut).result())


def case_ckptstore(res: H.Results, ctx: Ctx, d: Path) -> None:
    from ckptstore import Store, Writing
    root, state = d / "store", ctx.state()
    with Store(str(root)) as store:
        with ctx.timed(res, CK[0]) as m:
            m["note"] = C.result_note(store.save(state, 1))
            m["disk"] = C.disk_bytes(root)
        if "disk" not in m:
            return
        before = C.disk_bytes(root)
        with ctx.timed(res, CK[1]) as m:
            m["note"] = C.result_note(store.save(state, 2))
            m["disk"] = C.disk_bytes(root) - before
    # the opt-in: a tensor whose version counter and optimizer-step count did not move is neither read nor
    # hashed (the default hashes everything: the row above)
    with Store(str(root), writing=Writing(track_versions=True)) as store:
        store.save(state, 3)
        with ctx.timed(res, CK[2]) as m:
            m["note"] = C.result_note(store.save(state, 4))
    C.evict(root)
    with Store(str(root)) as store:
        with ctx.timed(res, CK[3]):
            plain = store.load(step=None, map_location="cpu")
        ctx.check(res, CK[3], plain)
        plain = None
        with ctx.timed(res, CK[4]):
            plain = store.load(step=None, map_location="cpu")
        plain = None
        C.evict(root)
        with C.perturbed(ctx.tensors()):
            with ctx.timed(res, CK[5]):
                step = store.resume(state)
            ctx.check(res, CK[5])
            if res.first and step != 4:
                res.note(CK[5], f"step={step!r}, expected 4")
        with ctx.timed(res, CK[6]):
            store.resume(state)


def case_ckptstore_nb(res: H.Results, ctx: Ctx, d: Path) -> None:
    from ckptstore import Store
    with Store(str(d / "store_nb")) as store:
        r = split(res, ctx, NB, lambda: store.save(ctx.state(), 1, blocking=False), lambda h: h.result())
        res.rows[NB[1]].samples[-1]["note"] = C.result_note(r)
        # Steady state, what a training loop sees from its second save on: the staging buffers exist. Every
        # tensor's version counter is bumped (add_(0): same bytes) so nothing is skipped as unchanged and the
        # stall is the full copy; the stall floor is one copy_ of every tensor into buffers allocated once.
        tensors = ctx.tensors()
        bufs = [torch.empty_like(t) for t in tensors]
        for b, t in zip(bufs, tensors):
            b.copy_(t)                                     # first touch of the buffers, not timed
        with ctx.timed(res, STEADY[0]):
            for b, t in zip(bufs, tensors):
                b.copy_(t)
        del bufs
        with torch.no_grad():
            for t in tensors:
                t.add_(0)
        with ctx.timed(res, STEADY[1]) as m:
            h = store.save(ctx.state(), 2, blocking=False)
        r = h.result()
        m["note"] = f"stall_seconds={r.stall_seconds:.3f} unchanged={r.bytes_unchanged}"


CASES = {"raw": (case_raw, (RAW_W, RAW_R)), "torch": (case_torch, (TORCH_S, TORCH_COLD, TORCH_WARM, TORCH_LSD)),
         "dcp": (case_dcp, (DCP_S, DCP_COLD, DCP_WARM)), "dcp_async": (case_dcp_async, (DCP_STALL, DCP_TOTAL)),
         "ckptstore": (case_ckptstore, CK), "ckptstore_nb": (case_ckptstore_nb, NB + STEADY)}


def contenders(ctx: Ctx, cases: list[str]) -> list[H.Contender]:
    def one(name: str) -> H.Contender:
        fn, rows = CASES[name]
        return H.Contender(name, lambda res, d: fn(res, ctx, d), records=True, rows=rows,
                           setup=lambda: C.fresh_dir(ctx.base, f"{name}_"), teardown=C.rmtree)
    return [one(c) for c in cases]


# --------------------------------------------------------------------------- --memory: one child per case


def memory_peaks(args, cases: list[str]) -> dict[str, list[int]]:
    """Each case once in a child of its own (fixed malloc thresholds, before this process builds its state):
    row -> peak RSS above the RSS before the phase."""
    peaks: dict[str, list[int]] = {}
    for case in cases:
        print(f"[memory] {case} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--child", case, "--size", args.size, "--dir", str(args.dir),
               "--seed", str(args.seed), "--no-verify", "--raw-block-mib", str(args.raw_block_mib)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **C.MALLOC_ENV))
        found = [ln[len("RESULT "):] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if not found:
            print(f"  [{case}] memory child failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        for name, row in json.loads(found[-1]).items():
            if row["peaks"]:
                peaks.setdefault(name, []).extend(row["peaks"])
            elif row["note"]:
                print(f"  [{case}] memory run: {name}: {row['note']}", file=sys.stderr)
    return peaks


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, repeat=3, sizes=C.SIZES, size="1gb", verify=True)
    ap.add_argument("--only", default=",".join(CASES), help=f"comma list of cases, from {','.join(CASES)}")
    ap.add_argument("--memory", action="store_true",
                    help="also measure peak RSS per row, one subprocess per case (slower)")
    ap.add_argument("--raw-block-mib", type=int, default=64, help="O_DIRECT block size (MiB)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    if set(cases) - set(CASES):
        ap.error(f"unknown case(s): {sorted(set(cases) - set(CASES))}")
    if args.child:                                      # a --memory child: one run of one case
        ctx = Ctx(args)
        res = H.compare(contenders(ctx, [args.child]), 1, progress=False)
        print("RESULT " + json.dumps({n: {"peaks": r.values("peak"), "note": r.note} for n, r in res.rows.items()}))
        return 0
    peaks = memory_peaks(args, cases) if args.memory else {}
    ctx = Ctx(args)
    print(H.banner())
    print(f"state: size={args.size}  {sum(p.numel() for p in ctx.model.parameters()) / 1e6:.1f} M params fp32 + "
          f"AdamW moments = {C.gb(ctx.state_bytes)} in {ctx.n_tensors} tensors (built in {ctx.build_s:.1f} s)")
    print(f"dir: {ctx.base} ({C.fs_type(ctx.base)}), O_DIRECT {'yes' if ctx.direct else 'NO (buffered + fsync)'}; "
          f"repeat={args.repeat}, verify={'first run' if args.verify else 'off'}", flush=True)
    t_all = time.perf_counter()
    res = H.Results().declare(*SAVES, group="save").declare(*LOADS, group="load")
    H.compare(contenders(ctx, cases), args.repeat, res)
    if ctx.ref is not None and C.fingerprint(ctx.tensors()) != ctx.ref:
        print("WARNING: the live state changed during the run (a loader wrote wrong data?)", file=sys.stderr)
    for name in list(res.rows):
        if not res.rows[name].samples and not res.rows[name].note:
            del res.rows[name]                          # a case not run
    columns = [("GB/s", lambda r: f"{ctx.state_bytes / r.median() / 1e9:.2f}" if r.median() else "n/a"),
               ("on disk", lambda r: C.fmt_bytes(r.median("disk")) if r.values("disk") else "")]
    if args.memory:
        columns.append(("peak RSS+", lambda r: C.fmt_bytes(max(peaks[r.name])) if peaks.get(r.name) else "n/a"))
    print("\n" + res.table(ratios=RATIOS, columns=columns))
    print(f"\nGB/s = {C.gb(ctx.state_bytes)} of tensor bytes / median seconds. x torch / x raw = median / median of "
          "the baseline row (>1 = slower). 'on disk' = bytes the op added. "
          f"total {time.perf_counter() - t_all:.0f} s")
    H.write_json(args.json, args, size=args.size, state_bytes=ctx.state_bytes, n_tensors=ctx.n_tensors,
                 o_direct=ctx.direct, rows=res.to_json(RATIOS), peak_rss=peaks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
