"""``Remote(codec="auto")``: the uploader stores the raw float blobs of the local tier as planes frames (``.bpl``)
on the remote, manifests unchanged; readers of the remote find them by id (issue 30). Real moto S3 on 127.0.0.1."""
import json
import os
import shutil

import fsspec
import pytest
import torch

from ckptstore import Packing, Remote, Retention, Store, Writing
from ckptstore.format.layout import manifest_path
from ckptstore.remote.transfer import STREAM_THRESHOLD, StepCopier
from ckptstore.storage import open_storage
from helpers import cli

pytestmark = pytest.mark.remote

# each tensor of 1-2 MiB is one blob (packs take only the small values); "big" is one chunk above
# STREAM_THRESHOLD (the uploader streams such a raw blob from its file, and reads it whole to encode it)
WRITING = Writing(chunk_size=32 << 20, packing=Packing(threshold=64 << 10))
BIG = (STREAM_THRESHOLD >> 2) + 4096


def state_at(seed: int, big: bool = False):
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(1 << 19, generator=g),                          # fp32: a 2 MiB blob
         "h": torch.randn(1 << 19, generator=g).to(torch.bfloat16),       # bf16: one 1 MiB blob
         "ids": torch.randint(0, 1 << 40, (1 << 17,), generator=g),       # int64: a 1 MiB blob, not float
         "bias": torch.randn(100, generator=g), "progress": {"seed": seed}}
    if big:
        s["big"] = torch.randn(BIG, generator=g)
    return s


def empty_like(state):
    return {k: None for k in state}


def objects(fs, root: str, top: str = "objects"):
    """``{name: size}`` of the files under ``root/top`` (blobs, or packs)."""
    return {p.rsplit("/", 1)[1]: fs.size(p) for p in fs.find(f"{root}/{top}")}


def remote_objects(target, top: str = "objects"):
    fs, root = fsspec.core.url_to_fs(target.url, **target.storage_options)
    fs.invalidate_cache()
    return objects(fs, root, top)


def local_objects(root):
    return objects(fsspec.filesystem("file"), str(root))


def blob_ids(store: Store, step: int, key: str):
    """The ids of ``key``'s chunks stored as blobs of their own in ``step`` (rank 0)."""
    commit = store.catalog.read_commit(step)
    m = store.catalog.read_manifest(commit, 0)
    return [c.blob_id for n, e in m.arrays() if n.path == (key,) for c in e.chunks if c.pack is None]


def open_store(root, target, **kw):
    return Store(root, remote=Remote(target.url, codec="auto"), storage_options=target.storage_options,
                 writing=WRITING, **kw)


def test_remote_codec_is_checked():
    with pytest.raises(ValueError, match="Remote.codec"):
        Remote("memory://x", codec="zstd")
    assert Remote("memory://x").codec == "raw"


def test_auto_uploads_float_blobs_as_planes_and_resumes_bit_for_bit(tmp_path, s3_bucket_url):
    target, root = s3_bucket_url, tmp_path / "run"
    state = state_at(1, big=True)
    with open_store(root, target) as s:
        s.save(state, 1)
        s.wait_for_uploads()
        floats = {b for k in ("w", "h", "big") for b in blob_ids(s, 1, k)}
        ints = set(blob_ids(s, 1, "ids"))
        manifest = s.storage.read_bytes(manifest_path(1, 0, 0))
    local, remote = local_objects(root), remote_objects(target)
    assert set(local) == floats | ints                                 # the local tier stays raw
    assert set(remote) == {f"{b}.bpl" for b in floats} | ints          # the remote: float blobs encoded
    assert sum(remote.values()) < 0.95 * sum(local.values())
    fs, rroot = fsspec.core.url_to_fs(target.url, **target.storage_options)
    assert fs.cat_file(f"{rroot}/{manifest_path(1, 0, 0)}") == manifest   # manifests unchanged
    p = cli("verify", target.url, "--storage-options", json.dumps(target.storage_options), check=False)
    assert p.returncode == 0 and "step 1: ok" in p.stdout, p.stdout + p.stderr
    with Store(target.url, storage_options=target.storage_options, create=False) as r:   # read in place
        direct = r.load(1)
    assert all(torch.equal(direct[k], state[k]) for k in ("w", "h", "ids", "big"))

    shutil.rmtree(root)
    got = empty_like(state)
    with open_store(root, target) as s:
        assert s.resume(got) == 1 and s.resumed_from["tier"] == "remote"
        assert s.verify() == {1: None}
        # pulled as stored: the .bpl copies land locally as .bpl, and a later save dedups against them by id
        assert set(local_objects(root)) == set(remote)
        s.save(state, 2)
        assert set(local_objects(root)) == set(remote)
        m = s.catalog.read_manifest(s.catalog.read_commit(2), 0)
        assert {c.codec for n, e in m.arrays() if n.path == ("w",) for c in e.chunks} == {"planes"}
        s.wait_for_uploads()
        assert s._parts.uploader.uploaded[-1].bytes_copied == 0
    for k, v in state.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    assert all(t.dtype == state[k].dtype for k, t in got.items() if isinstance(t, torch.Tensor))


