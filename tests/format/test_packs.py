"""Format 2: small chunks in pack files. Round trips, dedup measured on disk, damage inside packs, the
format-1 fixture, and packs through a real loopback S3 / GCS / memory remote."""
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointError, CorruptCheckpointError, Packing, Store, Writing, Remote
from ckptstore.format.packs import coalesce, plan_packs, ReadItem
from ckptstore.format.manifest import ChunkRef
from ckptstore.state.flatten import TORCH_DTYPES
from fixture_v1 import fixture_state
from helpers import (CHUNK_FIELDS, TESTS, bits_equal, blob_files, chunks_of_key, edit_chunk, flip_byte, pack_files,
                     rewrite_manifest)

FIXTURE = TESTS / "fixtures" / "v1_store"
SMALL = Packing(threshold=64 << 10, target_size=256 << 10)      # small sizes so tests span several packs


def many_small(n=300, seed=0, lo=1, hi=3000):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lo, hi, (n,), generator=g).tolist()
    return {"model": {f"l{i}": torch.randn(k, generator=g) for i, k in enumerate(sizes)}}


def files_under(root: Path):
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}


# -- pure planning functions ----------------------------------------------------------------------------------
def test_plan_packs_closes_groups_at_the_target():
    assert plan_packs([], 10) == []
    assert plan_packs([4, 4, 4, 4], 8) == [[0, 1], [2, 3]]
    assert plan_packs([20, 1, 1], 8) == [[0], [1, 2]]                # an oversize chunk stands alone
    assert plan_packs([3, 3, 3], 9) == [[0, 1, 2]]


def test_coalesce_merges_neighbours_within_gap_and_span():
    def item(off, n):
        return ReadItem(ChunkRef("0" * 64, n, "raw", "1" * 64, off, n), memoryview(bytearray(n)))
    spans = coalesce([item(100, 10), item(0, 50), item(50, 50), item(1000, 5)], gap=10, max_span=1 << 20)
    assert [(o, n, len(i)) for o, n, i in spans] == [(0, 110, 3), (1000, 5, 1)]
    spans = coalesce([item(0, 50), item(50, 50)], gap=10, max_span=60)
    assert [(o, n) for o, n, _ in spans] == [(0, 50), (50, 50)]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_scatter_read_fills_every_buffer_in_order(tmp_path, kind):
    """The ranged read under every packed load: more buffers than one preadv takes (IOV_MAX), empty ones, and
    a range running past the end of the file (the buffers past it stay as they were)."""
    from ckptstore.storage import open_storage
    storage = open_storage(tmp_path if kind == "local" else f"memory://scatter-{tmp_path.name}")
    data = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    storage.write_atomic("f", data)
    sizes = np.random.default_rng(1).integers(0, 40, 3000).tolist()          # 0-39 bytes each, ~58 KB in all
    bufs = [memoryview(bytearray(b"\xee" * n)) for n in sizes]
    got = storage.read_range_scatter("f", 100, bufs)
    assert got == min(sum(sizes), len(data) - 100)
    flat = b"".join(bytes(b) for b in bufs)
    assert flat[:got] == data[100:100 + got]
    assert set(flat[got:]) <= {0xee}


def test_subset_of_small_tensors_loads_through_holes_and_shared_chunks(tmp_path):
    """Resuming some top-level keys of a pack reads coalesced spans with holes (the keys left out), and two
    keys with equal bytes (one chunk, one range) both get them."""
    g = torch.Generator().manual_seed(0)
    saved = {f"k{i}": torch.randn(int(n), generator=g) for i, n in enumerate(torch.randint(1, 500, (300,), generator=g))}
    saved["twin"] = saved["k6"].clone()
    with Store(tmp_path / "s") as s:
        s.save(saved, 1)
    assert len(pack_files(tmp_path / "s")) == 1
    state = {k: None for k in list(saved)[::3]}
    with Store(tmp_path / "s") as s:
        assert s.resume(state, strict=False) == 1
    assert set(state) >= {"k6", "twin"}
    assert all(bits_equal(state[k], saved[k]) for k in state)


