"""The planes codec (issue 30): ``Writing(codec="auto")`` stores float chunks as byte planes + zstd. Round trips
bit for bit through a store (every float dtype, special values, views, odd chunk boundaries, packs and blobs),
incompressible chunks kept raw, hostile frames refused with an error naming the chunk (and resume falling back),
older codecs still loading, and a step through a loopback S3 remote."""
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ckptstore import CorruptCheckpointError, Packing, Remote, Store, Writing
from ckptstore.format import planes
from ckptstore.format.manifest import FORMAT_VERSION, PLANES_FORMAT
from helpers import bits_equal, cli, step_dir

FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.complex64]
BLOBS = Writing(codec="auto", packing=Packing(threshold=0), chunk_size=4099)     # chunks split elements


def special(dtype, n=3001, seed=0):
    """``n`` values of ``dtype``: trained-like values (normal, small), then NaNs with payloads, +-0.0,
    subnormals and infinities set bit by bit."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
        bits = t.view(ints)
        w = 8 * dtype.itemsize
        mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}[dtype]
        exp_all = ((1 << (w - 1 - mant)) - 1) << mant
        bits[:6] = torch.tensor([exp_all | 1, exp_all | 5, exp_all, 0, 1, 3], dtype=torch.int64).to(ints)
        bits[6] = -(1 << (w - 1))                                    # -0.0 (sign bit alone)
        bits[7] = bits[0] | bits[6]                                  # a negative NaN with a payload
    return t


def state_of(seed=0):
    g = torch.Generator().manual_seed(seed)
    s = {f"x_{str(d).split('.')[-1]}": special(d, seed=seed) for d in FLOATS}
    w = torch.randn(64, 96, generator=g) * 0.02
    s["t"] = w.t()                                                    # a non-contiguous view
    s["strided"] = w[::3, 1::2]
    s["empty"] = torch.empty(0, 5)
    s["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    s["big"] = torch.randn(70_000, generator=g) * 0.01               # crosses chunk_size many times
    s["ints"] = torch.arange(5000)
    return s


def codecs_of(store: Store, step: int):
    """key -> set of codecs of its chunks, from the step's manifest."""
    m = store.catalog.read_manifest(store.catalog.read_commit(step), 0)
    return {"/".join(map(str, n.path)): {c.codec for c in e.chunks} for n, e in m.arrays()}


@pytest.mark.parametrize("writing", [Writing(codec="auto"), BLOBS], ids=["packed", "blobs"])
def test_every_float_dtype_round_trips_bit_for_bit(tmp_path, writing):
    state = state_of()
    with Store(tmp_path / "s", writing=writing) as s:
        s.save(state, 1)
        got = s.load(1)
        used = codecs_of(s, 1)
    for k, v in state.items():
        assert bits_equal(got[k], v.contiguous()), k
    assert "planes" in used["big"] and "planes" in used["x_float32"] and "planes" in used["x_bfloat16"]
    assert used["ints"] <= {"zstd", "raw"} and "planes" not in used["ints"]       # no planes for ints


