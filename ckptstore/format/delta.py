"""The ``delta`` codec: a chunk stored as the XOR of its bytes with its *key* (the same tensor's chunk of an
earlier step, stored in full), the XOR then coded with the planes codec (floats) or zstd, or kept raw.

A pure module (bytes in, a frame out; a frame and the key's bytes in, bytes out): which chunk is a key, when a
delta pays and who keeps the key are the writer's (:mod:`ckptstore.io.writer`) and FORMAT.md's ("The delta
codec"). Why (issue 30): consecutive steps of one run differ in few bits, so the XOR of a chunk with the previous
step's has long runs of zero bits at the top of every element (sign, exponent, the mantissa's top bits), which
the planes codec turns into zero-heavy planes that zstd compresses well (benchmarks/README.md "bench_codec.py").

Frame (integers little-endian; FORMAT.md "The delta codec")::

    offset 0   4  magic b"CKDL"
           4   1  version (1)
           5   1  inner codec of the XOR: 0 raw, 1 zstd, 2 planes
           6   2  reserved (0)
           8  32  the key's chunk id (BLAKE3-256 of the key's raw bytes)
          40   8  n: raw length in bytes (the chunk's, and the key's)
          48 ...  the XOR's bytes, coded as the inner codec says (raw: exactly n bytes)

A reader (:func:`decode_into`) checks every field, that the key named is the one the manifest names and that
``n`` is the length it expects, decodes the XOR bounded by ``n`` and XORs the key's bytes into it. Any failure is
a :class:`DeltaError` (a ``ValueError``). Checking what the result hashes to is the caller's (the chunk's id).
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
_HEADER = struct.Struct("<4sBBH32sQ")
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


def encode(data, key, key_id: str, itemsize: Optional[int], level: int = 1) -> bytes:
    """The frame of ``data`` as a delta against ``key`` (the key's raw bytes, same length; ``key_id`` its chunk
    id). ``itemsize``: the element size of a floating-point chunk (:func:`planes.float_itemsize`), coded with the
    planes codec; ``None``: zstd at ``level``. The XOR is stored raw where coding saves less than 3%. Always
    returns a frame (the caller compares it with storing the chunk in full)."""
    x = xor(data, key)
    n = x.size
    inner, body = RAW, x
    if n:
        # transform NONE: an XOR's top planes are mostly zero as they are; regrouping the exponent (what
        # helps a float) cost 0.5-2.5% here (benchmarks/README.md "bench_codec.py")
        coded = planes.encode(x, itemsize, transform=planes.NONE) if itemsize is not None else \
            zstandard.ZstdCompressor(level=level, write_content_size=True).compress(x)
        if len(coded) <= MIN_GAIN * n:
            inner, body = (PLANES if itemsize is not None else ZSTD), coded
    return _HEADER.pack(MAGIC, VERSION, inner, 0, bytes.fromhex(key_id), n) + memoryview(body).cast("B")


def parse_header(frame) -> tuple:
    """``(inner codec, key id, n)`` of a frame's header. Raises :class:`DeltaError` for a frame too short, a
    wrong magic or version, an unknown inner codec or a reserved field that is not 0."""
    mv = memoryview(frame)
    if len(mv) < HEADER_SIZE:
        raise DeltaError(f"delta frame of {len(mv)} bytes is shorter than its header")
    magic, version, inner, reserved, key, n = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise DeltaError(f"not a delta frame (magic {bytes(magic)!r})")
    if version != VERSION:
        raise DeltaError(f"delta frame version {version} (this ckptstore reads {VERSION})")
    if inner not in (RAW, ZSTD, PLANES) or reserved:
        raise DeltaError(f"delta frame header: inner codec {inner}, reserved {reserved}")
    return inner, key.hex(), n


def decode_into(frame, key, key_id: str, out: memoryview) -> None:
    """Decode ``frame`` against ``key`` (the key's raw bytes, verified by the caller; ``key_id``: the key the
    manifest names) into ``out``, exactly the raw length expected. Raises :class:`DeltaError` when the header is
    damaged, names another key or another length, or the XOR does not decode to exactly that length. Allocates
    nothing larger than ``out``."""
    mv = memoryview(frame)
    inner, named, n = parse_header(mv)
    if named != key_id:
        raise DeltaError(f"delta frame is against chunk {named}, the manifest names {key_id}")
    if n != len(out) or len(memoryview(key)) != n:
        raise DeltaError(f"delta frame holds {n} bytes, expected {len(out)} (key: {len(memoryview(key))})")
    body = mv[HEADER_SIZE:]
    if inner == RAW:
        if len(body) != n:
            raise DeltaError(f"delta frame stores {len(body)} raw bytes for {n}")
        xor(body, key, out)
        return
    if n > len(body) * MAX_RATIO:
        raise DeltaError(f"{len(body)} bytes cannot hold {n}")
    try:
        if inner == PLANES:
            planes.decode_into(body, out)
        elif planes.zstd_into(body, out) != n:
            raise DeltaError(f"delta frame: the XOR decodes to fewer than {n} bytes")
    except zstandard.ZstdError as e:
        raise DeltaError(f"delta frame: the XOR does not decode ({e})") from None
    except DeltaError:
        raise
    except ValueError as e:
        raise DeltaError(f"delta frame: {e}") from None
    xor(out, key, out)
