"""Read each byte once at resume (issue 19, ckptstore/fanout.py): real DDP + AdamW jobs on gloo / 127.0.0.1
(tests/read_once_worker.py). Each load job resumes twice in the same processes: first with read-once turned off
(``CKPTSTORE_READ_ONCE=0``: every rank reads all it needs, as before), then on; every rank counts the chunk bytes
it reads through the storage layer (every read of ``objects/`` and ``packs/``). The values must be bit for bit
the saved ones both times, and the job must read the step's unique chunk bytes once instead of once per rank."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ckptstore import Store
from ckptstore.layout import blob_path
from ckptstore.manifest import ARRAY_KINDS
from dist import Job

WORKER = Path(__file__).resolve().parent / "read_once_worker.py"


def run(world: int, *args: str):
    return Job(world, *args, worker=WORKER).check(180)


def unique_chunk_bytes(root: Path, step: int) -> int:
    """Stored bytes of the distinct chunks the manifests of ``step`` name (a blob's file size, a packed chunk's
    stored range), over every saved rank's manifest."""
    with Store(root) as s:
        commit = s.catalog.read_commit(step)
        seen = {}
        for r in range(commit.world_size):
            for n in s.catalog.read_manifest(commit, r).nodes:
                if n.kind in ARRAY_KINDS:
                    for c in n.payload.chunks:
                        if c.pack is not None:
                            seen[(c.pack, c.offset)] = c.stored
                        else:
                            seen[c.blob_id] = (root / blob_path(c.blob_id, c.codec)).stat().st_size
    return sum(seen.values())


@pytest.fixture(scope="module")
def replicated3(tmp_path_factory):
    """3-rank DDP, ``save(replicated=["app"])`` (the DDP recipe: rank 0 alone holds model and optimizer), default
    packing, steps 1 and 2; the saved digests."""
    root = tmp_path_factory.mktemp("rep3") / "store"
    res = run(3, "--mode", "save", "--store", str(root), "--replicated", "app")
    assert len({r["digests"]["2"] for r in res.values()}) == 1
    return root, res[0]["digests"]


@pytest.fixture(scope="module")
def plain2(tmp_path_factory):
    """2-rank DDP without ``replicated`` (each rank saves the same tensors: the same chunk ids), every chunk a
    blob of its own (``Packing(threshold=0)``), steps 1 and 2; the saved digests."""
    root = tmp_path_factory.mktemp("plain2") / "store"
    res = run(2, "--mode", "save", "--store", str(root), "--threshold", "0")
    return root, res[0]["digests"]


def check_read_once(res, digests, unique: int, world: int):
    for label in ("before", "after"):
        got = [res[r][label] for r in sorted(res)]
        assert [g["step"] for g in got] == [2] * world, (label, got)
        assert {g["digest"] for g in got} == {digests["2"]}, label          # bit for bit, on every rank
        assert not any(g["warnings"] for g in got), [g["warnings"] for g in got]
    before = [res[r]["before"]["read"] for r in sorted(res)]
    after = [res[r]["after"]["read"] for r in sorted(res)]
    # as before: every rank reads every byte (a blob used twice, e.g. AdamW's equal "step" scalars, twice)
    assert all(unique <= b <= unique + 1024 for b in before), (before, unique)
    assert sum(after) == unique, (after, unique)               # now: each unique byte once, job-wide
    assert all(a > 0 for a in after), after                    # spread over the ranks, not all on rank 0
    assert max(after) < unique, after
    for r in sorted(res):
        stats = res[r]["after"]["resumed_from"]["read_once"]
        assert stats["read_bytes"] + stats["received_bytes"] == stats["shared_bytes"]
        assert "read_once" not in res[r]["before"]["resumed_from"]


def test_replicated_keys_are_read_once_by_the_job(replicated3):
    """save(replicated=[...]): every rank used to read rank 0's chunks; now each chunk is read by one rank."""
    root, digests = replicated3
    res = run(3, "--mode", "load", "--store", str(root), "--compare", "1")
    check_read_once(res, digests, unique_chunk_bytes(root, 2), 3)


def test_a_world_size_change_reads_rank_0s_values_once(replicated3):
    """3 ranks saved, 2 resume: every rank reads rank 0's plain values; now once for the job."""
    root, digests = replicated3
    res = run(2, "--mode", "load", "--store", str(root), "--compare", "1")
    check_read_once(res, digests, unique_chunk_bytes(root, 2), 2)


def test_identical_tensors_saved_by_every_rank_are_read_once(plain2):
    """DDP without replicated: each rank's manifest names the same chunk ids; each blob file is now read by
    exactly one rank, whole."""
    root, digests = plain2
    res = run(2, "--mode", "load", "--store", str(root), "--compare", "1")
    check_read_once(res, digests, unique_chunk_bytes(root, 2), 2)
    paths = [res[r]["after"]["paths"] for r in sorted(res)]
    assert not set(paths[0]) & set(paths[1])                       # no blob read by both ranks
    for r in sorted(res):
        assert all(p.startswith("objects/") for p in paths[r])


def test_a_damaged_chunk_read_by_one_rank_sends_every_rank_to_the_older_step(plain2, tmp_path):
    """A chunk of step 2 only (not in step 1) is damaged: the one rank that reads it finds it does not match
    its id, every rank gets that error for step 2 and all resume step 1 together, bit for bit."""
    src, digests = plain2
    root = tmp_path / "store"
    shutil.copytree(src, root)
    with Store(root) as s:
        def blobs(step):
            commit = s.catalog.read_commit(step)
            return {c.blob_id: c.codec for n in s.catalog.read_manifest(commit, 0).nodes if n.kind in ARRAY_KINDS
                    for c in n.payload.chunks}
        only2 = sorted(set(blobs(2)) - set(blobs(1)))
    assert only2
    bad = blob_path(only2[0], "raw")                                # Writing's default codec
    path = root / bad
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    res = run(2, "--mode", "load", "--store", str(root))
    got = [res[r]["after"] for r in sorted(res)]
    assert [g["step"] for g in got] == [1, 1]
    assert {g["digest"] for g in got} == {digests["1"]}
    readers = [r for r in sorted(res) if bad in got[r]["paths"]]
    assert len(readers) == 1, readers                               # read by its owner alone
    owner = readers[0]
    for r in sorted(res):
        warned = " ".join(got[r]["warnings"])
        assert "cannot resume from step 2" in warned and only2[0] in warned, warned
        if r != owner:                                              # the owner's error reached the others
            assert f"rank {owner} could not read its share" in warned, warned