def test_blobs_encoded_one_after_another_on_one_thread_are_each_their_own(tmp_path):
    """The blob path encodes into its thread's frame buffer, reused chunk after chunk (and grown for a larger
    one): with one worker every blob passes through the same buffer, and each blob stored is its own chunk's."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(n, generator=g) * 0.02 for i, n in enumerate([1 << 17, 3 << 18, 1 << 16, 3 << 19])}
    state["h"] = (torch.randn(1 << 18, generator=g) * 0.02).to(torch.bfloat16)
    with Store(tmp_path / "s", writing=Writing(codec="auto", workers=1, packing=Packing(threshold=0))) as s:
        s.save(state, 1)
        assert codecs_of(s, 1) == {k: {"planes"} for k in state}
    with Store(tmp_path / "s") as s:                                  # a new process's view: every blob verified
        assert bits_equal(s.load(1), state)
        assert cli("verify", str(tmp_path / "s")).returncode == 0


def test_auto_keeps_incompressible_chunks_raw(tmp_path):
    g = torch.Generator().manual_seed(1)
    noise = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    state = {"noise_f32": noise.view(torch.float32).clone(), "noise_u8": noise.clone(),
             "w": torch.randn(1 << 18, generator=g) * 0.02, "ints": torch.arange(1 << 17)}
    with Store(tmp_path / "s", writing=Writing(codec="auto")) as s:
        r = s.save(state, 1)
        used = codecs_of(s, 1)
        assert bits_equal(s.load(1), state)
    assert used == {"noise_f32": {"raw"}, "noise_u8": {"raw"}, "w": {"planes"}, "ints": {"zstd"}}
    assert r.bytes_written < sum(t.numel() * t.element_size() for t in state.values())


def test_older_codecs_still_load_and_keep_their_format(tmp_path):
    """Steps written raw and zstd load next to planes steps in one store; only a manifest naming a planes chunk
    is written as format 4 (an older reader refuses it as too new instead of calling it corrupt)."""
    import msgpack
    root = tmp_path / "s"
    states = {1: state_of(1), 2: state_of(2), 3: state_of(3)}
    for step, codec in ((1, "raw"), (2, "zstd"), (3, "auto")):
        with Store(root, writing=Writing(codec=codec)) as s:
            s.save(states[step], step)
    fmts = {step: msgpack.unpackb((step_dir(root, step) / "manifest-rank00000.msgpack").read_bytes())["format"]
            for step in (1, 2, 3)}
    assert fmts == {1: FORMAT_VERSION, 2: FORMAT_VERSION, 3: PLANES_FORMAT}
    with Store(root, writing=Writing(codec="auto")) as s:
        for step in (1, 2, 3):
            assert bits_equal(s.load(step), {k: v.contiguous() for k, v in states[step].items()})
        assert s.verify() == {1: None, 2: None, 3: None}


# -- hostile frames ------------------------------------------------------------------------------------------------
def _planes_blob(root: Path, store: Store, step: int, key: str):
    m = store.catalog.read_manifest(store.catalog.read_commit(step), 0)
    for n, e in m.arrays():
        if n.path == (key,):
            c = e.chunks[0]
            assert c.codec == "planes" and c.pack is None
            return root / "objects" / c.blob_id[:2] / f"{c.blob_id}.bpl", c
    raise KeyError(key)


def _lie_length(b: bytes) -> bytes:
    n = struct.unpack_from("<Q", b, 8)[0]
    return b[:8] + struct.pack("<Q", n - 1) + b[16:]


def _lie_plane(b: bytes) -> bytes:                 # the last plane claims one byte more than it stores
    k = b[6]
    off = 16 + 9 * (k - 1) + 1
    return b[:off] + struct.pack("<Q", struct.unpack_from("<Q", b, off)[0] + 1) + b[off + 8:]


@pytest.mark.parametrize("damage,match", [
    (lambda b: b"XKPL" + b[4:], "not a planes frame"),
    (lambda b: b[:4] + b"\x09" + b[5:], "version 9"),
    (lambda b: b[:6] + b"\x03" + b[7:], "element size 3"),
    (lambda b: b[:len(b) // 2], "planes frame"),
    (lambda b: b[:10], "shorter than its header"),
    (_lie_length, "holds"),
    (_lie_plane, "adds up to"),
], ids=["magic", "version", "itemsize", "truncated", "header-cut", "lying-length", "lying-plane"])
def test_damaged_planes_blob_is_a_clear_error_and_resume_falls_back(tmp_path, damage, match):
    root = tmp_path / "s"
    g = torch.Generator().manual_seed(0)
    old, new = {"w": torch.randn(50_000, generator=g)}, {"w": torch.randn(50_000, generator=g)}
    with Store(root, writing=Writing(codec="auto", packing=Packing(threshold=0))) as s:
        s.save(old, 1)
        s.save(new, 2)
        path, ref = _planes_blob(root, s, 2, "w")
    path.write_bytes(damage(path.read_bytes()))
    with Store(root) as s:
        with pytest.raises(CorruptCheckpointError, match=match) as ei:
            s.load(2)
        assert ei.value.step == 2 and ei.value.key == "w" and ei.value.blob == ref.blob_id
        assert s.verify(2)[2] is not None
        out = {"w": None}
        assert s.resume(out) == 1 and torch.equal(out["w"], old["w"])


def test_damaged_planes_chunk_in_a_pack_names_the_key(tmp_path):
    root = tmp_path / "s"
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(3000, generator=g), "b": torch.randn(3000, generator=g)}
    new = {k: v + 1 for k, v in old.items()}
    with Store(root, writing=Writing(codec="auto")) as s:
        s.save(old, 1)
        s.save(new, 2)
        m = s.catalog.read_manifest(s.catalog.read_commit(2), 0)
        ref = next(e.chunks[0] for n, e in m.arrays() if n.path == ("b",))
    assert ref.codec == "planes" and ref.pack is not None
    pack = root / "packs" / ref.pack[:2] / f"{ref.pack}.pack"
    data = bytearray(pack.read_bytes())
    data[ref.offset] ^= 0xFF                                          # the frame's magic
    pack.write_bytes(bytes(data))
    with Store(root) as s:
        with pytest.raises(CorruptCheckpointError, match="not a planes frame") as ei:
            s.load(2)
        assert ei.value.key == "b" and ei.value.step == 2
        out = {"a": None, "b": None}
        assert s.resume(out) == 1 and bits_equal(out, old)


def test_decoding_is_bounded_by_the_expected_length():
    """A zstd plane that expands far past its plane (a decompression bomb) is refused without allocating it;
    so is a frame whose claimed length differs from the one the reader expects."""
    import zstandard
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))             # 64 MiB of zeros, ~2 KiB
    n = 4096
    head = struct.pack("<4sBBBBQ", b"CKPL", 1, 0, 1, 1, n) + struct.pack("<BQ", 1, len(bomb))
    with pytest.raises(planes.FrameError, match="more than its"):
        planes.decode_into(head + bomb, memoryview(bytearray(n)))
    frame = planes.encode(np.arange(1000, dtype=np.float32).tobytes(), 4)
    with pytest.raises(planes.FrameError, match="holds 4000 bytes, expected 4004"):
        planes.decode_into(frame, memoryview(bytearray(4004)))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), itemsize=st.sampled_from([1, 2, 4, 8]),
       transform=st.sampled_from([planes.NONE, planes.EXPONENT]))
def test_planes_round_trip_any_bytes(data, itemsize, transform):
    frame = planes.encode(data, itemsize, transform=transform)
    out = bytearray(len(data))
    planes.decode_into(frame, memoryview(out))
    assert bytes(out) == data
    assert planes.frame_nbytes(frame) == len(data)


# -- remote ----------------------------------------------------------------------------------------------------------
@pytest.mark.remote
def test_auto_step_uploads_pulls_resumes_and_verifies_on_s3(tmp_path, s3_bucket_url):
    local = tmp_path / "run"
    state = state_of()
    opts = dict(storage_options=s3_bucket_url.storage_options)
    with Store(local, remote=s3_bucket_url.url, writing=Writing(codec="auto", packing=Packing(threshold=16 << 10)),
               **opts) as s:
        s.save(state, 1)
        s.wait_for_uploads()
        used = codecs_of(s, 1)
    assert any("planes" in c for c in used.values())
    assert any(p.suffix == ".bpl" for p in (local / "objects").rglob("*"))          # some planes chunks are blobs
    with Store(tmp_path / "pulled", remote=Remote(s3_bucket_url.url, upload=False), **opts) as s:
        out = {k: None for k in state}
        assert s.resume(out) == 1 and s.resumed_from["tier"] == "remote"
        assert bits_equal(out, {k: v.contiguous() for k, v in state.items()})
        assert s.verify() == {1: None}
    cli("verify", str(tmp_path / "pulled"))


def test_repack_keeps_planes_chunks_planes(tmp_path):
    """Repack re-encodes the live chunks of mostly dead packs: a planes chunk stays a planes chunk (the element size
    comes from its old frame), the step loads bit for bit and verifies."""
    small = Packing(threshold=64 << 10, target_size=1 << 20)

    def state_at(step):
        return {f"t{i}": torch.randn(1500 + i, generator=torch.Generator().manual_seed(
            1000 * (step if i % 4 else 0) + i)) * 0.02 for i in range(40)}
    root = tmp_path / "s"
    with Store(root, writing=Writing(codec="auto", packing=small)) as s:
        for step in (1, 2, 3):
            s.save(state_at(step), step)
        s.delete_step(1)
        s.delete_step(2)
        r = s.gc(grace_seconds=0)
        assert r.packs_repacked >= 1 and 3 in r.steps_rewritten
        assert set().union(*codecs_of(s, 3).values()) == {"planes"}
        assert bits_equal(s.load(3), state_at(3)) and s.verify() == {3: None}


# -- the frame as FORMAT.md specifies it (issue 30's speed work changed how planes are split, not the frame) -----
def _spec_planes(data: bytes, k: int, transform: int):
    """The planes of ``data`` as FORMAT.md "The planes codec" defines them, written the plain way (a transpose and
    the transform's formula), and the tail."""
    a = np.frombuffer(data, dtype=np.uint8)
    m = len(a) // k
    p = a[: m * k].reshape(m, k).T.copy()
    if transform == planes.EXPONENT and k > 1 and m:
        t, u = p[k - 1].copy(), p[k - 2].copy()
        p[k - 1] = ((t.astype(np.uint16) << 1) | (u >> 7)) & 0xFF
        p[k - 2] = (u & 0x7F) | (t & 0x80)
    return p, bytes(a[m * k:])


def _spec_frame(data: bytes, k: int, transform: int, compress=None) -> bytes:
    """A version 1 frame written from the spec alone; ``compress(plane) -> bytes or None`` picks zstd planes."""
    p, tail = _spec_planes(data, k, transform if k > 1 else planes.NONE)
    heads, parts = [], []
    for plane in p:
        packed = compress(plane.tobytes()) if compress else None
        heads.append(struct.pack("<BQ", 1 if packed else 0, len(packed) if packed else len(plane)))
        parts.append(packed or plane.tobytes())
    tr = transform if k > 1 else planes.NONE
    return b"".join([struct.pack("<4sBBBBQ", b"CKPL", 1, tr, k, k, len(data)), *heads, *parts, tail])


def _read_spec_frame(frame: bytes):
    """Parse a frame by the spec with python-zstandard's own decoder: (transform, k, planes, tail)."""
    import zstandard
    magic, version, tr, k, nplanes, n = struct.unpack_from("<4sBBBBQ", frame, 0)
    assert (magic, version, nplanes) == (b"CKPL", 1, k)
    m, pos, out = n // k, 16 + 9 * k, []
    for i in range(k):
        method, stored = struct.unpack_from("<BQ", frame, 16 + 9 * i)
        body = frame[pos: pos + stored]
        out.append(np.frombuffer(zstandard.ZstdDecompressor().decompress(body) if method == 1 else body,
                                 dtype=np.uint8))
        assert len(out[-1]) == m
        pos += stored
    return tr, k, out, frame[pos:]


def _floats(n: int, seed: int = 0, k: int = 4) -> bytes:
    """``n`` bytes of trained-like floats of ``k`` bytes (some zero runs, NaNs with payloads, infinities)."""
    g = np.random.default_rng(seed)
    dt = {1: np.uint8, 2: np.float16, 4: np.float32, 8: np.float64}[k]
    x = (g.standard_normal(n // k + 1) * 0.02).astype(dt) if k > 1 else g.integers(0, 16, n + 1, dtype=np.uint8)
    if k > 1 and len(x) > 20:
        x[5:15] = 0
        bits = x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[k])
        bits[1] = np.iinfo(bits.dtype).max                      # a negative NaN with every payload bit set
        bits[2] = bits[1] >> np.array(1, dtype=bits.dtype)      # a positive one
        x[3], x[4] = np.inf, -np.inf
    return x.tobytes()[:n]


SIZES = [0, 1, 3, 8, 1023, 4097, 4 * 4096 + 5, 70_001, 300_003, 8 * 2 ** 17 + 3]     # the last: several blocks at k = 8


NATIVE = pytest.mark.skipif(planes._native is None, reason="the C split/merge (ckptstore/format/_planes.c) is "
                            "not built here (no compiler at install, or CKPTSTORE_NATIVE=0)")


@pytest.fixture(params=["frame", "c", "numpy"])
def split_merge(request, monkeypatch):
    """Each test once with whole frames in C (where built), once with the C split / merge under planes.py's own
    frame code, and once with the numpy code."""
    if request.param == "frame" and not planes._whole:
        pytest.skip("the C frame code is not built here (or zstd's C API is not reachable)")
    if request.param == "c" and planes._native is None:
        pytest.skip("the C split/merge is not built here")
    if request.param != "frame":
        monkeypatch.setattr(planes, "_whole", False)
    if request.param == "numpy":
        monkeypatch.setattr(planes, "_native", None)
    return request.param


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("transform", [planes.NONE, planes.EXPONENT])
def test_encode_writes_the_frame_the_spec_defines(k, transform, split_merge):
    """Every element size, odd lengths with tails, both transforms, through the C and the numpy split / merge:
    the frame's planes (each decoded by python-zstandard's plain decoder) are the spec's planes, and decode_into
    gives the bytes back bit for bit."""
    for n in SIZES:
        for data in (_floats(n, n, k), np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()):
            frame = bytes(planes.encode(data, k, transform=transform))
            tr, kk, got, tail = _read_spec_frame(frame)
            want, want_tail = _spec_planes(data, k, tr)
            assert kk == k and tr == (transform if k > 1 else planes.NONE)
            assert tail == want_tail and all((g == w).all() for g, w in zip(got, want)), (k, transform, n)
            out = bytearray(n)
            planes.decode_into(frame, memoryview(out))
            assert out == data


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_version_1_frames_of_the_first_encoder_still_decode(k, split_merge):
    """Frames written from the spec with python-zstandard's compressor (as the first planes encoder wrote them:
    level 1, 32 KiB window, 7-byte matches), or with every plane raw, decode bit for bit."""
    import zstandard
    cctx = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        1, window_log=15, hash_log=8, min_match=7, write_content_size=1, write_checksum=0))
    for n in SIZES:
        data = _floats(n, n + 1, k)
        for compress in (None, lambda b: cctx.compress(b) if b else None):
            frame = _spec_frame(data, k, planes.EXPONENT, compress)
            out = bytearray(n)
            planes.decode_into(frame, memoryview(out))
            assert out == data, (k, n)


