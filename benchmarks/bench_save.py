#!/usr/bin/env python
"""Checkpoint save/load benchmark: raw disk vs torch.save vs torch.distributed.checkpoint
vs ckptstore, on ONE deterministic GPT-like fp32 model + AdamW state, in one run.

    python benchmarks/bench_save.py --size small --repeat 1      # quick (~0.25 GB state)
    python benchmarks/bench_save.py                              # 1 GB state, 3 repeats
    python benchmarks/bench_save.py --size 3gb --memory --json out.json

See benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # ckptstore from the checkout

import torch  # noqa: E402

import common as C  # noqa: E402
from ckptstore import Writing

warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")

# --------------------------------------------------------------------------- rows

# (name, kind, torch baseline row, raw baseline row) in table order
ROW_SPECS: list[tuple[str, str, str, str]] = [
    ("raw write O_DIRECT+fsync", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("torch.save+fsync", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("dcp.save", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("dcp.async_save stall", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("dcp.async_save total", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("ckptstore save", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("ckptstore save again (dedup)", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("ckptstore save again, track_versions=True", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("ckptstore save nonblocking stall", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("ckptstore save nonblocking total", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("copy_ into reused buffers (stall floor)", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("ckptstore nonblocking stall, buffers reused", "save", "torch.save+fsync", "raw write O_DIRECT+fsync"),
    ("raw read O_DIRECT", "load", "torch.load cold", "raw read O_DIRECT"),
    ("torch.load cold", "load", "torch.load cold", "raw read O_DIRECT"),
    ("torch.load warm", "load", "torch.load warm", "raw read O_DIRECT"),
    ("torch.load+load_state_dict cold", "load", "torch.load cold", "raw read O_DIRECT"),
    ("dcp.load cold (in place)", "load", "torch.load cold", "raw read O_DIRECT"),
    ("dcp.load warm (in place)", "load", "torch.load warm", "raw read O_DIRECT"),
    ("ckptstore load cold", "load", "torch.load cold", "raw read O_DIRECT"),
    ("ckptstore load warm", "load", "torch.load warm", "raw read O_DIRECT"),
    ("ckptstore resume cold (in place)", "load", "torch.load cold", "raw read O_DIRECT"),
    ("ckptstore resume warm (in place)", "load", "torch.load warm", "raw read O_DIRECT"),
]
REFS = {name: (t, r) for name, _, t, r in ROW_SPECS}


class Ctx:
    """The one state every method saves, plus run options."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.base = Path(args.dir).resolve()
        self.direct = C.o_direct_supported(self.base)
        t0 = time.perf_counter()
        self.model, self.opt = C.build_state(args.size, seed=args.seed)
        self.build_s = time.perf_counter() - t0
        ts = self.tensors()
        self.n_tensors = len(ts)
        self.state_bytes = sum(C.nbytes(t) for t in ts)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.ref = C.fingerprint(ts) if args.verify else None
        self.verify_now = False
        del ts

    def tensors(self) -> list[torch.Tensor]:
        return C.state_tensors(self.model, self.opt)

    def live_ok(self) -> bool:
        return C.fingerprint(self.tensors()) == self.ref

    def tree_ok(self, obj: Any) -> bool:
        return C.fingerprint(C.tree_tensors(obj)) == self.ref

    def stateful(self) -> dict[str, Any]:
        """What ckptstore gets (and resumes into): Stateful objects."""
        return {"model": self.model, "optimizer": self.opt}


class Measure:
    def __init__(self) -> None:
        self.ok = True
        self.disk: int | None = None
        self.note = ""
        self.error: BaseException | None = None


