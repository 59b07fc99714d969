"""One rank of a small FSDP2 (or FSDP+TP) job on CPU/gloo, launched like torchrun by tests/dist.py.

Modes (``--mode``):
  train    train ``--steps`` steps, saving every step (resuming first); rank 0 appends ``step loss`` lines to
           ``--log``. SIGKILL-safe: the log only gets a line after the step's save returned.
  save     train ``--steps`` steps, save the last one, and write the full (consolidated) state to ``--full``.
  load     resume into a fresh model/optimizer, write the full state to ``--full`` (and the step to stdout).
  fail     save with one rank's Stateful raising (``--bad-rank``); print what each rank saw, as JSON.
  stall    like fail, but the bad rank stops itself (SIGSTOP) inside its save.
The model, data and optimizer are deterministic functions of the step, so every run agrees bit for bit.
"""
import argparse
import json
import os
import signal
import time

import torch
import torch.utils._pytree as pytree
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptstore import Packing, Store, Remote, Retention, Writing
from ckptstore.util.errors import CheckpointError
from rank import close_and_report, finish, join, result


class Net(nn.Module):
    def __init__(self, dim=16, hidden=24, layers=2):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim))
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(self.norm(x))


class AppState:
    """The DCP tutorial's pattern: model + optimizer through get_state_dict / set_state_dict."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o}

    def load_state_dict(self, sd):
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class TorchRNG:
    """torch's CPU generator as a Stateful: seeded alike in build(), so every rank saves the same bytes (as HF
    Trainer's per-rank RNG state does)."""

    def state_dict(self):
        return {"torch": torch.get_rng_state()}

    def load_state_dict(self, sd):
        torch.set_rng_state(sd["torch"])


class Failing:
    """A Stateful that raises (or stops the process) on the chosen rank."""

    def __init__(self, bad, how):
        self.bad, self.how = bad, how

    def state_dict(self):
        if self.bad:
            if self.how == "stall":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise OSError(28, "No space left on device (injected)")
        return {"ok": True}

    def load_state_dict(self, sd):
        pass


def build(mesh_shape, seed=0, ddp=False, hidden=24):
    torch.manual_seed(seed)
    model = Net(hidden=hidden)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    if len(mesh_shape) == 2:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optim


