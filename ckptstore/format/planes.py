"""The ``planes`` codec: lossless compression of floating-point chunks, as byte planes + zstd.

A pure module (bytes and an element size in, a frame out; a frame in, bytes out): it knows nothing of blobs,
packs or manifests, so a writer's choice of codec (:func:`ckptstore.format.blobs.encode_chunk`) and a later delta
codec (the difference with the parent step's chunk, then this) reuse it as it is.

Why (issue 30; ZipNN, IBM 2024): in a float the exponent byte holds ~2.6-3.5 bits of information and the mantissa
bytes ~8, so zstd over the interleaved bytes finds little (1.08x on fp32 weights measured here), while the
exponent bytes alone compress ~3x. The elements' bytes are split into ``itemsize`` planes (plane ``i`` = byte
``i`` of every element, little-endian); for floats the top two planes are then regrouped so that the top one
holds the 8 bits after the sign (a bfloat16 / float32 exponent, the top 8 of a float64's) and the next one the
sign and the 7 bits after those (transform 1: the same gain as rotating each element left by one bit, as ZipNN
does, at a cost of a few passes over two planes instead of two over the whole chunk; +0.6% on fp32 weights,
+1.5% on bfloat16 and Adam's second moment against no transform, measured here). Each plane is stored as one zstd
frame or raw, whichever is smaller; only planes whose sampled byte histogram (4 x 1 KiB) promises >= 3% are
compressed at all (:func:`may_pay`), so incompressible mantissa planes cost a few microseconds.

How it is fast (benchmarks/README.md "bench_codec.py" has the figures, per core): where the optional C extension
was built at install (``ckptstore/format/_planes.c``: a compiler existed) and zstd's C API is reachable, a whole
frame is one C call per chunk, the GIL released (:data:`_whole`: the split, may_pay's decision, the zstd calls
through python-zstandard's own functions, the header; decoding likewise, every check below made in the same order
with the same words): a 1 KiB chunk costs ~5 us where the Python code below, kept as the fallback and as the
tests' reference, spends ~20-30 us on views and calls. Without the zstd C API the split, the merge and the
sample's byte statistics still run in C (one pass each; 8 GB/s split and merge of float32 per core here, where the
numpy code does 2-4 and 1.5-2); without the extension the split is one
truncating cast per plane of the elements read ``i`` bytes on (an unaligned integer view), written straight into
the frame, plus a few uint8 operations for the regrouping (:func:`_split_into`). zstd is called through its C API
(python-zstandard's cffi backend) with literals always Huffman-coded and the fast strategy's match search skipping ahead
(:data:`_C_PARAMS`), so it spends its time on Huffman coding, not on the matches a byte plane hardly has: 2x
faster than level 1 with a small hash table, and 1-3% smaller; a plane over half one value *in runs* is also tried
with the full search (runs are matches) and the smaller kept, one of 90% or more only with it (:func:`may_pay`).
Decoding is one
``ZSTD_decompressDCtx`` per zstd plane into a buffer of its exact length (this thread's, reused: :func:`scratch`),
then the merge (in C, or the top planes regrouped in uint8 and one strided byte copy per plane:
:func:`_merge_into`). What is left is zstd's Huffman coding of the exponent plane(s), ~0.7 GB/s to encode and
~1.5 GB/s to decode per byte of plane on this machine's cores: the bound on a float32 chunk (one such plane in
four bytes), twice as tight on bfloat16 and on Adam's second moment (two). Where cffi is missing, python-zstandard's own API
codes the planes (the same frames, compressed with ``_PARAMS``: level 1, 32 KiB window, 256-entry hash table,
7-byte matches, about half as fast).

Frame (all integers little-endian; FORMAT.md "The planes codec")::

    offset 0   4  magic b"CKPL"
           4   1  version (1)
           5   1  transform: 0 = none; 1 = exponent planes: with T, U the top two planes of the elements'
                  bytes, plane k-1 stores (T << 1 | U >> 7) & 0xFF and plane k-2 (U & 0x7F) | (T & 0x80)
           6   1  element size k: 1, 2, 4 or 8 bytes
           7   1  planes: k
           8   8  n: raw length in bytes (any n; the last n mod k bytes are the tail, stored raw)
          16  9k  per plane: method (1 byte: 0 raw, 1 zstd), stored length (8 bytes)
                  then the planes' stored bytes in order (plane i holds n div k bytes raw), then the tail

A reader (:func:`decode_into`) checks every field, that ``n`` is the length it expects (the manifest's), that
the stored lengths add up to the frame's length exactly, and decodes each zstd plane into a buffer of its raw
length (zstd never writes past it: a plane holding more, or claiming more in its zstd header, is refused, and
nothing is allocated by what a frame claims). Any failure is a
:class:`FrameError` (a ``ValueError``). Checking what the bytes hash to is the caller's (the chunk's id).
"""
from __future__ import annotations