class Probe:
    """Times named phases; in --memory children also records the peak RSS above the
    post-build baseline (high-water mark reset at the start of each phase)."""

    def __init__(self, memory: bool):
        self.memory = memory
        self.baseline = C.rss_bytes()
        self.t0: dict[str, float] = {}
        self.out: dict[str, dict[str, Any]] = {}
        self.peak_reset_ok = C.reset_peak_rss() if memory else False

    def start(self, *names: str) -> None:
        if self.memory:
            gc.collect()
            C.malloc_trim()
            self.baseline = C.rss_bytes()
            C.reset_peak_rss()
        now = time.perf_counter()
        for n in names:
            self.t0[n] = now

    def stop(self, name: str, m: Measure | None = None) -> None:
        dt = time.perf_counter() - self.t0.pop(name)
        rec = self.out.setdefault(name, {})
        rec["seconds"] = dt
        if self.memory:
            rec["peak"] = max(0, C.peak_rss_bytes() - self.baseline)
        if m is not None:
            if m.disk is not None:
                rec["disk"] = m.disk
            if m.note:
                rec["note"] = m.note

    def fail(self, names: tuple[str, ...] | list[str], e: BaseException) -> None:
        for n in names:
            self.t0.pop(n, None)
            self.out.setdefault(n, {})["note"] = "n/a: " + C.fmt_note(e)

    def note(self, name: str, text: str) -> None:
        rec = self.out.setdefault(name, {})
        rec["note"] = (rec.get("note", "") + " " + text).strip()

    @contextlib.contextmanager
    def timed(self, name: str, also_fail: tuple[str, ...] = ()):
        """Time the block; an exception marks the row (and also_fail rows) n/a instead of
        aborting the whole benchmark."""
        m = Measure()
        try:
            self.start(name)
            yield m
            self.stop(name, m)
        except Exception as e:  # noqa: BLE001 - a missing / broken API is a table entry
            m.ok, m.error = False, e
            self.fail((name, *also_fail), e)
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()

    def check(self, name: str, ok: bool) -> None:
        if not ok:
            self.note(name, "WRONG DATA")


# --------------------------------------------------------------------------- cases


def _io_note(n: int, io_s: float, what: str) -> str:
    return f"{what} calls alone {io_s:.3f} s = {n / io_s / 1e9:.2f} GB/s" if io_s > 0 else ""


def case_raw(ctx: Ctx, p: Probe, d: Path) -> None:
    ts = ctx.tensors()
    f = d / "raw.bin"
    name_w, name_r = "raw write O_DIRECT+fsync", "raw read O_DIRECT"
    block = ctx.args.raw_block_mib * C.MiB
    with p.timed(name_w, also_fail=(name_r,)) as m:
        n, io_s = C.raw_write(ts, f, block=block, direct=ctx.direct)
        m.disk = f.stat().st_size
        m.note = _io_note(n, io_s, "write+fsync") + ("" if ctx.direct else "; buffered: no O_DIRECT")
    if not m.ok:
        return
    if not ctx.direct:
        C.evict(f)
    with p.timed(name_r) as m:
        out, io_s = C.raw_read(ts, f, block=block, direct=ctx.direct)
        m.note = _io_note(n, io_s, "read")
    if m.ok and ctx.verify_now:
        p.check(name_r, ctx.tree_ok(out))
    del out, ts