def batch(step, rank, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 16, generator=g)
    y = torch.randint(0, 3, (8,), generator=g)
    per = 8 // world if 8 % world == 0 else 8
    if per == 8:
        return x, y
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def train_step(model, optim, step, rank, world, tp=1):
    x, y = batch(step, rank // tp, world // tp)
    loss = nn.functional.cross_entropy(model(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world


def set_grads_step(model, optim, step):
    """An optimizer step on gradients that are a deterministic function of the step and the parameters (no
    forward): the optimizer state gets every parameter's sharding."""
    optim.zero_grad()
    for p in model.parameters():
        p.grad = p.detach() * 0.5 + 0.01 * step
    optim.step()
    return 0.0


def digests(model, optim):
    """sha256 of this rank's own model and optimizer tensors (``digest``) and of torch's CPU generator (``rng``)."""
    import hashlib
    digest = hashlib.sha256()
    for t in pytree.tree_leaves([model.state_dict(), optim.state_dict()["state"]]):   # this rank's own
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return {"digest": digest.hexdigest(), "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()}


def target_boxes(model):
    """parameter name -> [offset, shape] of this rank's local shard, by torch's own
    ``compute_local_shape_and_global_offset`` (DTensor parameters only)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    out = {}
    for name, p in model.state_dict().items():
        if hasattr(p, "device_mesh"):
            shape, off = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            out[name] = [[int(x) for x in off], [int(x) for x in shape]]
    return out


def full_state(model, optim):
    m, o = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": m, "optim": o}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--remote")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mesh", default="")
    ap.add_argument("--log")
    ap.add_argument("--full")
    ap.add_argument("--blocking", type=int, default=1)
    ap.add_argument("--bad-rank", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--rank-local", default="error")
    ap.add_argument("--progress", type=int, default=0, help="save a per-rank progress dict (rank-local)")
    ap.add_argument("--ddp", type=int, default=0, help="DDP (replicated) instead of FSDP2")
    ap.add_argument("--so", default="{}", help="storage options of --remote, as JSON")
    ap.add_argument("--no-upload-node", type=int, default=-1, help="ranks 2n, 2n+1 do not upload")
    ap.add_argument("--upload-deadline", type=float, default=60.0)
    ap.add_argument("--keep-last", type=int, default=None)
    ap.add_argument("--deltas", type=int, default=0, help="Writing(codec='auto', deltas=N), every chunk a blob")
    ap.add_argument("--replicated", default="", help="comma-separated top-level keys saved by rank 0 only")
    ap.add_argument("--replicated-ranks", default="", help="only these ranks pass --replicated (a mistake)")
    ap.add_argument("--rng", type=int, default=0, help="save torch's CPU generator per rank (equal on every rank)")
    ap.add_argument("--hidden", type=int, default=24, help="the blocks' hidden size (13 on a 3x2 mesh: uneven)")
    ap.add_argument("--seed", type=int, default=0, help="the model's init seed")
    ap.add_argument("--forward", type=int, default=1,
                    help="0: optimizer steps on set gradients, no forward (torch's tensor parallel forward needs "
                         "even shards)")
    args = ap.parse_args()
    rank, world = join()
    mesh_shape = tuple(int(x) for x in args.mesh.split("x")) if args.mesh else (world,)
    model, optim = build(mesh_shape, ddp=bool(args.ddp), hidden=args.hidden, seed=args.seed)
    app = AppState(model, optim)
    progress = {"consumed": 0, "rank": rank} if args.progress else None
    store_root = args.store.replace("{rank}", str(rank)).replace("{node}", str(rank // 2))
    from ckptstore.util.retry import RetryPolicy
    remote = Remote(args.remote, retry=RetryPolicy(deadline=args.upload_deadline, op_timeout=30),
                    upload=rank // 2 != args.no_upload_node) if args.remote else None
    writing = Writing(codec="auto", deltas=args.deltas, packing=Packing(threshold=0)) if args.deltas else None
    store = Store(store_root, collective_timeout=args.timeout, remote=remote, storage_options=json.loads(args.so),
                  writing=writing,
                  keep=Retention(last=args.keep_last) if args.keep_last is not None else None)
    state = {"app": app, "step": 0}
    if progress is not None:
        state["progress"] = progress
    if args.rng:
        state["rng"] = TorchRNG()

    if args.mode in ("fail", "stall"):
        base = store.resume(state) or 0
        state["failing"] = Failing(rank == args.bad_rank, args.mode)
        t0 = time.monotonic()
        out = {"rank": rank}
        try:
            store.save(state, base + 1, blocking=bool(args.blocking))
            store.wait()                     # a non-blocking save's error surfaces here on every rank
            out["result"] = "committed"
        except CheckpointError as e:
            out.update(result="error", type=type(e).__name__, error=str(e),
                       failures={str(k): v for k, v in getattr(e, "failures", {}).items()})
        except OSError as e:
            out.update(result="error", type=type(e).__name__, error=str(e))
        out["seconds"] = time.monotonic() - t0
        result(out)
        if args.mode == "stall":            # the stopped rank never leaves: give the others time to read
            time.sleep(3)
            os._exit(0)
        store.close()
        finish()
        return

    if args.mode == "load":
        if os.environ.get("CKPTSTORE_TEST_RAISE_IN_RESUME") == str(rank):   # a bug, not damage, on this rank
            import ckptstore.io.restore as _restore

            def _raise(*a, **k):
                raise RuntimeError(f"injected failure on rank {rank}")
            _restore.StepLoader.load = _raise
        if args.rng:
            torch.rand(3)                   # the generator now differs from the saved one until resume sets it
        try:
            step = store.resume(state, rank_local=args.rank_local)
        except CheckpointError as e:
            result({"rank": rank, "result": "error", "type": type(e).__name__,
                    "error": str(e)})
            os._exit(0)
        fs = full_state(model, optim)
        if rank == 0 and args.full:
            torch.save({"step": step, "state": fs, "progress": progress}, args.full)
        result({"rank": rank, "result": "loaded", "step": step, **digests(model, optim),
                "tier": (store.resumed_from or {}).get("tier"),
                "manifests_read": (store.resumed_from or {}).get("manifests_read"),
                "progress": state.get("progress"), "boxes": target_boxes(model)})
        close_and_report(store, rank)
        finish()
        return

    start = store.resume(state) or 0
    step = state["step"]
    assert step == start, (step, start)
    while step < args.steps:
        step += 1
        # the tp ranks of a dp x tp mesh see their dp rank's batch (tensor parallelism splits one batch's work;
        # different batches would make the tp-replicated values, norms and biases, differ between tp ranks)
        loss = (train_step(model, optim, step, rank, world, tp=mesh_shape[1] if len(mesh_shape) == 2 else 1)
                if args.forward else set_grads_step(model, optim, step))
        if progress is not None:
            progress["consumed"] += 8
        state["step"] = step
        if rank == 0 and args.log:          # before the save: a step killed mid-save is logged, then redone
            with open(args.log, "a") as f:
                f.write(f"{step} {loss!r}\n")
                f.flush()
                os.fsync(f.fileno())
        if args.mode == "train" or step == args.steps:
            rep = [k for k in args.replicated.split(",") if k]
            if args.replicated_ranks and str(rank) not in args.replicated_ranks.split(","):
                rep = []
            try:
                store.save(state, step, blocking=bool(args.blocking), replicated=rep)
            except CheckpointError as e:
                result({"rank": rank, "result": "error", "type": type(e).__name__,
                        "error": str(e)})
                os._exit(0)
    if args.full:
        fs = full_state(model, optim)
        if rank == 0:
            torch.save({"step": step, "state": fs, "progress": progress}, args.full)
        result({"rank": rank, "step": step, **digests(model, optim)})
    close_and_report(store, rank)
    finish()


if __name__ == "__main__":
    main()