import os
import struct
import threading
from typing import Optional

import numpy as np
import zstandard

MAGIC = b"CKPL"
VERSION = 1
NONE, EXPONENT = 0, 1
_HEADER = struct.Struct("<4sBBBBQ")
_PLANE = struct.Struct("<BQ")
RAW, ZSTD = 0, 1
SIZES = (1, 2, 4, 8)                # element sizes a frame may name
_SAMPLE = 16 << 10                  # bytes per piece of sample() (zstd chunks are tried on 4 before compressing)
MIN_GAIN = 0.97                     # a plane (and the frame) is kept compressed only at <= 97% of its raw size
_HIST_SAMPLE = 1 << 10              # bytes per piece of the sample whose byte histogram decides (may_pay)
_CODER_BYTES = 64                   # a zstd frame's header + a Huffman table, about (bytes)
_RUNS_EXCESS = 0.03                 # repeats above independent bytes' that count as runs (a 4 KiB sample's noise: ~0.016)
_RUNS_ONLY = 2                      # may_pay's mark of a plane >= 90% one value: the full match search alone
_DCTX_READ = 1 << 20
_PARAMS = zstandard.ZstdCompressionParameters.from_level(1, window_log=15, hash_log=8, min_match=7,
                                                         write_content_size=1, write_checksum=0)
#: The plane coder's parameters, where zstd's C API is reachable: literals always Huffman-coded
#: (``ZSTD_c_literalCompressionMode``, which python-zstandard's API does not expose) and the fast strategy's match
#: search skipping ahead (``targetLength`` 4096), so zstd spends its time on Huffman coding, not on looking for
#: matches a byte plane hardly has: 2x faster than ``_PARAMS`` on exponent planes and 1-3% smaller (measured here,
#: benchmarks/README.md "bench_codec.py"). 32 KiB blocks (window 15): a Huffman table per 32 KiB follows the
#: statistics along a tensor (Adam's second moment gains 1.7% over 128 KiB blocks).
_C_PARAMS = (("strategy", 1), ("windowLog", 15), ("hashLog", 6), ("chainLog", 6), ("searchLog", 1),
             ("minMatch", 7), ("targetLength", 4096), ("literalCompressionMode", 1), ("contentSizeFlag", 1),
             ("checksumFlag", 0))
#: For a plane whose sample is mostly one byte value, the full match search is tried too and the smaller frame
#: kept: runs (a tensor's zero rows, a masked or unused region) are matches the skipping search above misses in
#: part (it stores the planes of an embedding's Adam moments with unused rows 8% larger, measured here), while
#: a plane of few values without runs (a LayerNorm weight's exponents) is 2x smaller as Huffman literals alone.
_C_PARAMS_RUNS = tuple((name, {"targetLength": 0, "hashLog": 8}.get(name, value)) for name, value in _C_PARAMS)
try:                                # zstd's C API through python-zstandard's cffi backend (needs the cffi package)
    from zstandard.backend_cffi import ffi as _ffi, lib as _lib
    for _name, _ in _C_PARAMS:      # an older zstandard may lack a parameter: then its own API, as without cffi
        getattr(_lib, "ZSTD_c_" + _name)
    _lib.ZSTD_error_dstSize_tooSmall
except (ImportError, AttributeError):   # pragma: no cover (then python-zstandard's own API with _PARAMS)
    _ffi = _lib = None
