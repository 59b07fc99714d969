"""Format records copied from others keep every field (issue 26, item 4): a manifest rewritten by repack or a
ranged pull once lost ``replicated`` because its copy named the fields one by one. The samples below set every
field to a value other than its default, and the checks iterate over ``dataclasses.fields``: a field the format
gains later is covered as soon as it is given a value here (the first test says so when it is not)."""
import dataclasses

import pytest

from ckptstore.format.manifest import (ArrayEntry, ChunkRef, Commit, Manifest, ManifestNode, decode_commit, decode_manifest,
                                encode_commit, encode_manifest)
from ckptstore.lifecycle.repack import repoint

OLD_PACK, NEW_PACK, OTHER_PACK = "a" * 64, "b" * 64, "c" * 64
CHUNK, KEPT = "1" * 64, "2" * 64


def manifest() -> Manifest:
    def tensor(key, ref):
        return ManifestNode(("app", key), "tensor", ArrayEntry("float32", (2,), [ref]))
    nodes = [ManifestNode((), "dict"), ManifestNode(("app",), "dict"),
             tensor("w", ChunkRef(CHUNK, 8, "raw", OLD_PACK, 0, 8)),
             tensor("v", ChunkRef(KEPT, 8, "raw", OTHER_PACK, 8, 8))]
    return Manifest(step=7, rank=0, world_size=2, stateful=["app"], nodes=nodes, replicated=["app"])


def commit() -> Commit:
    return Commit(step=7, world_size=2, manifests={0: (b"\x01" * 32, 100, 1), 1: (b"\x02" * 32, 90, 0)},
                  created=1.7e9, bytes_total=16, metrics={"loss": 0.5}, config={"lr": 0.1}, writer="ckptstore 9",
                  run_id="r1", best={"metric": "loss", "mode": "min"}, shards=(b"\x03" * 32, 50, 1),
                  names=("checkpoint-7",))


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@pytest.mark.parametrize("sample", [manifest, commit])
def test_the_samples_set_every_field(sample):
    record = sample()
    for f in dataclasses.fields(record):
        assert _default(f) is dataclasses.MISSING or getattr(record, f.name) != _default(f), \
            f"give {type(record).__name__}.{f.name} a value other than its default in {sample.__name__}()"


def test_repoint_keeps_every_field_but_the_chunks_it_moves():
    m = manifest()
    moved = ChunkRef(CHUNK, 8, "raw", NEW_PACK, 16, 8)
    got = repoint(m, {OLD_PACK}, {CHUNK: moved})
    for f in dataclasses.fields(Manifest):
        if f.name != "nodes":
            assert getattr(got, f.name) == getattr(m, f.name), f.name
    assert [e.chunks for _, e in got.arrays()] == [[moved], [ChunkRef(KEPT, 8, "raw", OTHER_PACK, 8, 8)]]
    assert [(n.path, n.kind) for n in got.nodes] == [(n.path, n.kind) for n in m.nodes]
    assert m.arrays()[0][1].chunks[0].pack == OLD_PACK            # the source is left as it was


@pytest.mark.parametrize("sample", [manifest, commit])
def test_replace_keeps_every_field_it_is_not_given(sample):
    record = sample()
    for f in dataclasses.fields(record):
        other = sample()
        changed = record.replace(**{f.name: getattr(other, f.name)})
        assert changed == record and changed is not record, f.name


def test_the_codecs_keep_every_field():
    m = manifest()
    got = decode_manifest(encode_manifest(m), step=m.step, rank=m.rank, what="manifest")
    for f in dataclasses.fields(Manifest):
        assert getattr(got, f.name) == getattr(m, f.name), f.name
    c = commit()
    got = decode_commit(encode_commit(c), step=c.step, what="COMMIT")
    for f in dataclasses.fields(Commit):
        assert getattr(got, f.name) == getattr(c, f.name), f.name
