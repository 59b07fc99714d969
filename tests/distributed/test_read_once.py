"""Read each byte once at resume (issue 19, ckptstore/distributed/fanout.py): real DDP + AdamW jobs on gloo / 127.0.0.1
(tests/read_once_worker.py). Each load job resumes several times in the same processes: with read-once turned off
(``CKPTSTORE_READ_ONCE=0``: every rank reads all it needs, as before), on (``=1``), and as ckptstore decides by
default (on for object stores and shared filesystems, off for a node's own disk); every rank counts the chunk
bytes it reads through the storage layer (every read of ``objects/`` and ``packs/``). The values must be bit for
bit the saved ones every time, and with read-once the job must read the step's unique chunk bytes once instead
of once per rank."""
from __future__ import annotations

import shutil
from pathlib import Path

import json

import pytest

from ckptstore import Store
from ckptstore.format.catalog import Catalog
from ckptstore.distributed.fanout import LOCAL_DISKS
from ckptstore.format.layout import blob_path
from ckptstore.format.manifest import ARRAY_KINDS
from ckptstore.storage import open_storage
from ckptstore.storage.local import filesystem_type
from dist import Job
from helpers import TESTS

WORKER = TESTS / "read_once_worker.py"


def run(world: int, *args: str):
    return Job(world, *args, script=WORKER).check(180)


def unique_chunk_bytes(root, step: int, storage_options=None) -> int:
    """Stored bytes of the distinct chunks the manifests of ``step`` name (a blob's file size, a packed chunk's
    stored range), over every saved rank's manifest, in the store at ``root`` (a path or a URL)."""
    storage = open_storage(str(root), storage_options)
    catalog = Catalog(storage)
    commit = catalog.read_commit(step)
    seen = {}
    for r in range(commit.world_size):
        for n in catalog.read_manifest(commit, r).nodes:
            if n.kind in ARRAY_KINDS:
                for c in n.payload.chunks:
                    if c.pack is not None:
                        seen[(c.pack, c.offset)] = c.stored
                    else:
                        seen[c.blob_id] = storage.size(blob_path(c.blob_id, c.codec))
    return sum(seen.values())


@pytest.fixture(scope="module")
def replicated2(tmp_path_factory):
    """2-rank DDP, ``save(replicated=["app"])`` (the DDP recipe: rank 0 alone holds model and optimizer), default
    packing, steps 1 and 2; the saved digests."""
    root = tmp_path_factory.mktemp("rep2") / "store"
    res = run(2, "--mode", "save", "--store", str(root), "--replicated", "app")
    assert len({r["digests"]["2"] for r in res.values()}) == 1
    return root, res[0]["digests"]


@pytest.fixture(scope="module")
def plain2(tmp_path_factory):
    """2-rank DDP without ``replicated`` (each rank saves the same tensors: the same chunk ids), every chunk a
    blob of its own (``Packing(threshold=0)``), steps 1 and 2; the saved digests."""
    root = tmp_path_factory.mktemp("plain2") / "store"
    res = run(2, "--mode", "save", "--store", str(root), "--threshold", "0")
    return root, res[0]["digests"]


def check_read_once(res, digests, unique: int, world: int, once: str = "after"):
    """Every phase resumed step 2 bit for bit on every rank; ``before``: each rank read every byte; ``once``
    (the phase reading once): the job read each unique byte once, spread over the ranks."""
    for label in res[0]:
        if label == "rank":
            continue
        got = [res[r][label] for r in sorted(res)]
        assert [g["step"] for g in got] == [2] * world, (label, got)
        assert {g["digest"] for g in got} == {digests["2"]}, label          # bit for bit, on every rank
        assert not any(g["warnings"] for g in got), [g["warnings"] for g in got]
    before = [res[r]["before"]["read"] for r in sorted(res)]
    after = [res[r][once]["read"] for r in sorted(res)]
    # as before: every rank reads every byte (a blob used twice, e.g. AdamW's equal "step" scalars, twice)
    assert all(unique <= b <= unique + 1024 for b in before), (before, unique)
    assert sum(after) == unique, (after, unique)               # now: each unique byte once, job-wide
    assert all(a > 0 for a in after), after                    # spread over the ranks, not all on rank 0
    assert max(after) < unique, after
    for r in sorted(res):
        stats = res[r][once]["resumed_from"]["read_once"]
        assert stats["read_bytes"] + stats["received_bytes"] == stats["shared_bytes"]
        assert "read_once" not in res[r]["before"]["resumed_from"]


def check_auto_on_local_disk(res, root: Path):
    """By default a node's own disk is read as before (its page cache serves the ranks of a node)."""
    if filesystem_type(str(root)) not in LOCAL_DISKS:         # a shared filesystem: read once by default
        for r in sorted(res):
            assert res[r]["auto"]["read"] == res[r]["after"]["read"]
        return
    for r in sorted(res):
        assert res[r]["auto"]["read"] == res[r]["before"]["read"]
        assert "read_once" not in res[r]["auto"]["resumed_from"]