#: The split / merge in C (ckptstore/format/_planes.c, built at install where a compiler exists: setup.py), else
#: ``None`` and the numpy code below (:func:`_split_into`, :func:`_merge_into`: the same bytes, 2-6x slower).
#: ``CKPTSTORE_NATIVE=0`` in the environment forces the numpy code.
_native = None
if os.environ.get("CKPTSTORE_NATIVE", "1") != "0":
    try:
        from ckptstore.format import _planes as _native
    except ImportError:             # pragma: no cover (no compiler where it was installed)
        _native = None
_local = threading.local()          # zstd contexts per thread (a context is not thread-safe)
#: Whole frames in C (``_native.encode`` / ``_native.decode_into``: one call per chunk, the GIL released), where
#: both the extension and zstd's C API are here: zstd's functions are handed to it once, by address.
_whole = False
if _native is not None and _lib is not None and hasattr(_native, "configure"):
    _native.configure(*(int(_ffi.cast("uintptr_t", _ffi.addressof(_lib, name))) for name in (
        "ZSTD_compress2", "ZSTD_decompressDCtx", "ZSTD_isError", "ZSTD_getErrorCode", "ZSTD_getErrorName")),
        int(_lib.ZSTD_error_dstSize_tooSmall), MIN_GAIN, float(_CODER_BYTES), _HIST_SAMPLE, _RUNS_EXCESS)
    _whole = True


def _c_ctx(kind: str):
    """This thread's zstd context (C API): compression with :data:`_C_PARAMS` (``"c"``) or
    :data:`_C_PARAMS_RUNS` (``"r"``), or decompression (``"d"``)."""
    ctx = getattr(_local, kind, None)
    if ctx is None:
        if kind in "cr":
            ctx = _ffi.gc(_lib.ZSTD_createCCtx(), _lib.ZSTD_freeCCtx)
            for name, value in (_C_PARAMS if kind == "c" else _C_PARAMS_RUNS):
                r = _lib.ZSTD_CCtx_setParameter(ctx, getattr(_lib, "ZSTD_c_" + name), value)
                if _lib.ZSTD_isError(r):
                    raise RuntimeError(f"zstd refused {name}={value}: {_ffi.string(_lib.ZSTD_getErrorName(r))}")
        else:
            ctx = _ffi.gc(_lib.ZSTD_createDCtx(), _lib.ZSTD_freeDCtx)
        setattr(_local, kind, ctx)
    return ctx


def _c_addr(kind: str) -> int:
    """The address of this thread's zstd context ``kind`` (:func:`_c_ctx`), for the C frame code."""
    addr = getattr(_local, "addr_" + kind, None)
    if addr is None:
        addr = int(_ffi.cast("uintptr_t", _c_ctx(kind)))
        setattr(_local, "addr_" + kind, addr)
    return addr


_SCRATCH_MAX = 2 << 20              # bytes: larger planes get a buffer of their own each time (8 MiB a thread)


def scratch(slot: str, size: int, keep: int = _SCRATCH_MAX) -> np.ndarray:
    """A uint8 buffer of ``size`` bytes for bytes on their way, this thread's own and reused from call to call up
    to ``keep`` bytes (a fresh buffer costs its page faults on every chunk: ~2 us a 4 KiB page here, ~10% of
    decoding a chunk, as much as encoding one); larger ones are new each time. Slots: ``c``, ``r``: the
    encoder's two searches, ``d0``, ``d1``: the decoder's top two planes (:data:`_SCRATCH_MAX` each, 8 MiB a
    thread), ``frame``: the blob path's frames (:func:`ckptstore.format.blobs.encode_chunk`). Valid until this
    thread asks for ``slot`` again."""
    if size > keep:
        return np.empty(size, dtype=np.uint8)
    bufs = getattr(_local, "scratch", None)
    if bufs is None:
        bufs = _local.scratch = {}
    buf = bufs.get(slot)
    if buf is None or buf.size < size:
        buf = bufs[slot] = np.empty(max(size, 64 << 10), dtype=np.uint8)
    return buf[:size]


