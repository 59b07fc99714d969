"""Which default codec for new blobs: raw vs zstd (levels 1 and 3), on one state, in one run.

    .venv/bin/python benchmarks/bench_codec.py --size 1gb [--repeat 2] [--dir ../bench_tmp]

For each codec: a blocking ``Store.save`` into a fresh store (seconds, bytes written, ratio to the raw bytes),
then a cold ``Store.load`` (files evicted from the page cache first). The state is the fp32 GPT + AdamW of
benchmarks/common.py, plus the same weights cast to bfloat16 (what a bf16 run saves), reported separately.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from ckptstore import Store, Writing  # noqa: E402


def run(state, codec, level, base: Path, repeat: int):
    saves, loads, written = [], [], 0
    for _ in range(repeat):
        d = C.fresh_dir(base, f"codec_{codec}{level}_")
        try:
            with Store(d, writing=Writing(codec=codec, zstd_level=level)) as s:
                t0 = time.perf_counter()
                r = s.save(state, 1)
                saves.append(time.perf_counter() - t0)
                written = r.bytes_written
                C.evict(d)
                t0 = time.perf_counter()
                s.load(1)
                loads.append(time.perf_counter() - t0)
        finally:
            C.rmtree(d)
    return statistics.median(saves), statistics.median(loads), written


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1gb", choices=["small", "1gb", "3gb"])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=str(C.default_bench_dir()))
    args = ap.parse_args()
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    model, opt = C.build_state(args.size)
    states = {"fp32 model+AdamW": {"model": model, "optimizer": opt},
              "bf16 weights": {"model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}}}
    print(f"torch {torch.__version__}; size {args.size}; {args.repeat} repeats, medians; dir {base}")
    print(f"{'state':18} {'codec':8} {'save s':>8} {'GB/s':>6} {'written/raw':>12} {'cold load s':>12}")
    for name, state in states.items():
        total = sum(C.nbytes(t) for t in C.tree_tensors({k: (v.state_dict() if hasattr(v, 'state_dict') else v)
                                                           for k, v in state.items()}))
        for codec, level in (("raw", 1), ("zstd", 1), ("zstd", 3)):
            save_s, load_s, written = run(state, codec, level, base, args.repeat)
            label = codec if codec == "raw" else f"zstd-{level}"
            print(f"{name:18} {label:8} {save_s:8.2f} {total / save_s / 1e9:6.2f} {written / total:12.3f} "
                  f"{load_s:12.2f}")


if __name__ == "__main__":
    main()
