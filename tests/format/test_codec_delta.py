"""The delta codec (issue 30): ``Writing(codec="auto", deltas=K)`` stores a blob chunk as its difference with
its parent step's key. Keys every K + 1 saves and chain depth 1; every step loads bit for bit and verifies; gc
keeps a key a live delta needs; a step goes to S3 and back with its keys; a missing or replaced key, a manifest
naming another key or a delta as a key, all end in ``CorruptCheckpointError`` and resume falling back; older
formats still load."""
import shutil

import msgpack
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckptstore import CorruptCheckpointError, IncompatibleCheckpointError, Packing, Remote, Retention, Store, Writing
from ckptstore.format import delta, manifest as mf, planes
from helpers import bits_equal, cli, rewrite_manifest, step_dir

K = 2
BLOBS = Packing(threshold=8 << 10)                         # every chunk of "w" and "h" is a blob
WRITING = Writing(codec="auto", deltas=K, packing=BLOBS, chunk_size=64 << 10)


def states(n, seed=0):
    """``n`` states of a slowly trained-like run: fp32 weights moving a little each step, their bf16 copy, a
    small int tensor (packed) and a plain value."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(40_000, generator=g) * 0.02
    out = []
    for i in range(n):
        w = w + torch.randn(40_000, generator=g) * 1e-5
        out.append({"w": w.clone(), "h": w.to(torch.bfloat16), "i": torch.arange(100) + i, "n": i})
    return out


def refs(store, step, key="w"):
    m = store.catalog.read_manifest(store.catalog.read_commit(step), 0)
    return next(e.chunks for n, e in m.arrays() if n.path == (key,))


def blob_file(root, ref):
    return root / "objects" / ref.blob_id[:2] / (ref.blob_id + {"raw": "", "zstd": ".zst", "planes": ".bpl",
                                                                  "delta": ".dlt"}[ref.codec])


def save_all(root, sts, writing=WRITING, **kw):
    with Store(root, writing=writing, **kw) as s:
        for step, st in enumerate(sts, 1):
            s.save(st, step)


def test_deltas_need_auto_and_a_count():
    with pytest.raises(ValueError, match="Writing.deltas"):
        Writing(codec="zstd", deltas=2)
    with pytest.raises(ValueError, match="Writing.deltas"):
        Writing(codec="auto", deltas=-1)
    assert Writing(codec="auto", deltas=3).deltas == 3 and Writing().deltas == 0


def test_keys_every_k_plus_one_saves_and_every_step_loads(tmp_path):
    root = tmp_path / "s"
    sts = states(2 * K + 3)
    save_all(root, sts)
    with Store(root) as s:
        for step, st in enumerate(sts, 1):
            for key in ("w", "h"):
                rs = refs(s, step, key)
                want = (step - 1) % (K + 1)              # 0: a key, else the n-th delta against it
                assert {r.seq for r in rs} == {want}, (step, key)
                if want:
                    key_step = step - want
                    assert all(r.codec == "delta" and r.base.codec != "delta" for r in rs)
                    assert [r.base for r in rs] == refs(s, key_step, key)          # the key step's full chunks
                else:
                    assert {r.codec for r in rs} == {"planes"}
            assert bits_equal(s.load(step), st)
            assert (step_dir(root, step) / "manifest-rank00000.msgpack").exists()
        assert s.verify() == {step: None for step in range(1, len(sts) + 1)}
        # a delta is smaller than the full chunk it replaces
        full = sum(blob_file(root, r).stat().st_size for r in refs(s, 1, "h"))
        d = sum(blob_file(root, r).stat().st_size for r in refs(s, 2, "h"))
        assert d < 0.6 * full
    outer = msgpack.unpackb((step_dir(root, 2) / "manifest-rank00000.msgpack").read_bytes())
    assert outer["format"] == mf.DELTA_FORMAT
    cli("verify", str(root))


def test_a_reader_of_format_4_refuses_a_delta_step_as_too_new(tmp_path, monkeypatch):
    root = tmp_path / "s"
    save_all(root, states(2))
    monkeypatch.setitem(mf.READ_FORMATS, "manifest", mf.PLANES_FORMAT)
    with Store(root) as s:
        assert bits_equal(s.load(1)["w"], states(2)[0]["w"])          # format 4: still read
        with pytest.raises(IncompatibleCheckpointError, match="format version 5"):
            s.load(2)


def test_older_formats_still_load(tmp_path):
    """Steps written as format 2 (raw) and format 4 (planes) load beside format-5 steps of the same store."""
    root = tmp_path / "s"
    sts = states(4)
    with Store(root, writing=Writing(packing=BLOBS, chunk_size=64 << 10)) as s:
        s.save(sts[0], 1)
    with Store(root, writing=Writing(codec="auto", packing=BLOBS, chunk_size=64 << 10)) as s:
        s.save(sts[1], 2)
    with Store(root, writing=WRITING) as s:
        s.save(sts[2], 3)
        s.save(sts[3], 4)
    formats = [msgpack.unpackb((step_dir(root, i) / "manifest-rank00000.msgpack").read_bytes())["format"]
               for i in (1, 2, 3, 4)]
    # step 3 is a delta against step 2's planes chunks already: the parent is the newest committed step
    assert formats == [mf.FORMAT_VERSION, mf.PLANES_FORMAT, mf.DELTA_FORMAT, mf.DELTA_FORMAT]
    with Store(root) as s:
        for step, st in enumerate(sts, 1):
            assert bits_equal(s.load(step), st)


def test_gc_keeps_the_key_a_live_delta_needs(tmp_path):
    root = tmp_path / "s"
    sts = states(K + 1)                                      # step 1 the key, steps 2..K+1 deltas against it
    save_all(root, sts, keep=Retention(last=1))
    with Store(root, keep=Retention(last=1)) as s:
        assert s.catalog.committed_steps() == [K + 1]
        s.gc(grace_seconds=0)
        keys = {r.base.blob_id for r in refs(s, K + 1)}
        assert keys and all(blob_file(root, r.base).exists() for r in refs(s, K + 1))
    fresh = tmp_path / "copy"
    shutil.copytree(root, fresh)
    with Store(fresh) as s:
        out = {k: None for k in sts[-1]}
        assert s.resume(out) == K + 1 and bits_equal(out, sts[-1])


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_missing_or_replaced_key_falls_back_to_the_older_valid_step(tmp_path, how):
    root = tmp_path / "s"
    sts = states(K + 3)                       # steps 1..K+1 on key 1; K+2 a new key, K+3 a delta against it
    save_all(root, sts)
    with Store(root) as s:
        ref = refs(s, K + 3)[0]
        assert ref.codec == "delta" and ref.base == refs(s, K + 2)[0]
        old_key = refs(s, 1)[0]
    path = blob_file(root, ref.base)
    if how == "deleted":
        path.unlink()
    else:                                     # another full blob's bytes of the same length under the key's name
        shutil.copyfile(blob_file(root, old_key), path)
    with Store(root) as s:
        with pytest.raises(CorruptCheckpointError) as ei:
            s.load(K + 3)
        assert ei.value.step == K + 3 and ei.value.key == "w" and ref.base.blob_id in str(ei.value)
        out = {k: None for k in sts[0]}
        assert s.resume(out) == K + 1 and bits_equal(out, sts[K])


def test_a_manifest_naming_another_key_or_a_delta_as_key_is_corrupt(tmp_path):
    root = tmp_path / "s"
    sts = states(K + 3)
    save_all(root, sts)
    with Store(root) as s:
        other_key = refs(s, 1)[0]                             # a full blob of the same length, not this key

    def wrong_key(body):
        for path, kind, payload in body["nodes"]:
            if path == ["w"]:
                payload["chunks"][0][3] = [other_key.blob_id, other_key.nbytes, other_key.codec]
    rewrite_manifest(root, K + 3, wrong_key, keep_format=True)
    with Store(root) as s:
        with pytest.raises(CorruptCheckpointError, match="delta frame is against chunk") as ei:
            s.load(K + 3)
        assert ei.value.key == "w" and ei.value.step == K + 3

    def delta_as_key(body):
        for path, kind, payload in body["nodes"]:
            if path == ["w"]:
                c = payload["chunks"]
                c[0][3] = list(c[1])                                   # the next chunk's delta record
    rewrite_manifest(root, 2, delta_as_key, keep_format=True)
    with Store(root) as s:
        with pytest.raises(CorruptCheckpointError, match="chain depth 1"):
            s.load(2)
        out = {k: None for k in sts[0]}
        assert s.resume(out) == K + 2 and bits_equal(out, sts[K + 1])   # K+3's manifest is wrong too


def test_manifest_grammar_refuses_hostile_delta_records():
    blob = "ab" * 32
    key = "cd" * 32

    def decode(chunk, fmt=mf.DELTA_FORMAT):
        body = {"step": 1, "rank": 0, "world_size": 1, "stateful": [], "packs": [],
                "nodes": [[[], "dict", None], [["x"], "tensor", {"dtype": "uint8", "shape": [8], "chunks": [chunk],
                                                                  "device": "cpu", "requires_grad": False}]]}
        return mf.decode_manifest(mf.frame("manifest", body, fmt), step=1, rank=0, what="m")
    ok = decode([blob, 8, "delta", [key, 8, "planes"], 1])
    c = ok.nodes[1].payload.chunks[0]
    assert c.base.blob_id == key and c.seq == 1 and [r.blob_id for r in ok.chunk_refs()] == [blob, key]
    assert ok.blob_ids() == {blob, key}
    for bad, msg in [([blob, 8, "delta", [key, 8, "delta", [key, 8, "raw"], 1], 1], "chain depth 1"),
                     ([blob, 8, "delta", [blob, 8, "raw"], 1], "itself"),
                     ([blob, 8, "delta", [key, 4, "raw"], 1], "key of 4"),
                     ([blob, 8, "delta", [key, 8, "raw", 0, 0, 8], 1], "not a blob"),
                     ([blob, 8, "delta", [key, 8, "raw"], 0], "seq"),
                     ([blob, 8, "delta", [key, 8, "raw"]], "bad delta chunk")]:
        with pytest.raises(CorruptCheckpointError, match=msg):
            decode(bad)
    with pytest.raises(CorruptCheckpointError, match="format 4"):
        decode([blob, 8, "delta", [key, 8, "raw"], 1], fmt=mf.PLANES_FORMAT)


def test_delta_frames_refuse_the_wrong_key_length_and_damage():
    data, key = bytes(range(256)) * 40, bytes(reversed(range(256))) * 40
    kid = "ee" * 32
    for itemsize in (4, None):
        frame = delta.encode(data, key, kid, itemsize)
        out = bytearray(len(data))
        delta.decode_into(frame, key, kid, memoryview(out))
        assert bytes(out) == data
        with pytest.raises(delta.DeltaError, match="against chunk"):
            delta.decode_into(frame, key, "ff" * 32, memoryview(out))
        with pytest.raises(delta.DeltaError, match="expected"):
            delta.decode_into(frame, key[:-4], kid, memoryview(bytearray(len(data) - 4)))
        with pytest.raises(delta.DeltaError):
            delta.decode_into(frame[:-3], key, kid, memoryview(out))
    frame = delta.encode(data, key, kid, 4)
    assert frame[6:8] == bytes([delta.DIFF, 4])              # floats: the zigzag difference of 4-byte integers
    for op_k in ((delta.DIFF, 3), (delta.DIFF, 0), (delta.XOR, 4), (2, 4)):
        bad = bytearray(frame)
        bad[6:8] = bytes(op_k)
        with pytest.raises(delta.DeltaError, match="op"):
            delta.decode_into(bad, key, kid, memoryview(bytearray(len(data))))


def test_a_damaged_delta_is_quarantined_and_resume_falls_back(tmp_path):
    root = tmp_path / "s"
    sts = states(2)
    save_all(root, sts)
    with Store(root) as s:
        ref = refs(s, 2)[1]
    path = blob_file(root, ref)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40                                          # in the coded XOR, past the header
    path.write_bytes(bytes(data))
    with Store(root) as s:
        with pytest.raises(CorruptCheckpointError, match="delta frame") as ei:
            s.load(2)
        assert ei.value.step == 2 and ei.value.key == "w"
        out = {k: None for k in sts[0]}
        assert s.resume(out) == 1 and bits_equal(out, sts[0])
    assert not path.exists() and (root / "quarantine" / path.name).exists()      # the key itself stays
    assert blob_file(root, ref.base).exists()


@settings(max_examples=60, deadline=None)
@given(pair=st.integers(0, 3000).flatmap(lambda n: st.tuples(st.binary(min_size=n, max_size=n),
                                                             st.binary(min_size=n, max_size=n))),
       itemsize=st.sampled_from([1, 2, 4, 8, None]))
def test_delta_round_trip_any_bytes(pair, itemsize):
    data, key = pair
    frame = delta.encode(data, key, "ab" * 32, itemsize)
    assert delta.parse_header(frame)[1:] == ("ab" * 32, len(data))
    out = bytearray(len(data))
    delta.decode_into(frame, key, "ab" * 32, memoryview(out))
    assert bytes(out) == data


@pytest.mark.skipif(planes._native is None, reason="the C kernels (ckptstore/format/_planes.c) are not built here")
@settings(max_examples=80, deadline=None)
@given(pair=st.integers(0, 3000).flatmap(lambda n: st.tuples(st.binary(min_size=n, max_size=n),
                                                             st.binary(min_size=n, max_size=n))),
       k=st.sampled_from([2, 4, 8]))
def test_c_difference_equals_the_numpy_one(pair, k):
    """The C zigzag difference and its inverse give the numpy code's bytes (any lengths, tails, every
    carry and sign pattern), and undo each other."""
    a, b = pair
    got = delta.diff(a, b, k)
    native, planes._native = planes._native, None
    try:
        want = delta.diff(a, b, k)
        back = bytearray(got.tobytes())
        delta.undiff(memoryview(back), b, k)
    finally:
        planes._native = native
    assert got.tobytes() == want.tobytes()
    assert bytes(back) == a
    back = bytearray(got.tobytes())
    delta.undiff(memoryview(back), b, k)
    assert bytes(back) == a
    with pytest.raises(ValueError):
        planes._native.diff(a, b + b"x", bytearray(len(a)), k)
    with pytest.raises(ValueError):
        planes._native.undiff(bytearray(len(a)), b, 3)


@pytest.mark.remote
def test_deltas_upload_and_resume_from_s3_on_an_empty_dir(tmp_path, s3_bucket_url):
    """Only the newest step is kept locally and remotely: its keys go up with it (and survive the remote's
    retention), and a fresh directory resumes from the remote bit for bit (the keys pulled with the deltas)."""
    opts = dict(storage_options=s3_bucket_url.storage_options)
    sts = states(K + 1)
    with Store(tmp_path / "run", remote=s3_bucket_url.url, writing=WRITING,
               keep=Retention(last=1), **opts) as s:
        for step, st in enumerate(sts, 1):
            s.save(st, step)
        s.wait_for_uploads()
    with Store(tmp_path / "pulled", remote=Remote(s3_bucket_url.url, upload=False), **opts) as s:
        assert s.step_tiers() == {K + 1: ["remote"]}                  # the keys' step 1 is gone from the remote
        out = {k: None for k in sts[-1]}
        assert s.resume(out) == K + 1 and s.resumed_from["tier"] == "remote"
        assert bits_equal(out, sts[-1])
        assert {r.codec for r in refs(s, K + 1)} == {"delta"}
        assert s.verify() == {K + 1: None}


@pytest.mark.remote
def test_a_chunk_stored_in_full_after_its_delta_was_uploaded_reaches_the_remote(tmp_path, s3_bucket_url):
    """A chunk uploaded as a delta, then saved in full (its key gone locally after a restart): the remote gets the
    full copy too; a delta on the remote is no copy of the chunk for a step that names it in full."""
    opts = dict(storage_options=s3_bucket_url.storage_options)
    sts = states(2)
    run = tmp_path / "run"
    with Store(run, remote=s3_bucket_url.url, writing=WRITING, **opts) as s:
        s.save(sts[0], 1)
        s.save(sts[1], 2)
        s.wait_for_uploads()
        assert {r.codec for r in refs(s, 2)} == {"delta"}
        key = refs(s, 2)[0].base
    blob_file(run, key).unlink()                                 # step 2's key, gone from the local tier
    with Store(run, remote=s3_bucket_url.url, writing=WRITING, **opts) as s:
        s.save(sts[1], 3)                                        # unchanged: stored in full, as it cannot be a delta
        s.wait_for_uploads()
        assert "delta" not in {r.codec for r in refs(s, 3) if r.blob_id == refs(s, 2)[0].blob_id}
    with Store(tmp_path / "pulled", remote=Remote(s3_bucket_url.url, upload=False), **opts) as s:
        out = {k: None for k in sts[1]}
        assert s.resume(out) == 3 and bits_equal(out, sts[1])
        assert s.verify() == {3: None}