def case_torch(ctx: Ctx, p: Probe, d: Path) -> None:
    f = d / "ckpt.pt"
    with p.timed("torch.save+fsync",
                 also_fail=("torch.load cold", "torch.load warm", "torch.load+load_state_dict cold")) as m:
        with open(f, "wb") as fh:
            torch.save({"model": ctx.model.state_dict(), "optimizer": ctx.opt.state_dict()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        C.fsync_path(d)
        m.disk = f.stat().st_size
    if not m.ok:
        return
    C.evict(f)
    with p.timed("torch.load cold") as m:
        sd = torch.load(f, weights_only=True, map_location="cpu")
    if m.ok and ctx.verify_now:
        p.check("torch.load cold", ctx.tree_ok(sd))
    sd = None
    with p.timed("torch.load warm"):
        sd = torch.load(f, weights_only=True, map_location="cpu")
    sd = None
    C.evict(f)
    with C.perturbed(ctx.tensors()):
        with p.timed("torch.load+load_state_dict cold") as m:
            sd = torch.load(f, weights_only=True, map_location="cpu")
            ctx.model.load_state_dict(sd["model"])
            ctx.opt.load_state_dict(sd["optimizer"])
            sd = None
        if m.ok and ctx.verify_now:
            p.check("torch.load+load_state_dict cold", ctx.live_ok())


def _dcp_state(ctx: Ctx) -> dict[str, Any]:
    """FQN-keyed model+optimizer state via the DCP state_dict helpers (the documented
    pattern); falls back to the raw Stateful objects."""
    try:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.stateful import Stateful
    except ImportError:
        return {"model": ctx.model, "optimizer": ctx.opt}

    class AppState(Stateful):
        def state_dict(self) -> dict[str, Any]:
            msd, osd = get_state_dict(ctx.model, ctx.opt)
            return {"model": msd, "optimizer": osd}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            set_state_dict(ctx.model, ctx.opt, model_state_dict=sd["model"],
                           optim_state_dict=sd["optimizer"])

    return {"app": AppState()}


def case_dcp(ctx: Ctx, p: Probe, d: Path) -> None:
    loads = ("dcp.load cold (in place)", "dcp.load warm (in place)")
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    except ImportError as e:
        p.fail(("dcp.save", *loads), e)
        return
    state = _dcp_state(ctx)
    path = d / "dcp"
    with p.timed("dcp.save", also_fail=loads) as m:
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
        m.disk = C.disk_bytes(path)
    if not m.ok:
        return
    C.evict(path)
    with C.perturbed(ctx.tensors()):
        with p.timed(loads[0]) as m:
            dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)
        if m.ok and ctx.verify_now:
            p.check(loads[0], ctx.live_ok())
    with p.timed(loads[1]):
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=True)


def case_dcp_async(ctx: Ctx, p: Probe, d: Path) -> None:
    stall, total = "dcp.async_save stall", "dcp.async_save total"
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
    except ImportError as e:
        p.fail((stall, total), e)
        return
    if not hasattr(dcp, "async_save"):
        p.fail((stall, total), AttributeError("no dcp.async_save"))
        return
    state = _dcp_state(ctx)
    path = d / "dcp_async"
    m = Measure()
    try:
        p.start(stall, total)
        fut = dcp.async_save(state, storage_writer=FileSystemWriter(path), no_dist=True)
        p.stop(stall)
        fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse (zero-overhead stager)
        fut.result()
        m.disk = C.disk_bytes(path)
        p.stop(total, m)
    except Exception as e:  # noqa: BLE001
        p.fail((stall, total) if stall in p.t0 else (total,), e)


CKPT_ROWS = ("ckptstore save", "ckptstore save again (dedup)", "ckptstore save again, track_versions=True",
             "ckptstore load cold",
             "ckptstore load warm", "ckptstore resume cold (in place)",
             "ckptstore resume warm (in place)")
NB_ROWS = ("ckptstore save nonblocking stall", "ckptstore save nonblocking total")
STEADY_ROWS = ("copy_ into reused buffers (stall floor)", "ckptstore nonblocking stall, buffers reused")


def _import_store() -> Any:
    from ckptstore import Store  # noqa: PLC0415

    return Store


def _close(store: Any) -> None:
    close = getattr(store, "close", None)
    if callable(close):
        close()


def _supports_nonblocking(store: Any) -> bool:
    try:
        params = inspect.signature(store.save).parameters
    except (TypeError, ValueError):
        return False
    return "blocking" in params or any(v.kind is v.VAR_KEYWORD for v in params.values())


def _result_note(res: Any) -> str:
    parts = []
    for attr, label in (("bytes_written", "written"), ("blobs_new", "new blobs"),
                        ("blobs_total", "blobs")):
        v = getattr(res, attr, None)
        if isinstance(v, int):
            parts.append(f"{label} {C.fmt_bytes(v) if attr == 'bytes_written' else v}")
    v = getattr(res, "stall_seconds", None)
    if isinstance(v, (int, float)):
        parts.append(f"stall_seconds {v:.3f}")
    return ", ".join(parts)