def test_replicated_keys_are_read_once_by_the_job(replicated2):
    """save(replicated=[...]): every rank used to read rank 0's chunks; now each chunk is read by one rank."""
    root, digests = replicated2
    res = run(2, "--mode", "load", "--store", str(root), "--phases", "before,after,auto")
    check_read_once(res, digests, unique_chunk_bytes(root, 2), 2)
    check_auto_on_local_disk(res, root)


@pytest.mark.slow
def test_a_world_size_change_reads_rank_0s_values_once(replicated2):
    """2 ranks saved, 3 resume: every rank reads rank 0's plain values; now once for the job, in 3 uneven runs."""
    root, digests = replicated2
    res = run(3, "--mode", "load", "--store", str(root), "--phases", "before,after,auto")
    check_read_once(res, digests, unique_chunk_bytes(root, 2), 3)
    check_auto_on_local_disk(res, root)


def test_identical_tensors_saved_by_every_rank_are_read_once(plain2):
    """DDP without replicated: each rank's manifest names the same chunk ids; each blob file is now read by
    exactly one rank, whole."""
    root, digests = plain2
    res = run(2, "--mode", "load", "--store", str(root), "--phases", "before,after,auto")
    check_read_once(res, digests, unique_chunk_bytes(root, 2), 2)
    check_auto_on_local_disk(res, root)
    paths = [res[r]["after"]["paths"] for r in sorted(res)]
    assert not set(paths[0]) & set(paths[1])                       # no blob read by both ranks
    for r in sorted(res):
        assert all(p.startswith("objects/") for p in paths[r])


@pytest.mark.slow
def test_by_default_resume_from_s3_reads_each_byte_once(tmp_path, s3_bucket_url):
    """The DDP recipe (replicated keys) saved to a loopback S3 bucket by 2 ranks; both resume from empty
    local roots reading the bucket (read_only): by default (no CKPTSTORE_READ_ONCE) each chunk is fetched
    from the bucket by one rank."""
    url, so = s3_bucket_url.url, s3_bucket_url.storage_options
    res = run(2, "--mode", "save", "--store", str(tmp_path / "save{rank}"), "--remote", url, "--so",
              json.dumps(so), "--replicated", "app")
    digests = res[0]["digests"]
    res = run(2, "--mode", "load", "--store", str(tmp_path / "load{rank}"), "--remote", url, "--so",
              json.dumps(so), "--read-only", "1", "--phases", "before,auto")
    assert {res[r]["auto"]["resumed_from"]["tier"] for r in res} == {"remote"}
    check_read_once(res, digests, unique_chunk_bytes(url, 2, so), 2, once="auto")


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


def test_a_rank_that_fails_before_reading_still_joins_and_every_rank_falls_back(plain2, tmp_path):
    """Rank 1's manifest of step 2 is gone: rank 1 fails before it reads anything, yet takes part in the
    exchange with its error (nobody waits for it), and both ranks resume step 1 together, bit for bit."""
    src, digests = plain2
    root = tmp_path / "store"
    shutil.copytree(src, root)
    gone = list((root / "steps").glob("*2/manifest-rank00001*"))
    assert len(gone) == 1, list((root / "steps").rglob("*"))
    gone[0].unlink()
    res = run(2, "--mode", "load", "--store", str(root))
    got = [res[r]["after"] for r in sorted(res)]
    assert [g["step"] for g in got] == [1, 1]
    assert {g["digest"] for g in got} == {digests["1"]}
    assert "rank 1 could not read its share" in " ".join(got[0]["warnings"]), got[0]["warnings"]


@pytest.mark.slow
def test_a_read_once_resume_connects_each_rank_to_log_n_others(tmp_path):
    """Issue 29: 6 DDP ranks resume with read-once (every chunk a blob: several ranks read a run and broadcast
    it). gloo's binomial-tree broadcast and ring all-reduce reach ranks ``r +/- 2^i`` (mod N) only: at 6 ranks
    4 other ranks (+/-1, +/-2; +/-4 are -/+2), where a full mesh connects each rank to all 5. (6 is the fewest
    ranks where the two differ: at 4 or 5 ranks ``r +/- 2^i`` is every other rank.)"""
    world = 6
    tree = {(s << i) % world for i in range(world.bit_length()) if (1 << i) < world for s in (1, -1)} - {0}
    assert len(tree) == 4 < world - 1
    root = tmp_path / "store"
    run(world, "--mode", "save", "--store", str(root), "--threshold", "0", "--steps", "1")
    res = run(world, "--mode", "load", "--store", str(root), "--threshold", "0", "--steps", "1")
    got = [res[r]["after"] for r in sorted(res)]
    assert [g["step"] for g in got] == [1] * world and len({g["digest"] for g in got}) == 1, got
    roots = [r for r, g in enumerate(got) if g["resumed_from"]["read_once"]["read_bytes"] > 0]
    assert len(roots) > 1, roots                                    # broadcasts from several roots
    conns = [g["connections"] for g in got]
    assert all(2 <= c <= len(tree) for c in conns), (conns, roots)  # the ring's 2 at least; never all 5
