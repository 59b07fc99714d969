"""The shard map's rule for FSDP2 + tensor parallel layouts (issue 29 item 4): ``_StridedShard`` placements and
sub-meshes (FSDP2's ``dp`` mesh of a ``dp x tp`` mesh, whose slices hold the same shards) are walked, checked
against torch's own placement of every element (``Shard._split_tensor`` / ``_StridedShard._split_tensor`` on
index tensors), not against a re-derivation. The multi-process resume is in tests/distributed/test_distributed.py."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ckptstore.format.manifest import frame
from ckptstore.format.shardmap import ShardMap, _Rule, _split, key_hash, parse_placements, rule_box


def torch_indices(g, mesh, objs, coord):
    """Per tensor dim, the global indices coordinate ``coord`` holds, in its local order, by torch's own split."""
    idx = [torch.arange(n) for n in g]
    for p, n, c in zip(objs, mesh, coord):
        if not isinstance(p, Replicate):          # the same placement on dim 0 of that dim's index tensor
            on0 = _StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0)
            idx[p.dim] = on0._split_tensor(idx[p.dim], n, with_padding=False)[0][c]
    return [i.tolist() for i in idx]


def expand(iv):
    return [a + i for a, s in iv for i in range(s)]


def random_layout(rng, g):
    mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
    strs, objs = [], []
    for _ in mesh:
        kind, d = rng.choice(["R", "S", "SS"]), rng.randrange(len(g))
        if kind == "R":
            strs.append("R"), objs.append(Replicate())
        elif kind == "S":
            strs.append(f"S({d})"), objs.append(Shard(d))
        else:
            sf = rng.randint(2, 4)
            objs.append(_StridedShard(d, split_factor=sf))
            strs.append(str(objs[-1]))
    return mesh, strs, objs


def test_strided_placements_parse_from_torchs_own_names():
    assert str(_StridedShard(1, split_factor=4)) == "_S(1, 4)"
    assert parse_placements(["_S(1, 4)", "S(0)", "R"]) == [("SS", 1, 4), ("S", 0, 1), ("R", -1, 1)]
    assert parse_placements(["_S(1, 0)"]) is None and parse_placements(["P(sum)"]) is None


def test_the_rule_holds_what_torch_places_for_strided_shards_element_by_element():
    """Every coordinate of 1-D to 3-D meshes mixing R, S(d) and _S(d, sf), uneven and empty shards included:
    the rule's intervals are torch's indices in torch's order, and its box is one exactly when they join up."""
    rng = random.Random(29)
    for _ in range(400):
        g = tuple(rng.randint(0, 14) for _ in range(rng.randint(1, 2)))
        mesh, strs, objs = random_layout(rng, g)
        parsed = parse_placements(strs)
        for coord in itertools.product(*(range(n) for n in mesh)):
            want = torch_indices(g, mesh, objs, coord)
            hold = {}
            for (kind, d, sf), n, c in zip(parsed, mesh, coord):
                if kind != "R":
                    hold[d] = _split(hold.get(d, [(0, g[d])]), kind, sf, n, c)
            assert [expand(hold.get(d, [(0, g[d])])) for d in range(len(g))] == want, (g, mesh, strs, coord)
            box = rule_box(g, mesh, coord, parsed)
            joined = all(w == list(range(w[0], w[0] + len(w))) for w in want if w)
            assert (box is not None) == joined, (g, mesh, strs, coord)
            if box is not None:
                assert [s for s in box[1]] == [len(w) for w in want]
                assert all(o == w[0] for o, w in zip(box[0], want) if w)


def test_the_walk_names_exactly_the_ranks_holding_elements_of_a_box_for_strided_shards_and_sub_mesh_slices():
    """The reader's walk against torch's placement of every element: a random box, the ranks whose holdings
    meet it, one rank per replicated holding (the reader's own slice first); the mesh sometimes has a leading
    slice dim (a sub-mesh's slices, rule 2)."""
    rng = random.Random(291)
    checked = 0
    for _ in range(400):
        g = tuple(rng.randint(1, 13) for _ in range(rng.randint(1, 2)))
        mesh, strs, objs = random_layout(rng, g)
        slices = rng.choice([1, 1, 2, 3])
        full = ((slices,) if slices > 1 else ()) + mesh
        size = int(np.prod(full))
        grid = np.array(rng.sample(range(size + 3), size), dtype="<i4")
        rule = _Rule([(full, grid)], {b"k" * 8: (0, g, parse_placements(strs))})
        holding = {}
        for flat in range(size):
            coord = np.unravel_index(flat, full)[len(full) - len(mesh):]
            idx = torch_indices(g, mesh, objs, [int(c) for c in coord])
            holding[int(grid[flat])] = tuple(tuple(i) for i in idx)
        lo = tuple(rng.randrange(n) for n in g)
        box = (lo, tuple(rng.randint(1, n - o) for n, o in zip(g, lo)))
        prefer = int(grid[rng.randrange(size)])
        got = rule.ranks(b"k" * 8, g, box, prefer=prefer)

        def meets(h):
            return all(any(o <= i < o + s for i in dim) for dim, o, s in zip(h, *box))
        want = {h for h in holding.values() if meets(h)}
        assert {holding[r] for r in got} == want, (g, full, strs, box)
        assert len(got) == len(want)                                # one rank per replicated holding
        if slices > 1:                   # replicas across slices come from the reader's own slice
            own = np.unravel_index(int(np.flatnonzero(grid == prefer)[0]), full)[0]
            assert all(np.unravel_index(int(np.flatnonzero(grid == r)[0]), full)[0] == own for r in got)
        checked += len(got)
    assert checked > 400


def _map(rule, mesh_shape, key_mesh, placements, world=8):
    grid = np.arange(int(np.prod(mesh_shape)), dtype="<i4").tobytes()
    return frame("shards", {"step": 1, "world_size": world, "rule": rule, "meshes": [[list(mesh_shape), grid]],
                            "keys": [[key_hash(("w",)), 0, [8], list(key_mesh), placements]], "rank_local": []})


def test_a_sub_mesh_slice_dim_needs_rule_2_and_split_factors_are_bounded():
    ok = ShardMap.decode(_map(2, (2, 2), (2,), ["S(0)"]), step=1, world_size=8, what="shards")
    assert ok.ranks(("w",), (8,), ((0,), (8,)), prefer=3) == [2, 3]      # rank 3's slice: [[0, 1], [2, 3]][1]
    for data, why in [(_map(1, (2, 2), (2,), ["S(0)"]), "is not mesh 0's"),        # rule 1 has no slices
                      (_map(2, (2, 2, 2), (2,), ["S(0)"]), "is not mesh 0's"),     # one slice dim at most
                      (_map(1, (2, 2), (2, 2), ["_S(0, 9)", "S(0)"]), "more pieces than there are ranks"),
                      (_map(1, (2,), (2,), ["_S(3, 2)"]), "shard a dim")]:
        with pytest.raises(Exception, match=why):
            ShardMap.decode(data, step=1, world_size=8, what="shards")
