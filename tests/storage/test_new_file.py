"""Files written piece by piece and named once whole (``Storage.open_new``): how a pack is streamed to disk while
its later chunks are still being encoded (issue 30: a blocking save with a codec wrote its pack only after every
chunk was encoded). The bytes, the create-only link, the replace, what is left behind (nothing once discarded; a
temp file garbage collection removes when the process died), on a disk with O_DIRECT, without it, on tmpfs
(which refuses O_DIRECT), and through the in-memory default an object store gets."""
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import Store, Writing
from ckptstore.format import packs
from ckptstore.format.blobs import digest_bytes
from ckptstore.format.layout import pack_path
from ckptstore.storage.fsspec_storage import FsspecStorage
from ckptstore.storage.local import BOUNCE_BYTES, LocalStorage
from helpers import bits_equal

PIECES = [0, 1, 4095, 4097, BOUNCE_BYTES - 3, 5, BOUNCE_BYTES + 4096, 100]   # across the 16 MiB buffer's edges


def _storages(tmp_path):
    out = [("disk, O_DIRECT", LocalStorage(str(tmp_path / "direct"))),
           ("disk, buffered", LocalStorage(str(tmp_path / "buffered"), direct_io=False)),
           ("memory (default)", FsspecStorage(f"memory://newfile-{os.getpid()}-{time.monotonic_ns()}"))]
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        import tempfile
        out.append(("tmpfs", LocalStorage(tempfile.mkdtemp(dir="/dev/shm", prefix="ckpt-newfile-"))))
    return out


def _files(storage):
    root = storage.local_path("")
    if root is None:
        return None
    return sorted(str(p.relative_to(root)) for p in Path(root).rglob("*") if p.is_file())


@pytest.mark.parametrize("which", range(4))
def test_pieces_are_written_linked_once_and_leave_nothing_behind(tmp_path, which):
    stores = _storages(tmp_path)
    if which >= len(stores):
        pytest.skip("no writable /dev/shm here")
    name, st = stores[which]
    rng = np.random.default_rng(which)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in PIECES]
    whole = b"".join(p.tobytes() for p in pieces)
    f = st.open_new("packs/zz")
    try:
        for p in pieces:
            f.write(memoryview(p))
            p[:] = 0                                    # the caller may reuse its buffer once write returns
        assert f.size == len(whole)
        assert f.link("packs/ab/one.pack")
    finally:
        f.discard()
    assert st.read_bytes("packs/ab/one.pack") == whole, name
    st.sync([])
    if _files(st) is not None:
        assert _files(st) == [os.path.join("packs", "ab", "one.pack")], name    # no temp file left

    # create-only: a second file of the same name is not linked, replaces only when told, and leaves nothing
    g = st.open_new("packs/zz")
    try:
        g.write(b"other bytes")
        assert not g.link("packs/ab/one.pack")
        assert st.read_bytes("packs/ab/one.pack") == whole
        g.replace("packs/ab/one.pack")
    finally:
        g.discard()
    assert st.read_bytes("packs/ab/one.pack") == b"other bytes"
    if _files(st) is not None:
        assert _files(st) == [os.path.join("packs", "ab", "one.pack")], name

    h = st.open_new("packs/zz")                        # discarded before it is named: nothing at all
    h.write(b"x" * 10_000)
    h.discard()
    h.discard()
    if _files(st) is not None:
        assert _files(st) == [os.path.join("packs", "ab", "one.pack")], name


