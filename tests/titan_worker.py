"""One rank of a small torchtitan-style training job on CPU/gloo, checkpointed by
``ckptstore.integrations.torchtitan.CkptstoreCheckpointManager``; launched like torchrun by
tests/integrations/test_integration_torchtitan.py.

It drives the manager exactly as torchtitan's ``Trainer.train()`` does: ``load(step=load_step)`` first, then per
step ``maybe_wait_for_staging()`` before ``optimizers.step()`` and ``save(step, last_step=step == steps)``, then
``close()``. The parts are torchtitan's own: FSDP2 (``fully_shard``) model parts, ``OptimizersContainer`` from
``default_adamw`` (fused AdamW, torchtitan's default), ``LRSchedulersContainer`` (warmup + linear decay),
``ParallelAwareDataloader`` (torchdata's StatefulDataLoader, shuffled, per dp rank), and a Stateful train state
like the Trainer's. (torchtitan's debug llama cannot train on CPU: its flex / varlen attention have no CPU
backward, so the model is a tiny residual MLP LM.)

Rank 0 appends ``{"step", "loss"}`` lines to ``--log`` after each step's ``save`` returned; the last line of
stdout is ``RESULT {json}``.
"""
import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager
from helpers import arm_kill_in_save
from rank import finish, join, result

VOCAB, DIM, SEQ = 64, 32, 16


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
                                    for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.output(self.norm(h))


class Tokens(Dataset):
    """A fixed random corpus: item i is (input, label) of SEQ tokens."""

    def __init__(self, n=96):
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i, :-1], self.data[i, 1:]


class TrainState:
    """Stateful like torchtitan's Trainer: {"step", "ntokens_seen"}."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = int(sd["step"]), int(sd["ntokens_seen"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True, help="the trainer's dump_folder (base_folder)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--interval", type=int, default=1)
    ap.add_argument("--keep", type=int, default=10, help="keep_latest_k")
    ap.add_argument("--remote")
    ap.add_argument("--so", default=None, help="storage_options_json")
    ap.add_argument("--log")
    ap.add_argument("--nonblocking", type=int, default=1)
    ap.add_argument("--last-model-only", type=int, default=1)
    ap.add_argument("--load-step", type=int, default=-1)
    ap.add_argument("--memory-root", default=None, help="checkpoint.memory_root (the memory tier)")
    ap.add_argument("--disk-every", type=int, default=None, help="checkpoint.memory_disk_every")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep per step (kill window)")
    ap.add_argument("--kill-in-save", type=int, default=None,
                    help="rank 0 SIGKILLs itself inside the save of this step, before its commit marker")
    args = ap.parse_args()

    rank, world = join()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizers = default_adamw(lr=3e-3).build(model_parts=[model])
    assert all(g["fused"] for o in optimizers for g in o.param_groups)     # torchtitan's default
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8).build(
        optimizers=optimizers, training_steps=args.steps)
    dataloader = ParallelAwareDataloader(Tokens(), dp_rank=rank, dp_world_size=world, batch_size=4,
                                         shuffle=True, generator=torch.Generator().manual_seed(100 + rank))
    train_state = TrainState()
    cfg = CkptstoreCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=args.interval, keep_latest_k=args.keep,
        load_step=args.load_step, remote=args.remote, storage_options_json=args.so,
        nonblocking=bool(args.nonblocking), last_save_model_only=bool(args.last_model_only),
        memory_root=args.memory_root, memory_disk_every=args.disk_every)
    checkpointer = cfg.build(dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={"train_state": train_state}, sd_adapter=None,
                             base_folder=args.dump)
    assert type(checkpointer) is CkptstoreCheckpointManager
    if args.kill_in_save is not None and rank == 0:
        arm_kill_in_save(checkpointer.store, args.kill_in_save)

    loaded = checkpointer.load(step=cfg.load_step)
    start = train_state.step
    tier = (checkpointer.store.resumed_from or {}).get("tier")
    print(f"rank {rank} loaded={loaded} start={start}", flush=True)
    data = iter(dataloader)
    saved = []
    while train_state.step < args.steps:
        train_state.step += 1
        inputs, labels = next(data)
        train_state.ntokens_seen += inputs.numel()
        optimizers.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
        loss.backward()
        checkpointer.maybe_wait_for_staging()
        optimizers.step()
        lr_schedulers.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        t0 = time.perf_counter()
        if checkpointer.save(train_state.step, last_step=train_state.step == args.steps):
            saved.append(train_state.step)
        print(f"step {train_state.step} save {time.perf_counter() - t0:.3f}s", flush=True)
        if rank == 0 and args.log:
            with open(args.log, "a") as f:
                f.write(json.dumps({"step": train_state.step, "loss": (t / world).item()}) + "\n")
        time.sleep(args.step_sleep)
    checkpointer.close()
    result({"loaded": loaded, "start": start, "saved": saved, "tier": tier,
            "ntokens_seen": train_state.ntokens_seen})
    finish()


if __name__ == "__main__":
    sys.exit(main())
