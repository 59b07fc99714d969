"""The options of a :class:`~ckptstore.store.Store`, as a few small objects of things that belong together.

* :class:`Writing`: how a save turns tensors into chunks, blobs and packs on the local disk (sizes, codec,
  threads, O_DIRECT, change detection, :class:`~ckptstore.format.packs.Packing`).
* :class:`Remote`: the object store a run uploads to (and resumes from), with its upload knobs.
* :class:`~ckptstore.lifecycle.retention.Retention` (``Store(keep=...)``): which steps to keep.

Each is frozen and checks its values when made, so a bad option fails where it is written, not at the first
save.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Tuple

from ..format.blobs import WRITE_CODECS
from ..format.packs import Packing
from ..lifecycle.retention import Retention
from ..lifecycle.rewind import ON_REWIND
from ..util.retry import RetryPolicy

DEFAULT_CHUNK_SIZE = 64 << 20
UPLOAD_CODECS = ("raw", "auto")     # what ``Remote.codec`` may ask for


def _count(owner: str, name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{owner}.{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class Writing:
    """How ``save`` writes (``Store(writing=Writing(...))``). Sizes in bytes.

    ``chunk_size``: maximum bytes per chunk (default 64 MiB, at least 4096). ``codec``: ``"raw"`` (default),
    ``"zstd"`` for new chunks, at ``zstd_level``, or ``"auto"``: chunks of floating-point tensors (fp64, fp32, bf16,
    fp16, fp8) as byte planes + zstd (the ``planes`` codec, FORMAT.md; its own fixed zstd parameters), other chunks
    as zstd at ``zstd_level`` where a sample shows it pays. Any compressed chunk is kept only where it saves >= 3%,
    else stored raw; chunk ids are the BLAKE3 of the raw bytes whatever the codec. Measured here (issue 30,
    benchmarks/README.md "bench_codec.py"): zstd saves ~8% on fp32 weights; ``"auto"`` ~17% on fp32 weights,
    19-23% on Adam's moments and ~34% on bf16 weights, at 0.25-0.5 GB/s per core to compress (a blocking save
    took 1.6-2.3x a raw one), so raw stays the default.
    ``workers``: threads hashing / writing / reading chunks (default 4). ``direct_io``: use O_DIRECT for large
    aligned writes where the filesystem supports it. ``packing``: a :class:`~ckptstore.format.packs.Packing` (chunks
    under ``threshold`` bytes, default 4 MiB, go into pack files of about ``target_size`` bytes;
    ``Packing(threshold=0)`` writes every chunk as a blob of its own; see FORMAT.md).

    ``deltas``: with ``codec="auto"`` only (else ``ValueError``), default 0 (off): a chunk stored as a blob whose
    tensor had a blob chunk of the same key path, dtype, index and length in this rank's previous committed step is
    stored as the difference with that chunk's key (the full chunk the delta chain started from), at most
    ``deltas`` saves in a row; then in full again (the next key). Chains have depth 1 (a key is never a delta).
    Opt-in: a delta costs one read of its key (the chunk's raw length) at save, and a read of the key beside the
    delta at load; gc keeps a key while a delta needs it. Measured here (issue 30, saved every training step):
    1.62x fp32 weights, 1.52x Adam v, 4.0x bf16 weights between consecutive saves (Adam m: 1.24x, about what
    ``"auto"`` gives alone); averaged over a cycle of one key and ``deltas=4`` deltas 1.45x / 1.43x / 2.60x
    (benchmarks/README.md "bench_codec.py"; FORMAT.md "The delta codec").
    ``track_versions``: opt-in (default ``False``: every tensor is hashed at every save, and content addressing
    alone skips writing unchanged bytes). ``True`` skips copying and hashing a tensor whose storage, autograd
    version counter and optimizer-step count are unchanged since the last save (frozen layers in fine-tuning).
    It cannot see writes through ``.data``, numpy views, ``untyped_storage()``, DLPack or extension kernels
    that leave the version counter alone: such a tensor is saved with its old bytes. Fused optimizers are seen
    (see :mod:`ckptstore.io.changes`); DTensor shards are always hashed.
    """
    chunk_size: int = DEFAULT_CHUNK_SIZE
    codec: str = "raw"
    zstd_level: int = 1
    workers: int = 4
    direct_io: bool = True
    track_versions: bool = False
    packing: Packing = field(default_factory=Packing)
    deltas: int = 0

    def __post_init__(self):
        if self.codec not in WRITE_CODECS:
            raise ValueError(f"Writing.codec must be one of {WRITE_CODECS}, got {self.codec!r}")
        _count("Writing", "deltas", self.deltas, 0)
        if self.deltas and self.codec != "auto":
            raise ValueError(f"Writing.deltas={self.deltas} needs Writing.codec='auto', got {self.codec!r}")
        _count("Writing", "chunk_size", self.chunk_size, 4096)
        _count("Writing", "workers", self.workers, 1)
        if isinstance(self.zstd_level, bool) or not isinstance(self.zstd_level, int):
            raise ValueError(f"Writing.zstd_level must be an int, got {self.zstd_level!r}")
        if not isinstance(self.packing, Packing):
            raise TypeError(f"Writing.packing must be a ckptstore.Packing, got {type(self.packing).__name__}")


@dataclass(frozen=True)
class Remote:
    """The remote tier (``Store(remote=Remote(url, ...))``; ``Store(remote=url)`` is ``Remote(url)``).

    ``url``: an fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``, ``file://...``) to which
    every committed step is uploaded in the background, in commit order (see :mod:`ckptstore.remote.upload` for the
    order, crash safety and backlog policy), and from which ``resume`` / ``load`` / ``restore`` read.
    ``workers``: parallel blob uploads (default 8). ``retry``: a :class:`~ckptstore.util.retry.RetryPolicy`
    (deadline and per-attempt timeout, in seconds) for every call to the remote, uploads and reads, and for
    reads of ``load_path``. ``backlog``: committed steps allowed to wait for upload (default 8; older waiting
    ones are dropped from the queue, never from the disk). ``upload``: ``False`` to use the remote only to read
    from (resume, ``pull``), never to write to it. ``keep_local``: keep at most this many committed steps on
    local disk once they are uploaded (the newest ones; a step not yet uploaded is never removed by this rule);
    ``0``: no local copy of an uploaded step is kept, ``resume`` then pulls from the remote; ``None`` (default):
    local steps follow ``keep`` alone. ``every``: upload only the committed steps that are multiples of it
    (default 1: every step); with a memory tier (:class:`~ckptstore.memtier.memory.Memory`) those are the disk steps
    that are multiples of it.

    ``codec``: how the uploader stores chunks on the remote: ``"raw"`` (default: as the local tier holds them)
    or ``"auto"``: each blob holding a chunk of a floating-point tensor that the local tier holds raw is encoded
    with the ``planes`` codec on its way up (after its raw bytes are checked against its id), and stored as
    ``<id>.bpl`` where that saves >= 3% (else raw); packs, compressed blobs, deltas and other dtypes go as they
    are, and so do blobs over 64 MiB (``ENCODE_MAX``: they are read whole to encode, one per upload worker).
    The local tier stays raw (a save costs what a raw save costs, a local resume reads raw); the manifests and
    commit marker on the remote stay byte-identical to the local ones: a blob may be stored on a tier under
    another codec than its manifest records, and readers find it by id (FORMAT.md "Chunks, blobs and packs").
    Measured here (issue 30, benchmarks/README.md "bench_upload.py"): see the "Codecs" paragraph there. Opt-in:
    it costs the uploader's threads ~0.1 s of CPU per 64 MiB fp32 chunk encoded, and readers of the remote must
    be of a ckptstore that knows the rule (older ones report the ``.bpl`` blobs missing). Any other value:
    ``ValueError``.
    """
    url: str
    workers: int = 8
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    backlog: int = 8
    upload: bool = True
    keep_local: Optional[int] = None
    every: int = 1
    codec: str = "raw"

    def __post_init__(self):
        if not isinstance(self.url, str) or not self.url:
            raise ValueError(f"Remote.url must be a non-empty URL string, got {self.url!r}")
        if self.codec not in UPLOAD_CODECS:
            raise ValueError(f"Remote.codec must be one of {UPLOAD_CODECS}, got {self.codec!r}")
        _count("Remote", "workers", self.workers, 1)
        _count("Remote", "backlog", self.backlog, 1)
        if not isinstance(self.retry, RetryPolicy):
            raise TypeError(f"Remote.retry must be a ckptstore.RetryPolicy, got {type(self.retry).__name__}")
        if self.keep_local is not None:
            _count("Remote", "keep_local", self.keep_local, 0)
        _count("Remote", "every", self.every, 1)

    @classmethod
    def of(cls, remote) -> Optional["Remote"]:
        """``Store(remote=...)``'s value as a :class:`Remote`: ``None``, a URL string (or path), or a
        :class:`Remote`."""
        if remote is None or isinstance(remote, Remote):
            return remote
        if isinstance(remote, (str, os.PathLike)):
            return cls(os.fspath(remote))
        raise TypeError(f"remote must be a URL string or a ckptstore.Remote, got {type(remote).__name__}")


def store_options(writing, remote, keep, on_rewind: str) -> Tuple[Writing, Optional[Remote]]:
    """``Store(writing=, remote=, keep=, on_rewind=)`` checked before anything is opened: returns ``writing``
    (default ``Writing()``) and ``remote`` (see :meth:`Remote.of`) as objects. Raises ``TypeError`` for a
    ``writing`` that is no :class:`Writing`, a ``keep`` that is no
    :class:`~ckptstore.lifecycle.retention.Retention` or a bad ``remote``; ``ValueError`` for an ``on_rewind``
    not in :data:`~ckptstore.lifecycle.rewind.ON_REWIND`."""
    writing = writing if writing is not None else Writing()
    if not isinstance(writing, Writing):
        raise TypeError(f"writing must be a ckptstore.Writing, got {type(writing).__name__}")
    remote = Remote.of(remote)
    if keep is not None and not isinstance(keep, Retention):
        raise TypeError(f"keep must be a ckptstore.Retention, got {type(keep).__name__}")
    if on_rewind not in ON_REWIND:
        raise ValueError(f"on_rewind must be one of {ON_REWIND}, got {on_rewind!r}")
    return writing, remote
