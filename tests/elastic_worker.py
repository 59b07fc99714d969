"""One rank of a small DDP job reading its data through ``ckptstore.ElasticSampler``, launched like torchrun by
tests/dist.py (``Job(..., script=WORKER)``); used by tests/state/test_elastic_data.py.

It resumes from ``--store`` (whatever world size saved it), trains a linear model on a ``TensorDataset`` whose
first column is the sample's index, saves every ``--save-every`` steps with the sampler in the state, and
appends one line per trained batch to ``--logdir/<tag>-rank<r>.log``: ``<step> <epoch> <i>,<i>,...`` (written
after the batch was trained on). ``--die-after k`` SIGKILLs every rank (with its DataLoader workers) right
after step ``k`` (a crash after the last save: the lines of later steps belong to work the checkpoint does not
hold). ``--join 1`` wraps each epoch in ``torch.distributed.algorithms.Join`` (DDP with uneven inputs: the
tail of an epoch may give a rank no sample; needs DDP). Prints ``RESULT {...}``: the resumed step and cursor,
and at each save how many indices the sampler's iterator had handed out beyond what this rank had trained on
(the DataLoader's prefetching).
"""
import argparse
import contextlib
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.join import Join
from torch.utils.data import DataLoader, TensorDataset

from ckptstore import ElasticSampler, Store
from rank import add_options, finish, join, result


class CountingSampler(ElasticSampler):
    """Counts the indices its iterators hand out (the loader takes them ahead of training)."""
    handed_out = 0

    def __iter__(self):
        for i in super().__iter__():
            self.handed_out += 1
            yield i


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--logdir", required=True)
    ap.add_argument("--tag", required=True)
    add_options(ap, n=70, batch=4, epochs=1, save_every=0, die_after=0, workers=0, prefetch=2, join=0)
    ap.add_argument("--ddp", type=int, default=1, help="0: average the gradients by hand (no DDP: ~1 s less "
                    "per rank, as DDP's construction imports torch._dynamo)")
    args = ap.parse_args()
    rank, world = join()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.n, 4, generator=g)
    ds = TensorDataset(torch.arange(args.n), x, x.sum(1, keepdim=True))
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1)) if args.ddp else nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = CountingSampler(ds, batch_size=args.batch, seed=7)
    loader = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=args.workers,
                        prefetch_factor=args.prefetch if args.workers else None)
    store = Store(args.store, collective_timeout=60)
    state = {"model": model, "optim": optim, "sampler": sampler, "step": 0}
    resumed = store.resume(state)
    step = state["step"]
    out = {"rank": rank, "resumed": resumed, "epoch": sampler.epoch, "consumed": sampler.consumed, "ahead": []}
    result(out)

    with open(os.path.join(args.logdir, f"{args.tag}-rank{rank}.log"), "a") as logf:
        for epoch in range(sampler.epoch, args.epochs):
            sampler.set_epoch(epoch)
            sampler.handed_out, trained = 0, 0
            with Join([model]) if args.join else contextlib.nullcontext():
                for idx, xb, yb in loader:
                    loss = nn.functional.mse_loss(model(xb), yb)
                    optim.zero_grad()
                    loss.backward()
                    if not args.ddp:
                        for p in model.parameters():
                            dist.all_reduce(p.grad)
                            p.grad /= world
                    optim.step()
                    sampler.advance()
                    step += 1
                    trained += len(idx)
                    state["step"] = step
                    logf.write(f"{step} {epoch} {','.join(str(int(i)) for i in idx)}\n")
                    logf.flush()
                    if args.save_every and step % args.save_every == 0:
                        store.save(state, step, replicated=["model", "optim"])
                        out["ahead"].append(sampler.handed_out - trained)
                        result({"ahead": out["ahead"]})
                    if step == args.die_after:
                        os.killpg(os.getpgid(0), signal.SIGKILL)      # this rank and its loader workers
            sampler.finish_epoch()
    store.close()
    finish()


if __name__ == "__main__":
    main()