def case_ckptstore(ctx: Ctx, p: Probe, d: Path) -> None:
    try:
        Store = _import_store()
    except (ImportError, AttributeError) as e:
        p.fail(CKPT_ROWS, e)
        return
    root = d / "store"
    state = ctx.stateful()
    try:
        store = Store(str(root))
    except Exception as e:  # noqa: BLE001
        p.fail(CKPT_ROWS, e)
        return
    try:
        with p.timed(CKPT_ROWS[0], also_fail=CKPT_ROWS[1:]) as m:
            res = store.save(state, 1)
            m.disk = C.disk_bytes(root)
            m.note = _result_note(res)
        if not m.ok:
            return
        before = C.disk_bytes(root)
        with p.timed(CKPT_ROWS[1]) as m:
            res = store.save(state, 2)
            m.disk = C.disk_bytes(root) - before
            m.note = _result_note(res)
        _close(store)
        # the opt-in: a tensor whose version counter and optimizer-step count did not move is neither read
        # nor hashed (the default hashes everything: the row above)
        store = Store(str(root), writing=Writing(track_versions=True))
        store.save(state, 3)
        with p.timed(CKPT_ROWS[2]) as m:
            res = store.save(state, 4)
            m.note = _result_note(res)
        _close(store)
        C.evict(root)
        store = Store(str(root))
        with p.timed(CKPT_ROWS[3]) as m:
            plain = store.load(step=None, map_location="cpu")
        if m.ok and ctx.verify_now:
            p.check(CKPT_ROWS[3], ctx.tree_ok(plain))
        plain = None
        with p.timed(CKPT_ROWS[4]):
            plain = store.load(step=None, map_location="cpu")
        plain = None
        C.evict(root)
        with C.perturbed(ctx.tensors()):
            with p.timed(CKPT_ROWS[5]) as m:
                step = store.resume(state)
            if m.ok and ctx.verify_now:
                p.check(CKPT_ROWS[5], ctx.live_ok())
                if step != 4:
                    p.note(CKPT_ROWS[5], f"step={step!r}, expected 4")
        with p.timed(CKPT_ROWS[6]):
            store.resume(state)
    finally:
        _close(store)


def case_ckptstore_nonblocking(ctx: Ctx, p: Probe, d: Path) -> None:
    stall, total = NB_ROWS
    try:
        Store = _import_store()
        store = Store(str(d / "store_nb"))
    except Exception as e:  # noqa: BLE001
        p.fail(NB_ROWS, e)
        return
    try:
        if not _supports_nonblocking(store):
            p.fail(NB_ROWS, NotImplementedError("no blocking= parameter yet"))
            return
        m = Measure()
        try:
            p.start(stall, total)
            h = store.save(ctx.stateful(), 1, blocking=False)
            p.stop(stall)
            res = h.result()
            m.disk = C.disk_bytes(d / "store_nb")
            m.note = _result_note(res)
            p.stop(total, m)
        except Exception as e:  # noqa: BLE001
            p.fail((stall, total) if stall in p.t0 else (total,), e)
        # Steady state, what a training loop sees from its second save on: the staging buffers exist. Every
        # tensor's version counter is bumped (add_(0): same bytes) so nothing is skipped as unchanged and the
        # stall is the full copy; the stall floor is one copy_ of every tensor into buffers allocated once.
        floor, steady = STEADY_ROWS
        try:
            tensors = _state_tensors(ctx.stateful())
            bufs = [torch.empty_like(t) for t in tensors]
            for b, t in zip(bufs, tensors):
                b.copy_(t)                       # first touch of the buffers, not timed
            p.start(floor)
            for b, t in zip(bufs, tensors):
                b.copy_(t)
            p.stop(floor)
            del bufs
            with torch.no_grad():
                for t in tensors:
                    t.add_(0)
            p.start(steady)
            h = store.save(ctx.stateful(), 2, blocking=False)
            p.stop(steady)
            res = h.result()
            p.note(steady, f"stall_seconds={res.stall_seconds:.3f} unchanged={res.bytes_unchanged}")
        except Exception as e:  # noqa: BLE001
            p.fail(STEADY_ROWS, e)
    finally:
        _close(store)