def _compress_plane(plane: np.ndarray, limit: int, runs: bool = False) -> Optional[np.ndarray]:
    """``plane`` as one zstd frame when it fits in ``limit`` bytes, else ``None`` (the frame in this thread's
    scratch: valid until the next call with the same ``runs``); ``runs``: with the full match search
    (:data:`_C_PARAMS_RUNS`)."""
    if _lib is None:
        packed = zstandard.ZstdCompressor(compression_params=_PARAMS).compress(plane)
        return packed if len(packed) <= limit else None
    dst = scratch("r" if runs else "c", max(limit, 1))
    r = _lib.ZSTD_compress2(_c_ctx("r" if runs else "c"), _ffi.from_buffer(dst), limit, _ffi.from_buffer(plane),
                            plane.size)
    if _lib.ZSTD_isError(r):
        if _lib.ZSTD_getErrorCode(r) == _lib.ZSTD_error_dstSize_tooSmall:
            return None
        raise RuntimeError(f"zstd: {_ffi.string(_lib.ZSTD_getErrorName(r)).decode()}")
    return dst[:r]


class FrameError(ValueError):
    """A planes frame that is not what it must be (damaged, truncated, or claiming other lengths)."""


def header_size(itemsize: int) -> int:
    return _HEADER.size + _PLANE.size * itemsize


def sample(plane: np.ndarray, piece: int = _SAMPLE) -> np.ndarray:
    """At most ``4 * piece`` bytes of ``plane`` (uint8; 64 KiB by default): 4 pieces spread over it, or all of it
    when smaller."""
    if plane.size <= 4 * piece:
        return plane
    step = plane.size // 4
    return np.concatenate([plane[i * step: i * step + piece] for i in range(4)])


_UINT = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


_XLOG2 = np.arange(4 * _HIST_SAMPLE + 1) * np.log2(np.maximum(np.arange(4 * _HIST_SAMPLE + 1), 1))  # c log2 c


def may_pay(planes: np.ndarray):
    """For each row of ``planes`` (uint8, ``k`` x ``m``, ``m`` > 0): whether it could be stored in <=
    :data:`MIN_GAIN` of its size by an order-0 entropy coder (zstd's Huffman-coded literals, counting
    :data:`_CODER_BYTES` for the coder's table and frame; booleans), and which match search to try (integers: 0
    the skipping one alone; 1 the full one too, the smaller frame kept: over half one value *in runs*;
    :data:`_RUNS_ONLY` the full one alone: 90% or more one value, where Huffman's floor of 1 bit per byte leaves
    the match search the better coder: a delta's top planes); by the byte statistics of the row or, above 4 KiB,
    of a sample (4 pieces of 1 KiB spread over it). A plane of near-uniform bytes (a float's low mantissa bytes:
    7.99 bits each) has nothing for zstd to find; this costs ~1 us where compressing a 64 KiB sample cost 40-250
    (measured here).

    Runs: the bytes equal to the one before them, against what independent bytes of the same histogram would
    give (the sum of the squared frequencies). A plane of mostly one value scattered (a delta's third plane: 88%
    zeros) gains nothing from the full search, which took 2.3x the skipping one's time there and was 7% larger;
    runs (an embedding's unused rows in Adam's moments) are matches it finds (8% smaller there)."""
    k, m = planes.shape
    n = min(m, 4 * _HIST_SAMPLE)
    pairs = max(1, n - (1 if m <= 4 * _HIST_SAMPLE else 4))
    pays, runs = [], []
    for xlogx, top, sumsq, reps in _sample_stats(planes):
        bits = _XLOG2[n] - xlogx                          # n H: the sample's order-0 information
        pays.append(bits / 8 + _CODER_BYTES * n / m <= MIN_GAIN * n)
        if top * 10 >= 9 * n:
            runs.append(_RUNS_ONLY)
        elif top * 2 > n:
            p = top / n
            runs.append(int(reps / pairs - sumsq / (n * n) > max(_RUNS_EXCESS, 0.25 * p * (1 - p))))
        else:
            runs.append(0)
    return pays, runs


