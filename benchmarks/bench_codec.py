#!/usr/bin/env python
"""Which default codec for new blobs: raw vs zstd (levels 1 and 3), on one state, in one run.

    .venv/bin/python benchmarks/bench_codec.py --size 1gb [--repeat 2] [--dir ../bench_tmp]

Contenders, alternated, per state: a blocking ``Store(writing=Writing(codec=...)).save`` into a fresh store
(seconds, bytes written, ratio to the raw bytes), then a cold ``Store.load`` (files evicted from the page cache
first). The states are the fp32 GPT + AdamW of benchmarks/common.py and the same weights cast to bfloat16
(what a bf16 run saves). Ratios are against codec raw.
"""
from __future__ import annotations

import sys

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import common as C  # noqa: E402
import torch  # noqa: E402

CODECS = (("raw", 1), ("zstd", 1), ("zstd", 3))


def contender(state_name: str, state, codec: str, level: int, base) -> H.Contender:
    label = f"{state_name}, {codec if codec == 'raw' else f'zstd-{level}'}"

    def run(res: H.Results, d) -> None:
        from ckptstore import Store, Writing
        with Store(d, writing=Writing(codec=codec, zstd_level=level)) as s:
            with res.timed(f"{label} save") as m:
                r = s.save(state, 1)
            m["bytes"] = r.bytes_written
            C.evict(d)
            with res.timed(f"{label} load cold"):
                s.load(1)
    return H.Contender(label, run, records=True, rows=(f"{label} save", f"{label} load cold"),
                       setup=lambda: C.fresh_dir(base, f"codec_{codec}{level}_"), teardown=C.rmtree)


def main() -> int:
    args = H.parser(__doc__, repeat=2, sizes=C.SIZES, size="1gb").parse_args()
    base = H.scratch_dir(args.dir)
    model, opt = C.build_state(args.size, seed=args.seed)
    states = {"fp32 model+AdamW": {"model": model, "optimizer": opt},
              "bf16 weights": {"model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}}}
    total = {"fp32 model+AdamW": sum(C.nbytes(t) for t in C.state_tensors(model, opt)),
             "bf16 weights": sum(C.nbytes(t) for t in states["bf16 weights"]["model"].values())}
    print(H.banner(size=args.size, dir=base))
    res = H.compare([contender(n, st, c, lv, base) for n, st in states.items() for c, lv in CODECS], args.repeat)

    def state_of(r):
        return r.name.split(",")[0]
    cols = [("GB/s", lambda r: f"{total[state_of(r)] / r.median() / 1e9:.2f}"),
            ("written/raw", lambda r: f"{r.median('bytes') / total[state_of(r)]:.3f}" if r.values("bytes") else "")]
    ratios = {"x raw codec": lambda r: f"{state_of(r)}, raw " + ("load cold" if r.name.endswith("cold") else "save")}
    print("\n" + res.table(ratios=ratios, columns=cols, fmt="{:.2f}"))
    H.write_json(args.json, args, state_bytes=total, rows=res.to_json(ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
