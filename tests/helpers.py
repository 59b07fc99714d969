"""Small helpers shared by the tests: reaching into a store's files on purpose (to damage them), comparing
states bit for bit, running the command line, and where the shared scaffolding lives."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack

from ckptstore import Store

TESTS = Path(__file__).resolve().parent      # the shared scaffolding: worker scripts, proxies, fixtures/
REPO = TESTS.parent


def cli(*args, check=True):
    """Run the ``ckptstore`` command (the installed console script, else ``python -m ckptstore.cli``) as a
    real subprocess; raise with its output when ``check`` and it fails."""
    exe = shutil.which("ckptstore", path=os.path.dirname(sys.executable)) or shutil.which("ckptstore")
    cmd = [exe, *args] if exe else [sys.executable, "-m", "ckptstore.cli", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}: {p.stdout}\n{p.stderr}")
    return p


def two_at_a_time(*calls):
    """Run the zero-argument ``calls`` (each starting a subprocess, e.g. :func:`cli`) two at a time, the test
    machine's two cores: a command's start-up (importing torch) is most of its time and uses one core. Returns
    their results in order; the first exception raised is raised."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: call(), calls))


def bits_equal(a, b) -> bool:
    """``a`` and ``b`` hold the same values bit for bit (tensors and arrays by dtype, shape and bytes; dicts,
    lists and tuples element by element; anything else by ``==`` and type)."""
    import numpy as np
    import torch
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(bits_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    return type(a) is type(b) and a == b


def step_dir(root, step) -> Path:
    return Path(root) / "steps" / f"{step:012d}"


def blob_files(root):
    return sorted(p for p in (Path(root) / "objects").rglob("*") if p.is_file())


def pack_files(root):
    return sorted(p for p in (Path(root) / "packs").rglob("*") if p.is_file())


def data_files(root):
    """Every blob and pack file of a store."""
    return blob_files(root) + pack_files(root)


def chunks_of_key(store: Store, step: int, key: tuple, rank: int = 0):
    """``[(file, offset, stored length, ChunkRef)]`` for each chunk of the tensor at ``key`` of ``step``: a
    blob file at offset 0, or a pack file and the chunk's range in it (read through the catalog)."""
    commit = store.catalog.read_commit(step)
    manifest = store.catalog.read_manifest(commit, rank)
    for node, entry in manifest.arrays():
        if node.path == key:
            out = []
            for c in entry.chunks:
                if c.pack is None:
                    out.append((Path(store.root) / "objects" / c.blob_id[:2] / c.blob_id, 0, c.nbytes, c))
                else:
                    out.append((Path(store.root) / "packs" / c.pack[:2] / f"{c.pack}.pack", c.offset, c.stored, c))
            return out
    raise KeyError(key)


def blobs_of_key(store: Store, step: int, key: tuple):
    """Blob files holding the tensor at ``key`` of ``step`` (a store whose chunks are blobs)."""
    files = [f for f, off, n, c in chunks_of_key(store, step, key)]
    assert all(f.parent.parent.name == "objects" for f in files), "this tensor's chunks are packed"
    return files


def flip_byte(path: Path, offset: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def rewrite_frame(path: Path, mutate, keep_format: bool = False) -> None:
    """Decode a frame (manifest, commit marker, shard map: compressed or not), let ``mutate(body_dict)`` change
    it, re-encode it with a valid checksum (a compressed body stays compressed, in the frame's format; an
    uncompressed one is written as format 2 unless ``keep_format``)."""
    from ckptstore.format.manifest import FORMAT_VERSION, frame
    outer = msgpack.unpackb(path.read_bytes(), raw=False)
    packed = outer["body"]
    if "zstd" in outer:
        import zstandard
        packed = zstandard.ZstdDecompressor().decompress(packed, max_output_size=outer["zstd"])
    body = msgpack.unpackb(packed, raw=False, strict_map_key=False)
    mutate(body)
    if "zstd" in outer:
        path.write_bytes(frame(outer["kind"], body, outer["format"], compress=True))
    else:
        path.write_bytes(frame(outer["kind"], body, outer["format"] if keep_format else FORMAT_VERSION))


def rewrite_manifest(root, step, mutate, rank: int = 0, keep_format: bool = False) -> None:
    """Change a step's manifest with ``mutate(body)`` and re-record its digest in the commit marker, so that
    only the schema checks (not the digest check) stand between the damage and the reader."""
    from ckptstore.format.blobs import digest_bytes
    mf = step_dir(root, step) / f"manifest-rank{rank:05d}.msgpack"
    rewrite_frame(mf, mutate, keep_format)
    data = mf.read_bytes()

    def fix_digest(body):
        for ref in body["manifests"]:
            if ref[0] == rank:
                ref[1], ref[2] = bytes.fromhex(digest_bytes(data)), len(data)
    rewrite_frame(step_dir(root, step) / "COMMIT", fix_digest)


def rewrite_tensor_entries(root, step, edit, key=None, rank: int = 0) -> None:
    """:func:`rewrite_manifest` calling ``edit(entry)`` on the entry (shape, dtype, chunks...) of every tensor
    node of the manifest, or only of the node at ``key`` (a tuple) when given."""
    def mutate(body):
        for node in body["nodes"]:
            if node[1] == "tensor" and (key is None or node[0] == list(key)):
                edit(node[2])
    rewrite_manifest(root, step, mutate, rank)


CHUNK_FIELDS = ("blob_id", "nbytes", "codec", "pack", "offset", "stored")   # a chunk record (FORMAT.md, manifest)


def edit_chunk(root, step, field: str, value, key=None, rank: int = 0) -> None:
    """Set ``field`` (one of :data:`CHUNK_FIELDS`) of the first chunk record of every tensor of ``step``'s
    manifest, or only of the tensor at ``key``, to ``value`` (a callable: ``value(old)``); see
    :func:`rewrite_tensor_entries`."""
    i = CHUNK_FIELDS.index(field)

    def edit(entry):
        chunk = entry["chunks"][0]
        chunk[i] = value(chunk[i]) if callable(value) else value
    rewrite_tensor_entries(root, step, edit, key=key, rank=rank)


def arm_kill_in_save(store, step: int) -> None:
    """Test-only fault injection for worker processes: SIGKILL this process when the commit marker of ``step``
    is about to be written (it goes through the store's storage ``write_atomic``; rank 0 writes it): the
    step's chunks and manifests are on disk, its commit marker is not."""
    import os
    import signal
    storage = store.storage
    real = storage.write_atomic
    marker = f"{step:012d}/COMMIT"

    def write_atomic(path, data):
        if str(path).endswith(marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, data)

    storage.write_atomic = write_atomic


def read_losses(log: Path) -> dict:
    """{step: [loss, ...]} of a worker's JSON-lines loss log (a step logged again after a resume appears twice)."""
    import json
    out = {}
    for line in log.read_text().splitlines():
        d = json.loads(line)
        out.setdefault(d["step"], []).append(d["loss"])
    return out
