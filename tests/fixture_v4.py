"""The values of the format-4 fixture store in ``tests/fixtures/v4_store``: the first format with the planes codec
(issue 30), written by ckptstore 0.1.0 at commit be6c20e with ``Writing(codec="auto", chunk_size=16384)`` and
``Packing(threshold=8192, target_size=65536)``, so that it holds planes frames (version 1) both as blobs
(``objects/*.bpl``) and inside a pack, zstd and raw chunks beside them. Deterministic: the fixture test rebuilds
the values here and compares bit for bit. Regenerate only if the format's writer must change (it must not:
readers keep reading this store):

    PYTHONPATH=. python tests/fixture_v4.py tests/fixtures/v4_store
"""
import sys

import numpy as np
import torch

WRITING = {"codec": "auto", "chunk_size": 16384}
PACKING = {"threshold": 8192, "target_size": 65536}


def fixture_state(step: int):
    g = torch.Generator().manual_seed(4321)
    frozen = torch.randn(64, 40, generator=g) * 0.02                     # 10240 B: a planes blob, both steps
    moving = torch.randn(3000, generator=g) * 0.02 * step               # 12000 B: a planes blob per step
    small = torch.randn(700, generator=g) * 1e-3 * step                 # 2800 B: a planes chunk in a pack
    return {
        "model": {"frozen": frozen, "moving": moving, "small": small,
                  "half": (torch.randn(2500, generator=g) * step).to(torch.float16),       # 5000 B, packed
                  "bf16": (torch.randn(3000, generator=g) * 0.1).to(torch.bfloat16),       # 6000 B, packed
                  "f64": torch.randn(600, generator=g, dtype=torch.float64) * step,        # 4800 B, packed
                  "ids": torch.arange(3000, dtype=torch.int64) % 7,                        # 24000 B: a zstd blob + a packed chunk
                  "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 4)},
        "optimizer": {"exp_avg_sq": (torch.rand(2048, generator=g) * 1e-6 * step)},        # 8192 B: a blob
        "np": {"arr": np.arange(12, dtype=np.float32).reshape(3, 4) * step},
        "progress": {"step": step, "name": "fixture-v4", "lr": 0.1 / (step + 1)},
    }


def write(root: str) -> None:
    from ckptstore import Store, Writing
    from ckptstore.format.packs import Packing
    with Store(root, writing=Writing(**WRITING, packing=Packing(**PACKING))) as s:
        for step in (1, 2):
            s.save(fixture_state(step), step, metrics={"loss": 2.5 / step})


if __name__ == "__main__":
    write(sys.argv[1])
