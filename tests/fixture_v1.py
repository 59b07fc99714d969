"""The values of the format-1 fixture store in ``tests/fixtures/v1_store`` (written by ckptstore 0.1.0, commit
8c7329f, the last format-1 writer). Deterministic: the fixture test rebuilds them here and compares bit for bit."""
import numpy as np
import torch


def fixture_state(step: int):
    g = torch.Generator().manual_seed(1234)
    frozen = torch.randn(64, 33, generator=g)                  # the same in both steps: shared blobs
    moving = torch.randn(3000, generator=g) * step             # 12000 bytes: 3 chunks of 4096+
    return {
        "model": {"frozen": frozen, "moving": moving, "bias": torch.arange(7, dtype=torch.bfloat16) * step,
                  "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 4),
                  "scalar": torch.tensor(step, dtype=torch.int64)},
        "np": {"arr": np.arange(12, dtype=np.int16).reshape(3, 4) * step, "s": np.float32(step / 3)},
        "progress": {"step": step, "name": "fixture", "lr": 0.1 / (step + 1), "big": 2 ** 70 + step,
                     "nested": [1, (2, 3), None, b"raw"]},
    }