def _sample_stats(planes: np.ndarray):
    """Per row of ``planes`` (uint8, ``k`` x ``m``, C-contiguous), over its whole bytes up to ``4 *
    _HIST_SAMPLE``, else 4 pieces of :data:`_HIST_SAMPLE` bytes starting at ``j * (m // 4)``: (the sum of ``c
    log2 c`` over the byte values' counts ``c``, the largest count, the sum of ``c * c``, how many bytes equal the
    one before them in their piece). In C where built (one pass, ~1 us for a small chunk where numpy's dozen calls
    cost ~25 us), else numpy."""
    k, m = planes.shape
    if _native is not None:
        return _native.sample_stats(planes, k, _HIST_SAMPLE)
    if m <= 4 * _HIST_SAMPLE:
        s = planes[:, None, :]
    else:
        step = m // 4
        s = np.stack([planes[:, i * step: i * step + _HIST_SAMPLE] for i in range(4)], axis=1)
    reps = (s[:, :, 1:] == s[:, :, :-1]).sum(axis=(1, 2))
    idx = s.reshape(k, -1).astype(np.intp)
    idx += (np.arange(k, dtype=np.intp) * 256)[:, None]
    c = np.bincount(idx.ravel(), minlength=256 * k).reshape(k, 256)
    sq = (c.astype(np.float64) ** 2).sum(axis=1)
    return list(zip(_XLOG2[c].sum(axis=1).tolist(), c.max(axis=1).tolist(), sq.tolist(), reps.tolist()))


_BLOCK = 1 << 16                    # elements per block of the split / merge: the block's bytes stay in cache


def _split_into(planes: np.ndarray, a: np.ndarray, k: int, transform: int) -> None:
    """Write the ``k`` byte planes of the ``m`` elements ``a`` (uint8, ``m * k`` bytes) into the rows of
    ``planes`` (uint8, ``k`` x ``m``), regrouping the top two for :data:`EXPONENT`. Plane ``i`` is a truncating
    cast of the elements read ``i`` bytes further on (an unaligned integer view; no strided byte copies), the
    regrouping a few uint8 operations; in blocks of :data:`_BLOCK` elements, so the source is read from memory
    once, not once per plane."""
    m = planes.shape[1]
    u = _UINT[k]
    tmp = np.empty((2, min(m, _BLOCK)), dtype=np.uint8)
    for lo in range(0, m, _BLOCK):
        hi = min(m, lo + _BLOCK)
        np.copyto(planes[0, lo:hi], a[lo * k: hi * k].view(u), casting="unsafe")
        last = hi - 1 if hi == m else hi                  # the array's last element is read alone (no bytes after it)
        for i in range(1, k):
            if last > lo:
                np.copyto(planes[i, lo:last], np.ndarray((last - lo,), dtype=u, buffer=a, offset=lo * k + i),
                          casting="unsafe")
            if last < hi:
                planes[i, last] = a[last * k + i]
        if transform == EXPONENT:
            e, s = planes[k - 1, lo:hi], planes[k - 2, lo:hi]   # hold T (top byte) and U (the byte below) now
            t, v = tmp[0, : hi - lo], tmp[1, : hi - lo]
            np.copyto(t, e)
            np.add(t, t, out=e)                           # T << 1 (uint8 addition wraps; faster than a shift)
            np.right_shift(s, 7, out=v)
            e |= v
            s &= 0x7F
            t &= 0x80
            s |= t


def _merge_into(out: np.ndarray, srcs, k: int, transform: int) -> None:
    """The inverse of :func:`_split_into`: the elements from their ``k`` planes (``srcs``, uint8 arrays of ``m``
    bytes) into ``out`` (uint8, ``m * k`` bytes): the top two planes regrouped back, then one strided byte copy per
    plane (numpy's strided copy beat widening casts + shifts + ORs here), in blocks of :data:`_BLOCK` elements
    so that a block of ``out`` stays in cache while its ``k`` columns are written."""
    m = len(srcs[0])
    cols = out.reshape(m, k)
    tmp = np.empty((3, min(m, _BLOCK)), dtype=np.uint8)
    for lo in range(0, m, _BLOCK):
        hi = min(m, lo + _BLOCK)
        blk = cols[lo:hi]
        for i in range(k - 2 if transform == EXPONENT else k):
            blk[:, i] = srcs[i][lo:hi]
        if transform == EXPONENT:
            e, s = srcs[k - 1][lo:hi], srcs[k - 2][lo:hi]
            top, low, t = tmp[0, : hi - lo], tmp[1, : hi - lo], tmp[2, : hi - lo]
            np.bitwise_and(s, 0x80, out=top)              # T = e >> 1 | sign
            np.right_shift(e, 1, out=t)
            top |= t
            np.bitwise_and(e, 1, out=low)                 # U = (e & 1) << 7 | s & 0x7F
            np.multiply(low, 0x80, out=low)               # (a uint8 multiply: faster than numpy's uint8 shift)
            np.bitwise_and(s, 0x7F, out=t)
            low |= t
            blk[:, k - 2] = low
            blk[:, k - 1] = top