def _state_tensors(state) -> list:
    out = []
    for v in state.values():
        sd = v.state_dict() if hasattr(v, "state_dict") else v
        stack = [sd]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, dict):
                stack.extend(x.values())
            elif isinstance(x, (list, tuple)):
                stack.extend(x)
    return out


CASES: dict[str, Callable[[Ctx, Probe, Path], None]] = {
    "raw": case_raw,
    "torch": case_torch,
    "dcp": case_dcp,
    "dcp_async": case_dcp_async,
    "ckptstore": case_ckptstore,
    "ckptstore_nb": case_ckptstore_nonblocking,
}


def run_case(ctx: Ctx, name: str, probe: Probe) -> dict[str, dict[str, Any]]:
    d = C.fresh_dir(ctx.base, f"{name}_")
    try:
        CASES[name](ctx, probe, d)
    finally:
        C.rmtree(d)
        gc.collect()
    out, probe.out = probe.out, {}
    return out


# --------------------------------------------------------------------------- memory children


def child_main(args: argparse.Namespace) -> None:
    ctx = Ctx(args)
    gc.collect()
    probe = Probe(memory=True)
    out = run_case(ctx, args.child, probe)
    print("@@RESULT " + json.dumps({"rows": out, "reset_ok": probe.peak_reset_ok,
                                    "baseline": probe.baseline}), flush=True)


