"""Where a DTensor's local tensor sits in the global tensor when its placements include ``_StridedShard``
(FSDP2 + tensor parallel, torchtitan's 2-D and 3-D layouts; issue 29), checked against torch itself: for every
rank of a grid of meshes, placements and sizes (uneven ones included), a tensor of its own indices is
``redistribute``d by torch over a fake process group (no processes) and the indices the rank's local tensor
holds must be exactly the box ckptstore saves it as (``local_shard``) and fills it as (``target_box``), or, where
they are not one box, both must refuse. ``compute_local_shape_and_global_offset`` is wrong for uneven
strided shards (it splits ``_StridedShard`` left to right): ckptstore refused to save those, or saved them at the
wrong offset. The multi-process save and resume is in tests/distributed/test_distributed.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from ckptstore.state.sharding import local_shard, target_box


def fsdp_tp(mesh_shape):
    """FSDP2 over tensor parallel (what ``fully_shard`` gives a colwise weight): ``_S(0, tp), S(0)``; with a
    leading replicate dim for HSDP."""
    tp = mesh_shape[-1]
    return [Replicate()] * (len(mesh_shape) - 2) + [_StridedShard(0, split_factor=tp), Shard(0)]


LAYOUTS = [((2, 2), fsdp_tp((2, 2))), ((3, 2), fsdp_tp((3, 2))), ((2, 3), fsdp_tp((2, 3))),
           ((4, 2), fsdp_tp((4, 2))), ((3, 3), fsdp_tp((3, 3))), ((2, 3, 2), fsdp_tp((2, 3, 2))),
           # 3-D: dp shards a dim two inner mesh dims shard (torch's own docstring example, smaller)
           ((2, 3, 2), [_StridedShard(0, split_factor=6), _StridedShard(0, split_factor=2), Shard(0)]),
           # split factors that fit no sharding order: torch splits left to right, possibly into pieces
           ((2, 2), [Shard(0), _StridedShard(0, split_factor=2)]),
           ((2, 2), [_StridedShard(0, split_factor=3), Shard(0)])]


def indices_held(mesh_shape, placements, n, rank):
    """Per case: (global indices this rank's local tensor holds in local order, the DTensor) by torch's own
    ``redistribute`` of ``arange(n)``, on a fake process group."""
    world = 1
    for s in mesh_shape:
        world *= s
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", mesh_shape)
        full = DTensor.from_local(torch.arange(n), mesh, [Replicate()] * len(mesh_shape), run_check=False)
        t = full.redistribute(mesh, placements)
        yield t.to_local().tolist(), t, mesh
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape,placements", LAYOUTS, ids=lambda v: str(v))
def test_the_saved_and_filled_box_of_a_strided_dtensor_is_what_torch_puts_there(mesh_shape, placements):
    world = 1
    for s in mesh_shape:
        world *= s
    placed = refused = wrong_by_torch = 0
    for n in range(1, 25):
        for rank in range(world):
            for held, t, mesh in indices_held(mesh_shape, placements, n, rank):
                one_box = held == list(range(held[0], held[0] + len(held))) if held else True
                if one_box:
                    local, info = local_shard(t)
                    box = (info.offset, tuple(local.shape))
                    assert torch.equal(local, t.to_local())
                    want = (held[0] if held else n,)
                    assert box == (want, (len(held),)), (mesh_shape, placements, n, rank, held, box)
                    assert target_box(t) == box
                    placed += 1
                    shape, off = compute_local_shape_and_global_offset((n,), mesh, placements)
                    wrong_by_torch += (tuple(off), tuple(shape)) != box and len(held) > 0
                else:                   # several pieces: refused, never placed as one box
                    with pytest.raises(TypeError, match="not one box|cannot place it"):
                        local_shard(t)
                    with pytest.raises(TypeError, match="not one box|cannot place it"):
                        target_box(t)
                    refused += 1
    assert placed
    if placements == fsdp_tp(mesh_shape):            # FSDP2 + TP: always one box, whatever the sizes
        assert refused == 0
    print(mesh_shape, placements, "placed", placed, "refused", refused, "torch's compute wrong", wrong_by_torch)


def test_uneven_fsdp_tp_shards_are_the_cases_torchs_compute_gets_wrong():
    """The grid above exercises the bug: on a 3 x 2 mesh a 13-row tensor's rank (2, 0) holds row 6 only, rank
    (2, 1) rows 11-12 (torch's redistribute, as ``fully_shard`` chunks the tensor parallel shard), while
    ``compute_local_shape_and_global_offset`` says 2 rows from 6 and 1 row from 12."""
    placements = fsdp_tp((3, 2))
    got = {}
    for rank in (4, 5):
        for held, t, mesh in indices_held((3, 2), placements, 13, rank):
            shape, off = compute_local_shape_and_global_offset((13,), mesh, placements)
            local, info = local_shard(t)
            got[rank] = (held, (tuple(off), tuple(shape)), (info.offset, tuple(local.shape)))
    assert got[4] == ([6], ((6,), (2,)), ((6,), (1,)))
    assert got[5] == ([11, 12], ((12,), (1,)), ((11,), (2,)))