def test_auto_uploads_nothing_twice_across_saves_and_processes(tmp_path, s3_bucket_url, proxy):
    target, root = s3_bucket_url, tmp_path / "run"
    state = state_at(2, big=True)
    with open_store(root, target) as s:
        s.save(state, 1)
        s.save(state, 2)                                   # unchanged tensors
        s.wait_for_uploads()
        first, second = s._parts.uploader.uploaded[-2:]
        assert first.bytes_copied > 0 and second.bytes_copied == 0
    before = remote_objects(target)
    with open_store(root, target) as s:                    # a new uploader: knows the remote by listing it
        s.save(state, 3)
        s.wait_for_uploads()
        assert s._parts.uploader.uploaded[-1].bytes_copied == 0
        big = blob_ids(s, 1, "big")[0]
        # an uploader that knows nothing of the remote: the large blob is looked up by id and found as .bpl (not
        # sent again); the small objects go as create-only writes, which may resend their bytes and find them
        # there (then counted in TransferStats.bytes_copied); no second copy appears under another name
        counted = open_storage(target.url, dict(target.storage_options, endpoint_url=proxy.endpoint))
        copier = StepCopier(s.storage, counted, codec="auto")
        try:
            sent = copier.copy_step(1).bytes_copied
        finally:
            copier.close()
    assert remote_objects(target) == before
    assert sent < before[f"{big}.bpl"]
    assert ("HEAD", big) in {(m, t.rsplit("/", 1)[1].partition(".")[0]) for m, t in proxy.requests}
    assert not any(big in t for m, t in proxy.requests if m in ("PUT", "POST"))


def test_damaged_planes_blob_on_the_remote_falls_back_to_the_older_step(tmp_path, s3_bucket_url):
    target, root = s3_bucket_url, tmp_path / "run"
    with open_store(root, target) as s:
        s.save(state_at(1), 1)
        s.save(state_at(2), 2)
        s.wait_for_uploads()
        victim = blob_ids(s, 2, "w")[0]
    fs, rroot = fsspec.core.url_to_fs(target.url, **target.storage_options)
    path = f"{rroot}/objects/{victim[:2]}/{victim}.bpl"
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x10                          # in the frame's payload
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    shutil.rmtree(root)
    got = empty_like(state_at(1))
    with open_store(root, target) as s:
        assert s.resume(got) == 1
    want = state_at(1)
    assert all(torch.equal(got[k], want[k]) for k in ("w", "h", "ids", "bias"))


def test_remote_retention_and_gc_remove_the_planes_blobs_of_deleted_steps(tmp_path, s3_bucket_url):
    target, root = s3_bucket_url, tmp_path / "run"
    with open_store(root, target, keep=Retention(last=1)) as s:
        s.save(state_at(1), 1)
        s.wait_for_uploads()
        old = {b for k in ("w", "h") for b in blob_ids(s, 1, k)}
        assert {f"{b}.bpl" for b in old} <= set(remote_objects(target))
        s.save(state_at(2), 2)
        s.wait_for_uploads()
        new = {b for k in ("w", "h") for b in blob_ids(s, 2, k)}
    left = set(remote_objects(target))                  # the remote's retention swept step 1's objects by id
    assert not any(f"{b}.bpl" in left or b in left for b in old)
    assert {f"{b}.bpl" for b in new} <= left
    with Store(target.url, storage_options=target.storage_options, create=False) as r:
        assert r.steps() == [2]
        r.gc(grace_seconds=0, repack=None)              # a gc of the remote keeps the live .bpl objects
        assert r.verify() == {2: None}
    assert set(remote_objects(target)) == left


@pytest.mark.parametrize("how", ["pull", "in_place", "url"])
def test_reading_an_auto_remote_costs_no_lookup_per_codec(tmp_path, s3_bucket_url, proxy, how):
    """Readers of the remote find raw-recorded float chunks under ``.bpl`` names without a lookup per codec: a
    store with ``Remote(codec="auto")`` (a resume's pull; a read-only store reading the remote in place) looks
    there first; a store on the remote URL (no such option) looks under each blob's raw name at most once,
    and not again once it has learnt where such blobs are."""
    target, root = s3_bucket_url, tmp_path / "run"
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(6)}          # six 1 MiB fp32 blobs
    with open_store(root, target) as s:
        s.save(state, 1)
        s.wait_for_uploads()
        ids = {b for k in state for b in blob_ids(s, 1, k)}
    assert {f"{b}.bpl" for b in ids} <= set(remote_objects(target))
    shutil.rmtree(root)
    opts = dict(target.storage_options, endpoint_url=proxy.endpoint)
    got = empty_like(state)
    if how == "url":
        with Store(target.url, storage_options=opts, create=False) as r:
            proxy.reset()
            got = r.load(1)
            first = list(proxy.requests)
            proxy.reset()
            assert all(torch.equal(t, state[k]) for k, t in r.load(1).items())   # learnt: .bpl first
            again = list(proxy.requests)
    else:
        proxy.reset()
        with Store(root, remote=Remote(target.url, codec="auto"), storage_options=opts,
                   read_only=how == "in_place") as s:
            if how == "pull":
                assert s.resume(got) == 1 and s.resumed_from["tier"] == "remote"
            else:
                got = s.load(1)
        first, again = list(proxy.requests), []
    assert all(torch.equal(got[k], v) for k, v in state.items())

    def raw_lookups(requests):
        return [t for m, t in requests if m in ("GET", "HEAD") and t.split("?")[0].rsplit("/", 1)[1] in ids]
    assert len(raw_lookups(first)) <= (len(ids) if how == "url" else 0), raw_lookups(first)
    assert raw_lookups(again) == []
