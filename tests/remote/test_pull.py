"""Ranged pulls: a step that reads a small part of many packs is pulled by range into new local packs.

The run: 8 layers, each a small weight ``w`` (64 KiB) and, while the layer trains, an optimizer moment ``m``
(896 KiB) saved beside it; a layer that is frozen keeps its weight and drops its moment (as an optimizer does
for parameters without gradients). With ``Packing(target_size=960 KiB)`` every save packs each changed layer as
``[w][m]``, so once layers freeze, the newest step reads 64 KiB of each of those 960 KiB packs.
"""
import shutil
import subprocess
import sys

import fsspec
import pytest
import torch

import ckptstore.remote.transfer as transfer
from ckptstore import CorruptCheckpointError, Packing, Retention, Store, Remote, Writing
from ckptstore.storage import open_storage
from helpers import pack_files

KiB = 1024
W, M = 64 * KiB // 4, 896 * KiB // 4          # elements (fp32)
PACKING = Packing(threshold=960 * KiB, target_size=960 * KiB)
LAYERS = 8
LATE = (6, 7)                                   # these layers train until step 6, the others until step 1
LAST = 7


def trains(layer, step):
    return step <= (6 if layer in LATE else 1)


def state_at(step):
    layers = []
    for i in range(LAYERS):
        last = step if trains(i, step) else (6 if i in LATE else 1)     # the step its weight last changed
        g = torch.Generator().manual_seed(1000 * i + last)
        layer = {"w": torch.randn(W, generator=g)}
        if trains(i, step):
            layer["m"] = torch.randn(M, generator=g)
        layers.append(layer)
    return {"layers": layers, "head": torch.full((4 * KiB,), float(step)), "progress": {"step": step}}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.remote)])
def target(request, tmp_path):
    """(url, storage_options) of the remote: a local directory, or a bucket of the loopback S3 server."""
    if request.param == "local":
        return str(tmp_path / "remote"), {}
    t = request.getfixturevalue("s3_bucket_url")
    return t.url, t.storage_options


def run(root, target, steps=range(1, LAST + 1)):
    url, opts = target
    # the remote keeps the newest step and every 3rd: 3, 6, 7
    with Store(root, remote=url, storage_options=opts, writing=Writing(packing=PACKING),
               keep=Retention(last=1, every=3)) as s:
        for step in steps:
            s.save(state_at(step), step)
        s.wait_for_uploads()
    with Store(url, storage_options=opts, create=False) as r:
        assert r.steps() == [3, 6, 7]


def remote_pack_sizes(target, step):
    """pack id -> size of the packs ``step`` of the remote references."""
    url, opts = target
    with Store(url, storage_options=opts, create=False) as r:
        commit = r.catalog.read_commit(step)
        packs = set()
        for rank in commit.manifests:
            packs |= r.catalog.read_manifest(commit, rank).pack_ids()
        return {p: r.storage.size(f"packs/{p[:2]}/{p}.pack") for p in packs}


def packs_on_disk(root):
    return {p.name[:-len(".pack")]: p.stat().st_size for p in pack_files(root)}


def resume(root, target, upload=True):
    url, opts = target
    state = {"layers": None, "head": None, "progress": None}
    s = Store(root, remote=Remote(url, upload=upload), storage_options=opts, writing=Writing(packing=PACKING))
    return s, state, s.resume(state)


