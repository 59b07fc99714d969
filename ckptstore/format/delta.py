"""The ``delta`` codec: a chunk stored as its difference with its *key* (the same tensor's chunk of an earlier
step, stored in full), the difference then coded with the planes codec (floats) or zstd, or kept raw.

A pure module (bytes in, a frame out; a frame and the key's bytes in, bytes out): which chunk is a key, when a
delta pays and who keeps the key are the writer's (:mod:`ckptstore.io.writer`) and FORMAT.md's ("The delta
codec"). Why (issue 30): consecutive steps of one run differ in few bits, so the difference of a chunk with the
previous step's has long runs of zero bits at the top of every element (sign, exponent, the mantissa's top bits),
which the planes codec turns into zero-heavy planes that zstd compresses well (benchmarks/README.md
"bench_codec.py").

The difference (``op``): for a float chunk (element size k = 2, 4 or 8), the elements' bit patterns read as
k-byte little-endian integers are subtracted (chunk - key, modulo 2^(8k)) and the result zigzag-coded
(``(d << 1) ^ (d >> (8k - 1))`` on the signed value: small magnitudes of either sign -> small numbers): a float
that moved by a few units in the last place has a difference of a few units whatever carries its mantissa took,
where the XOR of the two patterns has every bit up to the highest one the carry flipped set. Measured on the
state of bench_codec.py, one training step apart: fp32 weights 1.564x (XOR) -> 1.625x, Adam v 1.443 -> 1.521,
bf16 weights 3.51 -> 4.09. Other chunks (and the last n mod k bytes) are XORed byte by byte.

Frame (integers little-endian; FORMAT.md "The delta codec")::

    offset 0   4  magic b"CKDL"
           4   1  version (1)
           5   1  inner codec of the difference: 0 raw, 1 zstd, 2 planes
           6   1  op: 0 = XOR of the bytes; 1 = zigzag-coded difference of k-byte integers (then the tail XORed)
           7   1  k: the element size for op 1 (2, 4 or 8); 0 for op 0
           8  32  the key's chunk id (BLAKE3-256 of the key's raw bytes)
          40   8  n: raw length in bytes (the chunk's, and the key's)
          48 ...  the difference's bytes, coded as the inner codec says (raw: exactly n bytes)

A reader (:func:`decode_into`) checks every field, that the key named is the one the manifest names and that
``n`` is the length it expects, decodes the difference bounded by ``n`` and adds the key's bytes back (the inverse
of ``op``). Any failure is a :class:`DeltaError` (a ``ValueError``). Checking what the result hashes to is the caller's (the chunk's id).
"""
from __future__ import annotations

import struct
from typing import Optional

import numpy as np
import zstandard

from . import planes

MAGIC = b"CKDL"
VERSION = 1
RAW, ZSTD, PLANES = 0, 1, 2
XOR, DIFF = 0, 1                     # op: how the chunk and its key are combined
DIFF_SIZES = (2, 4, 8)
_HEADER = struct.Struct("<4sBBBB32sQ")
HEADER_SIZE = _HEADER.size           # 48 bytes
MIN_GAIN = 0.97                      # the XOR is kept coded only at <= 97% of its raw length
MAX_RATIO = 32768                    # zstd's (and planes') densest coding: a frame claiming more is refused


class DeltaError(ValueError):
    """A delta frame that is not what it must be (damaged, truncated, against another key, another length)."""


def xor(a, b, out: Optional[memoryview] = None) -> np.ndarray:
    """``a XOR b`` (bytes-like objects of one length) as a uint8 array, into ``out`` when given; 8 bytes at a
    time where the length allows (numpy releases the GIL)."""
    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    if x.size != y.size:
        raise ValueError(f"xor of {x.size} and {y.size} bytes")
    o = np.empty(x.size, dtype=np.uint8) if out is None else np.frombuffer(out, dtype=np.uint8)
    w = x.size // 8 * 8
    if w:
        np.bitwise_xor(x[:w].view(np.uint64), y[:w].view(np.uint64), out=o[:w].view(np.uint64))
    if w < x.size:
        np.bitwise_xor(x[w:], y[w:], out=o[w:])
    return o


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def diff(a, b, k: int) -> np.ndarray:
    """The zigzag-coded difference ``a - b`` of ``a`` and ``b`` (bytes-like objects of one length) read as
    ``k``-byte little-endian integers, as a uint8 array of the same length; the last ``len mod k`` bytes XORed."""
    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    if x.size != y.size:
        raise ValueError(f"difference of {x.size} and {y.size} bytes")
    o = np.empty(x.size, dtype=np.uint8)
    if planes._native is not None:                      # the same loop in C: one pass (ckptstore/format/_planes.c)
        planes._native.diff(x, y, o, k)
        return o
    w = x.size // k * k
    if w:
        d = np.subtract(x[:w].view(_UINT[k]), y[:w].view(_UINT[k])).view(_INT[k])    # modulo 2^(8k)
        zz = o[:w].view(_INT[k])
        np.left_shift(d, 1, out=zz)
        d >>= 8 * k - 1                                     # arithmetic: 0 or -1
        zz ^= d
    if w < x.size:
        np.bitwise_xor(x[w:], y[w:], out=o[w:])
    return o


