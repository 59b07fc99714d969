"""The commit agreement at 256 simulated ranks (issue 19): one real TCPStore, a connection and a thread per rank.
The state is a 70B-shaped FSDP2 + AdamW one (2,169 sharded tensors and 723 plain values per rank) or a 7B one.
See tests/simranks.py."""
from __future__ import annotations

import pytest

from ckptstore.format.manifest import decode_commit
from ckptstore.format.shardmap import ShardMap
from simranks import SimJob, llama_manifest, llama_params

N = 256
KB, MiB = 1024, 1 << 20


def test_256_ranks_commit_with_small_messages_and_leave_no_keys():
    """Rank 0 runs the save's commit code on its 70B-shaped manifest; the other ranks run the agreement with the
    parts that code computes for them (ranks 1, 255 and up to 4 random others from their own manifests,
    checked alike: each costs about a second; every rank computing its own is the 64-rank test below)."""
    job = SimJob(N, shape="70b", full=False, sample=4)
    try:
        check_first_save(job)
    finally:
        job.close()


def check_first_save(job):
    before = job.keys()
    outs = job.save(1)
    assert [o.error for o in outs if not o.committed] == []
    assert outs[0].wrote_marker and not any(o.wrote_marker for o in outs[1:])          # one shared root
    assert max(o.received for o in outs[1:]) <= KB                    # the verdict only
    assert max(o.sent for o in outs[1:]) <= KB                        # a fixed-size part, whatever the state
    assert max(c.largest_value for c in job.coords) <= MiB
    assert job.keys() == before                                        # the agreement deleted its keys

    files = job.files["/shared"]
    commit = decode_commit(files["1/COMMIT"], step=1, what="COMMIT")
    assert sorted(commit.manifests) == list(range(N)) and commit.shards is not None
    assert commit.shards[1] == len(files["1/shards"]) < MiB        # O(keys + ranks), not O(keys x ranks)
    smap = ShardMap.decode(files["1/shards"], step=1, world_size=N, what="shards")
    assert sorted(smap.rank_local) == [("progress", "position"), ("rng", "torch")]
    # the map, described by rule, names exactly the saved ranks whose shards overlap a target box
    name, g = next((n, g) for n, g in llama_params("70b") if len(g) == 2 and g[0] % N == 0)
    per = g[0] // N
    path = ("optimizer", "state", name, "exp_avg")
    assert smap.ranks(path, g, ((0, 0), (g[0], g[1])), prefer=0) == list(range(N))     # 256 -> 1 rank
    assert smap.ranks(path, g, ((per * 10, 0), (per * 2, g[1])), prefer=0) == [10, 11]  # 256 -> 128 ranks
    assert smap.ranks(path, g, ((per * 10 + 1, 0), (per, g[1])), prefer=0) == [10, 11]
    assert smap.ranks(path, (g[0] + 1, g[1]), ((0, 0), (1, 1)), prefer=0) is None       # another global shape
    m7 = llama_manifest("70b", 7, N, job.grid)
    smap.check_manifest(m7, step=1)                    # every rank holds every sharded key, at the rule's box
    first = next(i for i, n in enumerate(m7.nodes) if n.kind == "dtensor")
    with pytest.raises(Exception, match="sharded keys"):
        smap.check_manifest(m7.replace(nodes=m7.nodes[:first] + m7.nodes[first + 1:]), step=1)


@pytest.fixture
def job():
    """256 ranks of a 7B-shaped state; rank 0 runs the save's commit code on its manifest, the others send the
    parts it computes for them (a sample computed from real manifests: ranks 1, 255 and up to 4 random others)."""
    j = SimJob(N, shape="7b", full=False, sample=4)
    yield j
    j.close()


def test_a_missing_rank_is_named_and_a_failed_agreement_leaves_every_rank_able_to_save(job):
    before = job.keys()
    outs = job.save(2, timeout=3, absent=[5])
    for r, o in enumerate(outs):
        if r != 5:
            assert o.committed is False and "rank 5" in o.error and "step 2 was not committed" in o.error, (r, o)
    assert "did not reach the commit within 3 s" in outs[0].error
    assert "2/COMMIT" not in job.files["/shared"]

    outs = job.save(3, failing=[7])                    # one rank fails to write its manifest
    assert all(o.committed is False and "rank 7" in o.error and "could not write its manifest" in o.error
               for o in outs)
    assert max(o.received for o in outs[1:]) <= KB
    assert "3/COMMIT" not in job.files["/shared"]

    outs = job.save(4)                                 # every rank can save again; no key is left behind
    assert all(o.committed for o in outs)
    assert job.keys() == before


