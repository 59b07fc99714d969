#!/usr/bin/env python
"""accelerate checkpointing (issue 28 goal 1): ``Accelerator.save_state`` vs a ckptstore ``Store`` with the
:func:`ckptstore.integrations.accelerate.accelerator_state` recipe, in a real DDP training loop, one run.

``--world`` ranks (default 2) launched like torchrun (gloo on 127.0.0.1, ``Accelerator(cpu=True)``: DDP), an MLP
(``--layers`` x ``--width``, torch's default AdamW, a LinearLR scheduler) trained ``--steps`` steps, a save after
every step. Per repeat every mode starts from a new folder, so its first save goes into a new store and the
others into a used one (every tensor changed by the step between). Modes, alternated inside the ranks:

- ``save_state``: ``accelerator.save_state(<dir>/step_N)`` (rank 0 writes the model as safetensors, the optimizer
  and scheduler with torch.save, every rank its RNG states; nothing is fsynced);
- ``save_state+sync``: the same, then ``os.sync()`` on every rank (its durable cost; ckptstore's saves are durable
  when they return);
- ``ckptstore``: ``store.save(state, step)`` (blocking: every rank's chunks, manifest and the commit written);
- ``ckptstore non-blocking``: ``store.save(state, step, blocking=False)`` (the recipe's: training waits for the
  copy of the changed tensors, and for the previous save when it is still running); ``store.close()`` at the
  end of the loop is timed apart (``close s``).

A save's seconds are the slowest rank's (what the next collective waits for). Rows: the first save and the median
of the others, per mode; ratios against ``save_state`` of the same row. Run by hand (one benchmark at a time):

    PYTHONPATH=. python benchmarks/bench_accelerate.py [--repeat 5] [--steps 8] [--width 256] [--layers 4]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness as H  # noqa: E402  (puts the checkout and tests/ on sys.path)

MODES = ("save_state", "save_state+sync", "ckptstore", "ckptstore non-blocking")


def rank_run(cfg: dict, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
    from torch.utils.data import DataLoader, TensorDataset

    from ckptstore import Store
    from ckptstore.integrations.accelerate import accelerator_state, replicated_keys

    set_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    w = cfg["width"]
    layers = [nn.Linear(16, w), nn.ReLU()]
    for _ in range(cfg["layers"] - 2):
        layers += [nn.Linear(w, w), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(w, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=10_000)
    g = torch.Generator().manual_seed(1)
    n = 8 * world * (cfg["steps"] + 2)
    data = TensorDataset(torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g))
    dl = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator())
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    n_params = sum(p.numel() for p in model.parameters())
    base = Path(cfg["dir"])
    samples: dict = {}
    for rep, mode in H.alternated(MODES, cfg["repeat"]):
        folder = base / f"{mode.replace(' ', '_')}_{rep}"
        store = state = replicated = None
        if mode.startswith("ckptstore"):
            store = Store(str(folder))
            state = accelerator_state(acc, progress={"step": 0})
            replicated = replicated_keys(acc, state)
        stalls, phases, it = [], [], iter(dl)
        dist.barrier()
        for step in range(1, cfg["steps"] + 1):
            x, y = next(it)
            loss = nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            dist.barrier()                          # every rank starts the save together
            t0 = time.perf_counter()
            if mode.startswith("save_state"):
                acc.save_state(str(folder / f"step_{step}"))
                if mode.endswith("+sync"):
                    os.sync()
            else:
                state["progress"]["step"] = step
                r = store.save(state, step, blocking=(mode == "ckptstore"), replicated=replicated)
                if mode == "ckptstore":
                    phases.append(r.phases)
            stalls.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        if store is not None:
            store.close()
        closing = time.perf_counter() - t0
        dist.barrier()
        samples.setdefault(mode, []).append({"stalls": stalls, "close": closing, "phases": phases})
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
    return {"rank": rank, "samples": samples, "params": n_params}


def main() -> None:
    p = H.parser(__doc__, repeat=5, scratch=True, seed=False)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank-cfg", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank_cfg:
        H.rank_main(lambda rank, world: rank_run(json.loads(a.rank_cfg), rank, world))
        return
    work = Path(tempfile.mkdtemp(prefix="bench_accelerate_", dir=H.scratch_dir(a.dir)))
    try:
        cfg = dict(dir=str(work), repeat=a.repeat, steps=a.steps, width=a.width, layers=a.layers)
        ranks = H.launch(a.world, __file__, "--rank-cfg", json.dumps(cfg))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res = H.Results()
    for mode in MODES:
        res.declare(f"{mode} first", f"{mode} steady")
        for i in range(a.repeat):
            recs = [r["samples"][mode][i] for r in ranks]
            per_save = [max(rec["stalls"][k] for rec in recs) for k in range(a.steps)]
            close = max(rec["close"] for rec in recs)
            res.add(f"{mode} first", per_save[0])
            res.add(f"{mode} steady", statistics.median(per_save[1:]), close=close if mode.endswith("blocking") else None)
    params = ranks[0]["params"]
    print(f"\naccelerate DDP, {a.world} ranks: MLP {a.layers} x {a.width}, {params / 1e6:.2f} M params, "
          f"{params * 12 / 1e6:.1f} MB model + AdamW state; {a.steps} steps, a save after each; {a.repeat} repeats "
          f"alternated; {H.banner()}")
    print("seconds: the slowest rank's time in the save call; first: into a new folder/store; steady: median of the "
          "other saves of the run (every tensor changed)")
    print(res.table(head="mode", ratios={"x save_state": lambda r: "save_state " + r.name.rsplit(" ", 1)[1],
                                         "x +sync": lambda r: "save_state+sync " + r.name.rsplit(" ", 1)[1]},
                    columns=[("close s", lambda r: f"{r.median('close'):.3f}" if r.values("close") else "")]))
    steady = [ph for rec in ranks[0]["samples"]["ckptstore"] for ph in rec["phases"][1:]]
    print("where a steady blocking ckptstore save's time went on rank 0 (SaveResult.phases, medians, ms): " + ", ".join(
        f"{k} {1000 * statistics.median(ph.get(k, 0.0) for ph in steady):.1f}" for k in steady[0]))
    H.write_json(a.json, a, rows=res.to_json())


if __name__ == "__main__":
    main()