def undiff(out: memoryview, key, k: int) -> None:
    """The inverse of :func:`diff`, in place: ``out`` holds the coded difference and becomes ``key + d``."""
    o, y = np.frombuffer(out, dtype=np.uint8), np.frombuffer(key, dtype=np.uint8)
    if planes._native is not None:
        planes._native.undiff(o, y, k)
        return
    w = o.size // k * k
    if w:
        u = o[:w].view(_UINT[k])
        sign = np.bitwise_and(u, 1).view(_INT[k])
        np.negative(sign, out=sign)                         # 0 or -1 (all ones)
        u >>= 1
        u ^= sign.view(_UINT[k])
        u += y[:w].view(_UINT[k])                           # modulo 2^(8k)
    if w < o.size:
        np.bitwise_xor(o[w:], y[w:], out=o[w:])


def encode(data, key, key_id: str, itemsize: Optional[int], level: int = 1) -> bytes:
    """The frame of ``data`` as a delta against ``key`` (the key's raw bytes, same length; ``key_id`` its chunk
    id). ``itemsize``: the element size of a floating-point chunk (:func:`planes.float_itemsize`), coded with the
    planes codec; ``None``: zstd at ``level``. The XOR is stored raw where coding saves less than 3%. Always
    returns a frame (the caller compares it with storing the chunk in full)."""
    op, k = (DIFF, itemsize) if itemsize in DIFF_SIZES else (XOR, 0)
    x = diff(data, key, k) if op == DIFF else xor(data, key)
    n = x.size
    inner, body = RAW, x
    if n:
        # transform NONE: a difference's top planes are mostly zero as they are; regrouping the exponent (what
        # helps a float) cost 0.5-2.5% on XORs here (benchmarks/README.md "bench_codec.py")
        coded = planes.encode(x, itemsize, transform=planes.NONE) if itemsize is not None else \
            zstandard.ZstdCompressor(level=level, write_content_size=True).compress(x)
        if len(coded) <= MIN_GAIN * n:
            inner, body = (PLANES if itemsize is not None else ZSTD), coded
    return _HEADER.pack(MAGIC, VERSION, inner, op, k, bytes.fromhex(key_id), n) + memoryview(body).cast("B")


def _fields(mv: memoryview) -> tuple:
    """``(inner codec, op, k, key id, n)`` of a frame's header, checked (see :func:`parse_header`)."""
    if len(mv) < HEADER_SIZE:
        raise DeltaError(f"delta frame of {len(mv)} bytes is shorter than its header")
    magic, version, inner, op, k, key, n = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise DeltaError(f"not a delta frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise DeltaError(f"delta frame version {version} (this ckptstore reads {VERSION})")
    if inner not in (RAW, ZSTD, PLANES) or not ((op == XOR and k == 0) or (op == DIFF and k in DIFF_SIZES)):
        raise DeltaError(f"delta frame header: inner codec {inner}, op {op}, element size {k}")
    return inner, op, k, key.hex(), n


def parse_header(frame) -> tuple:
    """``(inner codec, key id, n)`` of a frame's header. Raises :class:`DeltaError` for a frame too short, a
    wrong magic or version, an unknown inner codec or op, or an element size the op does not take."""
    inner, _, _, key, n = _fields(memoryview(frame))
    return inner, key, n


def decode_into(frame, key, key_id: str, out: memoryview) -> None:
    """Decode ``frame`` against ``key`` (the key's raw bytes, verified by the caller; ``key_id``: the key the
    manifest names) into ``out``, exactly the raw length expected. Raises :class:`DeltaError` when the header is
    damaged, names another key or another length, or the difference does not decode to exactly that length. Allocates
    nothing larger than ``out``."""
    mv = memoryview(frame)
    inner, op, k, named, n = _fields(mv)
    if named != key_id:
        raise DeltaError(f"delta frame is against chunk {named}, the manifest names {key_id}")
    if n != len(out) or len(memoryview(key)) != n:
        raise DeltaError(f"delta frame holds {n} bytes, expected {len(out)} (key: {len(memoryview(key))})")
    body = mv[HEADER_SIZE:]
    if inner == RAW:
        if len(body) != n:
            raise DeltaError(f"delta frame stores {len(body)} raw bytes for {n}")
        if op == XOR:
            xor(body, key, out)
        else:
            np.frombuffer(out, dtype=np.uint8)[:] = np.frombuffer(body, dtype=np.uint8)
            undiff(out, key, k)
        return
    if n > len(body) * MAX_RATIO:
        raise DeltaError(f"{len(body)} bytes cannot hold {n}")
    try:
        if inner == PLANES:
            planes.decode_into(body, out)
        elif planes.zstd_into(body, out) != n:
            raise DeltaError(f"delta frame: the difference decodes to fewer than {n} bytes")
    except zstandard.ZstdError as e:
        raise DeltaError(f"delta frame: the difference does not decode ({e})") from None
    except DeltaError:
        raise
    except ValueError as e:
        raise DeltaError(f"delta frame: {e}") from None
    if op == XOR:
        xor(out, key, out)
    else:
        undiff(out, key, k)