def test_frames_decode_the_same_through_either_zstd_binding(monkeypatch):
    """Planes are coded through zstd's C API (cffi) where it is importable, else python-zstandard's API: frames
    from either decode through the other, bit for bit."""
    if planes._lib is None:
        pytest.skip("zstandard's cffi backend is not importable here")
    datas = [(_floats(n, n, k), k) for n in (4097, 300_003) for k in (2, 4, 8)]
    c_frames = [bytes(planes.encode(d, k)) for d, k in datas]
    monkeypatch.setattr(planes, "_lib", None)
    monkeypatch.setattr(planes, "_whole", False)
    py_frames = [bytes(planes.encode(d, k)) for d, k in datas]
    for (d, k), f in zip(datas, c_frames):
        out = bytearray(len(d))
        planes.decode_into(f, memoryview(out))
        assert out == d
    monkeypatch.undo()
    for (d, k), f in zip(datas, py_frames):
        out = bytearray(len(d))
        planes.decode_into(f, memoryview(out))
        assert out == d


def test_encoding_from_threads_gives_the_same_frames():
    """Each thread has its own zstd contexts: frames encoded by 4 threads at once equal those encoded alone."""
    from concurrent.futures import ThreadPoolExecutor
    datas = [_floats(200_000 + i, i) for i in range(16)]
    alone = [bytes(planes.encode(d, 4)) for d in datas]
    with ThreadPoolExecutor(4) as ex:
        assert [bytes(f) for f in ex.map(lambda d: planes.encode(d, 4), datas)] == alone
        outs = list(ex.map(lambda f: _decoded(f), alone))
    assert outs == datas