def _compress_planes(buf: np.ndarray, body: np.ndarray, pos: int, transform: int):
    """Compress, in place, the planes (rows of ``body``, a view of ``buf`` from ``pos``) that pay: each stored as
    zstd or raw, the later ones moved down over what compression saved. Returns (plane headers, end)."""
    k, m = body.shape
    start, heads = pos, []
    if m and m <= 4 * _HIST_SAMPLE and transform == EXPONENT and _native is None:
        tries = runs = [i >= k - 2 for i in range(k)]     # small floats: the top two planes, both searches (a
    else:                                                 # numpy histogram costs more than compressing them)
        tries, runs = may_pay(body) if m else (None, None)
    for i in range(k):
        plane = body[i]
        method, stored = RAW, m
        if m:
            if tries[i]:
                packed = None if runs[i] == _RUNS_ONLY else _compress_plane(plane, int(MIN_GAIN * m))
                if runs[i]:                               # runs or few values: the full search may do better
                    other = _compress_plane(plane, int(MIN_GAIN * m), True)
                    if other is not None and (packed is None or len(other) < len(packed)):
                        packed = other
                if packed is not None:
                    method, stored = ZSTD, len(packed)
                    buf[pos: pos + stored] = np.frombuffer(packed, dtype=np.uint8)
        if method == RAW and pos != start + i * m:
            buf[pos: pos + m] = plane                     # numpy copies overlapping ranges correctly
        heads.append(_PLANE.pack(method, stored))
        pos += stored
    return heads, pos


def encode(data, itemsize: int, *, transform: int = EXPONENT) -> bytearray:
    """The frame of ``data`` (a bytes-like object of any length) as ``itemsize``-byte elements (1, 2, 4, 8), as
    a ``bytearray``. Always returns a frame (it may be larger than ``data``: the caller keeps raw bytes when it
    does not pay). ``transform``: :data:`EXPONENT` for floats (the exponent fills the top plane), :data:`NONE`
    otherwise. Raises ``ValueError`` for another element size or transform. :func:`encode_into` writes it into a
    buffer of the caller's."""
    n = np.frombuffer(data, dtype=np.uint8).size
    frame = bytearray(header_size(itemsize if itemsize in SIZES else 1) + n)
    end = encode_into(data, itemsize, frame, transform=transform)
    del frame[end:]
    return frame


