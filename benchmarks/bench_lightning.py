"""Lightning's own checkpointing (TorchCheckpointIO) vs CkptstoreCheckpointIO, in a real ``Trainer.fit``.

A LightningModule of 10 Linear(2048, 2048) layers (42 M params: 503 MB of fp32 weights + AdamW moments), one
checkpoint per optimizer step for 10 steps (``ModelCheckpoint(every_n_train_steps=1)``, Lightning's default
``save_top_k=1``: each new checkpoint replaces the previous one). Reported per IO:
  - seconds per save: the time ``save_checkpoint`` takes (Lightning waits for it: the training-visible stall),
    median and max over the 10 saves; for ``blocking=False`` also the background commit time;
  - bytes written over the 10 saves (TorchCheckpointIO: the file sizes; ckptstore: ``SaveResult.bytes_written``);
  - the wall time of ``fit``.
``--save-last``: ``save_last=True`` too, so each step is saved twice (Lightning's top-k path, then ``last.ckpt``):
two ``torch.save`` files per step for Lightning, one commit with two names (a re-save) for ckptstore.

Run by hand:  PYTHONPATH=. python benchmarks/bench_lightning.py [--dir /dev/shm/bench-lightning] [--layers 10]
(the default directory is a tmpfs: the machine this was written on had 2.5 GB of free disk; pass --dir for a disk)
The IOs are harness contenders, alternated over ``--repeat`` rounds; ratios are against TorchCheckpointIO.
"""
from __future__ import annotations

import os
import shutil
import statistics
import time
import warnings

warnings.filterwarnings("ignore")

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import torch  # noqa: E402
import lightning.pytorch as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckptstore.integrations.lightning import CkptstoreCheckpointIO  # noqa: E402

WIDTH = 2048


class Big(L.LightningModule):
    def __init__(self, layers: int):
        super().__init__()
        self.net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])

    def training_step(self, batch, idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


class TimedTorchIO(TorchCheckpointIO):
    def __init__(self):
        super().__init__()
        self.seconds, self.bytes = [], 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        t = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        with open(path, "rb+") as f:            # durable, as ckptstore's commit is
            os.fsync(f.fileno())
        self.seconds.append(time.perf_counter() - t)
        self.bytes += os.path.getsize(path)


class TimedCkptstoreIO(CkptstoreCheckpointIO):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seconds, self.results = [], []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        store = self.store
        if not getattr(store, "_bench_wrapped", False):
            inner = store.save

            def save(*a, **kw):
                r = inner(*a, **kw)
                self.results.append(r)
                return r
            store.save, store._bench_wrapped = save, True
        t = time.perf_counter()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.seconds.append(time.perf_counter() - t)

    def teardown(self):
        self.results = [r.result() if hasattr(r, "result") and not hasattr(r, "bytes_written") else r
                        for r in self.results]
        super().teardown()


def run_fit(io, d: str, layers: int, steps: int, save_last: bool = False) -> float:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(steps * 8, WIDTH)), batch_size=8)
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", plugins=[io],
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(d, "names"), every_n_train_steps=1,
                                                   save_last=save_last or None)])
    t = time.perf_counter()
    trainer.fit(Big(layers), data)
    return time.perf_counter() - t


IOS = {"TorchCheckpointIO (Lightning default)": lambda d: TimedTorchIO(),
       "CkptstoreCheckpointIO blocking=True": lambda d: TimedCkptstoreIO(os.path.join(d, "store")),
       "CkptstoreCheckpointIO blocking=False": lambda d: TimedCkptstoreIO(os.path.join(d, "store"), blocking=False)}


def main():
    p = H.parser(__doc__, repeat=1, scratch=False, seed=False)
    p.add_argument("--dir", default="/dev/shm/bench-lightning")
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-last", action="store_true",
                   help="ModelCheckpoint(save_last=True): each step is saved twice (its path, then last.ckpt)")
    a = p.parse_args()
    state_mb = a.layers * (WIDTH * WIDTH + WIDTH) * 12 / 1e6
    print(f"model + AdamW state: {state_mb:.0f} MB, {a.steps} steps" + (", save_last=True" if a.save_last else ""))

    def contender(name: str, make) -> H.Contender:
        d = os.path.join(a.dir, name.split()[0] + name.split()[-1])

        def run(_):
            io = make(d)
            wall = run_fit(io, d, a.layers, a.steps, a.save_last)
            written = io.bytes if isinstance(io, TimedTorchIO) else sum(r.bytes_written for r in io.results)
            commit = None if isinstance(io, TimedTorchIO) else statistics.median(r.seconds for r in io.results)
            return dict(seconds=statistics.median(io.seconds), max=max(io.seconds), commit=commit, written=written,
                        fit=wall)
        return H.Contender(name, run, setup=lambda: shutil.rmtree(d, ignore_errors=True),
                           teardown=lambda _: shutil.rmtree(d, ignore_errors=True))
    res = H.compare([contender(n, make) for n, make in IOS.items()], a.repeat)
    print(res.table(head="checkpoint IO", unit="s per save", ratios={"x Lightning": next(iter(IOS))}, columns=[
        ("max s", lambda r: f"{max(r.values('max')):.3f}"),
        ("commit s", lambda r: f"{r.median('commit'):.3f}" if r.values("commit") else "-"),
        ("GB written", lambda r: f"{r.median('written') / 1e9:.2f}"), ("fit s", lambda r: f"{r.median('fit'):.1f}")]))
    H.write_json(a.json, a, state_mb=state_mb, rows=res.to_json())


if __name__ == "__main__":
    main()
