#!/usr/bin/env python
"""How much does a background checkpoint slow the training loop down?

A matmul loop stands in for training compute. Its throughput (iterations/s over a fixed
wall time) is measured alone, then while checkpoints of the benchmark state are saved
back-to-back (or every --interval s) by each mode; the time the loop spends inside the
save call (the stall) is part of the window, as it would be in training.

    python benchmarks/bench_compute_slowdown.py --size small --seconds 10

Modes (--modes): ckptstore_nb (Store.save(..., blocking=False), shown as n/a until the
API has it), dcp_async (torch.distributed.checkpoint.async_save), and two blocking
references: torch_save (torch.save+fsync) and ckptstore (Store.save blocking).
Every save goes to a fresh folder / fresh store, so no save is cheaper thanks to dedup; except mode
ckptstore_nb_reused, which keeps one store for the run as training does (staging buffers reused) and
changes every tensor before each save so all bytes are written again.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import common as C  # noqa: E402
from ckptstore import Retention

warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")


class _Done:
    """Handle for a blocking save: already finished."""

    def __init__(self, value: Any = None):
        self.value = value

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        return self.value


class Mode:
    """start(folder) -> handle with done()/result(); cleanup() after the window."""

    name = "?"

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer):
        self.model, self.opt = model, opt

    def check(self) -> None:  # raise if unavailable
        pass

    def start(self, folder: Path) -> Any:
        raise NotImplementedError

    def finish(self, handle: Any) -> None:
        pass


class TorchSave(Mode):
    name = "torch_save (blocking)"

    def start(self, folder: Path) -> Any:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "ckpt.pt", "wb") as fh:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        return _Done()


class DcpAsync(Mode):
    name = "dcp.async_save"

    def check(self) -> None:
        import torch.distributed.checkpoint as dcp

        if not hasattr(dcp, "async_save"):
            raise AttributeError("torch.distributed.checkpoint has no async_save")

    def start(self, folder: Path) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        fut = dcp.async_save({"model": self.model, "optimizer": self.opt},
                             storage_writer=FileSystemWriter(folder), no_dist=True)
        return getattr(fut, "upload_completion", fut)


class _StoreMode(Mode):
    def check(self) -> None:
        from ckptstore import Store  # noqa: F401

    def _open(self, folder: Path) -> Any:
        from ckptstore import Store

        return Store(str(folder))

    def _track(self, handle: Any, store: Any) -> Any:
        self.__dict__.setdefault("_stores", {})[id(handle)] = store
        return handle

    def finish(self, handle: Any) -> None:
        store = self.__dict__.get("_stores", {}).pop(id(handle), None)
        if store is not None and callable(getattr(store, "close", None)):
            store.close()


class CkptstoreBlocking(_StoreMode):
    name = "ckptstore (blocking)"

    def start(self, folder: Path) -> Any:
        store = self._open(folder)
        return self._track(_Done(store.save({"model": self.model, "optimizer": self.opt}, 1)), store)


class CkptstoreNonBlocking(_StoreMode):
    name = "ckptstore blocking=False"

    def check(self) -> None:
        from ckptstore import Store

        params = inspect.signature(Store.save).parameters
        if "blocking" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise NotImplementedError("Store.save has no blocking= parameter yet")

    def start(self, folder: Path) -> Any:
        store = self._open(folder)
        h = store.save({"model": self.model, "optimizer": self.opt}, 1, blocking=False)
        return self._track(h, store)


class CkptstoreNonBlockingReused(CkptstoreNonBlocking):
    """What a training loop does: one Store for the whole run (staging buffers allocated once), and every
    tensor changed before each save (one element each, so every tensor's bytes are written again)."""
    name = "ckptstore blocking=False, one store"

    def start(self, folder: Path) -> Any:
        if getattr(self, "_store", None) is None:
            from ckptstore import Store
            self._store = Store(str(folder.parent / "slow_reused_store"), keep=Retention(last=2))
            self._step = 0
        with torch.no_grad():
            for t in C.state_tensors(self.model, self.opt):
                t.view(-1)[:1].add_(1.0)
        self._step += 1
        return self._store.save({"model": self.model, "optimizer": self.opt}, self._step, blocking=False)

    def finish(self, handle: Any) -> None:
        handle.result()


MODES: dict[str, type[Mode]] = {
    "ckptstore_nb": CkptstoreNonBlocking,
    "ckptstore_nb_reused": CkptstoreNonBlockingReused,
    "dcp_async": DcpAsync,
    "torch_save": TorchSave,
    "ckptstore": CkptstoreBlocking,
}


def matmul_loop(seconds: float, n: int, tick: Callable[[], None] | None = None) -> tuple[int, float]:
    torch.manual_seed(0)
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    iters = 0
    t0 = time.perf_counter()
    while True:
        el = time.perf_counter() - t0
        if el >= seconds:
            return iters, el
        torch.mm(a, b, out=c)
        iters += 1
        if tick is not None:
            tick()


def run_mode(mode: Mode, base: Path, seconds: float, n: int, interval: float) -> dict[str, Any]:
    """Matmul loop for `seconds` while saves run; a new save starts when the previous one
    is done and `interval` s have passed since it started."""
    state: dict[str, Any] = {"handle": None, "started": -1e9, "stalls": [], "totals": [],
                             "k": 0, "error": None, "folder": None}
    done_folders: list[Path] = []

    def new_folder() -> Path:
        state["k"] += 1
        return C.fresh_dir(base, f"slow_{state['k']:03d}_")

    def reap(wait: bool) -> None:
        h = state["handle"]
        if h is None or not (wait or h.done()):
            return
        h.result()
        mode.finish(h)
        state["totals"].append(time.perf_counter() - state["started"])
        done_folders.append(state["folder"])  # deleted after the window (ext4 discard is slow)
        state["handle"] = None

    def tick() -> None:
        if state["error"] is not None:
            return
        try:
            reap(wait=False)
            now = time.perf_counter()
            if state["handle"] is None and now - state["started"] >= interval:
                state["folder"] = new_folder()
                t0 = time.perf_counter()
                h = mode.start(state["folder"])
                state["stalls"].append(time.perf_counter() - t0)
                state["started"] = t0
                state["handle"] = h
        except Exception as e:  # noqa: BLE001
            state["error"] = e
            if os.environ.get("BENCH_DEBUG"):
                traceback.print_exc()

    iters, el = matmul_loop(seconds, n, tick)
    tail = time.perf_counter()
    try:
        reap(wait=True)  # the save in flight at the end of the window is not counted
    except Exception as e:  # noqa: BLE001
        state["error"] = state["error"] or e
    for folder in done_folders + ([state["folder"]] if state["folder"] is not None else []):
        C.rmtree(folder)
    return {"iters": iters, "seconds": el, "rate": iters / el,
            "saves_started": len(state["stalls"]), "saves_done": len(state["totals"]),
            "stall_mean": statistics.mean(state["stalls"]) if state["stalls"] else None,
            "stall_sum": sum(state["stalls"]), "save_total_median":
                statistics.median(state["totals"]) if state["totals"] else None,
            "drain_s": time.perf_counter() - tail,
            "error": C.fmt_note(state["error"]) if state["error"] else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=list(C.SIZES), default="small")
    ap.add_argument("--seconds", type=float, default=10.0, help="wall time of each window")
    ap.add_argument("--matmul", type=int, default=1024, help="square matmul size")
    ap.add_argument("--interval", type=float, default=0.0,
                    help="min seconds between save starts (0 = back-to-back)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"from {','.join(MODES)}")
    ap.add_argument("--dir", default=str(C.default_bench_dir()))
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    model, opt = C.build_state(args.size)
    state_bytes = sum(C.nbytes(t) for t in C.state_tensors(model, opt))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; state {args.size} = "
          f"{C.gb(state_bytes)}; matmul {args.matmul}^2 fp32; window {args.seconds:.0f} s; "
          f"dir {base} ({C.fs_type(base)})", flush=True)

    matmul_loop(1.0, args.matmul)  # warm-up
    results: list[dict[str, Any]] = []
    alone = [matmul_loop(args.seconds, args.matmul)]
    for key in [m.strip() for m in args.modes.split(",") if m.strip()]:
        mode = MODES[key](model, opt)
        try:
            mode.check()
        except Exception as e:  # noqa: BLE001
            results.append({"mode": mode.name, "error": "n/a: " + C.fmt_note(e)})
            continue
        print(f"  {mode.name} ...", file=sys.stderr, flush=True)
        r = run_mode(mode, base, args.seconds, args.matmul, args.interval)
        r["mode"] = mode.name
        results.append(r)
        gc.collect()
        alone.append(matmul_loop(args.seconds, args.matmul))  # re-measure: drift check
    rates = [i / s for i, s in alone]
    base_rate = statistics.median(rates)

    head = ["mode", "it/s", "slowdown", "saves done", "stall mean s", "stall % of window",
            "save total s", "note"]
    lines = [["compute alone", f"{base_rate:.2f}", "-", "", "", "", "",
              f"{len(rates)} windows, {min(rates):.2f}-{max(rates):.2f} it/s"]]
    for r in results:
        if "rate" not in r:
            lines.append([r["mode"], "n/a", "n/a", "", "", "", "", r["error"]])
            continue
        r["slowdown_pct"] = 100.0 * (1 - r["rate"] / base_rate)
        lines.append([
            r["mode"], f"{r['rate']:.2f}", f"{r['slowdown_pct']:.1f}%",
            f"{r['saves_done']}/{r['saves_started']}",
            f"{r['stall_mean']:.3f}" if r["stall_mean"] is not None else "n/a",
            f"{100 * r['stall_sum'] / r['seconds']:.0f}%",
            f"{r['save_total_median']:.2f}" if r["save_total_median"] is not None else "n/a",
            r["error"] or "",
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines)]
    print()
    for i, row in enumerate([head] + lines):
        print("  ".join(str(c).ljust(w) if j in (0, len(row) - 1) else str(c).rjust(w)
                        for j, (c, w) in enumerate(zip(row, widths))).rstrip())
        if i == 0:
            print("-" * sum(widths + [2 * (len(widths) - 1)]))
    print("\nslowdown = 1 - it/s during saves / median it/s alone. The save still in flight "
          "when a window ends is waited for outside the window.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "state_bytes": state_bytes, "alone_rates": rates,
                       "results": results, "args": vars(args)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
