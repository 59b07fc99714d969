"""torchtitan's own DCP CheckpointManager vs ckptstore's CkptstoreCheckpointManager, driven as torchtitan's
Trainer drives its checkpointer (FSDP2 model parts, torchtitan's fused-AdamW OptimizersContainer, its
LRSchedulersContainer, a ParallelAwareDataloader, a train state), on N ranks (gloo, CPU) launched like torchrun.

For each mode, ``--saves`` saves, one after each training step:
  dcp            CheckpointManager(async_mode="disabled")   (torchtitan's default)
  dcp-async      CheckpointManager(async_mode="async")      (dcp.async_save: staging copy, then a thread)
  ckpt           CkptstoreCheckpointManager(nonblocking=False)
  ckpt-nb        CkptstoreCheckpointManager(nonblocking=True)  (the adapter's default)
Reported per mode (medians over the saves, rank 0's clock; every save is collective):
  save_s   seconds from save() to durable (blocking modes: the call; async modes: the call plus the wait
           for the background part, measured after one more training step: it is the time the save needed
           beyond what the step hid)
  stall_s  training-visible stall per save: the save() call plus maybe_wait_for_staging() plus any wait in
           the next save() for the previous one
  bytes    bytes on disk after all saves (keep_latest_k=0: nothing deleted, so it is what was written)

    python benchmarks/bench_torchtitan.py --state-mb 600 --saves 10 --dir /dev/shm/bench_titan    # ~1.5 min
    python benchmarks/bench_torchtitan.py --ranks 2 ...     # FSDP2 over 2 ranks: slower (gloo all-gathers)

The modes run one after another in one job (harness.launch), in the order of harness.alternated over
``--repeat`` rounds; the table gives the median over rounds of each round's median, and ratios against dcp.

Measured (2-core VM shared with other jobs, load average 5-8; tmpfs because the disk was 98% full, so these
are CPU-side costs, not disk bandwidth; 50.3 M params, 604 MB of model + AdamW state, 10 saves):

| ranks | mode | seconds per save (to durable) | stall per save, median / max | bytes over 10 saves |
|---|---|---|---|---|
| 1 | dcp | 0.714 | 0.714 / 1.012 | 6042 MB |
| 1 | dcp-async | 1.531 (2.14x dcp) | 0.280 (0.39x) / 0.874 | 6042 MB |
| 1 | ckpt | 0.774 (1.08x) | 0.774 (1.08x) / 0.896 | 6040 MB |
| 1 | ckpt-nb | 0.826 (1.16x) | 0.306 (0.43x) / 0.523 | 6040 MB |
| 2 | dcp | 1.542 | 1.542 / 4.792 | 6043 MB |
| 2 | dcp-async | 2.516 (1.63x) | 0.259 (0.17x) / 0.684 | 6043 MB |
| 2 | ckpt | 1.218 (0.79x) | 1.218 (0.79x) / 1.574 | 6040 MB |
| 2 | ckpt-nb | 0.931 (0.60x) | 0.232 (0.15x) / 0.552 | 6040 MB |

Every parameter and AdamW moment changes at every step, so both write the whole state each time (content
addressing saves nothing here; it does for frozen or rarely-updated tensors).

The model is a residual MLP LM (torchtitan's debug llama cannot train on CPU); its model + AdamW state is about
``--state-mb`` MB in all (fp32 params + 2 moments). Run by hand; needs torchtitan (``ckptstore[torchtitan]``).
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import harness as H  # noqa: E402  (puts the checkout on sys.path)

MODES = ("dcp", "dcp-async", "ckpt", "ckpt-nb")


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def worker(args, rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import Dataset
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager

    mesh = init_device_mesh("cpu", (world,))
    dim, vocab, seq = 1024, 8192, 16
    per_block = 2 * dim * 4 * dim
    n_blocks = max(1, round((args.state_mb * 1e6 / 12 - 2 * vocab * dim) / per_block))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(),
                                                      nn.Linear(4 * dim, dim, bias=False))
                                        for _ in range(n_blocks))
            self.output = nn.Linear(dim, vocab, bias=False)

        def forward(self, t):
            h = self.tok_embeddings(t)
            for layer in self.layers:
                h = h + layer(h)
            return self.output(h)

    class Tokens(Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            x = torch.randint(0, vocab, (seq + 1,), generator=g)
            return x[:-1], x[1:]

    class TrainState:                                   # torchtitan's train state: a Stateful step counter
        step = 0

        def state_dict(self):
            return {"step": self.step}

        def load_state_dict(self, sd):
            self.step = sd["step"]

    torch.manual_seed(0)
    model = LM()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    n_params = sum(p.numel() for p in model.parameters())
    optimizers = default_adamw(lr=1e-4).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=1000)
    dataloader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=1)
    data = iter(dataloader)
    ts = TrainState()

    def train_step():
        ts.step += 1
        x, y = next(data)
        optimizers.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()

    results = {"rank": rank, "ranks": world, "params": n_params, "state_mb": n_params * 12 / 1e6, "samples": {}}
    for _, mode in H.alternated(args.modes.split(","), args.repeat):
        folder = Path(args.dir) / mode
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        common = dict(enable=True, folder=str(folder), interval=1, keep_latest_k=0, last_save_model_only=False)
        if mode.startswith("dcp"):
            cfg = CheckpointManager.Config(async_mode="async" if mode == "dcp-async" else "disabled", **common)
        else:
            cfg = CkptstoreCheckpointManager.Config(nonblocking=mode == "ckpt-nb", **common)
        checkpointer = cfg.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                 lr_schedulers=lr_schedulers, states={"train_state": ts}, sd_adapter=None,
                                 base_folder="")
        train_step()                                    # warm-up step (optimizer state exists from here on)
        stalls, saves, steps = [], [], []
        for _ in range(args.saves):
            t0 = time.perf_counter()
            train_step()
            t1 = time.perf_counter()
            checkpointer.save(ts.step)
            t2 = time.perf_counter()
            stalls.append(t2 - t1)
            if mode in ("dcp", "ckpt"):
                saves.append(t2 - t1)
            steps.append(t1 - t0)
        # background completion: one more step, then the wait for the last save's background part
        if mode in ("dcp-async", "ckpt-nb"):
            t0 = time.perf_counter()
            checkpointer.maybe_wait_for_saving()
            tail = time.perf_counter() - t0
        checkpointer.close()
        dist.barrier()
        if mode in ("dcp-async", "ckpt-nb"):
            # per-save time to durable, measured separately: save then wait at once (no overlap)
            folder2 = Path(str(folder) + "-seq")
            if rank == 0:
                shutil.rmtree(folder2, ignore_errors=True)
            dist.barrier()
            cfg.folder = str(folder2)
            checkpointer = cfg.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                                     lr_schedulers=lr_schedulers, states={"train_state": ts}, sd_adapter=None,
                                     base_folder="")
            for _ in range(3):
                train_step()
                t1 = time.perf_counter()
                checkpointer.save(ts.step)
                checkpointer.maybe_wait_for_saving()
                saves.append(time.perf_counter() - t1)
            checkpointer.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder2, ignore_errors=True)
        stall_total = sum(stalls)
        if mode in ("dcp-async", "ckpt-nb"):
            stall_total += tail
        if rank == 0:
            results["samples"].setdefault(mode, []).append(dict(
                seconds=statistics.median(saves), stall=statistics.median(stalls), stall_max=max(stalls),
                stall_total=stall_total, step=statistics.median(steps), bytes=du(folder)))
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
    return results


def main() -> None:
    ap = H.parser(__doc__, repeat=1, scratch=False, seed=False)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--state-mb", type=float, default=600.0, help="model + AdamW state, MB, all ranks")
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/bench_titan", help="where the checkpoints go (deleted after)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return H.rank_main(lambda rank, world: worker(args, rank, world))
    got = H.launch(args.ranks, __file__, "--worker", "--state-mb", args.state_mb, "--saves", args.saves, "--dir",
                   args.dir, "--modes", args.modes, "--repeat", args.repeat, timeout=3600)[0]
    res = H.Results()
    for m in (m for m in MODES if m in got["samples"]):
        for sample in got["samples"][m]:
            res.add(m, **sample)
    base = "dcp" if "dcp" in res.rows else None
    print(f"\n{got['ranks']} ranks, {got['params'] / 1e6:.1f} M params, model + AdamW state {got['state_mb']:.0f} MB, "
          f"{args.saves} saves, one per training step; {args.repeat} round(s); {H.banner()}\n")
    print(res.table(head="mode", unit="s per save (to durable)", ratios={"x dcp": base} if base else {}, columns=[
        ("stall per save s", lambda r: f"{r.median('stall'):.3f}"),
        ("stall x dcp", lambda r: f"{r.median('stall') / res.rows[base].median('stall'):.2f}" if base else ""),
        ("stall max s", lambda r: f"{max(r.values('stall_max')):.3f}"),
        (f"MB written over {args.saves} saves", lambda r: f"{r.median('bytes') / 1e6:.0f}")]))
    H.write_json(args.json, args, ranks=got["ranks"], params=got["params"], rows=res.to_json())


if __name__ == "__main__":
    main()