def _decoded(frame) -> bytes:
    out = bytearray(planes.frame_nbytes(frame))
    planes.decode_into(frame, memoryview(out))
    return bytes(out)


def test_hostile_zstd_planes_are_refused_without_allocating():
    """A zstd plane that claims 64 GiB in its frame header, holds a second frame, is cut short, or decodes to
    fewer bytes than the plane: a FrameError, and nothing larger than the output is allocated (the 64 GiB claim
    would fail with MemoryError otherwise)."""
    import zstandard
    n = 4096
    m = n // 4
    z = zstandard.ZstdCompressor(level=1)
    plane = bytes(range(256)) * (m // 256)
    head = lambda stored: (struct.pack("<4sBBBBQ", b"CKPL", 1, 0, 4, 4, n)         # noqa: E731
                           + struct.pack("<BQ", 0, m) * 3 + struct.pack("<BQ", 1, stored))
    raw3 = plane * 3
    claim = bytearray(z.compress(plane))
    liar = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(64 << 10))
    cases = {
        "two frames": (z.compress(plane) + z.compress(b"x"), "more than its|does not decode"),
        "cut short": (bytes(claim[:-3]), "does not decode|fewer"),
        "too few": (z.compress(plane[:-1]), "fewer"),
        "no content size, too many": (liar, "more than its"),
    }
    for name, (payload, match) in cases.items():
        with pytest.raises(planes.FrameError, match=match):
            planes.decode_into(head(len(payload)) + raw3 + payload, memoryview(bytearray(n)))
    # a frame header claiming 64 GiB (frame content size field patched): refused, not allocated
    big = bytearray(zstandard.ZstdCompressor(level=1).compress(plane))
    params = zstandard.get_frame_parameters(bytes(big))
    assert params.content_size == m
    fhd = big[4]
    assert fhd >> 6 == 1 and fhd & 0x03 == 0                           # a 2-byte content size field, no dict id
    start = 5 if fhd & 0x20 else 6                                      # single segment: no window descriptor
    forged = big[:4] + bytes([fhd | 0xC0]) + big[5:start] + struct.pack("<Q", 64 << 30) + big[start + 2:]
    assert zstandard.get_frame_parameters(bytes(forged)).content_size == 64 << 30
    with pytest.raises(planes.FrameError):
        planes.decode_into(head(len(forged)) + raw3 + bytes(forged), memoryview(bytearray(n)))


