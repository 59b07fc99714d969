#!/usr/bin/env python
"""Pack-threshold sweep (issue 8): ckptstore save / cold load and files per step for several
``Packing(threshold=...)`` values, against torch.save / torch.load of the same state, in one run.

    python benchmarks/bench_pack_threshold.py --state small --repeat 3
    python benchmarks/bench_pack_threshold.py --state gpt1gb --repeat 2 --thresholds 1m,4m,16m

The states are bench_packs.py's (``--state small|gpt1gb|gpt3gb`` and its small-state options). Each
repeat runs every method once, in rotated order, each into a fresh folder deleted afterwards. Save:
``Store(root, packing=Packing(threshold=T)).save(state, 1)`` (Store construction not timed) vs
``torch.save`` + fsync. Load: files evicted from the page cache, then ``Store(root).load(1)`` (construction
timed) vs ``torch.load(weights_only=True)``. Files = every file under the store root after one save.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import bench_packs as BP  # noqa: E402
import common as C  # noqa: E402
from ckptstore import Writing

MiB = C.MiB


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "kmg" else s) * mult)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--thresholds", default="1m,4m,16m", help="comma list of Packing thresholds (k/m/g suffix)")
    ap.add_argument("--target-size", default="64m", help="Packing.target_size")
    args, rest = ap.parse_known_args()
    pargs = BP.parse_args(rest)                          # --state, --repeat, --dir, --seed, small-state options
    thresholds = [parse_size(x) for x in args.thresholds.split(",")]
    target = max(parse_size(args.target_size), max(thresholds))
    from ckptstore import Packing, Store
    st = BP.State(pargs)
    base = C.fresh_dir(Path(pargs.dir).resolve(), "bench-thr-")
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}")
    print(f"state {pargs.state}: {st.desc}; {st.nbytes / MiB:.1f} MiB in {st.n_tensors} tensors "
          f"(median {st.sizes[len(st.sizes) // 2]} B, max {st.sizes[-1]} B); target_size {target >> 20} MiB",
          flush=True)
    methods = ["torch"] + [f"thr {t}" for t in thresholds]
    save_s: dict = {m: [] for m in methods}
    load_s: dict = {m: [] for m in methods}
    files: dict = {}
    wrong: set = set()
    t_all = time.perf_counter()
    try:
        for rep in range(pargs.repeat):
            order = methods[rep % len(methods):] + methods[:rep % len(methods)]
            for m in order:
                d = C.fresh_dir(base, "m-")
                try:
                    if m == "torch":
                        f = d / "ckpt.pt"
                        t0 = time.perf_counter()
                        with open(f, "wb") as fh:
                            torch.save(st.torch_obj(), fh)
                            fh.flush()
                            os.fsync(fh.fileno())
                        C.fsync_path(d)
                        save_s[m].append(time.perf_counter() - t0)
                        files[m] = {"files": 1, "bytes": f.stat().st_size}
                        C.evict(f)
                        t0 = time.perf_counter()
                        out = torch.load(f, weights_only=True, map_location="cpu")
                        load_s[m].append(time.perf_counter() - t0)
                    else:
                        thr = int(m.split()[1])
                        root = d / "store"
                        store = Store(str(root), writing=Writing(packing=Packing(threshold=thr, target_size=target)))
                        t0 = time.perf_counter()
                        store.save(st.store_state, 1)
                        save_s[m].append(time.perf_counter() - t0)
                        store.close()
                        fc = BP.count_files(root, 1)
                        files[m] = {"files": fc["total"]["files"], "bytes": fc["total"]["bytes"],
                                    "packs": fc.get("packs", {}).get("files", 0),
                                    "objects": fc.get("objects", {}).get("files", 0)}
                        C.evict(root)
                        t0 = time.perf_counter()
                        store = Store(str(root))
                        out = store.load(1, map_location="cpu")
                        load_s[m].append(time.perf_counter() - t0)
                        store.close()
                    if rep == 0 and pargs.verify and not st.tree_ok(out):
                        wrong.add(m)
                    del out
                finally:
                    C.rmtree(d)
                    gc.collect()
            print(f"  repeat {rep + 1}/{pargs.repeat} done, {time.perf_counter() - t_all:.0f} s", file=sys.stderr,
                  flush=True)
    finally:
        C.rmtree(base)
    med = statistics.median
    rows = [["method", "save s", "min-max", "x torch", "load cold s", "min-max", "x torch", "files/step",
             "packs", "objects", "note"]]
    for m in methods:
        name = "torch.save / torch.load" if m == "torch" else f"ckptstore threshold {int(m.split()[1]) / MiB:g} MiB"
        rows.append([name, f"{med(save_s[m]):.3f}", f"{min(save_s[m]):.3f}-{max(save_s[m]):.3f}",
                     f"{med(save_s[m]) / med(save_s['torch']):.2f}",
                     f"{med(load_s[m]):.3f}", f"{min(load_s[m]):.3f}-{max(load_s[m]):.3f}",
                     f"{med(load_s[m]) / med(load_s['torch']):.2f}", str(files[m]["files"]),
                     str(files[m].get("packs", "")), str(files[m].get("objects", "")),
                     "WRONG DATA" if m in wrong else ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) if j in (0, len(r) - 1) else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("-" * (sum(widths) + 2 * len(widths)))
    print(f"\nmedian of {pargs.repeat} (round-robin, rotated order); load includes Store(); files from a "
          f"fresh store after one save. total {time.perf_counter() - t_all:.0f} s; load average now "
          f"{os.getloadavg()[0]:.2f}")
    if pargs.json:
        Path(pargs.json).write_text(json.dumps({"state": pargs.state, "state_bytes": st.nbytes,
                                                "thresholds": thresholds, "target_size": target,
                                                "save_s": save_s, "load_s": load_s, "files": files,
                                                "wrong": sorted(wrong)}, indent=1))
        print(f"wrote {pargs.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
