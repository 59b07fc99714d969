#!/usr/bin/env python
"""Pack-threshold sweep (issue 8): ckptstore save / cold load and files per step for several
``Packing(threshold=...)`` values, against torch.save / torch.load of the same state, in one run.

    python benchmarks/bench_pack_threshold.py --state small --repeat 3
    python benchmarks/bench_pack_threshold.py --state gpt1gb --repeat 2 --thresholds 1m,4m,16m

The states and their options are bench_packs.py's (``--state small|gpt1gb|gpt3gb``, ``--n-tensors`` ...).
Contenders, alternated, each into a fresh folder deleted afterwards: ``torch.save`` + fsync / ``torch.load``
(bench_save.case_torch) and, per threshold T, ``Store(root, writing=Writing(packing=Packing(threshold=T)))
.save(state, 1)`` (construction not timed) / evicted, ``Store(root).load(1)`` (construction timed)
(bench_packs.case_ckptstore). Files = every file under the store root after one save.
"""
from __future__ import annotations

import sys

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
from bench_packs import State, add_state_args, case_ckptstore, state_line  # noqa: E402
from bench_save import TORCH_COLD, TORCH_S, case_torch  # noqa: E402


def parse_size(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(s[-1:], 1)
    return int(float(s[:-1] if s[-1:] in "kmg" else s) * mult)


def main() -> int:
    ap = H.parser(__doc__, repeat=3, verify=True)
    add_state_args(ap)
    ap.add_argument("--thresholds", default="1m,4m,16m", help="comma list of Packing thresholds (k/m/g suffix)")
    ap.add_argument("--target-size", default="64m", help="Packing.target_size (raised to the largest threshold)")
    args = ap.parse_args()
    from ckptstore import Packing, Writing
    thresholds = [parse_size(x) for x in args.thresholds.split(",")]
    target = max(parse_size(args.target_size), max(thresholds))
    st = State(args)
    run_dir = C.fresh_dir(st.base, "bench-thr-")
    print(H.banner())
    print(state_line(st) + f"; target_size {target >> 20} MiB", flush=True)

    def contender(name, run, rows):
        return H.Contender(name, run, records=True, rows=rows, setup=lambda: C.fresh_dir(run_dir, "m-"),
                           teardown=C.rmtree)

    def threshold(t: int) -> H.Contender:
        rows = (f"ckptstore threshold {t / C.MiB:g} MiB save", f"ckptstore threshold {t / C.MiB:g} MiB load cold")
        writing = Writing(packing=Packing(threshold=t, target_size=target))
        return contender(f"threshold {t}", lambda res, d: case_ckptstore(res, st, d, writing, rows), rows)

    contenders = [contender("torch", lambda res, d: case_torch(res, st, d), (TORCH_S, TORCH_COLD))]
    contenders += [threshold(t) for t in thresholds]
    try:
        res = H.compare(contenders, args.repeat)
    finally:
        C.rmtree(run_dir)

    def files(area: str):
        return lambda r: str(r.samples[0]["files"].get(area, {}).get("files", 0)) if "files" in r.samples[0] else ""
    ratios = {"x torch": lambda r: TORCH_S if r.name.endswith("save") or r.name == TORCH_S else TORCH_COLD}
    print("\n" + res.table(ratios=ratios, columns=[("files/step", files("total")), ("packs", files("packs")),
                                                  ("objects", files("objects"))]))
    print(f"\nmedian of {args.repeat} (alternated); load includes Store(); files from a fresh store after one save. "
          f"load average now {H.environment()['loadavg']:.2f}")
    H.write_json(args.json, args, state_bytes=st.nbytes, thresholds=thresholds, target_size=target,
                 rows=res.to_json(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
