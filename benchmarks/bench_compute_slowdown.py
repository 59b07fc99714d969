#!/usr/bin/env python
"""How much does a background checkpoint slow the training loop down?

A matmul loop stands in for training compute. Its throughput (iterations/s over a fixed wall time) is
measured alone, then while checkpoints of the benchmark state are saved back-to-back (or every --interval s)
by each mode; the time the loop spends inside the save call (the stall) is part of the window, as it would
be in training. The compute-alone window runs again after each mode (drift check); it is the anchor.

    python benchmarks/bench_compute_slowdown.py --size small --seconds 10

Modes (--modes): ckptstore_nb (Store.save(..., blocking=False)), dcp_async (torch.distributed.checkpoint
.async_save), and two blocking references: torch_save (torch.save+fsync) and ckptstore (Store.save blocking).
Every save goes to a fresh folder / fresh store, so no save is cheaper thanks to dedup; except mode
ckptstore_nb_reused, which keeps one store for the run as training does (staging buffers reused) and
changes every tensor before each save so all bytes are written again.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import torch  # noqa: E402

C.quiet_dcp()
ALONE = "compute alone"


class Modes:
    """Each mode: ``start(folder) -> (handle with done()/result() or None when the save is done, cleanup)``."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.model, self.opt = model, opt
        self.state = {"model": model, "optimizer": opt}
        self.reused = None

    def torch_save(self, folder: Path):
        C.torch_save_fsync({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, folder / "ckpt.pt")
        return None, None

    def dcp_async(self, folder: Path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter
        fut = dcp.async_save(self.state, storage_writer=FileSystemWriter(folder), no_dist=True)
        return getattr(fut, "upload_completion", fut), None

    def ckptstore(self, folder: Path, blocking: bool = True):
        from ckptstore import Store
        store = Store(str(folder))
        h = store.save(self.state, 1, blocking=blocking)
        return (None if blocking else h), store.close

    def ckptstore_nb_reused(self, folder: Path):
        """What a training loop does: one Store for the whole run (staging buffers allocated once), and every
        tensor changed before each save (one element each, so every tensor's bytes are written again)."""
        from ckptstore import Retention, Store
        if self.reused is None:
            self.reused = [Store(str(folder.parent / "slow_reused_store"), keep=Retention(last=2)), 0]
        with torch.no_grad():
            for t in C.state_tensors(self.model, self.opt):
                t.view(-1)[:1].add_(1.0)
        self.reused[1] += 1
        return self.reused[0].save(self.state, self.reused[1], blocking=False), None

    def get(self, key: str) -> tuple[str, Callable]:
        return {"ckptstore_nb": ("ckptstore blocking=False", lambda f: self.ckptstore(f, blocking=False)),
                "ckptstore_nb_reused": ("ckptstore blocking=False, one store", self.ckptstore_nb_reused),
                "dcp_async": ("dcp.async_save", self.dcp_async), "torch_save": ("torch_save (blocking)", self.torch_save),
                "ckptstore": ("ckptstore (blocking)", self.ckptstore)}[key]


MODES = ("ckptstore_nb", "ckptstore_nb_reused", "dcp_async", "torch_save", "ckptstore")


def matmul_loop(seconds: float, n: int, tick: Callable[[], None] | None = None) -> dict[str, Any]:
    torch.manual_seed(0)
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)
    iters, t0 = 0, time.perf_counter()
    while (el := time.perf_counter() - t0) < seconds:
        torch.mm(a, b, out=c)
        iters += 1
        if tick is not None:
            tick()
    return {"seconds": el, "iters": iters, "rate": iters / el}


def run_mode(start: Callable, base: Path, seconds: float, n: int, interval: float) -> dict[str, Any]:
    """Matmul loop for ``seconds`` while saves run; a new save starts when the previous one is done and
    ``interval`` s have passed since it started. The save in flight when the window ends is waited for outside
    it (and not counted); the folders are deleted after the window (ext4 discard is slow)."""
    s: dict[str, Any] = {"handle": None, "cleanup": None, "started": -1e9, "stalls": [], "totals": [], "busy": False}
    folders: list[Path] = []

    def reap(wait: bool) -> None:
        if not s["busy"] or not (wait or s["handle"] is None or s["handle"].done()):
            return
        if s["handle"] is not None:
            s["handle"].result()
        if s["cleanup"] is not None:
            s["cleanup"]()
        s["totals"].append(time.perf_counter() - s["started"])
        s["busy"] = False

    def tick() -> None:
        reap(wait=False)
        if not s["busy"] and time.perf_counter() - s["started"] >= interval:
            folders.append(C.fresh_dir(base, f"slow_{len(folders):03d}_"))
            t0 = time.perf_counter()
            s["handle"], s["cleanup"] = start(folders[-1])
            s["stalls"].append(time.perf_counter() - t0)
            s["started"], s["busy"] = t0, True

    try:
        out = matmul_loop(seconds, n, tick)
        reap(wait=True)
    finally:
        for f in folders:
            C.rmtree(f)
    return dict(out, saves_started=len(s["stalls"]), saves_done=len(s["totals"]),
                stall_mean=statistics.mean(s["stalls"]) if s["stalls"] else None,
                stall_pct=100 * sum(s["stalls"]) / out["seconds"],
                save_total=statistics.median(s["totals"]) if s["totals"] else None)


def main(argv: list[str] | None = None) -> int:
    ap = H.parser(__doc__, repeat=1, sizes=C.SIZES, size="small")
    ap.add_argument("--seconds", type=float, default=10.0, help="wall time of each window")
    ap.add_argument("--matmul", type=int, default=1024, help="square matmul size")
    ap.add_argument("--interval", type=float, default=0.0, help="min seconds between save starts (0 = back-to-back)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"from {','.join(MODES)}")
    args = ap.parse_args(argv)
    base = H.scratch_dir(args.dir)
    model, opt = C.build_state(args.size, seed=args.seed)
    state_bytes = sum(C.nbytes(t) for t in C.state_tensors(model, opt))
    print(H.banner(state=f"{args.size} = {C.gb(state_bytes)}", matmul=f"{args.matmul}^2 fp32",
                   window=f"{args.seconds:.0f} s", dir=f"{base} ({C.fs_type(base)})"), flush=True)
    matmul_loop(1.0, args.matmul)  # warm-up
    modes, alone = Modes(model, opt), H.Contender(ALONE, lambda: matmul_loop(args.seconds, args.matmul))
    contenders = [alone]
    for key in (m.strip() for m in args.modes.split(",") if m.strip()):
        label, start = modes.get(key)
        contenders += [H.Contender(label, lambda start=start: run_mode(start, base, args.seconds, args.matmul,
                                                                        args.interval)), alone]
    res = H.compare(contenders, args.repeat)
    if modes.reused is not None:
        modes.reused[0].close()
    cols = [("slowdown", lambda r: f"{100 * (1 - r.median('rate') / res.rows[ALONE].median('rate')):.1f}%"
             if r.name != ALONE else "-"),
            ("saves done", lambda r: f"{sum(r.values('saves_done'))}/{sum(r.values('saves_started'))}"
             if r.name != ALONE else ""),
            ("stall mean s", lambda r: f"{r.median('stall_mean'):.3f}" if r.values("stall_mean") else ""),
            ("stall % of window", lambda r: f"{r.median('stall_pct'):.0f}%" if r.values("stall_pct") else ""),
            ("save total s", lambda r: f"{r.median('save_total'):.2f}" if r.values("save_total") else "")]
    print("\n" + res.table(key="rate", unit="it/s", fmt="{:.2f}", ratios={"x alone": ALONE}, columns=cols,
                           head="mode"))
    print(f"\nslowdown = 1 - it/s during saves / median it/s alone ({len(res.rows[ALONE].samples)} windows: one "
          "before and one after each mode). The save still in flight when a window ends is waited for outside the "
          "window.")
    H.write_json(args.json, args, state_bytes=state_bytes, rows=res.to_json({"x alone": ALONE}, key="rate"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