# -- round trips ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES.values(), key=str), ids=str)
def test_every_dtype_round_trips_through_a_pack(tmp_path, dtype):
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (4 * 33 * 16,), dtype=torch.uint8, generator=g)
    t = raw.view(dtype).reshape(4, -1) if dtype.itemsize <= 16 else raw
    state = {"t": t, "scalar": raw[:dtype.itemsize].view(dtype).reshape(()), "empty": torch.empty(0, 3, dtype=dtype)}
    with Store(tmp_path, writing=Writing(packing=SMALL)) as s:
        s.save(state, 1)
        assert pack_files(tmp_path) and not blob_files(tmp_path)
        assert bits_equal(s.load(1), state)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_chunks_at_below_and_above_the_threshold(tmp_path, codec):
    th = SMALL.threshold
    state = {"below": torch.arange(th // 4 - 1, dtype=torch.float32),          # th - 4 bytes: packed
             "at": torch.zeros(th // 4, dtype=torch.float32),                   # th bytes: a blob
             "above": torch.randn(th // 4 + 1),                                 # a blob + a 4-byte packed tail
             "multi": torch.randn(3 * th // 4 + 7),                             # chunks of th and a small tail
             "np": np.arange(100, dtype=np.int64), "npscalar": np.float64(2.5), "plain": [1, "x", None]}
    with Store(tmp_path, writing=Writing(chunk_size=th, codec=codec, packing=SMALL)) as s:
        s.save(state, 1)
        where = {k: {c.pack is not None for c in (r for *_, r in chunks_of_key(s, 1, (k,)))}
                 for k in ("below", "at", "above", "multi")}
        assert where == {"below": {True}, "at": {False}, "above": {False, True}, "multi": {False, True}}
        assert bits_equal(s.load(1), state)


def test_only_small_tensors_and_only_big_ones(tmp_path):
    small, big = many_small(), {"big": torch.randn(3, 70_000)}
    with Store(tmp_path / "a", writing=Writing(packing=SMALL)) as s:
        s.save(small, 1)
        assert bits_equal(s.load(1), small)
        assert blob_files(tmp_path / "a") == [] and 2 <= len(pack_files(tmp_path / "a")) <= 10
    with Store(tmp_path / "b", writing=Writing(packing=SMALL)) as s:
        s.save(big, 1)
        assert bits_equal(s.load(1), big) and pack_files(tmp_path / "b") == []


def test_a_save_of_many_small_tensors_is_a_handful_of_files(tmp_path):
    state = many_small(n=4000, lo=16, hi=4096)                       # 64 B - 16 KiB, as in the issue
    with Store(tmp_path) as s:
        r = s.save(state, 1)
        assert bits_equal(s.load(1), state)
    files = files_under(tmp_path)
    assert len(files) <= 4, sorted(files)                            # pack, manifest, commit, latest
    assert r.objects_new == 1 and r.blobs_new == 4000


# -- dedup, measured on disk ------------------------------------------------------------------------------------
def test_unchanged_small_tensors_are_not_written_again(tmp_path):
    state = many_small()
    with Store(tmp_path, writing=Writing(packing=SMALL)) as s:
        s.save(state, 1)
    before = files_under(tmp_path)
    with Store(tmp_path,
               writing=Writing(packing=SMALL)) as s:                       # a new process: the index is rebuilt
        state["model"]["l7"].add_(1)
        r = s.save(state, 2)
        assert bits_equal(s.load(2), state)
    after = files_under(tmp_path)
    new = {k: v for k, v in after.items() if k not in before}
    new_data = {k: v for k, v in new.items() if k.startswith(("packs/", "objects/"))}
    assert len(new_data) == 1 and sum(new_data.values()) == state["model"]["l7"].numel() * 4
    assert r.bytes_written == sum(new_data.values()) and r.objects_new == 1


def save_as_two_ranks(root, state_of_rank, step):
    """Ranks 0 and 1 of one step without a process group (rank 0 commits once rank 1's manifest exists)."""
    import threading

    def run(rank):
        with Store(root, rank=rank, world_size=2, writing=Writing(packing=SMALL)) as s:
            s.save(state_of_rank(rank), step)
    t = threading.Thread(target=run, args=(1,))
    t.start()
    run(0)
    t.join()


def test_replicated_ranks_store_large_chunks_once(tmp_path):
    big = torch.randn(50_000)                                         # 200 KB: a blob under SMALL
    save_as_two_ranks(tmp_path, lambda rank: {"w": big, "rank": torch.tensor([rank])}, 1)
    assert len(blob_files(tmp_path)) == 1
    with Store(tmp_path, rank=1, world_size=2) as s:
        assert torch.equal(s.load(1)["w"], big)


def test_identical_packs_of_two_ranks_are_one_file(tmp_path):
    state = many_small(n=20)                                          # < SMALL.target_size: one pack
    save_as_two_ranks(tmp_path, lambda rank: state, 1)
    assert len(pack_files(tmp_path)) == 1                            # content-named: written once


# -- damage inside packs ----------------------------------------------------------------------------------------
@pytest.fixture
def packed_steps(tmp_path):
    """Steps 10 and 20 of 40 small tensors each in one pack per step; ``w`` differs between them."""
    store = Store(tmp_path, writing=Writing(packing=SMALL))
    base = many_small(n=40)
    store.save({**base, "w": torch.arange(300.0), "progress": {"step": 10}}, 10)
    store.save({**base, "w": torch.arange(300.0) + 1, "progress": {"step": 20}}, 20)
    yield store, tmp_path
    store.close()


def fresh():
    return {"model": None, "w": None, "progress": None}


def test_flipped_byte_fails_only_the_chunk_it_hits(packed_steps, caplog):
    store, root = packed_steps
    path, off, n, ref = chunks_of_key(store, 20, ("w",))[0]
    flip_byte(path, off + 17)
    with pytest.raises(CorruptCheckpointError) as ei:
        store.load(20)
    assert ei.value.step == 20 and ei.value.key == "w" and ei.value.blob == ref.blob_id
    assert "does not match its hash" in str(ei.value) and ref.pack in str(ei.value)
    with Store(root) as s2:                                          # the rest of the pack still loads
        assert s2.verify(10) == {10: None}
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        state = fresh()
        assert store.resume(state) == 10
    assert torch.equal(state["w"], torch.arange(300.0)) and "step 20" in caplog.text
    # the next save must not reference the damaged chunk: it writes a good copy
    r = store.save({**many_small(n=40), "w": torch.arange(300.0) + 1, "progress": {"step": 30}}, 30)
    assert r.blobs_new == 1 and torch.equal(store.load(30)["w"], torch.arange(300.0) + 1)


def test_truncated_pack(packed_steps):
    store, root = packed_steps
    path, off, n, ref = chunks_of_key(store, 20, ("w",))[0]
    path.write_bytes(path.read_bytes()[:off + 5])
    with pytest.raises(CorruptCheckpointError, match="pack ends at byte") as ei:
        store.load(20)
    assert ei.value.step == 20
    assert store.resume(fresh()) == 10


def test_missing_pack(packed_steps):
    store, root = packed_steps
    path, *_ = chunks_of_key(store, 20, ("w",))[0]
    path.unlink()
    with pytest.raises(CorruptCheckpointError, match="pack missing"):
        store.load(20)
    assert "pack missing" in store.verify()[20]
    assert store.resume(fresh()) == 10


def test_manifest_pointing_past_the_end_of_a_pack(packed_steps):
    store, root = packed_steps
    edit_chunk(root, 20, "offset", 10 ** 9, key=("w",))                # far beyond the pack
    with pytest.raises(CorruptCheckpointError, match="pack ends at byte"):
        store.load(20)
    assert store.resume(fresh()) == 10


def second_packed_chunk_onto_first(root, step, fields, shift=0):
    """In ``step``'s manifest, copy ``fields`` (of CHUNK_FIELDS) of the first packed chunk record into the
    second one, then move the second one's offset by ``shift`` bytes."""
    def mutate(body):
        a, b = [n[2]["chunks"][0] for n in body["nodes"] if n[1] == "tensor" and len(n[2]["chunks"][0]) == 6][:2]
        for f in fields:
            b[CHUNK_FIELDS.index(f)] = a[CHUNK_FIELDS.index(f)]
        b[CHUNK_FIELDS.index("offset")] += shift
    rewrite_manifest(root, step, mutate)


def test_overlapping_ranges_are_rejected(packed_steps):
    store, root = packed_steps
    second_packed_chunk_onto_first(root, 20, ("pack", "offset"), shift=1)   # same pack, b starts inside a
    with pytest.raises(CheckpointError, match="overlapping ranges"):
        store.load(20)
    assert store.resume(fresh()) == 10


def test_same_range_claimed_by_two_chunks_is_rejected(packed_steps):
    store, root = packed_steps
    second_packed_chunk_onto_first(root, 20, ("pack", "offset", "stored"))
    with pytest.raises(CorruptCheckpointError, match="claimed by chunks|stores"):
        store.load(20)


def test_raw_chunk_with_a_wrong_stored_length_is_rejected(packed_steps):
    store, root = packed_steps
    edit_chunk(root, 20, "stored", lambda n: n + 4, key=("w",))
    with pytest.raises(CorruptCheckpointError, match="stores"):
        store.load(20)


# -- gc with packs -------------------------------------------------------------------------------------------------
def test_gc_keeps_a_pack_while_any_step_references_it(packed_steps):
    store, root = packed_steps
    shared = {p for *_, r in chunks_of_key(store, 20, ("model", "l0")) for p in [r.pack]}
    only10 = {r.pack for *_, r in chunks_of_key(store, 10, ("w",))}
    assert shared == only10                                           # step 10's pack holds the shared chunks
    store.delete_step(10)
    r = store.gc(grace_seconds=0)
    assert r.packs_deleted == 0 and all(p.exists() for p in pack_files(root))
    assert bits_equal(store.load(20)["model"], many_small(n=40)["model"])
    store.save({"x": torch.ones(3)}, 30)
    store.delete_step(20)
    r = store.gc(grace_seconds=0)
    assert r.packs_deleted == 2 and len(pack_files(root)) == 1
    assert torch.equal(store.load(30)["x"], torch.ones(3))


def test_gc_then_save_rewrites_chunks_of_deleted_packs(tmp_path):
    """The writer's chunk index must not reference a pack that gc (here, another process) removed."""
    state = many_small(n=30)
    with Store(tmp_path, writing=Writing(packing=SMALL)) as writer:
        writer.save(state, 1)
        writer.save({"other": torch.ones(2)}, 2)
        with Store(tmp_path) as other:
            other.delete_step(1)
            assert other.gc(grace_seconds=0).packs_deleted == 1
        writer.save(state, 3)                                         # chunks of step 1's pack: gone
        assert bits_equal(writer.load(3)["model"], state["model"])
        assert writer.verify() == {2: None, 3: None}


# -- format 1 ------------------------------------------------------------------------------------------------------
@pytest.fixture
def v1_store(tmp_path):
    root = tmp_path / "v1"
    shutil.copytree(FIXTURE, root)
    return root


def test_v1_fixture_loads_bit_for_bit(v1_store):
    with Store(v1_store) as s:
        assert s.steps() == [1, 2] and s.latest_step() == 2
        for step in (1, 2):
            assert bits_equal(s.load(step), fixture_state(step))
        assert s.verify() == {1: None, 2: None}
        assert s.commit_info(2).metrics == {"loss": 1.25}


def test_v1_fixture_resumes_and_takes_new_saves(v1_store):
    with Store(v1_store, writing=Writing(chunk_size=4096)) as s:   # the fixture's chunking: same ids
        state = {k: None for k in fixture_state(2)}
        assert s.resume(state) == 2 and bits_equal(state, fixture_state(2))
        before = set(p.name for p in blob_files(v1_store))
        r = s.save(fixture_state(2), 3)                               # unchanged: dedups against v1 blobs
        assert r.bytes_written == 0 and set(p.name for p in blob_files(v1_store)) == before
        s4 = fixture_state(2)
        s4["model"]["bias"] = s4["model"]["bias"] + 1
        s.save(s4, 4)                                                 # a mixed step: v1 blobs + a v2 pack
        assert len(pack_files(v1_store)) == 1
    with Store(v1_store) as s:
        assert bits_equal(s.load(4), s4) and bits_equal(s.load(1), fixture_state(1))
        assert s.verify() == {1: None, 2: None, 3: None, 4: None}


def test_v1_fixture_gc(v1_store):
    with Store(v1_store) as s:
        r = s.gc(grace_seconds=0)
        assert r.steps_removed == [3] and r.blobs_deleted == 0        # the crash leftover goes, nothing else
        s.delete_step(1)
        r = s.gc(grace_seconds=0)
        assert r.blobs_deleted > 0 and s.verify() == {2: None}
        assert bits_equal(s.load(2), fixture_state(2))


# -- packs through a remote ------------------------------------------------------------------------------------
@pytest.mark.remote
def test_packs_upload_and_resume_from_remote(tmp_path, remote_url):
    local = tmp_path / "run"
    state = many_small(n=400)
    state["big"] = torch.randn(100_000)
    opts = dict(storage_options=remote_url.storage_options, writing=Writing(packing=SMALL))
    with Store(local, remote=remote_url.url, **opts) as s:
        s.save(state, 1)
        state["model"]["l3"].add_(1)
        s.save(state, 2)
        s.wait_for_uploads()
        up = s._parts.uploader.uploaded
        assert up[1].blobs_copied == 1                                # only the new pack of step 2 moved
    shutil.rmtree(local)
    with Store(local, remote=Remote(remote_url.url, upload=False), **opts) as s:
        out = {k: None for k in state}
        assert s.resume(out) == 2 and s.resumed_from["tier"] == "remote"
        assert bits_equal(out, state)
        # the local copy is what the remote holds: every file of the step, verified
        assert s.verify() == {2: None}
    # a load straight from the remote (load_path) reads only the ranges of the keys it needs
    with Store(tmp_path / "ft", load_path=remote_url.url, storage_options=remote_url.storage_options,
               load_components=("big",)) as s:
        out = {"big": None, "model": {"fresh": 1}}
        assert s.resume(out) is None and torch.equal(out["big"], state["big"]) and out["model"] == {"fresh": 1}