@settings(max_examples=40, deadline=None)
@given(seed=st.binary(min_size=1, max_size=600), size=st.integers(16_385, 40_000), k=st.sampled_from([2, 4, 8]),
       fill=st.sampled_from([None, 0, 0x7F, 0xFF]), noise=st.booleans())
def test_planes_round_trip_sampled_planes(seed, size, k, fill, noise):
    """Chunks large enough for the sampled decision (a histogram per plane): any bytes (a pattern repeated,
    or random), partly runs of one byte value: every NaN / inf / subnormal payload comes back bit for bit."""
    data = (seed * (size // len(seed) + 1))[:size]
    if noise:
        data = np.random.default_rng(len(seed)).integers(0, 256, size, dtype=np.uint8).tobytes()
    if fill is not None:
        data = data[: len(data) // 2] + bytes([fill]) * (len(data) - len(data) // 2)
    frame = planes.encode(data, k)
    out = bytearray(len(data))
    planes.decode_into(frame, memoryview(out))
    assert bytes(out) == data


@NATIVE
@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=5000), k=st.sampled_from([2, 4, 8]),
       transform=st.sampled_from([planes.NONE, planes.EXPONENT]))
def test_c_split_and_merge_equal_the_numpy_code(data, k, transform):
    """The C split / merge give the numpy code's planes and elements byte for byte, for any bytes (every NaN,
    sign and exponent pattern), every element size and both transforms."""
    m = len(data) // k
    a = np.frombuffer(data[: m * k], dtype=np.uint8)
    want = np.empty((k, m), dtype=np.uint8)
    if m:
        planes._split_into(want, a, k, transform)
    got = np.empty(k * m, dtype=np.uint8)
    planes._native.split(a, got, k, transform)
    assert (got.reshape(k, m) == want).all()
    out = bytearray(m * k)
    planes._native.merge(out, [want[i] for i in range(k)], transform)
    assert bytes(out) == data[: m * k]


WHOLE = pytest.mark.skipif(not planes._whole, reason="the C frame code (ckptstore/format/_planes.c) is not built "
                           "here, or zstd's C API is not reachable")


@WHOLE
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), n=st.sampled_from([0, 1, 7, 64, 1023, 4097, 20_001, 70_003]),
       k=st.sampled_from([2, 4, 8]), transform=st.sampled_from([planes.NONE, planes.EXPONENT]),
       kind=st.sampled_from(["floats", "bytes", "few", "runs", "zeros"]))
