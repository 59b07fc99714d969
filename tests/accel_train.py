"""An accelerate training loop checkpointed with ckptstore (the recipe of ckptstore.integrations.accelerate), run
by tests/integrations/test_integration_accelerate.py: a model with dropout, torch's default AdamW, a LinearLR
scheduler, a shuffled DataLoader (accelerate's seedable sampler) crossing epoch boundaries, a non-blocking save every
step. One process, or N ranks launched like torchrun (accelerate then runs DDP over gloo on CPU).

Rank 0 appends ``{"step", "loss"}`` lines to ``--log`` after each step's save returned; the last stdout line is
``RESULT {json}``.
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

from ckptstore import Retention, Store
from ckptstore.integrations.accelerate import accelerator_state, replicated_keys
from rank import result


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--log")
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--keep", type=int, default=3, help="Retention(last=...); 0 keeps every step")
    ap.add_argument("--remote", help="remote URL of the store (e.g. s3://bucket)")
    ap.add_argument("--so", default="{}", help="the remote's storage options, JSON")
    args = ap.parse_args()

    set_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 32), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1,
                                                  total_iters=args.steps)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g))
    # generator=: the DataLoader draws its iterator's base seed from this generator instead of the global RNG,
    # which the resumed run restores (a resumed run creates one iterator more, mid-epoch; see the recipe)
    train_dl = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator())
    model, optimizer, scheduler, train_dl = accelerator.prepare(model, optimizer, scheduler, train_dl)

    store = Store(args.store, keep=Retention(last=args.keep) if args.keep else None, remote=args.remote,
                  storage_options=json.loads(args.so) if args.remote else None)
    state = accelerator_state(accelerator, progress={"epoch": 0, "batch": 0, "step": 0})
    start = store.resume(state)
    p = state["progress"]
    print(f"rank {accelerator.process_index} resumed from {start} at {p}", flush=True)
    replicated = replicated_keys(accelerator, state)
    epoch = p["epoch"]
    while p["step"] < args.steps:
        train_dl.set_epoch(epoch)
        dl = accelerator.skip_first_batches(train_dl, p["batch"]) if p["batch"] else train_dl
        for x, y in dl:
            model.train()
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            p["batch"] += 1
            p["step"] += 1
            store.save(state, p["step"], blocking=False, replicated=replicated)
            mean = accelerator.reduce(loss.detach(), reduction="mean").item()
            if accelerator.is_main_process and args.log:
                with open(args.log, "a") as f:
                    f.write(json.dumps({"step": p["step"], "loss": mean, "x": x.sum().item()}) + "\n")
            time.sleep(args.step_sleep)
            if p["step"] >= args.steps:
                break
        else:
            epoch += 1
            p["epoch"], p["batch"] = epoch, 0
    store.close()
    result({"start": start, "progress": p, "replicated": replicated, "keys": sorted(state)})


if __name__ == "__main__":
    sys.exit(main())