def test_node_local_roots_get_their_commit_marker_and_shard_map_from_their_leader():
    """Every rank runs the save's commit code on its own manifest."""
    j = SimJob(64, shape="7b", ranks_per_root=8, full=True)
    try:
        before = j.keys()
        outs = j.save(1)
        assert all(o.committed for o in outs)
        leaders = [r for r, o in enumerate(outs) if o.wrote_marker]
        assert leaders == list(range(0, 64, 8))
        for r in range(8, 64, 8):
            files = j.files[f"/node{r // 8}"]
            assert files["1/COMMIT"] == j.files["/node0"]["1/COMMIT"]
            assert files["1/shards"] == j.files["/node0"]["1/shards"]          # built by the leader itself
        others = [o.received for r, o in enumerate(outs) if r % 8]
        assert max(others) <= KB
        marker = len(j.files["/node0"]["1/COMMIT"])
        assert max(outs[r].received for r in leaders[1:]) <= marker + KB      # the marker, not the map
        assert j.keys() == before
    finally:
        j.close()


def test_the_rule_walk_names_exactly_the_ranks_torch_places_overlapping_shards_on():
    """The shard map's rule against torch's own placement of every coordinate, on 1-D to 3-D meshes with
    Shard / Replicate placements (nested shards of one dim included), uneven and empty shards, random grids."""
    import random

    import numpy as np
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from ckptstore.format.shardmap import _chunk, _Rule, parse_placements
    for size in range(0, 40):
        for n in range(1, 9):
            assert [_chunk(size, n, c) for c in range(n)] == \
                [tuple(int(x) for x in Shard.local_shard_size_and_offset(size, n, c)) for c in range(n)]
    rng = random.Random(19)
    for _ in range(300):
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        g = tuple(rng.randint(0, 13) for _ in range(rng.randint(1, 3)))
        strs = [rng.choice(["R"] + [f"S({d})" for d in range(len(g))]) for _ in mesh]
        objs = [Replicate() if p == "R" else Shard(int(p[2:-1])) for p in strs]
        size = int(np.prod(mesh))
        grid = np.array(rng.sample(range(size + 3), size), dtype="<i4")      # a sub-mesh of a larger world
        rule = _Rule([(mesh, grid)], {b"k" * 8: (0, g, parse_placements(strs))})
        box_of = {}
        for flat in range(size):
            coord = np.unravel_index(flat, mesh)
            shape, off = _compute_local_shape_and_global_offset(g, mesh, [int(c) for c in coord], objs)
            box_of[int(grid[flat])] = (off, shape, coord)
        lo = tuple(rng.randint(0, d) for d in g)
        box = (lo, tuple(rng.randint(0, d - o) for d, o in zip(g, lo)))
        got = rule.ranks(b"k" * 8, g, box, prefer=int(grid[0]))
        if 0 in box[1]:
            assert got == []
            continue

        def overlaps(off, shape):
            return all(o < b0 + b1 and o + s > b0 and s > 0 for o, s, b0, b1 in zip(off, shape, *box))
        want_boxes = {tuple(zip(off, shape)) for off, shape, _ in box_of.values() if overlaps(off, shape)}
        got_boxes = {tuple(zip(box_of[r][0], box_of[r][1])) for r in got}
        assert got_boxes == want_boxes, (mesh, g, strs, box)            # every overlapping box, no other
        assert len(got) == len(got_boxes)                               # one rank per replicated box