def test_c_frames_equal_the_python_code(seed, n, k, transform, kind):
    """One C call per chunk (planes._native.encode / decode_into) writes the frame planes.py's own code writes,
    byte for byte (the same split, the same may_pay decisions, the same zstd calls), and reads it back: floats,
    random bytes, a few values, runs of one value, zeros."""
    rng = np.random.default_rng(seed)
    data = {"floats": lambda: _floats(n, seed % 1000, k),
            "bytes": lambda: rng.integers(0, 256, n, dtype=np.uint8).tobytes(),
            "few": lambda: rng.integers(0, 3, n, dtype=np.uint8).tobytes(),
            "runs": lambda: np.repeat(rng.integers(0, 256, n // 37 + 1, dtype=np.uint8), 37)[:n].tobytes(),
            "zeros": lambda: bytes(n)}[kind]()
    got = bytes(planes.encode(data, k, transform=transform))
    planes._whole = False
    try:
        want = bytes(planes.encode(data, k, transform=transform))
    finally:
        planes._whole = True
    assert got == want
    out = bytearray(n)
    planes.decode_into(got, memoryview(out))
    assert out == data


@WHOLE
def test_c_decoding_refuses_what_the_python_code_refuses_with_its_words():
    """Damaged frames (every header field, each byte flipped at random, cut short, lengthened, the wrong expected
    length): the C decoder raises the FrameError planes.py's code raises, with the same message, or decodes the
    same bytes where a flip lands in a raw plane."""
    rng = np.random.default_rng(1)
    x = _floats(20_002, 3, 4)
    f = bytes(planes.encode(x, 4))
    cases = [f[:10], f[:20], b"XXXX" + f[4:], f[:4] + b"\x02" + f[5:], f[:5] + b"\x07" + f[6:],
             f[:6] + b"\x03" + f[7:], f[:7] + b"\x02" + f[8:], f + b"z", f[:-1]]
    for _ in range(150):
        for span in (len(f), planes.header_size(4)):
            g = bytearray(f)
            g[rng.integers(0, span)] ^= 1 << rng.integers(0, 8)
            cases.append(bytes(g))
    errors = 0
    for expected in (len(x), len(x) - 1):
        for case in cases:
            seen = []
            for whole in (True, False):
                planes._whole = whole
                out = bytearray(expected)
                try:
                    planes.decode_into(case, memoryview(out))
                    seen.append(bytes(out))
                except planes.FrameError as e:
                    seen.append(str(e))
                finally:
                    planes._whole = True
            assert seen[0] == seen[1]
            errors += isinstance(seen[0], str)
    assert errors > len(cases)                       # most cases are refused (all with the wrong length)


@NATIVE
def test_c_split_and_merge_refuse_wrong_lengths_and_overlap():
    """Lengths are checked before a byte moves: a ValueError names what is wrong, nothing is written."""
    a = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="element size 3"):
        planes._native.split(a, np.empty(64, np.uint8), 3, 0)
    with pytest.raises(ValueError, match="63 bytes of 4-byte elements"):
        planes._native.split(a[:63], np.empty(63, np.uint8), 4, 0)
    with pytest.raises(ValueError, match="into 60 bytes"):
        planes._native.split(a, np.empty(60, np.uint8), 4, 0)
    with pytest.raises(ValueError, match="overlap"):
        planes._native.split(a, a, 4, 0)
    with pytest.raises(ValueError, match="transform 2"):
        planes._native.split(a, np.empty(64, np.uint8), 4, 2)
    out = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="plane 2 holds 15 bytes, 16 expected"):
        planes._native.merge(out, [a[:16], a[16:32], a[32:47], a[48:64]], 1)
    with pytest.raises(ValueError, match="3 planes"):
        planes._native.merge(out, [a[:16]] * 3, 0)
    with pytest.raises(ValueError, match="overlaps"):
        planes._native.merge(out, [out[:16], a[16:32], a[32:48], a[48:64]], 0)
    with pytest.raises(TypeError):
        planes._native.merge(bytes(64), [a[:16]] * 4, 0)          # a read-only destination
    assert not out.any()