def test_ranged_resume_fetches_only_the_step_and_is_bit_for_bit(tmp_path, target):
    root = tmp_path / "run"
    run(root, target)
    referenced = remote_pack_sizes(target, LAST)
    shutil.rmtree(root)                                           # the node was wiped
    s, state, step = resume(root, target)
    with s:
        assert step == LAST and s.resumed_from["tier"] == "remote"
        assert same(state, state_at(LAST))
        stats = s.pulled[-1]
        assert s.verify() == {LAST: None}
    # the step holds 8 weights of 64 KiB and a 16 KiB head; its packs hold 8 x 960 KiB besides
    step_bytes = LAYERS * W * 4 + 16 * KiB
    on_disk = sum(packs_on_disk(root).values())
    assert on_disk == step_bytes, (on_disk, step_bytes)
    assert sum(referenced.values()) > 7 * step_bytes              # what whole packs would have cost
    assert stats.packs_ranged == LAYERS and stats.ranges_fetched == LAYERS
    assert stats.bytes_fetched == step_bytes                      # measured at the source: ranges, no holes
    assert stats.packs_whole == 1                                 # the head's own pack, read as a whole
    # the pack the step reads entirely (the head's) kept its id; the others were replaced by new packs
    whole = [p for p, n in referenced.items() if n == 16 * KiB]
    assert len(whole) == 1 and whole[0] in packs_on_disk(root)
    assert not (set(referenced) - set(whole)) & set(packs_on_disk(root))


def test_pack_read_mostly_is_copied_whole_and_keeps_its_id(tmp_path, target, monkeypatch):
    root = tmp_path / "run"
    run(root, target)
    referenced = remote_pack_sizes(target, LAST)
    shutil.rmtree(root)
    monkeypatch.setattr(transfer, "RANGED_PULL_THRESHOLD", 64 / 960 - 0.001)   # 64 of 960 KiB is "mostly"
    s, state, step = resume(root, target)
    with s:
        assert step == LAST and same(state, state_at(LAST))
        assert s.pulled[-1].packs_ranged == 0 and s.pulled[-1].packs_whole == len(referenced)
        assert s.verify() == {LAST: None}
    assert packs_on_disk(root) == referenced                       # same ids, same bytes
    url, opts = target
    with Store(url, storage_options=opts, create=False) as r:  # marker copied verbatim
        assert (root / "steps" / f"{LAST:012d}" / "COMMIT").read_bytes() == r.catalog.read_commit_bytes(LAST)[0]


def test_flipped_byte_in_a_fetched_range_fails_the_pull_and_resume_falls_back(tmp_path, target):
    root = tmp_path / "run"
    run(root, target)
    shutil.rmtree(root)
    url, opts = target
    # layer 6's weight of step 6: read by range by steps 6 and 7 (in step 6's pack [w][m]); step 3 has its own
    with Store(url, storage_options=opts, create=False) as r:
        manifest = r.catalog.read_manifest(r.catalog.read_commit(LAST), 0)
        ref = next(e.chunks[0] for n, e in manifest.arrays() if n.path == ("layers", 6, "w"))
    assert ref.pack is not None and ref.offset == 0
    fs, base = fsspec.core.url_to_fs(url, **opts)
    path = f"{base}/packs/{ref.pack[:2]}/{ref.pack}.pack"
    data = bytearray(fs.cat_file(path))
    data[ref.offset + 1000] ^= 0x40
    fs.pipe_file(path, bytes(data))
    fs.invalidate_cache()
    with Store(root, remote=Remote(url, upload=False), storage_options=opts, writing=Writing(packing=PACKING)) as s:
        with pytest.raises(CorruptCheckpointError, match=ref.blob_id) as e:
            s.pull(LAST)
        assert e.value.step == LAST
        assert s.steps() == []                                    # nothing half-pulled is visible
        state = {"layers": None, "head": None, "progress": None}
        assert s.resume(state) == 3                               # 7 and 6 read the damaged range
        assert s.steps() == [3] and same(state, state_at(3))