def test_a_shard_map_written_before_issue_19_is_still_read():
    """The older map form (one box per saved rank and key) decodes and selects the same ranks."""
    from ckptstore.format.manifest import frame
    from ckptstore.format.shardmap import key_hash
    path = ("model", "w")
    boxes = [[key_hash(path), [[r, [3 * r, 0], [3, 4]] for r in range(4)]]]
    data = frame("shards", {"step": 5, "world_size": 4, "boxes": boxes, "rank_local": [["rng"]]})
    smap = ShardMap.decode(data, step=5, world_size=4, what="shards")
    assert smap.ranks(path, (12, 4), ((4, 0), (4, 4)), prefer=0) == [1, 2]
    assert smap.rank_local == [("rng",)]
    from ckptstore.format.manifest import ArrayEntry, Manifest, ManifestNode
    from ckptstore.state.sharding import ShardInfo

    def rank2(offset):
        entry = ArrayEntry("float32", (3, 4), [], shard=ShardInfo((12, 4), offset, (4,), ("S(0)",)))
        return Manifest(step=5, rank=2, world_size=4, stateful=[], nodes=[
            ManifestNode((), "dict"), ManifestNode(("model",), "dict"), ManifestNode(path, "dtensor", entry)])
    smap.check_manifest(rank2((6, 0)), step=5)
    with pytest.raises(Exception, match="does not describe rank 2's shard of 'model/w'"):
        smap.check_manifest(rank2((3, 0)), step=5)
    with pytest.raises(Exception, match="invalid shard map"):
        ShardMap.decode(frame("shards", {"step": 5, "world_size": 4, "boxes": [[key_hash(path), [[9, [0, 0], [3, 4]]]]],
                                         "rank_local": None}), step=5, world_size=4, what="shards")


def test_device_meshes_are_told_apart_by_their_ranks_not_by_object():
    """DTensors on distinct DeviceMesh objects of the same ranks (a grid each) make one mesh of the map."""
    import dataclasses

    import numpy as np
    from ckptstore.format.shardmap import build_rule, layout
    grid = np.arange(16, dtype="<i4").tobytes()
    m = llama_manifest("tiny", 3, 16, grid)
    same = llama_manifest("tiny", 3, 16, grid)
    for n in same.nodes:                                  # a new grid object per DTensor, equal bytes
        if n.kind == "dtensor":
            n.payload.shard = dataclasses.replace(n.payload.shard, grid=bytes(bytearray(grid)))
    assert layout(same, 3) == layout(m, 3) and layout(m, 3)[1] is True
    data = build_rule(1, 16, same, [])
    assert data == build_rule(1, 16, m, [])
    assert len(ShardMap.decode(data, step=1, world_size=16, what="shards")._rule.meshes) == 1


def test_past_inline_rows_leaders_and_resuming_ranks_handle_a_bounded_amount_of_metadata():
    """600 ranks (> ``mtable.INLINE_ROWS``), node-local roots of 8: the marker names a manifest table instead of
    holding 600 rows; a leader receives the marker and its own root's 8 rows (issue 29: it received the whole
    marker, 41 B a rank), and a rank resuming on 300 ranks reads the marker, the shard map and the pages of the
    table holding the rows it needs (rank 0's and the few saved ranks its shards overlap), not every row."""
    from ckptstore.format import mtable
    n = 600
    assert n > mtable.INLINE_ROWS
    j = SimJob(n, shape="7b", ranks_per_root=8, full=False, sample=2)
    try:
        outs = j.save(1)
        assert all(o.committed for o in outs)
        leaders = [r for r, o in enumerate(outs) if o.wrote_marker]
        assert leaders == list(range(0, n, 8))
        commit = decode_commit(j.files["/node0"]["1/COMMIT"], step=1, what="COMMIT")
        assert commit.table is not None and len(j.files["/node0"]["1/COMMIT"]) < 4 * KB
        assert max(o.received for o in outs[1:]) <= KB                   # leaders included
        assert max(c.largest_lead for c in j.coords) <= KB
        rows = [k for k in j.files["/node3"] if "/rows-" in k]
        assert len(rows) == 1 and ".r00024." in rows[0]                   # node 3's rows, in its root
        for rank in (0, 1, 150, 299):
            got = j.resume_reads(1, rank, n // 2)
            # rank 0's page and at most two more (the overlapping ranks are consecutive)
            assert got["ranks"] <= 16 and got["rows_B"] <= 3 * mtable.ROWS_PER_PAGE * mtable.ROW.size, got
            assert got["total_B"] <= 64 * KB, got
    finally:
        j.close()