def encode_into(data, itemsize: int, out, *, transform: int = EXPONENT) -> int:
    """Write the frame of ``data`` (see :func:`encode`) into the start of ``out`` (a writable buffer of at least
    ``header_size(itemsize) + len(data)`` bytes) and return its length in bytes. A buffer reused from chunk to
    chunk costs no page faults, where a fresh one costs them on every chunk (~2 us a 4 KiB page on this VM: as
    much as the coding, benchmarks/README.md "bench_codec.py"). Raises ``ValueError`` for another element size or
    transform, or an ``out`` too small.

    The planes are written straight into the frame at their raw places; a plane that compresses is replaced by
    its zstd frame and the planes after it move down, so a chunk is copied once (its planes) besides zstd."""
    if itemsize not in SIZES or transform not in (NONE, EXPONENT):
        raise ValueError(f"planes: element size {itemsize!r} / transform {transform!r} not supported")
    k = itemsize
    if k == 1:
        transform = NONE                 # one plane: nothing to regroup
    a = np.frombuffer(data, dtype=np.uint8)
    n = a.size
    m = n // k
    hs = header_size(k)
    if len(memoryview(out).cast("B")) < hs + n:
        raise ValueError(f"planes: a frame of {n} bytes needs {hs + n} bytes of buffer")
    if _whole and k > 1:
        with memoryview(out).cast("B")[: hs + n] as frame:
            return _native.encode(a, frame, k, transform, _c_addr("c"), _c_addr("r"))
    buf = np.frombuffer(out, dtype=np.uint8)[: hs + n]
    body = buf[hs: hs + m * k].reshape(k, m)
    if k == 1:
        body[0] = a[:m]
    elif m and _native is not None:
        _native.split(a[: m * k], buf[hs: hs + m * k], k, transform)
    elif m:
        _split_into(body, a[: m * k], k, transform)
    heads, pos = _compress_planes(buf, body, hs, transform)
    tail = n - m * k
    if tail:
        buf[pos: pos + tail] = a[m * k:]
    buf[: hs] = np.frombuffer(_HEADER.pack(MAGIC, VERSION, transform, k, k, n) + b"".join(heads), dtype=np.uint8)
    return pos + tail


def parse_header(frame) -> tuple:
    """``(transform, itemsize, n, [(method, stored length), ...], header length)`` of a frame's header.
    Raises :class:`FrameError` for a frame too short, a wrong magic or version, an unknown transform or
    method, or an element size that is not 1, 2, 4 or 8."""
    mv = memoryview(frame)
    if len(mv) < _HEADER.size:
        raise FrameError(f"planes frame of {len(mv)} bytes is shorter than its header")
    magic, version, transform, k, nplanes, n = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"not a planes frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise FrameError(f"planes frame version {version} (this ckptstore reads {VERSION})")
    if transform not in (NONE, EXPONENT) or k not in SIZES or nplanes != k:
        raise FrameError(f"planes frame header: transform {transform}, element size {k}, {nplanes} planes")
    end = header_size(k)
    if len(mv) < end:
        raise FrameError(f"planes frame of {len(mv)} bytes is shorter than its header ({end})")
    planes = [_PLANE.unpack_from(mv, _HEADER.size + i * _PLANE.size) for i in range(k)]
    for method, _ in planes:
        if method not in (RAW, ZSTD):
            raise FrameError(f"planes frame: unknown plane method {method}")
    return transform, k, n, planes, end


def frame_nbytes(frame) -> int:
    """The raw length a frame claims (its header checked, nothing decoded). Raises :class:`FrameError`."""
    return parse_header(frame)[2]


def zstd_into(payload, out: memoryview) -> int:
    """Decode the zstd frame ``payload`` into ``out``, producing at most ``len(out)`` bytes; return how many.

    Streams: the frame header's content size is never trusted (a 20-byte frame may claim 64 GiB, and
    ``ZstdDecompressor.decompress`` would allocate it). Raises ``ValueError`` when the frame holds more than
    ``len(out)`` bytes, ``zstandard.ZstdError`` when it is damaged. (Also a zstd blob's decoder:
    :func:`ckptstore.format.blobs.decompress_into`.)
    """
    n = len(out)
    reader = zstandard.ZstdDecompressor().stream_reader(payload, read_size=_DCTX_READ)
    got = 0
    while got < n:
        k = reader.readinto(out[got:])
        if not k:
            break
        got += k
    if got == n and reader.read(1):
        raise ValueError(f"zstd frame holds more than the {n} bytes declared")
    return got


