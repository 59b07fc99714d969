#!/usr/bin/env python3
"""A small, deterministic, resumable training job: a byte-level causal transformer trained on the Python
standard library's own source code, checkpointed with ckptstore.

Usable as a script::

    python examples/train_lm.py --store checkpoints/lm --steps 300 --ckpt-every 25 --log losses.jsonl

and importable (``build_parser``, ``main(argv)``, ``load_corpus``, ``TinyLM``, ``StatefulSampler``).

Everything that influences the numbers is either derived from ``--seed`` or part of the checkpointed state, so
an uninterrupted run and a run that is SIGKILLed at any point and restarted (any number of times) log the same
losses, bit for bit:

* the model, AdamW and the LR scheduler are Stateful and restored in place;
* ``RNGState()`` restores Python ``random`` (random window shift), NumPy's global RNG (byte-noise augmentation)
  and torch's CPU RNG (dropout);
* ``StatefulSampler`` records its epoch and position, and the DataLoader iterator is recreated from it after a
  resume, so the run continues mid-epoch with the same batch order;
* the DataLoader gets its own ``torch.Generator``, so creating an iterator does not draw from the global torch RNG;
* ``step`` counts *completed* optimizer steps: the loss of the update that takes the model from step s-1 to s is
  logged as ``{"step": s}`` and ``store.save(state, s)`` is called after it, so a resume from s continues with
  step s+1 and nothing is repeated or skipped.

Log lines (``--log``) are appended with one ``write()`` each, so a kill never leaves half a line. After a kill the
steps since the last checkpoint are redone and logged again (with the same values).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, Sampler

# Run from a checkout without installing: prefer the ckptstore package next to examples/.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_REPO, "ckptstore", "__init__.py")) and _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# --------------------------------------------------------------------------------------------------------------
# data


def load_corpus(max_bytes: int = 400_000) -> bytes:
    """A fixed, deterministic corpus: the standard library's top-level ``.py`` files, sorted by name, concatenated
    until ``max_bytes``. Same Python installation -> same bytes."""
    libdir = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(libdir) if n.endswith(".py") and os.path.isfile(os.path.join(libdir, n)))
    parts: List[bytes] = []
    total = 0
    for name in names:
        with open(os.path.join(libdir, name), "rb") as f:
            data = f.read()
        parts.append(b"# ---- " + name.encode() + b"\n" + data)
        total += len(parts[-1])
        if total >= max_bytes:
            break
    corpus = b"".join(parts)[:max_bytes]
    if len(corpus) < 10_000:
        raise RuntimeError(f"standard library corpus too small ({len(corpus)} bytes) in {libdir}")
    return corpus


class WindowDataset(Dataset):
    """Fixed-length windows of ``block + 1`` bytes at stride ``block``. Each fetch shifts its window by a random
    offset in ``[0, block)`` drawn from Python's global ``random`` (so that RNG is part of the training state)."""

    def __init__(self, data: torch.Tensor, block: int, shift: bool = True):
        self.data, self.block, self.shift = data, block, shift
        self.n = (len(data) - 2 * block - 1) // block

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.block + (random.randrange(self.block) if self.shift else 0)
        return self.data[start:start + self.block + 1]


class StatefulSampler(Sampler[int]):
    """A shuffling sampler that can be checkpointed mid-epoch.

    Epoch ``e`` visits ``randperm(n)`` drawn from a private generator seeded with ``(seed, e)``. ``position`` is
    the number of indices of the current epoch already handed out; it is advanced *before* an index is yielded,
    so at any point between DataLoader batches (num_workers=0, no prefetch) it equals the number of samples
    consumed. ``__iter__`` starts at ``position``; an exhausted epoch rolls over to the next one.
    """

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed
        self.epoch, self.position = 0, 0

    def _perm(self, epoch: int) -> List[int]:
        g = torch.Generator()
        g.manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        if self.position >= self.n:
            self.epoch, self.position = self.epoch + 1, 0
        perm = self._perm(self.epoch)
        while self.position < self.n:
            idx = perm[self.position]
            self.position += 1
            yield idx

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["n"]) != self.n or int(sd["seed"]) != self.seed:
            raise ValueError(f"sampler state for n={sd['n']} seed={sd['seed']}, this run has n={self.n} "
                             f"seed={self.seed}")
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


