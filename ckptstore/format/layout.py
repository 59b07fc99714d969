"""Where things live inside a store root (local directory or remote prefix).

This module is the only one that spells file names; every path it returns is relative to the store root and
uses ``/``. Everything read from an untrusted store (blob ids, step names) is validated here before it is
turned into a path, so nothing in a manifest can name a file outside the root.

Layout (format version 2; version 1 is the same without ``packs/`` and manifest generations)::

    objects/<id[:2]>/<id>          blob, raw bytes of one chunk      (id = BLAKE3-256 hex of the raw bytes)
    objects/<id[:2]>/<id>.zst      blob, zstd frame of the raw bytes
    objects/<id[:2]>/<id>.bpl      blob, planes frame of the raw bytes (ckptstore.format.planes)
    packs/<id[:2]>/<id>.pack       pack: many small chunks back to back (id = BLAKE3-256 hex of the whole file)
    steps/<step:012d>/manifest-rank<rank:05d>.msgpack          generation 0
    steps/<step:012d>/manifest-rank<rank:05d>.g<gen>.msgpack   generation gen > 0 (rewritten by a repack)
    steps/<step:012d>/manifests-<tag>.tbl              manifest table of a step of > 512 ranks (mtable.py)
    steps/<step:012d>/rows-<tag>.r<rank:05d>.msgpack   some ranks' rows of it, in a root without the table
    steps/<step:012d>/COMMIT       commit marker, written last: makes the step visible
    steps/<step:012d>.aside-<tag>/ a committed step set aside by a resume from an older step (ASIDE + its files)
    latest                         latest pointer (JSON), names the newest committed step
    quarantine/                    blobs found corrupt on read, moved aside so the next save rewrites them
    locks/                         writer lease, gc lease, in-flight markers, gc epoch, retired packs,
                                   remote-deletion intents (a local root's: steps to delete from its remote)
"""
from __future__ import annotations

import re

OBJECTS = "objects"
PACKS = "packs"
PACK_SUFFIX = ".pack"
STEPS = "steps"
LATEST = "latest"
QUARANTINE = "quarantine"
COMMIT_NAME = "COMMIT"
STORE_MARKER = "ckptstore.json"
# coordination between writers and deleters (see FORMAT.md "Writers and deleters", ckptstore/lifecycle/lease.py)
LOCKS = "locks"
WRITER_LEASE = "locks/writer.json"       # the one job allowed to save into this root
GC_LEASE = "locks/gc.json"               # the one deleter (gc, retention sweep, repack) running now
INFLIGHT = "locks/inflight"              # locks/inflight/<token>.json: a save or copy in flight
GC_EPOCH = "locks/gc-epoch"              # changes whenever a deleter removed something
RETIRED = "locks/retired"                # locks/retired/<pack id>: a pack replaced by repack, and when
REMOTE_DELETES = "locks/remote-deletes"  # locks/remote-deletes/<step>.json: a step to delete from the remote

CODEC_SUFFIX = {"raw": "", "zstd": ".zst", "planes": ".bpl", "delta": ".dlt"}
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_STEP_DIR_RE = re.compile(r"^[0-9]{12}$")
_MANIFEST_RE = re.compile(r"^manifest-rank([0-9]{5})(?:\.g([0-9]{1,9}))?\.msgpack$")
_PACK_RE = re.compile(r"^([0-9a-f]{64})\.pack$")
_BLOB_RE = re.compile(r"^([0-9a-f]{64})(\.zst|\.bpl|\.dlt)?$")
MAX_STEP = 10**12 - 1


def check_blob_id(blob_id: str) -> str:
    """Return ``blob_id`` if it is a 64-char lowercase hex digest, else raise ``ValueError``."""
    if not isinstance(blob_id, str) or not _HASH_RE.match(blob_id):
        raise ValueError(f"invalid blob id {blob_id!r}: expected 64 lowercase hex characters")
    return blob_id


def check_step(step) -> int:
    """Return ``step`` if it is an int in [0, 10**12), else raise ``ValueError`` / ``TypeError``."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {type(step).__name__}")
    if not 0 <= step <= MAX_STEP:
        raise ValueError(f"step {step} out of range [0, {MAX_STEP}]")
    return step


def blob_path(blob_id: str, codec: str) -> str:
    check_blob_id(blob_id)
    if codec not in CODEC_SUFFIX:
        raise ValueError(f"unknown codec {codec!r}")
    return f"{OBJECTS}/{blob_id[:2]}/{blob_id}{CODEC_SUFFIX[codec]}"


def pack_path(pack_id: str) -> str:
    """``packs/<id[:2]>/<id>.pack``; raises ``ValueError`` for an id that is not 64 lowercase hex."""
    check_blob_id(pack_id)
    return f"{PACKS}/{pack_id[:2]}/{pack_id}{PACK_SUFFIX}"


def parse_pack_name(name: str):
    """``'<id>.pack'`` -> id; anything else (temp files included) -> ``None``."""
    m = _PACK_RE.match(name)
    return m.group(1) if m else None


def parse_blob_name(name: str):
    """``'<id>'`` -> ``(id, 'raw')``, ``'<id>.zst'`` -> ``(id, 'zstd')``, ``'<id>.bpl'`` -> ``(id, 'planes')``,
    ``'<id>.dlt'`` -> ``(id, 'delta')``, anything else -> ``None``."""
    m = _BLOB_RE.match(name)
    if not m:
        return None
    return m.group(1), {None: "raw", ".zst": "zstd", ".bpl": "planes", ".dlt": "delta"}[m.group(2)]


def step_dir(step: int) -> str:
    return f"{STEPS}/{check_step(step):012d}"


MAX_GENERATION = 10 ** 9       # manifest and shard-map generations are below this


def parse_step_dir(name: str):
    """``'000000000100'`` -> 100; anything else -> ``None``."""
    return int(name) if _STEP_DIR_RE.match(name) else None


def manifest_path(step: int, rank: int, gen: int = 0) -> str:
    """Path of one rank's manifest; ``gen`` > 0 for a manifest rewritten by a repack (format 2)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 100000:
        raise ValueError(f"invalid rank {rank!r}")
    if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen < MAX_GENERATION:
        raise ValueError(f"invalid manifest generation {gen!r}")
    suffix = f".g{gen}" if gen else ""
    return f"{step_dir(step)}/manifest-rank{rank:05d}{suffix}.msgpack"


