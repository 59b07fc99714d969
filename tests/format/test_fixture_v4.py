"""Format 4 (the planes codec, issue 30) stays readable: ``tests/fixtures/v4_store`` was written by the first
format-4 writer (``tests/fixture_v4.py`` says how) and holds planes frames of version 1 as blobs and inside packs,
zstd and raw chunks beside them. Later writers (deltas, a faster planes frame) must keep loading it bit for bit."""
import shutil

import msgpack
import pytest

from ckptstore import Packing, Store, Writing
from fixture_v4 import PACKING, WRITING, fixture_state
from helpers import TESTS, bits_equal, blob_files, chunks_of_key, flip_byte, pack_files, step_dir

FIXTURE = TESTS / "fixtures" / "v4_store"


@pytest.fixture
def v4_store(tmp_path):
    root = tmp_path / "v4"
    shutil.copytree(FIXTURE, root)
    return root


def stored_codecs(root, step):
    """(format of the manifest frame, {codec: [blob or pack chunk]}) as the file says, read without ckptstore."""
    outer = msgpack.unpackb((step_dir(root, step) / "manifest-rank00000.msgpack").read_bytes())
    seen = {}
    for node in msgpack.unpackb(outer["body"])["nodes"]:
        if isinstance(node[2], dict) and "chunks" in node[2]:
            for c in node[2]["chunks"]:
                seen.setdefault(c[2], set()).add("pack" if len(c) > 3 else "blob")
    return outer["format"], seen


def test_the_fixture_is_what_it_claims(v4_store):
    # the test below would prove nothing if the fixture held no planes frames
    for step in (1, 2):
        fmt, seen = stored_codecs(v4_store, step)
        assert fmt == 4 and seen["planes"] == {"blob", "pack"} and "zstd" in seen and "raw" in seen
    assert any(p.suffix == ".bpl" for p in blob_files(v4_store)) and pack_files(v4_store)


def test_v4_fixture_loads_bit_for_bit(v4_store):
    with Store(v4_store) as s:
        assert s.steps() == [1, 2] and s.latest_step() == 2
        for step in (1, 2):
            assert bits_equal(s.load(step), fixture_state(step))
        assert s.verify() == {1: None, 2: None}
        assert s.commit_info(2).metrics == {"loss": 1.25}


def test_v4_fixture_resumes_and_dedups_new_saves(v4_store):
    with Store(v4_store, writing=Writing(**WRITING, packing=Packing(**PACKING))) as s:
        state = {k: None for k in fixture_state(2)}
        assert s.resume(state) == 2 and bits_equal(state, fixture_state(2))
        before = {p.name for p in blob_files(v4_store)}
        assert s.save(fixture_state(2), 3).bytes_written == 0       # the same chunks: nothing written
        assert {p.name for p in blob_files(v4_store)} == before
    with Store(v4_store) as s:
        assert bits_equal(s.load(3), fixture_state(2)) and s.verify() == {1: None, 2: None, 3: None}


def test_a_damaged_planes_blob_of_the_fixture_fails_its_step_only(v4_store):
    # step 2's own planes blob ("moving" changes per step); resume falls back to step 1, whole
    with Store(v4_store) as s:
        [(_, _, _, ref)] = chunks_of_key(s, 2, ("model", "moving"))
    assert ref.codec == "planes" and ref.pack is None
    [victim] = [p for p in blob_files(v4_store) if p.name == ref.blob_id + ".bpl"]
    flip_byte(victim, victim.stat().st_size // 2)
    with Store(v4_store) as s:
        state = {k: None for k in fixture_state(1)}
        assert s.resume(state) == 1 and bits_equal(state, fixture_state(1))
