#!/usr/bin/env python
"""GPU check (issue 28, goal 5): one script, a few minutes on one GPU, one table of what ckptstore does with CUDA.

    python benchmarks/gpu_check.py                       # on a GPU machine: < 5 minutes on one H100
    python benchmarks/gpu_check.py --smoke               # tiny sizes (seconds); CUDA rows too when there is CUDA
    python benchmarks/gpu_check.py --state-gb 4 --only a,b --json gpu.json

Rows (each runs on CUDA when it is there; without CUDA the script is a smoke test: every row runs on the CPU at
tiny sizes and the CUDA rows print ``skipped: no CUDA device`` with the reason):

(a) **D2H bandwidth of the staging path**: ``ckptstore.io.snapshot.StagingPool.stage`` (what a non-blocking save
    copies through: page-aligned host buffers allocated once and reused, pinned when the source is on CUDA,
    copies queued on a side stream), until its ready event fires, vs a plain ``copy_`` of the same tensors into
    pinned buffers allocated once (``non_blocking=True``, then synchronize). GB/s of the medians of alternated
    repeats; the first staging (which allocates the pinned buffers) is in the note.
(b) **Non-blocking save stall** of a large state (``--state-gb``, default 16 GiB on a GPU, scaled down to what fits
    in free GPU memory, host memory and the checkpoint root, saying so): ``Store.save(state, step,
    blocking=False)`` timed until it returns (the host stall) and until the training stream is free (the
    stream waits for the staging copies), vs one pinned ``copy_`` of the same bytes (every tensor into pinned
    buffers allocated once, then synchronize: the stall floor). Each save starts with the
    previous one's background hashing and writing finished (not timed). The values do not change between saves
    (a save without ``Writing(track_versions=True)`` stages every tensor anyway), so only the first one writes.
(c) **Stale-save rule** with fused AdamW / Adam / SGD (``fused=True``): a clone of model and optimizer state is
    taken (on the training stream) at ``save()`` time, ``save(blocking=False)`` is called while that step's
    kernels may still be queued, and optimizer steps are queued right after it returns, with no synchronize.
    The step loaded back must equal the clone bit for bit, and the live state must have moved on (else the
    check proves nothing). PASS / FAIL.
(d) **RNG restored bit for bit**: ``ckptstore.RNGState`` (Python, NumPy, torch CPU and the current CUDA device's
    generator) and a ``torch.Generator`` of the device saved through its ``get_state()``; after the
    generators are re-seeded and drawn from, ``resume`` must give back the saved generator states and the same
    next draws. PASS / FAIL.
(e) **Save every step to the memory tier**: a small training loop (an MLP with fused AdamW; one ``loss.item()``
    per step, as a loop that logs does; micro-batches calibrated to ``--step-ms``) saving every step with
    ``Store(root, memory=Memory(<tmpfs dir>, every=1, replicas=0))``, vs the same loop without checkpointing
    (run before and after, alternated). Throughput ratio (steps/s with over without), stall in ``save`` p50/p99.

(f) **Blocking save of a CUDA state** (``--blocking-gb``, default 4 GiB): ``Store.save(state, step)`` (what the
    HF and Lightning adapters call), first and later saves, vs ``torch.distributed.checkpoint.save`` and
    ``torch.save`` of the same tensors into the same kind of root, alternated; and a state of odd tensors
    (bfloat16, a transposed view, sizes not a multiple of the copy piece, a conjugate complex tensor) saved
    blocking and read back bit for bit (PASS / FAIL).

Exit status: 1 when a correctness row (c, d, f) fails, 2 when a row could not be measured (``n/a: <error>``;
``BENCH_DEBUG=1`` prints the traceback), else 0. See benchmarks/README.md, "gpu_check.py".
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
ROWS = "abcdef"
CORRECTNESS = "cdf"
OPTIMIZERS = {"AdamW": (torch.optim.AdamW, {}), "Adam": (torch.optim.Adam, {}),
              "SGD": (torch.optim.SGD, {"momentum": 0.9})}
perf = time.perf_counter


# --------------------------------------------------------------------------- sizes


@dataclass
class Sizes:
    """What each row uses. ``full`` on a GPU; ``smoke`` without CUDA or with ``--smoke`` (seconds on 2 cores)."""
    copy_bytes: int           # (a)
    state_bytes: int          # (b), before it is fitted to the machine
    opt_width: int            # (c): MLP width and depth, batch rows
    opt_layers: int
    opt_batch: int
    steps_after: int          # (c): optimizer steps queued right after save() returns
    loop_width: int           # (e)
    loop_layers: int
    loop_batch: int
    loop_steps: int
    loop_warmup: int
    step_ms: float
    repeat: int
    blocking_bytes: int = 4 * GiB   # (f)


def sizes(smoke: bool, args) -> Sizes:
    if smoke:
        s = Sizes(copy_bytes=16 * MiB, state_bytes=32 * MiB, opt_width=64, opt_layers=2, opt_batch=32,
                  steps_after=3, loop_width=64, loop_layers=2, loop_batch=32, loop_steps=6, loop_warmup=2,
                  step_ms=20.0, repeat=2, blocking_bytes=32 * MiB)
    else:
        s = Sizes(copy_bytes=2 * GiB, state_bytes=16 * GiB, opt_width=4096, opt_layers=4, opt_batch=2048,
                  steps_after=3, loop_width=2048, loop_layers=3, loop_batch=4096, loop_steps=40, loop_warmup=5,
                  step_ms=50.0, repeat=5)
    if args.state_gb is not None:
        s.state_bytes = int(args.state_gb * GiB)
    if args.copy_gb is not None:
        s.copy_bytes = int(args.copy_gb * GiB)
    if args.step_ms is not None:
        s.step_ms = args.step_ms
    if args.repeat is not None:
        s.repeat = args.repeat
    if args.blocking_gb is not None:
        s.blocking_bytes = int(args.blocking_gb * GiB)
    return s


def host_available() -> int:
    """Bytes of host memory available (``MemAvailable`` of /proc/meminfo, else free pages)."""
    avail = C.proc_kib("/proc/meminfo", "MemAvailable")
    return avail if avail is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def free_bytes(path: Path | None) -> int:
    try:
        return shutil.disk_usage(path).free if path is not None else 0
    except OSError:
        return 0


def fit_state(want: int, *, device_free: int | None, host_free: int, host_copies: int, shm_free: int,
              disk_free: int, margin: int) -> tuple[int, bool, str]:
    """The largest state (bytes, a multiple of 1 MiB) <= ``want`` that row (b) can hold: on the device
    (``device_free``, None on the CPU, where the state is one of the ``host_copies``), ``host_copies`` copies in
    host memory (the staging pool and the anchor's buffer, plus the state itself on the CPU) and one checkpoint
    in its root: tmpfs (``shm_free``, which also takes host memory) when it fits, else the disk. Returns
    (bytes, whether the root is tmpfs, why it was scaled down or "")."""
    limits = {"requested": want}
    if device_free is not None:
        limits[f"free GPU memory {device_free / GiB:.1f} GiB"] = device_free - margin
    host = f"host memory available {host_free / GiB:.1f} GiB / {host_copies} copies"
    limits[host] = (host_free - margin) // host_copies
    shm_room = min(int(shm_free * 0.9), (host_free - margin) // (host_copies + 1))
    limits[f"checkpoint root: tmpfs {shm_free / GiB:.1f} GiB free, disk {disk_free / GiB:.1f} GiB free"] = \
        max(shm_room, int(disk_free * 0.9))
    why, n = min(limits.items(), key=lambda kv: kv[1])
    n = max(MiB, n // MiB * MiB)
    return min(n, want), shm_room >= n, "" if why == "requested" else f"scaled down to fit the {why}"


def pieces(total: int, largest: int = 256 * MiB, least: int = 8) -> list[int]:
    """``total`` bytes as equal tensors of a power-of-two size (<= ``largest``, at least ``least`` of them
    when ``total`` allows): torch's pinned allocator rounds each block up to a power of two, so these sizes
    measure copies, not that rounding."""
    size = largest
    while size > 4096 and total // size < least:
        size //= 2
    return [size] * max(1, total // size)


# --------------------------------------------------------------------------- the device


class Dev:
    """The device the rows run on and the few calls that differ between CUDA and the CPU (the rest of the
    script is the same for both, so the CPU smoke run goes through it)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.label = "cuda" if cuda else "cpu"
        self.name = torch.cuda.get_device_name(self.device) if cuda else f"{os.cpu_count()} cpus"

    def sync(self) -> None:
        """Wait for everything queued on the device (nothing to wait for on the CPU)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def stream_sync(self) -> None:
        """Wait for the current (training) stream only."""
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory to copy this device's tensors into: pinned when CUDA."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def free(self) -> int | None:
        """Free device memory in bytes (``torch.cuda.mem_get_info``); None on the CPU."""
        return torch.cuda.mem_get_info(self.device)[0] if self.cuda else None

    def release(self) -> None:
        """Give cached device and pinned host memory back between rows."""
        import gc
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            empty = getattr(torch._C, "_host_emptyCache", None)
            if empty is not None:
                empty()

    def pinned_held(self) -> int | None:
        """Bytes of pinned blocks torch's host allocator holds (rounded block sizes), when it says."""
        if not self.cuda:
            return None
        try:
            return int(torch.cuda.host_memory_stats().get("allocated_bytes.current"))
        except Exception:  # noqa: BLE001 - an older torch: not shown
            return None


def make_tensors(total: int, dev: Dev, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device=dev.device).manual_seed(seed)
    return [torch.randn(n // 4, generator=g, device=dev.device) for n in pieces(total)]


def copy_into(bufs: list[torch.Tensor], tensors: list[torch.Tensor], dev: Dev) -> None:
    """The anchor: ``copy_`` of every tensor into its host buffer (allocated once), then synchronize."""
    for b, t in zip(bufs, tensors):
        b[: C.nbytes(t)].view(t.dtype).view(t.shape).copy_(t, non_blocking=dev.cuda)
    dev.sync()


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds is not None else "n/a"


def gbps(nbytes: int, seconds: float | None) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds else "n/a"


# --------------------------------------------------------------------------- the table


@dataclass
class Line:
    """One row of the printed table (and of the JSON's ``rows``)."""
    row: str
    check: str
    device: str
    measured: str = ""
    anchor: str = ""
    ratio: str = ""           # median seconds over the anchor's (> 1: slower), or the throughput ratio for (e)
    result: str = ""          # PASS / FAIL for correctness rows; skipped: ... / n/a: ...
    note: str = ""
    value: float | None = None          # the measured figure as a number (seconds, GB/s, ratio)


COLUMNS = ["row", "device", "check", "measured", "anchor", "ratio", "result", "note"]
RIGHT = {"measured", "anchor", "ratio"}


def table(lines: list[Line]) -> str:
    """The rows as one plain-text table: text left-aligned, figures right-aligned, a rule under the header."""
    cells = [COLUMNS] + [[str(getattr(ln, k)) for k in COLUMNS] for ln in lines]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    out = ["  ".join(c.rjust(w) if k in RIGHT else c.ljust(w) for k, c, w in zip(COLUMNS, r, widths)).rstrip()
           for r in cells]
    return "\n".join([out[0], "-" * len(out[0]), *out[1:]])


def failed_line(row: str, check: str, dev: Dev, e: BaseException) -> Line:
    if H.DEBUG:
        import traceback
        traceback.print_exception(e)
    result = "FAIL" if row in CORRECTNESS else "n/a"
    return Line(row, check, dev.label, result=result, note=("raised " if result == "FAIL" else "") + C.fmt_note(e))


# --------------------------------------------------------------------------- (a) staging path bandwidth


STAGE, COPY = "StagingPool.stage", "copy_ into reused host buffers"


def row_a(dev: Dev, sz: Sizes, seed: int, sections: dict) -> list[Line]:
    from ckptstore.io.snapshot import StagingPool, spec_of
    from ckptstore.state.flatten import Node
    tensors = make_tensors(sz.copy_bytes, dev, seed)
    total = sum(C.nbytes(t) for t in tensors)
    nodes = [Node(("a", i), "tensor", t) for i, t in enumerate(tensors)]
    live = [n.path for n in nodes]
    pool = StagingPool()

    def specs():                       # setup, not timed: the device idle, fresh specs (as a snapshot makes)
        dev.sync()
        return [(spec_of(n), n) for n in nodes]

    def stage(pairs) -> None:
        pool.stage(pairs, live_paths=live)
        for ev in {id(s.ready): s.ready for s, _ in pairs if s.ready is not None}.values():
            ev.synchronize()           # the writer thread's wait: the bytes are in host memory

    pairs = specs()
    t0 = perf()
    stage(pairs)                       # allocates the buffers (pinned on CUDA): the first save's extra cost
    first = perf() - t0
    last_spec, last = pairs[-1][0], tensors[-1]
    ok = torch.equal(torch.frombuffer(last_spec.view, dtype=torch.uint8), C.as_bytes(last).cpu())
    bufs = [dev.host_buffer(C.nbytes(t)) for t in tensors]
    t0 = perf()
    copy_into(bufs, tensors, dev)
    first_copy = perf() - t0
    held = dev.pinned_held()
    res = H.compare([H.Contender(STAGE, stage, setup=specs),
                     H.Contender(COPY, lambda _: copy_into(bufs, tensors, dev), setup=dev.sync)], sz.repeat)
    sections["a"] = res
    s, c = res.rows[STAGE].median(), res.rows[COPY].median()
    kind = "pinned " if dev.cuda else ""
    note = (f"{C.fmt_bytes(total)} in {len(tensors)} tensors, {sz.repeat} repeats; first stage (allocates) "
            f"{first:.3f} s, first {kind}copy_ {first_copy:.3f} s; pool holds {C.fmt_bytes(pool.bytes_held)}"
            + (f", host allocator {C.fmt_bytes(held)} pinned (both)" if held is not None else "")
            + ("" if ok else "; WRONG DATA in the staging buffer"))
    return [Line("a", f"D2H bandwidth: {STAGE} vs {kind}copy_" if dev.cuda else f"host copy: {STAGE} vs copy_",
                 dev.label, gbps(total, s), gbps(total, c), f"{s / c:.2f}" if s and c else "n/a",
                 "FAIL" if not ok else "" if s and c else "n/a",
                 " ".join(x for x in (note, res.rows[STAGE].note, res.rows[COPY].note) if x),
                 value=total / s / 1e9 if s else None)]


# --------------------------------------------------------------------------- (b) non-blocking save stall


RET, FREE, ONE_COPY = "save(blocking=False) returns", "until the training stream is free", "one copy_ (anchor)"


def row_b(dev: Dev, sz: Sizes, seed: int, base: Path, sections: dict) -> list[Line]:
    from ckptstore import Store
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    margin = 2 * GiB if not dev.cuda or sz.state_bytes > 4 * GiB else 0
    want, use_shm, why = fit_state(sz.state_bytes, device_free=dev.free(), host_free=host_available(),
                                   host_copies=2 if dev.cuda else 3, shm_free=free_bytes(shm),
                                   disk_free=free_bytes(base), margin=margin)
    tensors = make_tensors(want, dev, seed)
    total = sum(C.nbytes(t) for t in tensors)
    state = {"model": {f"w{i:03d}": t for i, t in enumerate(tensors)}}
    root = Path(tempfile.mkdtemp(prefix="ckptstore-gpucheck-", dir=shm if use_shm else base))
    steps = itertools.count(1)
    try:
        with Store(str(root)) as store:
            def quiet(*_):               # setup, not timed: the previous save's hashing and writing done
                store.wait()
                dev.sync()

            def save(res: H.Results, _) -> None:
                t0 = perf()
                h = store.save(state, next(steps), blocking=False)
                t1 = perf()
                dev.stream_sync()
                t2 = perf()
                res.add(RET, t1 - t0, stall=h.stall_seconds)
                res.add(FREE, t2 - t0)

            quiet()
            t0 = perf()
            h = store.save(state, next(steps), blocking=False)      # allocates the staging buffers
            dev.stream_sync()
            first = perf() - t0
            quiet()
            first_total = perf() - t0
            bufs = [dev.host_buffer(C.nbytes(t)) for t in tensors]
            copy_into(bufs, tensors, dev)                            # first touch, not timed
            res = H.compare([H.Contender("save", save, setup=quiet, records=True, rows=(RET, FREE)),
                             H.Contender(ONE_COPY, lambda _: copy_into(bufs, tensors, dev), setup=quiet)],
                            sz.repeat)
            store.wait()
            del bufs
    finally:
        shutil.rmtree(root, ignore_errors=True)
    sections["b"] = res
    c = res.rows[ONE_COPY].median()
    where = f"root on {'tmpfs' if use_shm else C.fs_type(base)}"
    size = f"{C.fmt_bytes(total)} in {len(pieces(want))} tensors" + (f" ({why})" if why else "")
    kind = "pinned " if dev.cuda else ""
    out = []
    for name, what, note in (
            (RET, "host", f"{size}; {where}; first save {first:.2f} s (allocates the staging buffers; committed "
                          f"after {first_total:.2f} s); SaveHandle.stall_seconds p50 "
                          f"{_ms(res.rows[RET].median('stall'))}"),
            (FREE, "GPU" if dev.cuda else "stream",
             "the training stream waits for the staging copies" if dev.cuda else "the same on the CPU")):
        m = res.rows[name].median()
        out.append(Line("b", f"non-blocking save stall ({what}): {name}, vs one {kind}copy_", dev.label,
                        f"{m:.3f} s" if m is not None else "n/a", f"{c:.3f} s" if c else "n/a",
                        f"{m / c:.2f}" if m is not None and c else "n/a", "" if m is not None and c else "n/a",
                        (note + " " + res.rows[name].note).strip(), value=m))
    return out


# --------------------------------------------------------------------------- (c) stale-save rule, fused optimizers


def mlp(width: int, layers: int, dev: Dev) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i < layers - 1:
            mods.append(torch.nn.GELU())
    return torch.nn.Sequential(*mods).to(dev.device)


def trainer(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
            micro: int = 1) -> Callable[[], torch.Tensor]:
    """One optimizer step over ``micro`` micro-batches of ``x`` (gradient accumulation); returns the loss,
    not synchronized."""
    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        for _ in range(micro):
            loss = model(x).square().mean()
            loss.backward()
        opt.step()
        return loss
    return step


def clone_tree(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def bitwise_mismatches(expected: Any, got: Any) -> list[str]:
    """Key paths whose tensors differ in key, dtype, shape or any byte (NaNs compared by their bits)."""
    e, g = dict(C.tree_items(expected)), dict(C.tree_items(got))
    bad = sorted(set(e) ^ set(g))
    for k in sorted(set(e) & set(g)):
        a, b = e[k].detach().cpu(), g[k].detach().cpu()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(C.as_bytes(a), C.as_bytes(b)):
            bad.append(k)
    return bad


def stale_check(opt_name: str, sz: Sizes) -> str:
    return f"stale-save rule: fused {opt_name}, {sz.steps_after} steps queued right after save() returns"


def stale_save(dev: Dev, sz: Sizes, opt_name: str, base: Path, seed: int) -> Line:
    from ckptstore import Store
    cls, kw = OPTIMIZERS[opt_name]
    torch.manual_seed(seed)
    model = mlp(sz.opt_width, sz.opt_layers, dev)
    opt = cls(model.parameters(), lr=1e-3, fused=True, **kw)
    step = trainer(model, opt, torch.randn(sz.opt_batch, sz.opt_width, device=dev.device))
    live = lambda: {"model": model.state_dict(), "optimizer": opt.state_dict()}   # noqa: E731
    check = stale_check(opt_name, sz)
    root = Path(tempfile.mkdtemp(prefix="ckptstore-gpucheck-", dir=base))
    try:
        with Store(str(root)) as store:
            step()
            step()
            dev.sync()
            step()                                 # queued: save() is called before it has run
            at_save = clone_tree(live())           # on the training stream: the values save() must store
            h = store.save({"model": model, "optimizer": opt}, 1, blocking=False)
            busy = dev.cuda and not torch.cuda.current_stream(dev.device).query()
            for _ in range(sz.steps_after):
                step()                             # no synchronize: these kernels race the staging copies
            r = h.result()
            dev.sync()
            moved = len(list(C.tree_items(at_save))) - len(bitwise_mismatches(at_save, live()))
            got = store.load(1, map_location="cpu")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bad = bitwise_mismatches(at_save, got)
    n = len(list(C.tree_items(at_save)))
    changed = n - moved
    ok = not bad and changed > 0
    note = (f"{n} tensors ({C.fmt_bytes(sum(C.nbytes(t) for t in C.tree_tensors(at_save)))}), "
            f"{len(bad)} differ from the clone at save() time"
            + (f" ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})" if bad else "")
            + f"; {changed} changed by the steps after it" + ("" if changed else " (nothing moved: proves nothing)")
            + (f"; GPU still busy when save() returned: {'yes' if busy else 'no'}" if dev.cuda else "")
            + f"; stall {r.stall_seconds * 1000:.1f} ms")
    return Line("c", check, dev.label, result="PASS" if ok else "FAIL", note=note)


# --------------------------------------------------------------------------- (d) RNG


def rng_draws(dev: Dev, gen: torch.Generator) -> list[Any]:
    """One draw from every generator a resume must restore."""
    out = [random.random(), np.random.random(4).tolist(), torch.rand(4)]
    if dev.cuda:
        out.append(torch.rand(4, device=dev.device))
    out.append(torch.rand(4, generator=gen, device=dev.device))
    return out


def rng_check(dev: Dev, base: Path, seed: int) -> Line:
    from ckptstore import RNGState, Store
    what = "Python, NumPy, torch CPU" + (f", CUDA device {dev.device.index} (RNGState)" if dev.cuda else " (RNGState)")
    check = f"RNG restored bit for bit: {what} + a torch.Generator({dev.label!r})"
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)                       # seeds every CUDA device too
    gen = torch.Generator(device=dev.device).manual_seed(seed + 1)
    rng_draws(dev, gen)                           # move off the seeds: the offsets must be restored too
    root = Path(tempfile.mkdtemp(prefix="ckptstore-gpucheck-", dir=base))
    try:
        with Store(str(root)) as store:
            store.save({"rng": RNGState(), "gen": gen.get_state()}, 1)
        saved = {"torch": torch.get_rng_state(), "gen": gen.get_state()}
        if dev.cuda:
            saved["cuda"] = torch.cuda.get_rng_state(dev.device)
        expect = rng_draws(dev, gen)
        random.seed(seed + 7)                     # elsewhere: other seeds, other draws
        np.random.seed(seed + 7)
        torch.manual_seed(seed + 7)
        gen.manual_seed(seed + 8)
        rng_draws(dev, gen)
        target = {"rng": RNGState(), "gen": torch.zeros_like(gen.get_state())}
        with Store(str(root)) as store:
            step = store.resume(target)
            sd = store.load(1)["rng"]
        gen.set_state(target["gen"])
        now = {"torch": torch.get_rng_state(), "gen": gen.get_state()}
        if dev.cuda:
            now["cuda"] = torch.cuda.get_rng_state(dev.device)
        got = rng_draws(dev, gen)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bad = [k for k in saved if not torch.equal(saved[k], now[k])]
    names = ["python", "numpy", "torch cpu"] + (["cuda"] if dev.cuda else []) + ["generator"]
    for name, a, b in zip(names, expect, got):
        same = torch.equal(a, b) if torch.is_tensor(a) else a == b
        if not same:
            bad.append(f"next draw of {name}")
    if dev.cuda and "cuda" not in sd:
        bad.append("no CUDA state in the checkpoint")
    if step != 1:
        bad.append(f"resume returned {step!r}")
    note = ("generator states and next draws equal" if not bad else "differ: " + ", ".join(bad))
    if dev.cuda and torch.cuda.device_count() > 1:
        note += f"; RNGState keeps the current device's generator only ({torch.cuda.device_count()} visible)"
    return Line("d", check, dev.label, result="FAIL" if bad else "PASS", note=note)


# --------------------------------------------------------------------------- (e) memory tier every step


NONE, MEMORY = "no checkpointing", "memory tier every step"


def train_loop(dev: Dev, step: Callable[[], torch.Tensor], steps: int, warmup: int,
               save: Callable[[int], Any] | None = None) -> dict:
    """``warmup`` + ``steps`` steps, each one ``loss.item()`` (the loop's logging: waits for the step), then
    ``save(step)`` when given; the step times and the stalls (time inside ``save``) after the warm-up."""
    step_s, stall_s = [], []
    dev.sync()
    t_start = None
    for i in range(1, steps + warmup + 1):
        if i == warmup + 1:
            dev.sync()
            t_start = perf()
        t0 = perf()
        step().item()
        ts = perf()
        if save is not None:
            save(i)
        t1 = perf()
        if i > warmup:
            step_s.append(t1 - t0)
            stall_s.append(t1 - ts)
    dev.sync()
    total = perf() - t_start
    return {"seconds": total, "steps": step_s, "stalls": stall_s, "rate": steps / total}


def row_e(dev: Dev, sz: Sizes, base: Path, seed: int, sections: dict) -> list[Line]:
    from ckptstore import Memory, Store
    torch.manual_seed(seed)
    model = mlp(sz.loop_width, sz.loop_layers, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(sz.loop_batch, sz.loop_width, device=dev.device)
    one = trainer(model, opt, x)
    for _ in range(3):
        one().item()
    t0 = perf()
    for _ in range(3):
        one().item()
    micro = max(1, round(sz.step_ms / 1000 / ((perf() - t0) / 3)))
    step = trainer(model, opt, x, micro)
    state = {"model": model, "optimizer": opt}
    state_bytes = sum(C.nbytes(t) for t in C.tree_tensors({"m": model.state_dict(), "o": opt.state_dict()}))
    shm = Path("/dev/shm")
    on_shm = shm.is_dir() and free_bytes(shm) > 8 * state_bytes + 64 * MiB
    mem_parent = shm if on_shm else base

    def memory_tier() -> dict:
        mem = tempfile.mkdtemp(prefix="ckptstore-gpucheck-mem-", dir=mem_parent)
        disk = tempfile.mkdtemp(prefix="ckptstore-gpucheck-disk-", dir=base)
        try:
            with Store(disk, memory=Memory(mem, every=1, capacity=4 * state_bytes, keep=2, replicas=0)) as store:
                out = train_loop(dev, step, sz.loop_steps, sz.loop_warmup,
                                 lambda i: store.save(state, i, blocking=False))
                store.wait()
                return out
        finally:
            shutil.rmtree(mem, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    none = H.Contender(NONE, lambda: train_loop(dev, step, sz.loop_steps, sz.loop_warmup))
    res = H.compare([none, H.Contender(MEMORY, memory_tier), none], sz.repeat)
    sections["e"] = res

    def pooled(name: str, key: str) -> list[float]:
        return [x for s in res.rows[name].samples for x in s[key]]

    def rate(name: str) -> float | None:
        xs = pooled(name, "steps")
        return len(xs) / sum(xs) if xs else None
    r_none, r_mem = rate(NONE), rate(MEMORY)
    stalls = pooled(MEMORY, "stalls")
    ratio = r_mem / r_none if r_mem and r_none else None
    note = (f"state {C.fmt_bytes(state_bytes)} (MLP {sz.loop_layers}x{sz.loop_width}, fused AdamW), "
            f"{micro} micro-batch(es) of {sz.loop_batch}/step, step p50 "
            + (f"{1000 * H.pct(pooled(NONE, 'steps'), 50):.1f} ms without" if r_none else "n/a")
            + f", {sz.loop_steps} steps x {sz.repeat} repeats each; memory root on "
            + ("tmpfs" if on_shm else f"{C.fs_type(base)} (/dev/shm too small)")
            + (f"; stall p50 {1000 * H.pct(stalls, 50):.1f} ms p99 {1000 * H.pct(stalls, 99):.1f} ms" if stalls else "")
            + " " + res.rows[NONE].note + " " + res.rows[MEMORY].note).strip()
    return [Line("e", "save every step to the memory tier: throughput vs no checkpointing", dev.label,
                 f"{r_mem:.2f} steps/s" if r_mem else "n/a", f"{r_none:.2f} steps/s" if r_none else "n/a",
                 f"{ratio:.3f}" if ratio else "n/a", "" if ratio else "n/a", note, value=ratio)]


# --------------------------------------------------------------------------- (f) blocking save of a CUDA state


def odd_state(dev: Dev, seed: int) -> dict:
    g = torch.Generator(device=dev.device).manual_seed(seed)
    big = 64 * MiB // 4 + 12345                              # crosses the 64 MiB copy piece, odd length
    z = torch.randn(4097, dtype=torch.complex64, generator=g, device=dev.device)
    return {"bf16": torch.randn(3_000_001, generator=g, device=dev.device).to(torch.bfloat16),
            "strided": torch.randn(2048, 1500, generator=g, device=dev.device).t(),
            "big": torch.randn(2 * big + 7, generator=g, device=dev.device),
            "small": torch.randn(33, generator=g, device=dev.device),
            "conj": z.conj(), "neg": torch.randn(1 << 21, generator=g, device=dev.device).neg().clone()}


def row_f(dev: Dev, sz: Sizes, base: Path, seed: int) -> list[Line]:
    from ckptstore import Store
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    want, use_shm, why = fit_state(sz.blocking_bytes, device_free=dev.free(), host_free=host_available(),
                                   host_copies=3, shm_free=free_bytes(shm), disk_free=free_bytes(base),
                                   margin=2 * GiB if dev.cuda else 0)
    where = shm if use_shm else base
    out = []
    # correctness first: odd tensors through the blocking path, read back on the CPU
    root = Path(tempfile.mkdtemp(prefix="ckptstore-gpucheck-f-", dir=where))
    try:
        odd = odd_state(dev, seed)
        with Store(str(root)) as store:
            store.save({"m": odd}, 1)
        with Store(str(root)) as store:
            got = store.load(1, map_location="cpu")
        expected = {"m": {k: v.resolve_conj().resolve_neg().cpu() for k, v in odd.items()}}
        bad = bitwise_mismatches(expected, got)
        out.append(Line("f", "blocking save of odd tensors read back bit for bit", dev.label,
                        result="FAIL" if bad else "PASS",
                        note=(f"{len(odd)} tensors (bf16, transposed, 2 x 64 MiB + odd, conj, neg); "
                              + (f"differ: {bad}" if bad else "all equal"))))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tensors = make_tensors(want, dev, seed)
    total = sum(C.nbytes(t) for t in tensors)
    state = {"model": {f"w{i:03d}": t for i, t in enumerate(tensors)}}
    import torch.distributed.checkpoint as dcp
    times: dict[str, list[float]] = {"ckptstore": [], "dcp.save": [], "torch.save": []}
    firsts: dict[str, float] = {}
    root = Path(tempfile.mkdtemp(prefix="ckptstore-gpucheck-f-", dir=where))
    try:
        with Store(str(root / "store")) as store:
            for r in range(sz.repeat + 1):
                for name in times:
                    dev.sync()
                    t0 = perf()
                    if name == "ckptstore":
                        store.save(state, r + 1)
                    elif name == "dcp.save":
                        dcp.save(state, checkpoint_id=str(root / f"dcp{r}"))
                    else:
                        torch.save(state, root / "ts.pt")
                    dt = perf() - t0
                    print(f"  run {r}/{sz.repeat} {name:34s} {dt:.2f} s", file=sys.stderr, flush=True)
                    if r:
                        times[name].append(dt)
                    else:
                        firsts[name] = dt
                    if name == "dcp.save":
                        shutil.rmtree(root / f"dcp{r}", ignore_errors=True)
                    elif name == "torch.save":
                        (root / "ts.pt").unlink()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: H.med(v) for k, v in times.items()}
    size = f"{C.fmt_bytes(total)} in {len(tensors)} tensors" + (f" ({why})" if why else "")
    note = (f"{size}; root on {'tmpfs' if use_shm else C.fs_type(base)}; first saves: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in firsts.items())
            + f"; later medians: torch.save {med['torch.save']:.2f} s")
    m, a = med["ckptstore"], med["dcp.save"]
    out.append(Line("f", "blocking save of a CUDA state: Store.save vs dcp.save (later saves)", dev.label,
                    f"{m:.2f} s", f"{a:.2f} s", f"{m / a:.2f}", "", note, value=m))
    return out


# --------------------------------------------------------------------------- main


CHECKS = {"a": "D2H bandwidth: StagingPool.stage vs pinned copy_",
          "b": "non-blocking save stall vs one pinned copy_",
          "c": "stale-save rule: fused AdamW / Adam / SGD",
          "d": "RNG restored bit for bit: CUDA generators",
          "e": "save every step to the memory tier: throughput vs no checkpointing",
          "f": "blocking save of a CUDA state vs dcp.save, and read back bit for bit"}


def run_rows(dev: Dev, sz: Sizes, only: str, base: Path, seed: int, sections: dict) -> list[Line]:
    lines: list[Line] = []

    def attempt(row: str, fn: Callable[[], Iterable[Line]], check: str | None = None) -> None:
        t0 = perf()
        print(f"[{row}] {check or ''} on {dev.label} ...", file=sys.stderr, flush=True)
        try:
            lines.extend(fn())
        except Exception as e:  # noqa: BLE001 - one row's failure is a table entry
            lines.append(failed_line(row, check or CHECKS[row], dev, e))
        dev.release()              # the row's tensors, stores and pinned buffers are gone with its frame
        print(f"[{row}] {perf() - t0:.1f} s", file=sys.stderr, flush=True)
    if "a" in only:
        attempt("a", lambda: row_a(dev, sz, seed, sections))
    if "b" in only:
        attempt("b", lambda: row_b(dev, sz, seed, base, sections))
    if "c" in only:
        for name in OPTIMIZERS:
            attempt("c", lambda name=name: [stale_save(dev, sz, name, base, seed)],
                    stale_check(name, sz))
    if "d" in only:
        attempt("d", lambda: [rng_check(dev, base, seed)])
    if "e" in only:
        attempt("e", lambda: row_e(dev, sz, base, seed, sections))
    if "f" in only:
        attempt("f", lambda: row_f(dev, sz, base, seed))
    return lines


def no_cuda_reason(args) -> str | None:
    if args.cpu:
        return "--cpu given"
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return f"torch.cuda.is_available() is False (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})"


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, repeat=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (seconds), also on a GPU")
    ap.add_argument("--cpu", action="store_true", help="run the CPU rows even where CUDA is (the smoke test's path)")
    ap.add_argument("--only", default=ROWS, help="rows to run, e.g. a,b (default all: abcde)")
    ap.add_argument("--repeat", type=int, default=None, help="alternated repeats of (a), (b), (e); default 5 (2 smoke)")
    ap.add_argument("--state-gb", type=float, default=None,
                    help="(b) state size in GiB (default 16; 32 MiB smoke), scaled down to what fits")
    ap.add_argument("--copy-gb", type=float, default=None, help="(a) bytes copied in GiB (default 2; 16 MiB smoke)")
    ap.add_argument("--blocking-gb", type=float, default=None, help="(f) state size in GiB (default 4; 32 MiB smoke)")
    ap.add_argument("--step-ms", type=float, default=None, help="(e) step time to calibrate to (default 50 ms)")
    args = ap.parse_args(argv)
    only = "".join(c for c in args.only.lower() if c in ROWS)
    reason = no_cuda_reason(args)
    dev = Dev(cuda=reason is None)
    smoke = args.smoke or not dev.cuda
    sz = sizes(smoke, args)
    base = H.scratch_dir(args.dir, warn_tmpfs=False)
    print(H.banner(device=dev.name, sizes="smoke" if smoke else "full"), flush=True)
    t_all = perf()
    sections: dict[str, H.Results] = {}
    lines = run_rows(dev, sz, only, base, args.seed, sections)
    if not dev.cuda:
        for row in only:
            lines.append(Line(row, CHECKS[row], "cuda", result=f"skipped: no CUDA device ({reason})"))
    print()
    print(table(lines))
    fails = [ln for ln in lines if ln.result == "FAIL"]
    errors = [ln for ln in lines if ln.result.startswith("n/a")]
    print(f"\nratio: median seconds over the anchor's (> 1: slower than the anchor); (e): steps/s with the memory "
          f"tier over steps/s without (1.0: free). {len(fails)} FAIL, {len(errors)} n/a; "
          f"total {perf() - t_all:.0f} s")
    H.write_json(args.json, args, device=dev.name, sizes=asdict(sz), rows=[asdict(ln) for ln in lines], **sections)
    return 1 if fails else 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
