"""A tiny Lightning training run on ckptstore, run as a subprocess by
tests/integrations/test_integration_lightning.py (one process, or one rank of a job launched like torchrun: RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT).

A LightningModule with dropout, random data, a torchdata ``StatefulDataLoader(shuffle=True)`` (resumable mid-epoch),
``torch.optim.AdamW`` with its defaults, ``ModelCheckpoint(every_n_train_steps=2, save_top_k=2, monitor="train_loss",
save_last=True)``. Every training step appends ``[step, loss, pid]`` to ``--log`` (``.r<rank>`` appended under a job);
every save prints ``saving step N`` first (flushed). The last line is ``RESULT {json}``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Optional

warnings.filterwarnings("ignore")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from ckptstore import Memory, Store  # noqa: E402
from rank import result  # noqa: E402
from ckptstore.integrations.lightning import CkptstoreCheckpointIO, CkptstoreModelParallelStrategy  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--names", required=True, help="ModelCheckpoint dirpath")
    p.add_argument("--log", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--resume", choices=["none", "io", "last"], default="none")
    p.add_argument("--strategy", choices=["single", "ddp", "fsdp"], default="single")
    p.add_argument("--remote", default=None)
    p.add_argument("--storage-options", default="{}")
    p.add_argument("--every-n", type=int, default=2, help="ModelCheckpoint(every_n_train_steps=)")
    p.add_argument("--memory-root", default=None, help="memory=Memory(this, every=--memory-every, "
                   "disk_every=--disk-every)")
    p.add_argument("--memory-every", type=int, default=1)
    p.add_argument("--disk-every", type=int, default=None)
    p.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to be killed mid-run)")
    p.add_argument("--stall-at", type=int, default=None,
                   help="stop at this global step, after logging its loss, until killed (a kill that always "
                        "lands mid-run, however loaded the machine)")
    return p.parse_args()


class Net(L.LightningModule):
    def __init__(self, log_path: str, sleep: float, fsdp: bool = False, lr: float = 1e-3,
                 stall_at: Optional[int] = None):
        super().__init__()
        self.save_hyperparameters(argparse.Namespace(lr=lr, width=32, kind="tiny"))
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                       torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Dropout(0.25),
                                       torch.nn.Linear(32, 1))
        self.log_path, self.sleep, self.fsdp, self.stall_at = log_path, sleep, fsdp, stall_at

    def configure_model(self):
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        with open(self.log_path, "a") as f:
            f.write(json.dumps([int(self.global_step), loss.item(), os.getpid(), x.sum().item()]) + "\n")
        if self.sleep:
            time.sleep(self.sleep)
        if self.stall_at is not None and self.global_step >= self.stall_at:
            time.sleep(3600)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class SayWhenSaving(Callback):
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.is_global_zero:
            print(f"saving step {checkpoint['global_step']}", flush=True)


class Snapshot(Callback):
    """Records the full model and optimizer state at train start / end (FSDP: gathered), for the resharding test."""

    def __init__(self):
        self.at = {}

    def _grab(self, trainer, pl_module, when):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        opt = trainer.optimizers[0]
        m, o = get_state_dict(pl_module, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            import hashlib

            def digest(t):
                return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            flat = {f"model.{k}": digest(v) for k, v in m.items()}
            for k, st in o.get("state", {}).items():
                for n, v in st.items():
                    if isinstance(v, torch.Tensor):
                        flat[f"optim.{k}.{n}"] = digest(v)
            self.at[when] = flat

    def on_train_start(self, trainer, pl_module):
        if trainer.ckpt_path:                     # a fresh optimizer has no state to gather yet
            self._grab(trainer, pl_module, "start")

    def on_train_end(self, trainer, pl_module):
        self._grab(trainer, pl_module, "end")


def main():
    a = parse()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    log_path = a.log + (f".r{rank}" if world > 1 else "")
    torch.manual_seed(1234)
    data = TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    loader = StatefulDataLoader(data, batch_size=4 if world == 1 else 2, shuffle=True)
    storage_options = json.loads(a.storage_options)
    fsdp = a.strategy == "fsdp"
    model = Net(log_path, a.sleep, fsdp=fsdp, stall_at=a.stall_at)
    ckpt = ModelCheckpoint(dirpath=a.names, every_n_train_steps=a.every_n, save_top_k=2, monitor="train_loss",
                           save_last=True)
    snap = Snapshot()
    callbacks = [SayWhenSaving(), ckpt] + ([snap] if fsdp else [])
    kw = dict(max_steps=a.steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
              accelerator="cpu", num_sanity_val_steps=0)
    if fsdp:
        io = CkptstoreModelParallelStrategy(a.root, remote=a.remote, storage_options=storage_options,
                                            data_parallel_size=world, tensor_parallel_size=1)
        trainer = L.Trainer(strategy=io, devices=world, callbacks=callbacks, **kw)
    else:
        memory = Memory(a.memory_root, every=a.memory_every, disk_every=a.disk_every) if a.memory_root else None
        io = CkptstoreCheckpointIO(a.root, remote=a.remote, storage_options=storage_options, memory=memory)
        callbacks.append(io.callback)
        strategy = "ddp" if a.strategy == "ddp" else "auto"
        # With Lightning's DistributedSampler inside torchdata's StatefulDataLoader the batches after a mid-epoch
        # resume differed from the uninterrupted run's (seen here, not investigated): each rank shuffles itself
        trainer = L.Trainer(strategy=strategy, devices=world, plugins=[io], callbacks=callbacks,
                            use_distributed_sampler=world == 1, **kw)
    ckpt_path = {"none": None, "io": io.resume_path(), "last": "last"}[a.resume]
    print(f"resuming from {ckpt_path}", flush=True)
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    out = {"rank": rank, "ckpt_path": ckpt_path, "global_step": trainer.global_step, "snap": snap.at}
    if trainer.is_global_zero:
        stubs = {}
        for n in sorted(os.listdir(a.names)) if os.path.isdir(a.names) else []:
            with open(os.path.join(a.names, n)) as f:
                stubs[n] = json.load(f)["step"]
        out["stubs"] = stubs
        out["best_k"] = {os.path.basename(k): float(v) for k, v in ckpt.best_k_models.items()}
        out["last"] = os.path.basename(ckpt.last_model_path)
        with Store(a.root, read_only=True, rank=0, world_size=1) as s:
            out["local_steps"] = s.steps()
        if a.remote:
            with Store(a.remote, storage_options=storage_options, read_only=True, rank=0, world_size=1,
                       create=False) as s:
                out["remote_steps"] = s.steps()
    result(out)


if __name__ == "__main__":
    sys.exit(main())
