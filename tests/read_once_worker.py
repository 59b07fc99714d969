"""One rank of a small DDP + AdamW job on CPU/gloo, launched like torchrun by tests/dist.py: saves, or resumes and
reports how many bytes of chunk data (``objects/`` and ``packs/``) it read from storage.

Modes (``--mode``):
  save   train ``--steps`` steps, saving every step (``--replicated``: keys saved by rank 0 only).
  load   resume into a fresh model/optimizer, once per ``--phases`` entry: ``before`` (read-once off), ``after``
         (on), ``auto`` (ckptstore's choice), each into fresh objects through a new Store.
Both print ``RESULT {...}`` with the state's digest (model and optimizer tensors, bit for bit), the step, and
for ``load`` the chunk bytes this rank read (counted at the storage layer: every read of a blob or a pack
range through LocalStorage / FsspecStorage), the warnings resume logged, ``resumed_from``, and ``connections``:
the TCP connections the resume opened to other ranks (not the c10d store's; issue 29).
"""
import argparse
import hashlib
import json
import logging
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ckptstore import Packing, Remote, Store, Writing
from ckptstore.storage.fsspec_storage import FsspecStorage
from ckptstore.storage.local import LocalStorage
from rank import finish, join, result, tcp_connections

COUNT = {"bytes": 0, "paths": {}}
_lock = threading.Lock()


def _counted(cls, name, size_of):
    orig = getattr(cls, name)

    def wrapper(self, path, *a, **k):
        out = orig(self, path, *a, **k)
        if path.startswith(("objects/", "packs/")):
            n = size_of(out)
            with _lock:
                COUNT["bytes"] += n
                COUNT["paths"][path] = COUNT["paths"].get(path, 0) + n
        return out
    setattr(cls, name, wrapper)


def count_reads():
    """Count the bytes of chunk data read through the storage layer (the one place every read goes through)."""
    _counted(LocalStorage, "read_bytes", len)
    _counted(LocalStorage, "read_range_scatter", int)
    _counted(LocalStorage, "read_into", int)
    # an object store's every read is one of these two GETs (its reads into a buffer, and a RetryingStorage's
    # reads, go through them): counting the callers as well would count a byte twice
    _counted(FsspecStorage, "read_bytes", len)
    _counted(FsspecStorage, "read_range_bytes", len)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 96)
        self.b = nn.Linear(96, 64)
        self.c = nn.Linear(64, 8)

    def add_big(self, dim: int):
        """A ``dim`` x ``dim`` weight (benchmarks: a larger state) that takes part in the loss, so DDP reduces
        its gradient and AdamW keeps both moments for it (non-repeating bytes)."""
        g = torch.Generator().manual_seed(1)
        self.big = nn.Linear(dim, dim, bias=False)
        self.register_buffer("z", torch.randn(4, dim, generator=g))
        self.register_buffer("w", torch.randn(4, dim, generator=g))

    def forward(self, x):
        out = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        if hasattr(self, "big"):
            out = out + 1e-3 * (self.big(self.z) * self.w).sum()
        return out


class App:
    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}

    def load_state_dict(self, sd):
        self.model.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])


def digest(model, optim) -> str:
    h = hashlib.sha256()
    for t in list(model.state_dict().values()) + [v for s in optim.state_dict()["state"].values()
                                                  for v in s.values()]:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--remote")
    ap.add_argument("--so", default="{}")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--replicated", default="")
    ap.add_argument("--threshold", type=int, default=None, help="Packing threshold (0: every chunk a blob)")
    ap.add_argument("--dim", type=int, default=0, help="extra square weight of this size (benchmarks)")
    ap.add_argument("--phases", default="after",
                    help="load: comma-separated resumes, in order: before (CKPTSTORE_READ_ONCE=0), after (=1), "
                         "auto (unset: ckptstore decides)")
    ap.add_argument("--chunk-mib", type=int, default=0, help="Writing.chunk_size in MiB (benchmarks)")
    ap.add_argument("--read-only", type=int, default=0, help="load: Store(read_only=True): read the remote")
    args = ap.parse_args()
    rank, world = join()
    wkw = {"packing": Packing(threshold=args.threshold)} if args.threshold is not None else {}
    if args.chunk_mib:
        wkw["chunk_size"] = args.chunk_mib << 20
    writing = Writing(**wkw)
    remote = Remote(args.remote, upload=args.mode == "save") if args.remote else None

    def fresh():
        torch.manual_seed(0)
        model = Net()
        if args.dim:
            model.add_big(args.dim)
        model = nn.parallel.DistributedDataParallel(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        store = Store(args.store.replace("{rank}", str(rank)), writing=writing, remote=remote,
                      storage_options=json.loads(args.so), collective_timeout=60,
                      read_only=bool(args.read_only))
        return model, optim, store, {"app": App(model, optim), "step": 0}

    out = {"rank": rank}
    if args.mode == "save":
        model, optim, store, state = fresh()
        rep = [k for k in args.replicated.split(",") if k]
        digests = {}
        for step in range(1, args.steps + 1):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 64, generator=g), torch.randint(0, 8, (16,), generator=g)
            loss = nn.functional.cross_entropy(model(x[rank::world]), y[rank::world])
            optim.zero_grad()
            loss.backward()
            optim.step()
            state["step"] = step
            store.save(state, step, replicated=rep)
            digests[step] = digest(model, optim)
        store.close()
        out.update(digests=digests)
    else:
        count_reads()
        warnings = []

        class Keep(logging.Handler):
            def emit(self, record):
                warnings.append(record.getMessage())
        logging.getLogger("ckptstore").addHandler(Keep(logging.WARNING))
        for label in args.phases.split(","):
            os.environ.pop("CKPTSTORE_READ_ONCE", None)
            if label != "auto":
                os.environ["CKPTSTORE_READ_ONCE"] = {"before": "0", "after": "1"}[label]
            before = tcp_connections(exclude_port=int(os.environ["MASTER_PORT"]))
            model, optim, store, state = fresh()
            COUNT["bytes"], COUNT["paths"] = 0, {}
            warnings.clear()
            dist.barrier()
            t0 = time.perf_counter()
            step = store.resume(state)
            seconds = time.perf_counter() - t0
            opened = tcp_connections(exclude_port=int(os.environ["MASTER_PORT"])) - before
            out[label] = dict(step=step, digest=digest(model, optim), read=COUNT["bytes"], paths=COUNT["paths"],
                              seconds=seconds, warnings=list(warnings), resumed_from=store.resumed_from,
                              connections=len(opened))
            store.close()
    result(out)
    finish()


if __name__ == "__main__":
    main()