def test_save_and_upload_after_a_ranged_pull_dedup_against_the_pulled_chunks(tmp_path, target):
    root = tmp_path / "run"
    run(root, target)
    shutil.rmtree(root)
    s, state, step = resume(root, target)
    with s:
        assert step == LAST and s.pulled[-1].packs_ranged == LAYERS
        before = sum(packs_on_disk(root).values())
        s.save(state_at(LAST + 1), LAST + 1)
        assert sum(packs_on_disk(root).values()) - before == 16 * KiB     # only the head is new
        s.wait_for_uploads()
        assert [u.step for u in s._parts.uploader.uploaded] == [LAST + 1]      # the pulled step is not re-sent
        # the new head pack, and the new local pack of the pulled weights (the remote has them in other packs)
        assert s._parts.uploader.uploaded[0].bytes_copied == 16 * KiB + LAYERS * W * 4
        assert s.verify() == {LAST: None, LAST + 1: None}
    url, opts = target
    with Store(url, storage_options=opts, create=False) as r:
        assert r.verify()[LAST + 1] is None
    shutil.rmtree(root)
    s, state, step = resume(root, target)
    with s:
        assert step == LAST + 1 and same(state, state_at(LAST + 1))


def test_repair_of_a_damaged_local_step_pulls_by_range(tmp_path, target):
    root = tmp_path / "run"
    run(root, target)
    shutil.rmtree(root)
    s, state, step = resume(root, target, upload=False)
    s.close()
    gens_before = sorted(p.name for p in (root / "steps" / f"{LAST:012d}").iterdir())
    for p in pack_files(root):                                   # every local pack damaged
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x01
        p.write_bytes(bytes(data))
    s, state, step = resume(root, target, upload=False)
    with s:
        assert step == LAST and s.resumed_from["tier"] == "remote" and same(state, state_at(LAST))
        assert s.pulled[-1].packs_ranged == LAYERS
        assert s.verify() == {LAST: None}
        names = sorted(p.name for p in (root / "steps" / f"{LAST:012d}").iterdir())
        assert names != gens_before and "COMMIT" in names          # a new generation, not overwritten
        s.gc(grace_seconds=0)                                      # the replaced manifests go
        assert s.verify() == {LAST: None}
    s, state, step = resume(root, target, upload=False)
    with s:
        assert step == LAST and s.resumed_from["tier"] == "local" and same(state, state_at(LAST))


def test_cli_pull_is_ranged_and_verifies(tmp_path):
    target = (str(tmp_path / "remote"), {})
    run(tmp_path / "run", target)
    dest = tmp_path / "dest"
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "pull", target[0], "--to", str(dest)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"pulled step {LAST}" in p.stdout and f"({LAYERS} pack(s) by {LAYERS} range(s))" in p.stdout
    assert f"step {LAST}: verified" in p.stdout
    assert sum(packs_on_disk(dest).values()) == LAYERS * W * 4 + 16 * KiB
    with Store(dest) as s:
        assert same(s.load(LAST), state_at(LAST))


KILL_AT_COMMIT = """
import os, signal, sys
from ckptstore.storage.local import LocalStorage
real = LocalStorage.write_atomic
def write_atomic(self, path, data):
    if path.endswith("COMMIT"):
        os.kill(os.getpid(), signal.SIGKILL)          # packs and manifests are in place, the marker is not
    return real(self, path, data)
LocalStorage.write_atomic = write_atomic
from ckptstore.cli import main
sys.argv[0] = "ckptstore"
main()
"""


def test_sigkill_before_the_commit_of_a_ranged_pull_leaves_nothing_committed(tmp_path):
    target = (str(tmp_path / "remote"), {})
    run(tmp_path / "run", target)
    dest = tmp_path / "dest"
    p = subprocess.run([sys.executable, "-c", KILL_AT_COMMIT, "pull", target[0], "--to", str(dest)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -9
    leftovers = packs_on_disk(dest)
    assert leftovers and not (dest / "steps" / f"{LAST:012d}" / "COMMIT").exists()
    with Store(dest) as s:
        assert s.steps() == []
    p = subprocess.run([sys.executable, "-m", "ckptstore.cli", "pull", target[0], "--to", str(dest)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"step {LAST}: verified" in p.stdout, p.stdout + p.stderr
    assert packs_on_disk(dest) == leftovers                        # the same new packs, written once
    with Store(dest) as s:
        s.gc(grace_seconds=0)
        assert s.verify() == {LAST: None} and same(s.load(LAST), state_at(LAST))