def test_c_split_and_merge_are_built_where_a_compiler_was():
    """The extension is optional at install (setup.py), so a broken build would only show as a slower codec:
    where this machine has a C compiler and Python's headers, the installed package must have it."""
    import os
    import shutil
    import sysconfig
    if os.environ.get("CKPTSTORE_NATIVE") == "0":
        pytest.skip("CKPTSTORE_NATIVE=0 turns the C split/merge off")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not (shutil.which(sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc")
            and headers.exists()):
        pytest.skip("no C compiler or Python headers here: the numpy split/merge is the one in use")
    assert planes._native is not None, "ckptstore/format/_planes.c was not built: reinstall (pip install -e .)"


@NATIVE
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20_000), k=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2 ** 32 - 1),
       spread=st.sampled_from([1, 4, 256]))
def test_c_sample_statistics_equal_the_numpy_ones(m, k, seed, spread):
    """may_pay's decision comes from the same numbers either way: the C sample (whole rows up to 4 KiB, else 4
    pieces of 1 KiB) gives numpy's byte counts' sum of c log2 c, largest count, sum of squares, and repeats."""
    rows = np.random.default_rng(seed).integers(0, spread, (k, m), dtype=np.uint8)
    got = planes._sample_stats(rows)
    native, planes._native = planes._native, None
    try:
        want = planes._sample_stats(rows)
    finally:
        planes._native = native
    assert [(t, r) for _, t, _, r in got] == [(t, r) for _, t, _, r in want]
    assert np.allclose([(x, q) for x, _, q, _ in got], [(x, q) for x, _, q, _ in want], rtol=1e-12, atol=1e-9)


