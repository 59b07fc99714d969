"""HF Trainer checkpointing: transformers' own ``_save_checkpoint`` vs ``CkptstoreTrainer`` (blocking and
``ckptstore_blocking=False``), same model, data, optimizer (the default fused AdamW) and save cadence, one run.

A GPT-2 from a config (default: 3 layers, width 768, vocab 32000: 46 M parameters, 0.55 GB of fp32 weights +
AdamW moments) trains ``--steps`` steps on CPU saving every ``--save-steps`` steps (default 1: after every step, so a non-blocking save
waits for the previous one; HF's own default is 500). Reported per mode:

- seconds per save: the median over the run's saves, and apart the first (into a new store: HF's first
  ``checkpoint-1``) and the median of the others (a used store, every tensor changed by the step between): the time ``_save_checkpoint`` keeps training waiting (the training-visible stall; for the
  non-blocking adapter the copy into staging memory, plus any wait for the previous save);
- the whole run's wall time, and the same run without saves (the saves' real cost to training);
- bytes written over all saves: for HF the size of each ``checkpoint-N`` dir right after its save (``du``), for
  the adapter ``SaveResult.bytes_written`` summed (new blobs and packs after dedup);
- HF's own files are not fsynced (page cache); ``+sync`` is the time ``os.sync()`` then takes after each save,
  so HF's durable cost is about save + sync (ckptstore's saves are durable on return).

``save_total_limit=1`` for both, so the disk holds about two checkpoints at a time. Run by hand:

    PYTHONPATH=. python benchmarks/bench_hf.py [--steps 10] [--layers 3] [--dir /path/on/disk] [--repeat 2]

The modes are harness contenders, alternated over ``--repeat`` rounds after one warm-up run without saves.
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import harness as H  # noqa: E402  (puts the checkout on sys.path)
import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from ckptstore.integrations.transformers import CkptstoreTrainer  # noqa: E402

SEQ = 64
MODES = ("nosave", "hf", "ckptstore", "ckptstore-nonblocking")


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
                             save_strategy="no" if mode == "nosave" else "steps", save_steps=a.save_steps,
                             save_total_limit=1, logging_steps=1000, report_to=[], use_cpu=True, seed=0,
                             disable_tqdm=True, dataloader_num_workers=0)
    data = Tokens(a.steps, a.vocab)
    stalls, syncs, written, copies, phases = [], [], [], [], []
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
            phases.append(r.phases)
        trainer.store.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"seconds": wall, "save": statistics.median(stalls) if stalls else None,
            "first": stalls[0] if stalls else None, "steady": statistics.median(stalls[1:]) if stalls[1:] else None,
            "sync_first": syncs[0] if syncs else None,
            "save_mean": statistics.mean(stalls) if stalls else None, "stalls": stalls,
            "sync": statistics.median(syncs) if syncs else None, "written": sum(written), "params": n_params,
            "copy": statistics.median(copies) if copies else None, "phases": phases}


def main() -> None:
    p = H.parser(__doc__, repeat=1, scratch=False, seed=False)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-steps", type=int, default=1,
                   help="HF's save_steps: a save every N steps (a non-blocking save hides behind the steps between)")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dir", default=None, help="work dir (default: a temp dir under the repo's parent disk)")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_hf_", dir=a.dir))
    try:
        run("nosave", a, work)                      # warm-up: first-call costs (allocator, lazy imports)
        res = H.compare([H.Contender(m, lambda m=m: run(m, a, work)) for m in MODES], a.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = res.rows["hf"].samples[0]["params"]
    print(f"\nGPT-2 {a.layers} layers x {a.width}, vocab {a.vocab}: {n / 1e6:.1f} M params, "
          f"{n * 12 / 1e9:.2f} GB model + AdamW state; {a.steps} steps, a save every {a.save_steps}; {H.banner()}")
    print("save s: median time _save_checkpoint kept training waiting; copy s: ckptstore's own stall_seconds (for "
          "a non-blocking save the copy into staging memory; save s adds the wait for the previous save); +sync s: "
          "os.sync() after HF's save (its files are not fsynced)")

    def opt(key, fmt):
        return lambda r: fmt.format(r.median(key)) if r.values(key) else "-"
    print(res.table(head="mode", key="save", unit="save s", ratios={"vs HF": lambda r: "hf" if r.name != "nosave" else None},
                    columns=[("+sync s", opt("sync", "{:.2f}")), ("first s", opt("first", "{:.3f}")),
                             ("+sync first", opt("sync_first", "{:.2f}")), ("steady s", opt("steady", "{:.3f}")),
                             ("mean s", opt("save_mean", "{:.3f}")),
                             ("copy s", opt("copy", "{:.3f}")), ("run wall s", opt("seconds", "{:.2f}")),
                             ("vs no save", lambda r: f"{r.median() / res.rows['nosave'].median():.2f}"),
                             ("written GB", lambda r: f"{r.median('written') / 1e9:.2f}")]))
    for m in MODES[2:]:
        ph = [x for s in res.rows[m].samples for x in s.get("phases") or [] if x]
        if ph:
            print(f"where a {m} save's time went (SaveResult.phases, medians over every save, ms; hash_cpu and "
                  "write_io summed over threads): " + ", ".join(
                      f"{k} {1000 * statistics.median(x.get(k, 0.0) for x in ph):.0f}" for k in ph[-1]))
    H.write_json(a.json, a, rows=res.to_json(key="save"))


if __name__ == "__main__":
    main()
