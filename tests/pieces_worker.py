"""One rank of a 4-rank (2 x 2 mesh) job for a DTensor whose local tensor is several pieces of the global one:
``(Shard(0), _StridedShard(0, split_factor=2))`` (a split factor that fits no sharding order, so torch splits
left to right: rank (0, 0) of 7 rows holds rows 0 and 2). ckptstore saves one box per rank and key, so it must
refuse such a value at save and as a resume target, naming it, never place it as one box. Launched by
tests/dist.py; prints one ``RESULT`` per rank."""
import argparse

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from ckptstore import Store
from ckptstore.util.errors import CheckpointError
from rank import finish, join, result

PIECES = [Shard(0), _StridedShard(0, split_factor=2)]


def strided(full, mesh):
    """``full`` laid out as :data:`PIECES` by torch's own redistribute (``distribute_tensor`` wants even sizes)."""
    return DTensor.from_local(full, mesh, [Replicate(), Replicate()], run_check=False).redistribute(mesh, PIECES)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    args = ap.parse_args()
    rank, world = join()
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    out = {"rank": rank}
    with Store(args.store, collective_timeout=60) as store:
        held = strided(full, mesh)
        out["held"] = held.to_local()[:, 0].div(3).long().tolist()          # the global rows, in local order
        try:                                                                # 1. save: refused
            store.save({"w": held}, 1)
            out["save"] = "committed"
        except CheckpointError as e:
            out["save"] = f"{type(e).__name__}: {e}"
        store.save({"w": distribute_tensor(full, mesh, [Shard(0), Replicate()])}, 2)
        target = strided(torch.zeros(7, 3), mesh)        # 2. resume into it: refused
        try:
            out["resume"] = f"step {store.resume({'w': target})}"
        except CheckpointError as e:
            out["resume"] = f"{type(e).__name__}: {e}"
        out["untouched"] = bool(torch.equal(target.to_local(), torch.zeros_like(target.to_local())))
    result(out)
    finish()


if __name__ == "__main__":
    main()
