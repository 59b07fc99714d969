"""HF Trainer checkpointing: transformers' own ``_save_checkpoint`` vs ``CkptstoreTrainer`` (blocking and
``ckptstore_blocking=False``), same model, data, optimizer (the default fused AdamW) and save cadence, one run.

A GPT-2 from a config (default: 3 layers, width 768, vocab 32000: 46 M parameters, 0.55 GB of fp32 weights +
AdamW moments) trains ``--steps`` steps on CPU saving after every step (``save_steps=1``), so each mode makes
``--steps`` saves. Reported per mode:

- seconds per save: the time ``_save_checkpoint`` keeps training waiting (the training-visible stall; for the
  non-blocking adapter the copy into staging memory, plus any wait for the previous save);
- the whole run's wall time, and the same run without saves (the saves' real cost to training);
- bytes written over all saves: for HF the size of each ``checkpoint-N`` dir right after its save (``du``), for
  the adapter ``SaveResult.bytes_written`` summed (new blobs and packs after dedup);
- HF's own files are not fsynced (page cache); ``+sync`` is the time ``os.sync()`` then takes after each save,
  so HF's durable cost is about save + sync (ckptstore's saves are durable on return).

``save_total_limit=1`` for both, so the disk holds about two checkpoints at a time. Run by hand:

    PYTHONPATH=. python benchmarks/bench_hf.py [--steps 10] [--layers 3] [--dir /path/on/disk]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ckptstore.integrations.transformers import CkptstoreTrainer  # noqa: E402

SEQ = 64


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int):
        self.x = torch.randint(0, vocab, (n, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def du(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def run(mode: str, a, work: Path) -> dict:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=12, vocab_size=a.vocab, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    out = work / mode
    args = TrainingArguments(output_dir=str(out), max_steps=a.steps, per_device_train_batch_size=1,
                             save_strategy="no" if mode == "nosave" else "steps", save_steps=1,
                             save_total_limit=1, logging_steps=1000, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    data = Tokens(a.steps, a.vocab)
    stalls, syncs, written, copies = [], [], [], []
    if mode in ("nosave", "hf"):
        trainer = Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = CkptstoreTrainer(model=model, args=args, train_dataset=data, store=str(out / "store"),
                                   ckptstore_blocking=(mode == "ckptstore"))
        real_save = trainer.store.save

        def save(*args, **kw):
            r = real_save(*args, **kw)
            results.append(r)
            return r
        results: list = []
        trainer.store.save = save
    real = trainer._save_checkpoint

    def timed(model_, trial):
        t0 = time.perf_counter()
        real(model_, trial)
        stalls.append(time.perf_counter() - t0)
        if mode == "hf":
            written.append(du(out / f"checkpoint-{trainer.state.global_step}"))
            t1 = time.perf_counter()
            os.sync()
            syncs.append(time.perf_counter() - t1)
    trainer._save_checkpoint = timed
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    if mode.startswith("ckptstore"):
        for r in results:
            r = r.result() if hasattr(r, "result") else r
            written.append(r.bytes_written)
            copies.append(r.stall_seconds)
        trainer.store.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"mode": mode, "wall": wall, "stalls": stalls, "syncs": syncs, "written": sum(written),
            "params": n_params, "copies": copies}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="work dir (default: a temp dir under the repo's parent disk)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_hf_", dir=a.dir))
    try:
        run("nosave", a, work)                      # warm-up: first-call costs (allocator, lazy imports)
        res = {m: run(m, a, work) for m in ("nosave", "hf", "ckptstore", "ckptstore-nonblocking")}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = res["hf"]["params"]
    print(f"GPT-2 {a.layers} layers x {a.width}, vocab {a.vocab}: {n / 1e6:.1f} M params, "
          f"{n * 12 / 1e9:.2f} GB model + AdamW state; {a.steps} steps, a save after each; torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs")
    base = res["nosave"]["wall"]
    hf_med = statistics.median(res["hf"]["stalls"])
    print("save s: median time _save_checkpoint kept training waiting; copy s: ckptstore's own stall_seconds (for "
          "a non-blocking save the copy into staging memory; save s adds the wait for the previous save)")
    print(f"{'mode':<24}{'save s (median)':>16}{'+sync s':>9}{'mean s':>8}{'vs HF':>7}{'copy s':>8}"
          f"{'run wall s':>12}{'vs no save':>11}{'written GB':>12}")
    print(f"{'no saves':<24}{'':>16}{'':>9}{'':>8}{'':>7}{'':>8}{base:>12.2f}{1.0:>11.2f}{0:>12.2f}")
    for m in ("hf", "ckptstore", "ckptstore-nonblocking"):
        r = res[m]
        med = statistics.median(r["stalls"])
        sync = f"{statistics.median(r['syncs']):.2f}" if r["syncs"] else "-"
        copy = f"{statistics.median(r['copies']):.3f}" if r["copies"] else "-"
        print(f"{m:<24}{med:>16.3f}{sync:>9}{statistics.mean(r['stalls']):>8.3f}{med / hf_med:>7.2f}{copy:>8}"
              f"{r['wall']:>12.2f}{r['wall'] / base:>11.2f}{r['written'] / 1e9:>12.2f}")


if __name__ == "__main__":
    main()
