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
frame or raw, whichever is smaller (a plane is first tried on a 64 KiB sample,
so incompressible mantissa planes cost no compression pass). The zstd parameters (level 1, 32 KiB window,
a 256-entry hash table, 7-byte minimum matches) leave nearly everything to zstd's Huffman literal coder: a byte
plane has no long repeats, and fewer matches compressed the exponent plane better (3.13x vs 2.83x at level 1's
defaults on fp32 weights; benchmarks/README.md "bench_codec.py").

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
the stored lengths add up to the frame's length exactly, and decodes each zstd plane bounded by its raw length
(a plane claiming more is refused, nothing larger than the output is ever allocated). Any failure is a
:class:`FrameError` (a ``ValueError``). Checking what the bytes hash to is the caller's (the chunk's id).
"""
from __future__ import annotations

import struct
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
_SAMPLE = 16 << 10                  # bytes per sample piece; 4 pieces are tried before a whole plane
MIN_GAIN = 0.97                     # a plane (and the frame) is kept compressed only at <= 97% of its raw size
_PARAMS = zstandard.ZstdCompressionParameters.from_level(1, window_log=15, hash_log=8, min_match=7,
                                                         write_content_size=1, write_checksum=0)
_DCTX_READ = 1 << 20


class FrameError(ValueError):
    """A planes frame that is not what it must be (damaged, truncated, or claiming other lengths)."""


def header_size(itemsize: int) -> int:
    return _HEADER.size + _PLANE.size * itemsize


def sample(plane: np.ndarray) -> np.ndarray:
    """At most 64 KiB of ``plane`` (uint8): 4 pieces of 16 KiB spread over it, or all of it when smaller."""
    if plane.size <= 4 * _SAMPLE:
        return plane
    step = plane.size // 4
    return np.concatenate([plane[i * step: i * step + _SAMPLE] for i in range(4)])


def _to_exponent_planes(hi: np.ndarray, lo: np.ndarray):
    """The top two byte planes of floats -> (exponent plane, sign + next 7 bits): the exponent's last bit moves
    from the top of ``lo`` to the bottom of ``hi``, the sign from the top of ``hi`` to the top of ``lo``."""
    e = np.left_shift(hi, 1)
    e |= lo >> 7
    s = lo & 0x7F
    s |= hi & 0x80
    return e, s


def _from_exponent_planes(e: np.ndarray, s: np.ndarray):
    """The inverse of :func:`_to_exponent_planes`: -> (top plane, next plane)."""
    hi = e >> 1
    hi |= s & 0x80
    lo = np.left_shift(e & 1, 7)
    lo |= s & 0x7F
    return hi, lo


def encode(data, itemsize: int, *, transform: int = EXPONENT) -> bytes:
    """The frame of ``data`` (a bytes-like object of any length) as ``itemsize``-byte elements (1, 2, 4, 8).
    Always returns a frame (it may be larger than ``data``: the caller keeps raw bytes when it does not pay).
    ``transform``: :data:`EXPONENT` for floats (the exponent fills the top plane), :data:`NONE` otherwise."""
    if itemsize not in SIZES or transform not in (NONE, EXPONENT):
        raise ValueError(f"planes: element size {itemsize!r} / transform {transform!r} not supported")
    if itemsize == 1:
        transform = NONE                 # one plane: nothing to regroup
    a = np.frombuffer(data, dtype=np.uint8)
    n = a.size
    m = n // itemsize
    planes = a[: m * itemsize].reshape(m, itemsize).T.copy() if itemsize > 1 else a[:m].reshape(1, m)
    if transform == EXPONENT and m:
        planes[-1], planes[-2] = _to_exponent_planes(planes[-1], planes[-2])
    cctx = zstandard.ZstdCompressor(compression_params=_PARAMS)
    heads, parts = [], []
    for plane in planes:
        method, stored = RAW, plane
        if m:
            s = sample(plane)
            packed = cctx.compress(s)
            if len(packed) <= MIN_GAIN * s.size:
                if s.size < m:                   # the sample was a part: compress the whole plane
                    packed = cctx.compress(plane)
                if len(packed) <= MIN_GAIN * m:
                    method, stored = ZSTD, packed
        heads.append(_PLANE.pack(method, len(stored)))
        parts.append(stored)
    head = _HEADER.pack(MAGIC, VERSION, transform, itemsize, itemsize, n)
    return b"".join([head, *heads, *parts, a[m * itemsize:]])


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
    """:func:`zstd_into` of one plane, its failures as :class:`FrameError`."""
    try:
        return zstd_into(payload, out)
    except zstandard.ZstdError as e:
        raise FrameError(f"planes frame: a plane does not decode ({e})") from None
    except ValueError:
        raise FrameError(f"planes frame: a plane holds more than its {len(out)} bytes") from None


def decode_into(frame, out: memoryview) -> None:
    """Decode ``frame`` into ``out``, which must be exactly the raw length the frame is expected to hold (the
    manifest's ``nbytes``). Raises :class:`FrameError` when the header is damaged, claims another length, the
    planes' stored lengths do not add up to the frame, or a plane does not decode to its length. Allocates
    at most ``len(out)`` bytes besides ``out``."""
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
            plane = o[:m] if k == 1 else np.empty(m, dtype=np.uint8)
            if _zstd_into(src, memoryview(plane)) != m:
                raise FrameError(f"planes frame: plane {i} decodes to fewer than its {m} bytes")
            src = plane
        srcs.append(src)
        pos += stored
    if m and transform == EXPONENT:
        srcs[-1], srcs[-2] = _from_exponent_planes(srcs[-1], srcs[-2])
    if k == 1:
        if planes[0][0] == RAW:
            o[:m] = srcs[0]
    elif m:
        cols = o[: m * k].reshape(m, k)
        for i, src in enumerate(srcs):
            cols[:, i] = src
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