def _chunks(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = (torch.randn(3000 + 97 * i, generator=g) * 0.02).numpy()
        v = memoryview(t).cast("B")
        out.append((digest_bytes(v), v, 4))
    return out


def test_a_streamed_pack_is_the_pack_written_whole(tmp_path):
    """A PackStream (the writer's path with a codec: chunks added as their encodes finish) gives the same pack,
    byte for byte and by name, as write_pack with every chunk at hand, and the same references."""
    from ckptstore.format.blobs import encode_chunk
    chunks = _chunks()
    enc = [encode_chunk(v, "auto", 1, k) for _, v, k in chunks]
    assert {u for u, _ in enc} == {"planes"}
    a, b = LocalStorage(str(tmp_path / "a")), LocalStorage(str(tmp_path / "b"))

    def streamed():
        st = packs.PackStream(b)
        try:
            for (cid, v, _), (used, payload) in zip(chunks, enc):
                st.add(cid, len(v), used, payload)
            return st.finish()
        finally:
            st.discard()
    refs_a, wrote_a = packs.write_pack(a, chunks, codec="auto", level=1, buffers=packs.PackBuffers(), encoded=enc)
    refs_b, wrote_b = streamed()
    assert refs_a == refs_b and wrote_a == wrote_b == sum(len(p) for _, p in enc)
    path = pack_path(refs_a[0].pack)
    assert a.read_bytes(path) == b.read_bytes(path)
    assert digest_bytes(b.read_bytes(path)) == refs_b[0].pack

    # the same pack again: not rewritten (0 bytes); a damaged one of that name is replaced by the right bytes
    assert streamed() == (refs_b, 0)
    full = Path(b.local_path(path))
    good = full.read_bytes()
    os.chmod(full, 0o644)
    full.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    assert streamed()[1] == len(good)
    assert full.read_bytes() == good
    assert not [p for p in Path(b.local_path("")).rglob("*.tmp-*")]


def test_a_save_streams_several_packs_and_loads(tmp_path):
    """With a codec, the save's small chunks go to packs of about ``target_size`` in order, each streamed as its
    chunks' batches finish: several packs, each hashing to its name, every tensor back bit for bit."""
    from ckptstore import Packing
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(30_000 + 7 * i, generator=g) * 0.02 for i in range(40)}     # ~120 KiB each
    state["dup"] = state["t3"].clone()                 # the same bytes twice: stored once
    with Store(tmp_path, writing=Writing(codec="auto", packing=Packing(threshold=1 << 20, target_size=1 << 20))) \
            as s:
        s.save(state, 1)
        m = s.catalog.read_manifest(s.catalog.read_commit(1), 0)
        refs = {"/".join(map(str, n.path)): e.chunks[0] for n, e in m.arrays()}
        pack_ids = {r.pack for r in refs.values()}
        assert len(pack_ids) >= 4 and None not in pack_ids
        assert refs["dup"] == refs["t3"]
        for pid in pack_ids:
            assert digest_bytes(s.storage.read_bytes(pack_path(pid))) == pid
        assert bits_equal(s.load(1), state) and s.verify() == {1: None}
    assert not list(tmp_path.rglob("*.tmp-*"))


def test_a_save_that_dies_mid_pack_leaves_a_temp_file_gc_removes(tmp_path, monkeypatch):
    """A pack streamed by a save whose encode fails part way: the save fails, nothing is named, the temp file
    is removed on the way out; one left by a process that died (made here by hand, as old as the grace) is
    removed by gc, and the earlier step still loads."""
    from ckptstore.io import writer
    state = {f"t{i}": torch.randn(20_000) * 0.02 for i in range(30)}
    with Store(tmp_path, writing=Writing(codec="auto")) as s:
        s.save(state, 1)
        real, calls = writer.encode_chunk, []

        def failing(view, codec, level, itemsize):
            calls.append(1)
            if len(calls) > 10:
                raise OSError(28, "No space left on device (injected)")
            return real(view, codec, level, itemsize)
        monkeypatch.setattr(writer, "encode_chunk", failing)
        changed = {k: v + 1 for k, v in state.items()}
        with pytest.raises(OSError, match="injected"):
            s.save(changed, 2)
        monkeypatch.undo()
        assert not list(tmp_path.rglob("*.tmp-*"))
        f = s.storage.open_new("packs/7f")
        f.write(b"half a pack")
        f._finish()                                     # the process "dies" here: the temp file stays
        left = list(tmp_path.rglob("*.tmp-*"))
        assert len(left) == 1
        old = time.time() - 7200
        os.utime(left[0], (old, old))
        assert s.gc().temp_files_removed == 1 and not left[0].exists()
        assert bits_equal(s.load(1), state) and s.steps() == [1]


def test_a_write_of_the_same_thread_meanwhile_does_not_touch_the_pieces_pending(tmp_path):
    """A new file's pending pieces sit in the thread's O_DIRECT bounce buffer; a write_new of unaligned bytes by
    the same thread before the file is named (bounced through O_DIRECT too) gets a buffer of its own."""
    st = LocalStorage(str(tmp_path))
    rng = np.random.default_rng(9)
    first, other = rng.integers(0, 256, 3 << 20, dtype=np.uint8), rng.integers(0, 256, (2 << 20) + 1, dtype=np.uint8)
    f = st.open_new("packs/aa")
    try:
        f.write(first.tobytes())                       # pending: under the 16 MiB buffer, not written yet
        assert st.write_new("objects/x", memoryview(other.tobytes())[1:])     # unaligned: bounced
        f.write(b"tail")
        assert f.link("packs/bb/p.pack")
    finally:
        f.discard()
    assert st.read_bytes("packs/bb/p.pack") == first.tobytes() + b"tail"
    assert st.read_bytes("objects/x") == other.tobytes()[1:]