def parse_manifest_name(name: str):
    """``'manifest-rank00003.g2.msgpack'`` -> ``(3, 2)``; anything else -> ``None``."""
    m = _MANIFEST_RE.match(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def shards_path(step: int, gen: int = 0) -> str:
    """Path of a step's shard map (see :mod:`ckptstore.format.shardmap`); ``gen``: its commit's rank 0 manifest
    generation, so a re-saved step's new map never replaces the one its old commit marker names."""
    if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen < MAX_GENERATION:
        raise ValueError(f"invalid shard map generation {gen!r}")
    return f"{step_dir(step)}/shards{f'.g{gen}' if gen else ''}.msgpack"


def parse_shards_name(name: str):
    """``'shards.g2.msgpack'`` -> 2, ``'shards.msgpack'`` -> 0; anything else -> ``None``."""
    m = re.match(r"^shards(?:\.g([1-9][0-9]{0,8}))?\.msgpack$", name)
    return int(m.group(1) or 0) if m else None


def table_tag(digest: bytes) -> str:
    """The name tag of a manifest table and its rows files: the first 16 hex digits of the table's digest (the
    files are named by their contents, so a re-saved, repacked or pulled step's new table never replaces the
    one an older marker names)."""
    if not isinstance(digest, bytes) or len(digest) != 32:
        raise ValueError(f"invalid manifest table digest {digest!r:.80}")
    return digest.hex()[:16]


def table_path(step: int, digest: bytes) -> str:
    """Path of a step's manifest table (FORMAT.md "Manifest table"): ``steps/<step>/manifests-<tag>.tbl``."""
    return f"{step_dir(step)}/manifests-{table_tag(digest)}.tbl"


def rows_path(step: int, digest: bytes, first: int) -> str:
    """Path of a rows file: the rows of some ranks of the table ``digest`` names (``first``: the lowest of
    them), written into a root that holds those ranks' parts but not the table (a leader's, a pull's)."""
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < 100000:
        raise ValueError(f"invalid rank {first!r}")
    return f"{step_dir(step)}/rows-{table_tag(digest)}.r{first:05d}.msgpack"


def parse_table_name(name: str):
    """``'manifests-<tag>.tbl'`` / ``'rows-<tag>.r<rank>.msgpack'`` -> the tag; anything else -> ``None``."""
    m = re.match(r"^(?:manifests-([0-9a-f]{16})\.tbl|rows-([0-9a-f]{16})\.r[0-9]{5}\.msgpack)$", name)
    return (m.group(1) or m.group(2)) if m else None


ASIDE_NAME = "ASIDE"                     # the record a set-aside step directory is written with first
_ASIDE_DIR_RE = re.compile(r"^([0-9]{12})\.aside-([0-9a-f]{16})$")


def aside_dir(step: int, tag: str) -> str:
    """``steps/<step:012d>.aside-<tag>``: where a step set aside after a resume from an older step lives (see
    :mod:`ckptstore.lifecycle.rewind`); ``tag`` is 16 lowercase hex (from its commit marker's digest)."""
    if not re.match(r"^[0-9a-f]{16}$", tag):
        raise ValueError(f"invalid set-aside tag {tag!r}")
    return f"{step_dir(step)}.aside-{tag}"


def parse_aside_dir(name: str):
    """``'000000000012.aside-0123456789abcdef'`` -> 12; anything else (a step directory too) -> ``None``."""
    m = _ASIDE_DIR_RE.match(name)
    return int(m.group(1)) if m else None


def commit_path(step: int) -> str:
    return f"{step_dir(step)}/{COMMIT_NAME}"


def inflight_path(token: str) -> str:
    if not re.match(r"^[0-9a-f]{32}$", token):
        raise ValueError(f"invalid in-flight token {token!r}")
    return f"{INFLIGHT}/{token}.json"


def parse_inflight_name(name: str):
    m = re.match(r"^([0-9a-f]{32})\.json$", name)
    return m.group(1) if m else None


def retired_path(pack_id: str) -> str:
    return f"{RETIRED}/{check_blob_id(pack_id)}"


def remote_delete_path(step: int) -> str:
    """``locks/remote-deletes/<step:012d>.json``: the intent to delete ``step`` from the remote (see
    :mod:`ckptstore.format.intents`)."""
    return f"{REMOTE_DELETES}/{check_step(step):012d}.json"


def parse_remote_delete_name(name: str):
    """``'000000000100.json'`` -> 100; anything else (temp files included) -> ``None``."""
    m = re.match(r"^([0-9]{12})\.json$", name)
    return int(m.group(1)) if m else None
