"""Damaged checkpoints: never loaded silently; resume falls back to the newest older valid step."""
import logging

import msgpack
import pytest
import torch

from ckptstore import CorruptCheckpointError, IncompatibleCheckpointError, Packing, Store, Writing
from helpers import blobs_of_key, edit_chunk, flip_byte, rewrite_tensor_entries, step_dir

# These tests damage blob files (a chunk stored alone, as every chunk at or above Packing.threshold is); the
# same damage inside pack files is tested in test_packs.py.
BLOBS = Packing(threshold=0)


@pytest.fixture
def two_steps(tmp_path):
    """A store with steps 10 and 20 whose tensor "w" differs (so the two steps share no blob for it)."""
    store = Store(tmp_path, writing=Writing(packing=BLOBS))
    w = torch.arange(1000, dtype=torch.float32)
    store.save({"w": w, "progress": {"step": 10}}, 10)
    store.save({"w": w + 1, "progress": {"step": 20}}, 20)
    yield store, tmp_path
    store.close()


def resume_fresh_state():
    return {"w": None, "progress": None}


def test_flipped_byte_in_blob(two_steps, caplog):
    store, root = two_steps
    bad = blobs_of_key(store, 20, ("w",))[0]
    flip_byte(bad, 123)
    with pytest.raises(CorruptCheckpointError) as ei:
        store.load(20)
    msg = str(ei.value)
    assert "step=20" in msg and "key='w'" in msg and bad.name in msg
    assert ei.value.step == 20 and ei.value.key == "w" and ei.value.blob == bad.name
    state = resume_fresh_state()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert store.resume(state) == 10
    assert "step 20" in caplog.text
    assert torch.equal(state["w"], torch.arange(1000, dtype=torch.float32)) and state["progress"] == {"step": 10}


def test_corrupt_blob_is_quarantined_and_rewritten_by_next_save(two_steps):
    store, root = two_steps
    bad = blobs_of_key(store, 20, ("w",))[0]
    flip_byte(bad, 0)
    with pytest.raises(CorruptCheckpointError):
        store.load(20)
    assert not bad.exists() and (root / "quarantine" / bad.name).exists()
    w20 = torch.arange(1000, dtype=torch.float32) + 1
    r = store.save({"w": w20, "progress": {"step": 30}}, 30)     # must not dedup against the bad blob
    assert r.blobs_new == 1
    assert torch.equal(store.load(30)["w"], w20)


def test_truncated_blob(two_steps):
    store, root = two_steps
    bad = blobs_of_key(store, 20, ("w",))[0]
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="100 bytes"):
        store.load(20)
    assert store.resume(resume_fresh_state()) == 10


def test_missing_blob(two_steps):
    store, root = two_steps
    blobs_of_key(store, 20, ("w",))[0].unlink()
    with pytest.raises(CorruptCheckpointError, match="blob missing"):
        store.load(20)
    assert store.resume(resume_fresh_state()) == 10


def test_truncated_manifest(two_steps):
    store, root = two_steps
    mf = step_dir(root, 20) / "manifest-rank00000.msgpack"
    mf.write_bytes(mf.read_bytes()[:-7])
    with pytest.raises(CorruptCheckpointError) as ei:
        store.load(20)
    assert "manifest-rank00000" in str(ei.value) and ei.value.step == 20
    assert store.resume(resume_fresh_state()) == 10


def test_deleted_commit_marker_makes_step_invisible(two_steps):
    store, root = two_steps
    (step_dir(root, 20) / "COMMIT").unlink()
    assert store.steps() == [10] and store.latest_step() == 10
    with pytest.raises(FileNotFoundError, match="step 20"):
        store.load(20)
    state = resume_fresh_state()
    assert store.resume(state) == 10 and state["progress"] == {"step": 10}


def test_garbled_commit_marker(two_steps):
    store, root = two_steps
    flip_byte(step_dir(root, 20) / "COMMIT", 40)
    with pytest.raises(CorruptCheckpointError):
        store.load(20)
    assert store.resume(resume_fresh_state()) == 10


def test_garbled_latest_pointer_is_only_a_hint(two_steps):
    store, root = two_steps
    (root / "latest").write_text("{not json")
    assert store.latest_step() == 20
    assert store.resume(resume_fresh_state()) == 20


def test_every_step_corrupt_gives_fresh_start_with_warning(two_steps, caplog):
    store, root = two_steps
    for s in (10, 20):
        flip_byte(blobs_of_key(store, s, ("w",))[0], 5)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert store.resume(resume_fresh_state()) is None
    assert "step 10" in caplog.text and "step 20" in caplog.text


def test_newer_format_version_is_incompatible(two_steps):
    store, root = two_steps
    mf = step_dir(root, 20) / "COMMIT"
    outer = msgpack.unpackb(mf.read_bytes(), raw=False)
    outer["format"] = 99
    mf.write_bytes(msgpack.packb(outer, use_bin_type=True))
    with pytest.raises(IncompatibleCheckpointError, match="format version 99"):
        store.load(20)
    with pytest.raises(IncompatibleCheckpointError):
        store.resume(resume_fresh_state())          # never silently skips to an older step


def test_manifest_cannot_name_files_outside_the_root(two_steps, tmp_path_factory):
    store, root = two_steps
    secret = tmp_path_factory.mktemp("outside") / "secret"
    secret.write_bytes(b"x" * 4000)
    edit_chunk(root, 20, "blob_id", "../../../../" + str(secret))
    with pytest.raises(CorruptCheckpointError, match="invalid blob id"):
        store.load(20)


def test_manifest_with_inconsistent_sizes_is_rejected(two_steps):
    store, root = two_steps

    def grow(entry):
        entry["shape"] = [10 ** 9]                  # would allocate 4 GB if trusted
    rewrite_tensor_entries(root, 20, grow)
    with pytest.raises(CorruptCheckpointError, match="needs 4000000000"):
        store.load(20)


def test_no_pickle_anywhere(two_steps, monkeypatch):
    import pickle
    store, root = two_steps

    def boom(*a, **k):
        raise AssertionError("unpickling attempted")
    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "Unpickler", boom)
    assert torch.equal(store.load(20)["w"], torch.arange(1000, dtype=torch.float32) + 1)
    for f in root.rglob("*"):
        if f.is_file():
            assert not f.read_bytes().startswith(b"\x80"), f"{f} looks like a pickle"


def test_short_blob_on_disk_is_not_deduplicated_against(tmp_path):
    """A blob file of the wrong length (e.g. left by a power loss) is replaced, not reused, by a new save."""
    w = torch.arange(100_000, dtype=torch.float32)
    with Store(tmp_path, writing=Writing(packing=BLOBS)) as s:
        s.save({"w": w}, 1)
        bad = blobs_of_key(s, 1, ("w",))[0]
    bad.write_bytes(b"")
    with Store(tmp_path, writing=Writing(packing=BLOBS)) as s:       # a new process: the blob is not known yet
        r = s.save({"w": w}, 2)
        assert r.blobs_new == 1 and r.bytes_written == w.numel() * 4
        assert torch.equal(s.load(2)["w"], w)