def test_the_full_match_search_is_tried_for_runs_not_for_scattered_values():
    """may_pay's choice of match search per plane: a plane mostly of one value *in runs* (an embedding's unused
    rows in Adam's moments) is tried with the full search too, one of the same share scattered at random (a
    delta's third plane) with the skipping search alone, one of 90% or more with the full search alone; and the
    frames chosen are no larger than with both searches tried on every plane."""
    rng = np.random.default_rng(5)
    m = 1 << 16
    runs = rng.integers(1, 256, m, dtype=np.uint8)
    runs[: m * 6 // 10] = 0                                          # 60% zeros, one run...
    runs = runs.reshape(512, -1)[rng.permutation(512)].ravel()       # ...cut into rows of 128, shuffled
    scattered = np.where(rng.random(m) < 0.88, 0, rng.integers(1, 256, m)).astype(np.uint8)
    mostly = np.where(rng.random(m) < 0.97, 0, rng.integers(1, 256, m)).astype(np.uint8)
    uniform = rng.integers(0, 256, m, dtype=np.uint8)
    rows = np.stack([uniform, runs, scattered, mostly])
    pays, how = planes.may_pay(rows)
    assert list(pays) == [False, True, True, True]
    assert list(how) == [0, 1, 0, planes._RUNS_ONLY]
    for plane, h in zip(rows[1:], how[1:]):
        fast, full = planes._compress_plane(plane, m), planes._compress_plane(plane, m, True)
        fast, full = (None if x is None else len(x) for x in (fast, full))
        if h == 0:
            assert fast <= full                                      # the skipped search would not have paid