def measure_memory(args: argparse.Namespace, case: str) -> dict[str, dict[str, Any]]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", case, "--size", args.size,
           "--dir", str(args.dir), "--seed", str(args.seed), "--no-verify",
           "--raw-block-mib", str(args.raw_block_mib)]
    # fixed glibc thresholds: big buffers are mmapped and handed back on free, so memory freed
    # by an earlier phase is not silently reused (which would hide part of the next peak)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT "):
            res = json.loads(line[len("@@RESULT "):])
            if not res["reset_ok"]:
                print(f"  [{case}] warning: could not reset the RSS high-water mark; peaks "
                      "include earlier phases", file=sys.stderr)
            for name, rec in res["rows"].items():
                if "peak" not in rec and rec.get("note"):
                    print(f"  [{case}] memory run: {name}: {rec['note']}", file=sys.stderr)
            return res["rows"]
    print(f"  [{case}] memory child failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}",
          file=sys.stderr)
    return {}


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(C.SIZES), default="1gb")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method (median, min-max)")
    ap.add_argument("--dir", default=str(C.default_bench_dir()),
                    help="scratch parent folder (same disk you checkpoint to; not tmpfs)")
    ap.add_argument("--only", default=",".join(CASES),
                    help=f"comma list of cases to run, from {','.join(CASES)}")
    ap.add_argument("--memory", action="store_true",
                    help="also measure peak RSS per method, one subprocess per method (slower)")
    ap.add_argument("--json", metavar="PATH", help="also write results as JSON")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--raw-block-mib", type=int, default=64, help="O_DIRECT block size (MiB)")
    ap.add_argument("--no-verify", dest="verify", action="store_false",
                    help="skip the checksum check of every load (done on the first repeat)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return 0
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown case(s): {', '.join(sorted(unknown))}")
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    fs = C.fs_type(base)
    if fs in ("tmpfs", "ramfs"):
        print(f"warning: --dir {base} is on {fs}: this measures RAM, not the disk", file=sys.stderr)

    # memory children first, while this process holds no big state
    mem: dict[str, dict[str, dict[str, Any]]] = {}
    if args.memory:
        for case in cases:
            print(f"[memory] {case} ...", file=sys.stderr, flush=True)
            mem[case] = measure_memory(args, case)

    ctx = Ctx(args)
    try:
        import ckptstore  # noqa: F401

        where = ckptstore.__file__ or next(iter(getattr(ckptstore, "__path__", [])), "?")
        ck = f"ckptstore {getattr(ckptstore, '__version__', '?')} ({where})"
        if not hasattr(ckptstore, "Store"):
            ck += ", no Store yet"
    except Exception as e:  # noqa: BLE001
        ck = "ckptstore n/a: " + C.fmt_note(e)
    print(f"torch {torch.__version__}, python {platform.python_version()}, {os.cpu_count()} cpus, "
          f"{torch.get_num_threads()} torch threads; {ck}")
    print(f"state: size={args.size}  {ctx.n_params / 1e6:.1f} M params fp32 + AdamW moments = "
          f"{C.gb(ctx.state_bytes)} in {ctx.n_tensors} tensors (built in {ctx.build_s:.1f} s)")
    print(f"dir: {base} ({fs}), O_DIRECT {'yes' if ctx.direct else 'NO (buffered + fsync)'}; "
          f"repeat={args.repeat}, verify={'first run' if args.verify else 'off'}", flush=True)

    samples: dict[str, dict[str, list]] = {}
    notes: dict[str, str] = {}
    t_all = time.perf_counter()
    for r in range(args.repeat):  # round-robin so disk drift hits every method alike
        for case in cases:
            ctx.verify_now = args.verify and r == 0
            t0 = time.perf_counter()
            out = run_case(ctx, case, Probe(memory=False))
            print(f"  run {r + 1}/{args.repeat} {case:13s} {time.perf_counter() - t0:7.2f} s",
                  file=sys.stderr, flush=True)
            for name, rec in out.items():
                s = samples.setdefault(name, {"seconds": [], "disk": []})
                if "seconds" in rec:
                    s["seconds"].append(rec["seconds"])
                if "disk" in rec:
                    s["disk"].append(rec["disk"])
                if rec.get("note"):
                    notes[name] = rec["note"]  # last run's note
    if args.verify and not ctx.live_ok():
        print("WARNING: the live state changed during the run (a loader wrote wrong data?)",
              file=sys.stderr)

    rows = []
    peaks: dict[str, list[int]] = {}
    for case_out in mem.values():
        for name, rec in case_out.items():
            if "peak" in rec:
                peaks.setdefault(name, []).append(rec["peak"])
    for name, kind, _, _ in ROW_SPECS:
        if name not in samples and name not in notes and name not in peaks:
            continue
        s = samples.get(name, {"seconds": [], "disk": []})
        rows.append(C.Row(name, kind, s["seconds"], s["disk"], peaks.get(name, []),
                          notes.get(name, "")))

    sys.stderr.flush()
    print()
    print(render(rows, ctx.state_bytes, REFS, args.memory))
    print(f"\nGB/s = {C.gb(ctx.state_bytes)} of tensor bytes / median seconds. x torch / x raw = "
          "median / median of the baseline row (>1 = slower). 'on disk' = bytes the op added. "
          f"total {time.perf_counter() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "torch": torch.__version__, "size": args.size, "params": ctx.n_params,
                "state_bytes": ctx.state_bytes, "n_tensors": ctx.n_tensors, "dir": str(base),
                "fs": fs, "o_direct": ctx.direct, "repeat": args.repeat, "ckptstore": ck,
                "rows": [dict(name=r.name, kind=r.kind, seconds=r.seconds,
                              median=r.median, min=min(r.seconds) if r.seconds else None,
                              max=max(r.seconds) if r.seconds else None,
                              gbps=(ctx.state_bytes / r.median / 1e9) if r.median else None,
                              x_torch=_ratio(rows, r, REFS[r.name][0]),
                              x_raw=_ratio(rows, r, REFS[r.name][1]),
                              disk=r.disk, peak_rss=r.peak, note=r.note) for r in rows],
            }, f, indent=1)
        print(f"wrote {args.json}")
    return 0


def _ratio(rows: list[C.Row], r: C.Row, ref: str) -> float | None:
    rr = next((x for x in rows if x.name == ref), None)
    if r.median is None or rr is None or not rr.median:
        return None
    return r.median / rr.median


def render(rows: list[C.Row], state_bytes: int, refs: dict[str, tuple[str, str]],
           show_peak: bool) -> str:
    return C.render_table(rows, state_bytes, refs, show_peak)


if __name__ == "__main__":
    sys.exit(main())