def _zstd_into(payload, out: memoryview) -> int:
    """:func:`zstd_into` of one plane, its failures as :class:`FrameError`. Through zstd's C API where reachable:
    one ``ZSTD_decompressDCtx`` into ``out`` (it writes at most ``len(out)`` bytes and allocates nothing by what
    the frame claims; a frame holding more fails with ``dstSize_tooSmall``)."""
    if _lib is not None:
        dst = np.frombuffer(out, dtype=np.uint8)
        r = _lib.ZSTD_decompressDCtx(_c_ctx("d"), _ffi.from_buffer(dst), dst.size, _ffi.from_buffer(payload),
                                     len(payload))
        if not _lib.ZSTD_isError(r):
            return r
        if _lib.ZSTD_getErrorCode(r) == _lib.ZSTD_error_dstSize_tooSmall:
            raise FrameError(f"planes frame: a plane holds more than its {len(out)} bytes")
        raise FrameError(f"planes frame: a plane does not decode ({_ffi.string(_lib.ZSTD_getErrorName(r)).decode()})")
    try:
        return zstd_into(payload, out)
    except zstandard.ZstdError as e:
        raise FrameError(f"planes frame: a plane does not decode ({e})") from None
    except ValueError:
        raise FrameError(f"planes frame: a plane holds more than its {len(out)} bytes") from None


def decode_into(frame, out: memoryview) -> None:
    """Decode ``frame`` into ``out``, which must be exactly the raw length the frame is expected to hold (the
    manifest's ``nbytes``). Raises :class:`FrameError` when the header is damaged, claims another length, the
    planes' stored lengths do not add up to the frame, or a plane does not decode to its length. Allocates,
    besides ``out``, its zstd planes (at most ``len(out)`` bytes together) and, for floats, three temporaries of
    one plane (``len(out) / k`` bytes each); never anything by what the frame claims."""
    if _whole:
        try:
            return _native.decode_into(frame, out, _c_addr("d"))
        except ValueError as e:
            raise FrameError(str(e)) from None
    mv = memoryview(frame)
    transform, k, n, planes, pos = parse_header(mv)
    if n != len(out):
        raise FrameError(f"planes frame holds {n} bytes, expected {len(out)}")
    m = n // k
    tail = n - m * k
    total = pos + tail
    for method, stored in planes:
        if (method == RAW and stored != m) or (method == ZSTD and not 0 < stored <= len(mv)):
            raise FrameError(f"planes frame: a plane stores {stored} bytes for {m}")
        total += stored
    if total != len(mv):
        raise FrameError(f"planes frame is {len(mv)} bytes, its header adds up to {total}")
    o = np.frombuffer(out, dtype=np.uint8)
    srcs = []
    for i, (method, stored) in enumerate(planes):
        src = np.frombuffer(mv[pos: pos + stored], dtype=np.uint8)
        if method == ZSTD:
            if k == 1:
                plane = o[:m]
            else:                                         # the top two planes (a float's compressible ones)
                plane = scratch(f"d{k - 1 - i}", m) if i >= k - 2 else np.empty(m, dtype=np.uint8)
            if _zstd_into(src, memoryview(plane)) != m:
                raise FrameError(f"planes frame: plane {i} decodes to fewer than its {m} bytes")
            src = plane
        srcs.append(src)
        pos += stored
    if k == 1:
        if planes[0][0] == RAW:
            o[:m] = srcs[0]
    elif m and _native is not None:
        _native.merge(o[: m * k], srcs, transform)
    elif m:
        _merge_into(o[: m * k], srcs, k, transform)
    if tail:
        o[m * k:] = np.frombuffer(mv[pos:], dtype=np.uint8)


def float_itemsize(dtype: str) -> Optional[int]:
    """The element size (bytes) to split a chunk of ``dtype`` by, when it is a floating-point dtype (a torch
    dtype name as manifests write them, e.g. ``"bfloat16"``, or a numpy dtype string, e.g. ``"<f4"``); complex
    dtypes split by their parts. ``None`` for any other dtype (the writer does not use this codec for it)."""
    if dtype.startswith(("float", "bfloat", "complex")):            # torch names: float32, float8_e4m3fn, ...
        try:
            import torch
            t = getattr(torch, dtype)
            if isinstance(t, torch.dtype) and (t.is_floating_point or t.is_complex):
                size = t.itemsize // (2 if t.is_complex else 1)
                return size if size in SIZES else None
        except AttributeError:
            return None
        return None
    if len(dtype) >= 3 and dtype[0] in "<|=" and dtype[1] in "fc" and dtype[2:].isdigit():
        size = int(dtype[2:]) // (2 if dtype[1] == "c" else 1)
        return size if size in SIZES else None
    return None