# --------------------------------------------------------------------------------------------------------------
# model


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // self.heads))
        att = att.masked_fill(mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.resid_drop(self.proj(y))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    """Byte-level causal transformer (GPT-style, pre-LN, learned positions, tied embeddings)."""

    def __init__(self, block: int = 64, d_model: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.zeros(block, d_model))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.register_buffer("mask", torch.triu(torch.ones(block, block, dtype=torch.bool), 1), persistent=False)
        nn.init.normal_(self.pos, std=0.02)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos[: idx.shape[1]])
        for b in self.blocks:
            x = b(x, self.mask)
        return self.ln(x) @ self.tok.weight.t()


def lr_lambda_factory(warmup: int, decay_steps: int, min_ratio: float = 0.1):
    """Linear warmup then cosine decay to ``min_ratio`` at ``decay_steps`` (flat after). Independent of
    ``--steps``, so a run may be extended on resume."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return f


# --------------------------------------------------------------------------------------------------------------
# training


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--store", required=True, help="local store root (checkpoints live here)")
    p.add_argument("--steps", type=int, default=300, help="train until this many optimizer steps are done")
    p.add_argument("--ckpt-every", type=int, default=25, help="save a checkpoint every N steps (and at the end)")
    p.add_argument("--log", default=None, help="append one JSON line per step: {'step': s, 'loss': x}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=64, help="context length in bytes")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--decay-steps", type=int, default=1000, help="cosine horizon (independent of --steps)")
    p.add_argument("--noise", type=float, default=0.02, help="fraction of input bytes replaced by random bytes "
                   "(NumPy global RNG)")
    p.add_argument("--corpus-bytes", type=int, default=400_000)
    p.add_argument("--sleep-per-step", type=float, default=0.0, help="sleep this long after each step (so a kill "
                   "lands at a random point)")
    p.add_argument("--ballast-mb", type=float, default=0.0, help="add this many MB of incompressible state that "
                   "changes every save (makes saves slow, for crash tests; checked on resume)")
    p.add_argument("--remote", default=None, help="remote store URL, passed to Store(remote=...) when set")
    p.add_argument("--storage-options", default=None, help="JSON dict, passed to Store(storage_options=...)")
    p.add_argument("--load-path", default=None, help="passed to Store(load_path=...) when set")
    p.add_argument("--memory", default=None, help="a RAM-backed directory (e.g. /dev/shm/run): saves go to the memory "
                   "tier every --ckpt-every steps, and to --store every --disk-every steps (ckptstore.Memory)")
    p.add_argument("--disk-every", type=int, default=None, help="with --memory: promote every N-th step to --store")
    p.add_argument("--nonblocking", action="store_true", help="save(blocking=False): training goes on while the "
                   "step is hashed and written")
    p.add_argument("--quiet", action="store_true", help="no per-checkpoint messages")
    return p


def run_config(args: argparse.Namespace) -> dict:
    """Everything that determines the numbers (the store refuses to resume into a run whose config differs,
    except ``steps``)."""
    keys = ("steps", "seed", "block", "d_model", "layers", "heads", "dropout", "batch_size", "lr",
            "weight_decay", "warmup", "decay_steps", "noise", "corpus_bytes")
    return {k: getattr(args, k) for k in keys}


def _ballast(base: torch.Tensor, step: int) -> torch.Tensor:
    return torch.bitwise_xor(base, step % 251 + 1)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from ckptstore import Memory, RNGState, Store

    torch.set_num_threads(1)  # one thread: reproducible reductions, and fast for a model this small
    # (not torch.use_deterministic_algorithms: it imports torch._inductor, +2 s per start, and CPU ops used here
    # are deterministic anyway; the tests check it)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    data = torch.frombuffer(bytearray(load_corpus(args.corpus_bytes)), dtype=torch.uint8).long()
    dataset = WindowDataset(data, args.block)
    sampler = StatefulSampler(len(dataset), seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=0,
                        generator=torch.Generator().manual_seed(args.seed))  # private: iter() draws a base seed
    model = TinyLM(args.block, args.d_model, args.layers, args.heads, args.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda_factory(args.warmup, args.decay_steps))

    state = {"model": model, "optimizer": opt, "scheduler": sched, "rng": RNGState(), "sampler": sampler,
             "progress": {"step": 0, "epoch": 0, "position": 0}}
    ballast_base = None
    if args.ballast_mb > 0:
        g = torch.Generator().manual_seed(12345)
        ballast_base = torch.randint(0, 256, (int(args.ballast_mb * 2**20),), dtype=torch.uint8, generator=g)
        state["ballast"] = _ballast(ballast_base, 0)

    store_kw = {}
    if args.remote:
        store_kw["remote"] = args.remote
    if args.storage_options:
        store_kw["storage_options"] = json.loads(args.storage_options)
    if args.load_path:
        store_kw["load_path"] = args.load_path
    if args.memory:
        store_kw["memory"] = Memory(args.memory, every=args.ckpt_every, disk_every=args.disk_every)

    log_fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.log else None
    with Store(args.store, config=run_config(args), config_may_change=("steps",), **store_kw) as store:
        start = store.resume(state)
        if start is None:
            step = 0
            print("fresh start", flush=True)
        else:
            step = int(start)
            prog = state["progress"]
            if int(prog["step"]) != step:
                raise RuntimeError(f"resumed step {step} but progress says {prog}")
            if ballast_base is not None and not torch.equal(state["ballast"], _ballast(ballast_base, step)):
                raise RuntimeError(f"ballast restored at step {step} does not match what was saved")
            print(f"resumed from step {step}", flush=True)

        model.train()
        it = iter(loader)  # starts at the sampler's (restored) epoch/position
        t0 = time.perf_counter()
        first = step
        saved = step if start is not None else None
        while step < args.steps:
            try:
                batch = next(it)
            except StopIteration:  # epoch done: the sampler rolls over to the next one
                it = iter(loader)
                batch = next(it)
            x, y = batch[:, :-1].clone(), batch[:, 1:]
            if args.noise > 0:
                noise = np.random.random_sample(x.shape) < args.noise
                repl = np.random.randint(0, 256, size=x.shape)
                x[torch.from_numpy(noise)] = torch.from_numpy(repl)[torch.from_numpy(noise)]
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            lossv = loss.item()
            if log_fd is not None:
                os.write(log_fd, (json.dumps({"step": step, "loss": lossv}) + "\n").encode())
            if step % args.ckpt_every == 0 or step == args.steps:
                state["progress"] = {"step": step, "epoch": sampler.epoch, "position": sampler.position}
                if ballast_base is not None:
                    state["ballast"] = _ballast(ballast_base, step)
                if not args.quiet:
                    print(f"saving step {step}", flush=True)
                res = store.save(state, step, metrics={"loss": lossv}, blocking=not args.nonblocking)
                saved = step
                if not args.quiet and res is not None and args.nonblocking:
                    print(f"saving step {step} in the background (stalled {res.stall_seconds:.3f}s)", flush=True)
                elif not args.quiet and res is not None:
                    print(f"saved step {step} loss={lossv:.4f} wrote {res.bytes_written}/{res.bytes_total} B "
                          f"({res.blobs_new}/{res.blobs_total} blobs) in {res.seconds:.3f}s", flush=True)
            if args.sleep_per_step > 0:
                time.sleep(args.sleep_per_step)
        dt = time.perf_counter() - t0
        n = step - first
        print(f"done: step {step}, last checkpoint {saved}, {n} steps in {dt:.2f}s "
              f"({1000 * dt / max(1, n):.1f} ms/step incl. saves)", flush=True)
    if log_fd is not None:
        os.close(log_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
