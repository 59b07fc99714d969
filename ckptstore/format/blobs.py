"""Content-addressed blobs: put-if-absent and get-and-verify, over any :class:`~ckptstore.storage.Storage`.

A blob holds one chunk of a tensor's raw bytes. Its id is the BLAKE3-256 hex digest of those raw bytes, so
identical chunks (across keys, steps and ranks) are stored once and the id does not depend on the codec. A
blob is stored raw (``objects/ab/<id>``), as one zstd frame (``objects/ab/<id>.zst``) or as one frame of the
``planes`` codec for floats (``objects/ab/<id>.bpl``, :mod:`ckptstore.format.planes`); the name records the
codec. Which codec a chunk gets is :func:`encode_chunk`'s choice (``Writing.codec``). Blobs are write-once:
written to a temp name and linked/renamed into place, never overwritten.

Why BLAKE3: it is cryptographic (a chunk cannot be forged to collide with another by a malicious bucket) and
runs at ~6 GB/s per core here, above the disk's 2.6 GB/s; SHA-256 (1.7 GB/s) would be the bottleneck.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Dict, Optional, Set, Tuple, TypeVar

import blake3
import numpy as np
import zstandard

from ..util.errors import CorruptCheckpointError, DamagedRead, TransferError
from .layout import CODEC_SUFFIX, QUARANTINE, blob_path, pack_path
from . import delta, planes
from ..util.retry import RetryPolicy

log = logging.getLogger("ckptstore")
T = TypeVar("T")

CODECS = ("raw", "zstd", "planes", "delta")    # how a chunk's bytes may be stored (manifests name one per chunk)
FULL_CODECS = ("raw", "zstd", "planes")       # those that need no other blob to decode (a delta needs its key)
WRITE_CODECS = ("raw", "zstd", "auto")     # what ``Writing.codec`` may ask for (see :func:`encode_chunk`)
_FALLBACK = ("planes", "raw", "zstd")      # where BlobStore.stat looks for a blob not under its manifest's name
_MT_HASH_BYTES = 16 << 20           # multi-threaded hashing pays only for large buffers
_MIN_ZSTD_GAIN = 0.97               # keep a zstd frame only if it is at most 97% of the raw size


def digest_bytes(buf, *, threads: bool = False) -> str:
    """BLAKE3-256 hex digest of a bytes-like object (the GIL is released while hashing)."""
    if threads and len(memoryview(buf)) >= _MT_HASH_BYTES:
        return blake3.blake3(buf, max_threads=blake3.blake3.AUTO).hexdigest()
    return blake3.blake3(buf).hexdigest()


def pack_intact(storage, pack_id: str, size: Optional[int] = None, *, unreadable=FileNotFoundError) -> bool:
    """Whether the stored pack ``pack_id`` is whole: present, ``size`` bytes long (when given) and hashing to its
    id. Content naming alone does not prove the stored bytes are still good (a pack whose name survived a power
    loss may hold anything: FORMAT.md "Write order"). A read error of type ``unreadable`` (an exception class or
    tuple) counts as not intact; any other ``OSError`` is raised."""
    path = pack_path(pack_id)
    try:
        stored = storage.size(path)
        if stored is None or (size is not None and stored != size):
            return False
        return digest_bytes(storage.read_bytes(path), threads=True) == pack_id
    except unreadable:
        return False


def compress(data: memoryview, level: int) -> bytes:
    # A ZstdCompressor is not safe to share between threads; building one costs microseconds.
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


#: zstd cannot expand data more than this: its densest block (RLE) is 4 bytes for at most 128 KiB of output.
#: A chunk claiming more raw bytes than ``stored x MAX_ZSTD_RATIO`` is refused before anything is allocated.
MAX_ZSTD_RATIO = 32768
_PIECE = 8 << 20                    # streaming reads / hashing work in pieces of this size
RECHECK_LIMIT = 1 << 30             # most raw bytes a re-check decodes before giving up (never quarantines then)


def zstd_claim_possible(stored: int, nbytes: int) -> bool:
    """Whether ``stored`` bytes of zstd (or of a planes frame: raw planes, zstd planes) can hold ``nbytes`` raw
    bytes at all (a bound, not a proof)."""
    return nbytes <= stored * MAX_ZSTD_RATIO


_SAMPLE_FROM = 256 << 10             # chunks from this size are tried on a sample before zstd compresses them


def _zstd_pays(data, level: int) -> bool:
    """Whether zstd at ``level`` saves >= 3% on a 64 KiB sample of ``data`` (4 pieces spread over it), so that an
    incompressible chunk costs no compression pass."""
    s = planes.sample(np.frombuffer(data, dtype=np.uint8))
    return len(compress(s, level)) <= _MIN_ZSTD_GAIN * s.size


FRAME_BUFFER_MAX = 64 << 20         # bytes: a larger chunk's frame gets a buffer of its own each time


def encode_chunk(data, codec: str, level: int = 1, itemsize: Optional[int] = None, *,
                 reuse: bool = False) -> Tuple[str, object]:
    """How one chunk is stored: ``(codec used, stored bytes)``, the raw ``data`` itself when nothing pays.

    ``codec``: ``"raw"``; ``"zstd"`` (one zstd frame at ``level``, kept where it saves >= 3%); ``"auto"``: a chunk
    of a floating-point tensor (``itemsize``: its element size in bytes, from
    :func:`ckptstore.format.planes.float_itemsize`; ``None`` for other dtypes) as a ``planes`` frame, any other
    as zstd tried first on a sample; either kept only where it saves >= 3% (issue 30; measured in
    benchmarks/README.md "bench_codec.py"). The chunk's id is the BLAKE3 of ``data`` whatever is chosen.

    ``reuse``: a planes frame may be written into this thread's frame buffer and returned as a memoryview of it,
    valid only until this thread's next ``encode_chunk(..., reuse=True)``: for a caller that writes the bytes
    out before it encodes again (:meth:`BlobStore.put`). A fresh frame costs its page faults on every chunk,
    ~2 us a 4 KiB page on this VM: as much as the coding itself (benchmarks/README.md "bench_codec.py")."""
    n = len(data)
    if codec == "raw" or not n:
        return "raw", data
    if codec == "auto" and itemsize is not None:
        if reuse:
            buf = planes.scratch("frame", planes.header_size(8) + n, FRAME_BUFFER_MAX)
            frame = memoryview(buf)[: planes.encode_into(data, itemsize, buf)]
        else:
            frame = planes.encode(data, itemsize)
        return ("planes", frame) if len(frame) <= _MIN_ZSTD_GAIN * n else ("raw", data)
    if codec not in ("zstd", "auto"):
        raise ValueError(f"unknown codec {codec!r}")
    if codec == "auto" and n >= _SAMPLE_FROM and not _zstd_pays(data, level):
        return "raw", data
    packed = compress(data, level)
    return ("zstd", packed) if len(packed) <= _MIN_ZSTD_GAIN * n else ("raw", data)


def decode_into(codec: str, payload, out: memoryview, *, key=None, key_id: Optional[str] = None) -> int:
    """Decode one chunk's stored bytes (``codec``: ``"zstd"``, ``"planes"`` or ``"delta"``) into ``out``, whose
    length is the raw length expected; return the bytes produced (bounded by ``len(out)``). A delta decodes
    against ``key`` (its key's raw bytes, verified by the caller) named ``key_id``. Raises ``ValueError`` (a
    :class:`~ckptstore.format.planes.FrameError` for planes, a :class:`~ckptstore.format.delta.DeltaError` for a
    delta) or ``zstandard.ZstdError`` for bytes that do not decode to that length."""
    if codec == "delta":
        if key is None:
            raise delta.DeltaError("a delta decodes only against its key")
        delta.decode_into(payload, key, key_id, out)
        return len(out)
    if codec == "planes":
        planes.decode_into(payload, out)
        return len(out)
    if codec != "zstd":
        raise ValueError(f"unknown codec {codec!r}")
    return decompress_into(payload, out)


def decompress_into(payload, out: memoryview) -> int:
    """Decode the zstd frame ``payload`` into ``out``, producing at most ``len(out)`` bytes; return how many
    (bounded, streaming: :func:`ckptstore.format.planes.zstd_into`). Raises ``ValueError`` when the frame holds
    more than ``len(out)`` bytes, ``zstandard.ZstdError`` when it is damaged."""
    return planes.zstd_into(payload, out)


def decompress(payload, nbytes: int) -> bytes:
    """The raw bytes of one zstd frame expected to hold ``nbytes`` (bounded: see :func:`decompress_into`).
    Raises ``ValueError`` / ``zstandard.ZstdError``; returns fewer bytes when the frame holds fewer."""
    if not zstd_claim_possible(len(payload), nbytes):
        raise ValueError(f"{len(payload)} bytes of zstd cannot hold {nbytes} bytes")
    out = bytearray(nbytes)
    got = decompress_into(payload, memoryview(out))
    return bytes(out) if got == nbytes else bytes(out[:got])


def read_verified(storage, path: str, read: Callable[[], T], *,
                  damaged: Optional[Callable[[DamagedRead], BaseException]] = None) -> T:
    """``read()``: one read of ``path`` from ``storage`` and the check of what came back, which raises
    :class:`~ckptstore.util.errors.DamagedRead` (its ``got``: the bad bytes' digest, or their length) for bytes that
    fail it. Returns ``read()``'s value. Bad bytes are judged here, for every verified read (FORMAT.md "Read
    verification"):

    * from a local file: damage at rest, at once;
    * from an object store: a transfer error first (a flipped byte or a cut body, which HTTP checks do not
      catch when the service sends no checksum or the client checks none): read again, backing off as the
      storage's :class:`~ckptstore.util.retry.RetryPolicy` does (``RetryingStorage.policy``; the default policy
      otherwise), until the bytes are good, or two reads in a row bring back the same bad bytes: damage at rest
      (the object itself), or the policy's deadline (seconds, from the first read) has passed: then
      :class:`~ckptstore.util.errors.TransferError` naming the object, the object is not called damaged.

    Damage at rest raises ``damaged(error)`` when given (a blob's quarantine rule), else the error's ``final``
    or a ``CorruptCheckpointError`` with its message. No random draw: the backoff has no jitter (item 1 of
    issue 26: ckptstore never draws from the caller's generators)."""
    def verified(e: DamagedRead, note: str = "") -> BaseException:
        if damaged is not None:
            return damaged(e)
        return e.final or CorruptCheckpointError(e.reason + note, step=e.step, key=e.key, blob=e.blob)
    start, last, attempt, policy = time.monotonic(), None, 0, None
    while True:
        attempt += 1
        try:
            return read()
        except DamagedRead as e:
            if attempt == 1:
                if storage.local_path(path) is not None:
                    raise verified(e) from None
                policy = getattr(storage, "policy", None) or RetryPolicy()
            elif e.got == last:
                raise verified(e, f" (the same bytes in {attempt} reads in a row)") from None
            last = e.got
            elapsed = time.monotonic() - start
            if attempt > 1 and elapsed >= policy.deadline:
                raise TransferError(
                    f"{path} of {storage.url}: {attempt} reads in {elapsed:.1f} s brought back bad bytes, different "
                    f"ones each time (last: {e.reason}): damaged in transfer, not where stored; the retry deadline "
                    f"({policy.deadline:g} s) is spent", step=e.step, key=e.key, blob=e.blob) from None
            pause = min(policy.max_backoff, policy.backoff * 2 ** (attempt - 1),
                        max(0.0, policy.deadline - elapsed))
            log.warning("%s of %s: %s; reading it again in %.2f s (read %d)", path, storage.url, e.reason, pause,
                        attempt + 1)
            time.sleep(pause)


class _RangeFile:
    """A read-only file object over ``storage`` ranged reads, for streaming a file of any size."""

    def __init__(self, storage, path: str, offset: int = 0, length: Optional[int] = None):
        self.storage, self.path, self.pos = storage, path, offset
        self.end = None if length is None else offset + length

    def read(self, size: int = -1) -> bytes:
        size = _PIECE if size is None or size < 0 else min(size, _PIECE)
        if self.end is not None:
            size = min(size, self.end - self.pos)
        if size <= 0:
            return b""
        buf = bytearray(size)
        got = self.storage.read_range_into(self.path, self.pos, memoryview(buf))
        self.pos += got
        if got < size:                # the object ended: never ask past its end (object stores answer 416)
            self.end = self.pos
        return bytes(buf[:got])


def hash_stream(read, cap: Optional[int] = None, piece: int = _PIECE):
    """BLAKE3 of what ``read(n)`` yields until it returns nothing or ``cap`` bytes were read (pieces of
    ``piece`` bytes). Returns ``(hasher, bytes read)``."""
    h = blake3.blake3()
    total = 0
    while cap is None or total < cap:
        chunk = read(piece if cap is None else min(piece, cap - total))
        if not chunk:
            break
        h.update(chunk)
        total += len(chunk)
    return h, total


def stream_check(storage, path: str, codec: str, *, nbytes: Optional[int], blob_id: str, offset: int = 0,
                 stored: Optional[int] = None, limit: int = RECHECK_LIMIT) -> Tuple[bool, int]:
    """Hash one stored chunk in bounded memory (pieces of 8 MiB). Returns ``(hashes to blob_id, raw bytes)``.

    ``nbytes``: the raw length expected (decoding stops one byte past it); ``None``: decode up to ``limit``.
    Raises ``OSError`` / ``ValueError`` from the storage, ``zstandard.ZstdError`` for an undecodable frame, and
    ``OverflowError`` when the raw bytes pass ``limit`` (nothing can be concluded then).
    """
    cap = limit if nbytes is None else nbytes + 1
    src = _RangeFile(storage, path, offset, stored)
    if codec == "planes":
        return _planes_check(src, nbytes=nbytes, blob_id=blob_id, stored=stored, limit=limit)
    if codec != "raw":
        src = zstandard.ZstdDecompressor().stream_reader(src, read_size=1 << 20)
    h, total = hash_stream(src.read, cap)
    if nbytes is None and total >= limit:
        raise OverflowError(f"more than {limit} raw bytes")
    return h.hexdigest() == blob_id and (nbytes is None or total == nbytes), total


def _planes_check(src: "_RangeFile", *, nbytes: Optional[int], blob_id: str, stored: Optional[int],
                  limit: int) -> Tuple[bool, int]:
    """:func:`stream_check` of a planes frame: its planes interleave, so the frame is read whole and decoded
    whole (memory: its stored bytes + its raw length, at most one chunk's; a frame claiming more than ``limit``
    raw bytes, or more than its size can hold, is not decoded)."""
    head = src.read(planes.header_size(8))
    claimed = planes.frame_nbytes(head)
    if nbytes is not None and claimed != nbytes:
        return False, claimed
    if claimed >= limit:
        raise OverflowError(f"more than {limit} raw bytes")
    pieces = [head]
    while True:
        piece = src.read(_PIECE)
        if not piece:
            break
        pieces.append(piece)
    frame = b"".join(pieces)
    if not zstd_claim_possible(len(frame), claimed):
        raise planes.FrameError(f"{len(frame)} bytes of planes cannot hold {claimed} bytes")
    out = bytearray(claimed)
    planes.decode_into(frame, memoryview(out))
    return digest_bytes(out) == blob_id, claimed


class BlobStore:
    """Blobs of one store root. Thread-safe; remembers which blobs it has seen so dedup costs no I/O."""

    def __init__(self, storage, *, quarantine: bool = True, prefer: Optional[Dict[str, str]] = None):
        """``prefer``: manifest codec -> the codec :meth:`stat` looks under first (``{"raw": "planes"}`` for a
        remote written with ``Remote(codec="auto")``; see ``_swaps``)."""
        self.storage = storage
        self.quarantine = quarantine              # False for stores this process only reads (load_path)
        self._known: Dict[str, str] = {}          # blob id -> codec, of blobs known to exist
        self._trusted: Set[str] = set()           # blobs this process wrote, or found on disk and hashed
        self._deltas: Dict[str, str] = {}         # delta blobs this process wrote or decoded and hashed -> key id
        self._lock = threading.Lock()
        self._dirs: Set[str] = set()              # object directories written since the last sync()
        # manifest codec -> the codec a blob recorded under it was last found stored as instead (a remote
        # written with Remote(codec="auto") holds raw float chunks as .bpl): :meth:`stat` looks there first
        self._swaps: Dict[str, str] = dict(prefer or {})

    def locate(self, blob_id: str) -> Optional[str]:
        """The codec under which ``blob_id`` is stored in full (not as a delta), or ``None`` if it is not."""
        codec = self._known.get(blob_id)
        if codec is not None:
            return codec
        for codec in FULL_CODECS:           # a delta is no copy of the chunk on its own (it needs its key)
            if self.storage.exists(blob_path(blob_id, codec)):
                self.remember(blob_id, codec)
                return codec
        return None

    def remember(self, blob_id: str, codec: str) -> None:
        with self._lock:
            self._known[blob_id] = codec

    def forget(self, blob_id: str) -> None:
        with self._lock:
            self._known.pop(blob_id, None)
            self._trusted.discard(blob_id)
            self._deltas.pop(blob_id, None)

    def forget_all(self) -> None:
        """Forget which blobs exist (another process's gc may have removed some)."""
        with self._lock:
            self._known.clear()
            self._trusted.clear()
            self._deltas.clear()

    def _reusable(self, blob_id: str, nbytes: int) -> Optional[str]:
        """The codec of a present blob that dedup by name may reuse, else ``None`` (a damaged one is
        quarantined). Dedup by name trusts only bytes this process wrote or has hashed: a blob first found on
        disk is read and hashed once (a file linked before its bytes were durable can hold anything after a
        power loss, with the right length or not; FORMAT.md "Write order"). ``nbytes``: its raw length."""
        present = self.locate(blob_id)
        if present is None:
            return None
        if blob_id in self._trusted:
            return present
        if ((present == "raw" and self.storage.adopt(blob_path(blob_id, present), nbytes))
                or self.judge(blob_id, present) is True):
            with self._lock:
                self._trusted.add(blob_id)
            return present
        self._quarantine(blob_id, present)
        return None

    def _write(self, blob_id: str, codec: str, payload) -> int:
        """Write a blob's stored bytes create-only; one that appeared meanwhile (another rank of a shared root)
        but is not whole is replaced atomically. Returns bytes written (0: a whole copy was there)."""
        path = blob_path(blob_id, codec)
        wrote = self.storage.write_new(path, payload)
        if not wrote and not self.storage.adopt(path, len(payload)) and self.judge(blob_id, codec) is not True:
            self.storage.write_atomic(path, payload)
            wrote = True
        self.remember(blob_id, codec)
        with self._lock:
            self._trusted.add(blob_id)
            self._dirs.add(path.rsplit("/", 1)[0])
        return len(payload) if wrote else 0

    def put(self, blob_id: str, data: memoryview, codec: str = "raw", level: int = 1,
            itemsize: Optional[int] = None) -> Tuple[str, int]:
        """Store ``data`` (raw bytes whose digest is ``blob_id``) unless already present.

        Returns ``(codec actually stored, bytes written)``; bytes written is 0 when the blob was present.
        ``codec`` (``"raw"``, ``"zstd"``, ``"auto"``) and ``itemsize`` (the element size of a float chunk) choose
        how it is stored (:func:`encode_chunk`: raw when compression saves less than 3%).
        """
        present = self._reusable(blob_id, len(data))
        if present is not None:
            return present, 0
        codec, payload = encode_chunk(data, codec, level, itemsize, reuse=True)   # written out before the next
        return codec, self._write(blob_id, codec, payload)

    def put_stored(self, blob_id: str, codec: str, nbytes: int, read) -> int:
        """Store a blob of ``nbytes`` raw bytes whose stored bytes (``read()``, encoded with ``codec``) come from
        another root of this job (a promotion from the memory tier), unless present and trusted (the rules of
        :meth:`put`). The bytes are not hashed: the caller vouches for them. Returns bytes written (0 when
        present); :meth:`sync` makes their directory entries durable."""
        if self._reusable(blob_id, nbytes) is not None:
            return 0
        if codec == "delta":
            return self.write_delta(blob_id, read())
        return self._write(blob_id, codec, read())

    def write_delta(self, blob_id: str, frame, check: Optional[Callable[[bytes], bool]] = None) -> int:
        """Write a delta blob (``frame``: :mod:`ckptstore.format.delta`) create-only. A copy already there is kept
        when it names the same key and, given ``check(stored bytes)``, passes it; one against another key is
        kept too (a committed step may name it) and ``-1`` returned: the caller stores the chunk in full
        instead. A damaged copy against the same key is replaced atomically. Returns bytes written (0: a whole
        copy was there). Deltas are never remembered as copies of the chunk (:meth:`locate`)."""
        path = blob_path(blob_id, "delta")
        wrote = len(frame) if self.storage.write_new(path, frame) else 0
        if not wrote:
            try:
                there = self.storage.read_bytes(path)
                same = delta.parse_header(there)[1] == delta.parse_header(frame)[1]
            except (OSError, ValueError):
                there, same = None, True                   # unreadable or damaged: replaced below
            if not same:
                return -1
            if there is None or (check is not None and not check(there)):
                self.storage.write_atomic(path, frame)
                wrote = len(frame)
        with self._lock:
            self._deltas[blob_id] = delta.parse_header(frame)[1]
            self._dirs.add(path.rsplit("/", 1)[0])
        return wrote

    def delta_trusted(self, ref) -> bool:
        """Whether the delta blob of ``ref`` (a delta :class:`~ckptstore.format.manifest.ChunkRef`) may be named
        again unwritten: its key is here in full, and the delta was written or decoded and hashed by this process
        (once per process otherwise: read, decoded against its key, hashed; FORMAT.md "Write order")."""
        with self._lock:
            known = self._deltas.get(ref.blob_id) == ref.base.blob_id
        if self.locate(ref.base.blob_id) is None:
            return False
        if known:
            return True
        if self.judge(ref.blob_id, "delta", base=ref.base) is not True:
            return False
        with self._lock:
            self._deltas[ref.blob_id] = ref.base.blob_id
        return True

    def put_pack(self, pack_id: str, read) -> int:
        """Store a pack whose bytes (``read()``) come from another root of this job, unless a whole copy is
        present (hashed once when this process did not write it). Returns bytes written (0 when present)."""
        path = pack_path(pack_id)
        with self._lock:
            trusted = pack_id in self._trusted
        if trusted:
            return 0
        if pack_intact(self.storage, pack_id, unreadable=OSError):     # any copy it cannot read is replaced
            with self._lock:
                self._trusted.add(pack_id)
            return 0
        payload = read()
        if not self.storage.write_new(path, payload):
            self.storage.write_atomic(path, payload)
        with self._lock:
            self._trusted.add(pack_id)
        return len(payload)

    @staticmethod
    def intact(payload, blob_id: str, codec: str, nbytes: int, *, threads: bool = False, key=None,
               key_id: Optional[str] = None) -> bool:
        """Whether a blob's stored bytes ``payload`` decode (``codec``) to ``nbytes`` raw bytes hashing to
        ``blob_id`` (decompression bounded by ``nbytes``). A delta decodes against ``key`` (its key's raw bytes,
        already verified) named ``key_id``."""
        try:
            if codec == "raw":
                raw = payload
            elif codec in ("delta", "planes"):            # decoded to exactly nbytes or refused
                raw = bytearray(nbytes)
                decode_into(codec, payload, memoryview(raw), key=key, key_id=key_id)
            else:
                raw = decompress(payload, nbytes)
        except (ValueError, zstandard.ZstdError):
            return False
        return len(raw) == nbytes and digest_bytes(raw, threads=threads) == blob_id

    def sync(self) -> None:
        """Make the directory entries of the blobs written so far durable (before a manifest names them)."""
        with self._lock:
            dirs, self._dirs = self._dirs, set()
        self.storage.sync(dirs)

    def stat(self, blob_id: str, codec: str) -> Tuple[str, Optional[int]]:
        """``(codec, stored size)`` of a blob, looking under the other codecs when it is not under ``codec``;
        size ``None`` when the blob is missing (or is not a regular file). A blob may be stored under another
        codec than its manifest records (FORMAT.md "Chunks, blobs and packs": re-written, or encoded on upload by
        ``Remote(codec="auto")``); the codec another blob recorded as ``codec`` was last found under (or the one
        ``prefer`` names) is looked at first, so that reading such a tier costs one lookup per blob, not one per
        codec."""
        first = (self._swaps.get(codec, codec), codec)
        with self._lock:
            known = self._known.get(blob_id)             # a full copy found before (e.g. re-written)
        # then the other full codecs' names (a delta's full copy serves too), each name looked up once
        for c in dict.fromkeys(first + ((known,) if known else ()) + _FALLBACK):
            size = self.storage.size(blob_path(blob_id, c))
            if size is None:
                continue
            if c not in first:
                self.remember(blob_id, c)
                if codec != "delta":
                    with self._lock:
                        self._swaps[codec] = c
            return c, size
        return codec, None

    def read_into(self, blob_id: str, codec: str, out: memoryview, *, step=None, key=None,
                  quarantine: bool = True, size: Optional[int] = None, base=None) -> None:
        """Fill ``out`` (exactly the blob's raw length) with the blob's bytes and verify their digest.

        Raises ``CorruptCheckpointError`` (naming step, key and blob) when the blob is missing, has the wrong
        length, cannot be decompressed, or its digest does not match; from an object store, bad bytes are read
        again first (:func:`read_verified`), and :class:`~ckptstore.util.errors.TransferError` is raised when they
        come back different each time until the retry deadline. Only a blob whose own bytes fail their hash
        when read again is moved to ``quarantine/`` (so the next save writes a good copy instead of
        deduplicating against it): a manifest that claims a wrong length or codec for an intact blob is the
        manifest's fault, and the blob stays for the steps that use it rightly. ``quarantine=False``: never.
        ``size``: the stored size if the caller has just looked it up (see :meth:`stat`).
        ``base``: a delta's key (its ``ChunkRef.base``), read and verified first (one more read of the key's raw
        length; a missing or damaged key fails as that blob); a full copy of the chunk, when there is one, is
        read instead of the delta.
        """
        nbytes = len(out)
        if size is None:
            codec, size = self.stat(blob_id, codec)
        self.check_claim(blob_id, codec, size, nbytes, step=step, key=key, quarantine=quarantine)
        path = blob_path(blob_id, codec)
        keybuf = self._read_key(blob_id, base, nbytes, step, key, quarantine) if codec == "delta" else None

        def once() -> None:
            with self._read_errors(blob_id, codec, nbytes, quarantine, step, key, base):
                if codec == "raw":
                    got = self.storage.read_into(path, out)
                else:
                    payload = self.storage.read_bytes(path)
                    try:
                        got = decode_into(codec, payload, out, key=keybuf, key_id=base and base.blob_id)
                    except (ValueError, zstandard.ZstdError) as e:
                        raise DamagedRead(f"blob unreadable ({e})", got=(len(payload), digest_bytes(payload)),
                                          step=step, key=key, blob=blob_id) from None
            if got != nbytes:
                raise DamagedRead(f"blob has {got} bytes, expected {nbytes}", got=(got, digest_bytes(out[:got])),
                                  step=step, key=key, blob=blob_id)
            digest = digest_bytes(out, threads=True)
            if digest != blob_id:
                raise DamagedRead("blob content does not match its hash", got=(got, digest), step=step, key=key,
                                  blob=blob_id)
        read_verified(self.storage, path, once, damaged=lambda e: self._damaged(
            e.reason, blob_id, codec, nbytes, quarantine, step, key, base))
        if codec != "delta":
            self.remember(blob_id, codec)

    def _read_key(self, blob_id: str, base, nbytes: int, step, key, quarantine: bool) -> bytearray:
        """The raw bytes of a delta's key, verified (:meth:`read_into`). Raises ``CorruptCheckpointError``."""
        if base is None or base.codec == "delta" or base.nbytes != nbytes:
            raise CorruptCheckpointError("a delta chunk needs a full blob of its length as its key", step=step,
                                         key=key, blob=blob_id)
        buf = bytearray(nbytes)
        self.read_into(base.blob_id, base.codec, memoryview(buf), step=step, key=key, quarantine=quarantine)
        return buf

    @contextlib.contextmanager
    def _read_errors(self, blob_id, codec, nbytes, quarantine, step, key, base=None):
        """Reading a blob: a missing or unreadable file is a CorruptCheckpointError naming it; undecodable
        bytes are damage (see :meth:`_damaged`)."""
        try:
            yield
        except FileNotFoundError:
            raise CorruptCheckpointError("blob missing", step=step, key=key, blob=blob_id) from None
        except OSError as e:
            raise CorruptCheckpointError(f"blob unreadable ({e.strerror or e})", step=step, key=key,
                                         blob=blob_id) from None
        except (ValueError, zstandard.ZstdError) as e:
            raise self._damaged(f"blob unreadable ({e})", blob_id, codec, nbytes, quarantine, step, key,
                                base) from None

    def verify(self, blob_id: str, codec: str, nbytes: int, *, step=None, key=None, quarantine: bool = False,
               base=None) -> None:
        """Read and hash one blob in bounded memory, without keeping it (``ckptstore verify``); raises like
        :meth:`read_into`. Quarantines nothing unless asked: verifying is a read-only command. A delta
        (``base``: its key) is decoded against its key whole: memory of twice its raw length and its frame."""
        codec, size = self.stat(blob_id, codec)
        if codec == "delta":
            self.read_into(blob_id, codec, memoryview(bytearray(nbytes)), step=step, key=key, quarantine=quarantine,
                           size=size, base=base)
            return
        self.check_claim(blob_id, codec, size, nbytes, step=step, key=key, quarantine=quarantine)
        with self._read_errors(blob_id, codec, nbytes, quarantine, step, key):
            ok, got = stream_check(self.storage, blob_path(blob_id, codec), codec, nbytes=nbytes, blob_id=blob_id,
                                   stored=size)
        if not ok:
            msg = (f"blob has {got if got <= nbytes else 'more than ' + str(nbytes)} bytes, expected {nbytes}"
                   if got != nbytes else "blob content does not match its hash")
            raise self._damaged(msg, blob_id, codec, nbytes, quarantine, step, key)

    def check_claim(self, blob_id: str, codec: str, size: Optional[int], nbytes: int, *, step=None, key=None,
                    quarantine: bool = True) -> None:
        """Check a claimed raw length against the stored size (from :meth:`stat`) before anything is allocated
        for it: a raw blob has exactly ``nbytes`` bytes; a zstd blob can hold at most ``MAX_ZSTD_RATIO`` times
        its size (a planes frame as well). Raises ``CorruptCheckpointError`` (see :meth:`_damaged` for the quarantine rule)."""
        if size is None:
            raise CorruptCheckpointError("blob missing", step=step, key=key, blob=blob_id)
        if codec == "raw" and size != nbytes:
            raise self._damaged(f"blob has {size} bytes, expected {nbytes}", blob_id, codec, nbytes, quarantine,
                                step, key)
        if codec != "raw" and not zstd_claim_possible(size, nbytes):
            raise self._damaged(f"{size} bytes of zstd cannot hold the {nbytes} bytes expected", blob_id, codec,
                                nbytes, quarantine, step, key)

    def _damaged(self, msg: str, blob_id: str, codec: str, nbytes: int, quarantine: bool, step, key, base=None):
        """The error for a blob that did not read back as claimed. The blob is re-read from scratch and
        hashed on its own (bounded memory, whatever the manifest claimed): only when its bytes do not hash to
        its id is it quarantined; when they do, the claim (length, codec) was wrong, and it says so."""
        verdict = self.judge(blob_id, codec, base=base)
        if verdict is True:
            return CorruptCheckpointError(f"{msg}; the blob itself is intact: the manifest's claim about it is "
                                          "wrong", step=step, key=key, blob=blob_id)
        self.forget(blob_id)
        if verdict is False and quarantine:
            self._quarantine(blob_id, codec)
            msg += " (moved to quarantine/)"
        return CorruptCheckpointError(msg, step=step, key=key, blob=blob_id)

    def judge(self, blob_id: str, codec: str, base=None) -> Optional[bool]:
        """Whether the stored blob hashes to its id: True, False, or None when that cannot be told (missing,
        not a regular file, an I/O error, or more than ``RECHECK_LIMIT`` raw bytes). A delta is judged against
        ``base`` (its key): None without one, when the key cannot be read whole, or when the frame names
        another key (it may be whole against that one)."""
        try:
            path = blob_path(blob_id, codec)
            size = self.storage.size(path)
            if size is None:
                return None
            if codec == "delta":
                return self._judge_delta(path, blob_id, base)
            ok, _ = stream_check(self.storage, path, codec, nbytes=None, blob_id=blob_id, stored=size)
            return ok
        except (ValueError, zstandard.ZstdError):
            return False                                   # an undecodable frame is damaged, whatever claimed
        except (OSError, OverflowError):
            return None

    def _judge_delta(self, path: str, blob_id: str, base) -> Optional[bool]:
        if base is None or base.nbytes >= RECHECK_LIMIT:
            return None
        frame = self.storage.read_bytes(path)
        if delta.parse_header(frame)[1:] != (base.blob_id, base.nbytes):
            return None if delta.parse_header(frame)[1] != base.blob_id else False
        keybuf = bytearray(base.nbytes)
        try:
            self.read_into(base.blob_id, base.codec, memoryview(keybuf), quarantine=False)
        except CorruptCheckpointError:
            return None
        return self.intact(frame, blob_id, "delta", base.nbytes, key=keybuf, key_id=base.blob_id)

    def _quarantine(self, blob_id: str, codec: str) -> None:
        self.forget(blob_id)
        if not self.quarantine:
            return
        try:
            self.storage.move(blob_path(blob_id, codec), f"{QUARANTINE}/{blob_id}{CODEC_SUFFIX[codec]}")
        except (OSError, ValueError):
            pass
