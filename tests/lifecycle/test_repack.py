"""Repack (format 2): the live chunks of mostly dead packs move into new packs, crash-safely."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from ckptstore import Packing, Store, Writing
from ckptstore.format.packs import ReadItem, read_chunks
from helpers import REPO, pack_files

SMALL = Packing(threshold=64 << 10, target_size=1 << 20)
ROOT = REPO
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
N = 60


def state_at(step):
    """60 small tensors; each step rewrites 3 in 4 of them (so older packs are mostly dead)."""
    out = {}
    for i in range(N):
        born = step if i % 4 else 0                                  # every 4th tensor never changes
        g = torch.Generator().manual_seed(1000 * born + i)
        out[f"t{i}"] = torch.randn(1500 + i, generator=g)
    return {"model": out, "step": step}


def disk_bytes(root):
    return sum(p.stat().st_size for p in pack_files(root))


def check(root, steps):
    with Store(root, create=False) as s:
        assert s.steps() == steps
        for step in steps:
            got = s.load(step)
            assert all(torch.equal(got["model"][k], v) for k, v in state_at(step)["model"].items()), step
        res = s.verify()
    assert all(v is None for v in res.values()), res


def make_store(root, steps=(1, 2, 3, 4, 5, 6), keep=(2, 4, 6)):
    with Store(root, writing=Writing(packing=SMALL)) as s:
        for step in steps:
            s.save(state_at(step), step)
        for step in steps:
            if step not in keep:
                s.delete_step(step)
    return list(keep)


def test_repack_reclaims_space_and_every_step_loads_bit_for_bit(tmp_path):
    kept = make_store(tmp_path)
    with Store(tmp_path) as s:
        s.gc(grace_seconds=0, repack=None)                            # plain gc: mostly dead packs stay
        before, packs_before = disk_bytes(tmp_path), len(pack_files(tmp_path))
        commit = s.catalog.read_commit(2)
        old_manifest = s.catalog.read_manifest(commit, 0)             # a reader that opened step 2 already
        t0 = time.perf_counter()
        r = s.gc(grace_seconds=3600)                                  # repack; old packs retired, not deleted
        took = time.perf_counter() - t0
        assert r.packs_repacked >= 1 and 2 in r.steps_rewritten and r.packs_deleted == 0
        assert s.commit_info(2).manifests[0][2] == 1                  # generation 1
        items = [ReadItem(c, memoryview(bytearray(c.nbytes))) for c in old_manifest.chunk_refs()]
        for f in read_chunks(s.storage, items, executor=s._parts.pool):    # the old ranges are all still there
            f.result()
        r2 = s.gc(grace_seconds=0)                                    # retired for >= 0 s: deleted now
        assert r2.packs_deleted == r.packs_repacked and r2.manifests_removed >= 1
    after = disk_bytes(tmp_path)
    print(f"repack: {packs_before} packs {before} B -> {len(pack_files(tmp_path))} packs {after} B "
          f"({r.bytes_repacked} live bytes rewritten) in {took:.2f} s")
    assert before - after == r2.bytes_freed - r.bytes_repacked > 0.2 * before   # old packs out, live bytes in
    check(tmp_path, kept)
    assert not list((tmp_path / "locks" / "retired").glob("*"))


def test_repack_threshold(tmp_path):
    make_store(tmp_path)
    with Store(tmp_path) as s:
        assert s.gc(grace_seconds=0, repack=0.0).packs_repacked == 0      # 0: only fully dead packs go
        before = disk_bytes(tmp_path)
        r = s.gc(grace_seconds=0, repack=1.0)
        assert r.packs_repacked >= 1 and r.packs_deleted == r.packs_repacked   # grace 0: old ones go at once
        assert disk_bytes(tmp_path) < before
    check(tmp_path, [2, 4, 6])


KILLED_GC = """
    import sys, time
    from ckptstore import Store
    from ckptstore.format.catalog import Catalog
    pause = float(sys.argv[2])
    for name in ("write_manifest", "write_commit"):                  # slowed down, so kills land mid-protocol
        real = getattr(Catalog, name)
        def slow(self, *a, _real=real, **kw):
            time.sleep(pause)
            out = _real(self, *a, **kw)
            time.sleep(pause)
            return out
        setattr(Catalog, name, slow)
    if sys.argv[3] == "cli":
        from ckptstore.cli import main
        print("start", flush=True)
        main(["gc", sys.argv[1], "--grace", "0"])
    else:
        with Store(sys.argv[1]) as s:
            print("start", flush=True)
            s.gc(grace_seconds=0)
"""


def test_sigkill_during_gc_and_repack_loses_nothing(tmp_path):
    template = tmp_path / "template"
    kept = make_store(template)
    rng = random.Random(7)
    for i in range(5):
        root = tmp_path / f"run{i}"
        shutil.copytree(template, root, symlinks=True)
        p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_GC), str(root), "0.05",
                              "cli" if i % 2 else "api"], env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            assert "start" in p.stdout.readline()
            time.sleep(rng.uniform(0.0, 0.7))
            os.kill(p.pid, signal.SIGKILL)
        finally:
            p.kill()
            p.wait()
        with Store(root, create=False) as s:
            gens = [s.commit_info(k).manifests[0][2] for k in kept]
        print(f"killed gc {i}: manifest generations {gens}, {len(pack_files(root))} packs")
        check(root, kept)                                             # every committed step, bit for bit
        with Store(root) as s:
            r = s.gc(grace_seconds=0, wait_seconds=10)                # the dead gc's lease is taken over
            assert not r.deferred
        check(root, kept)
        with Store(root) as s:                                        # and the work is finished
            assert s.gc(grace_seconds=0).packs_repacked == 0
        assert disk_bytes(root) < disk_bytes(template)


@pytest.mark.remote
def test_remote_gc_repacks(tmp_path, s3_bucket_url):
    target = s3_bucket_url
    with Store(tmp_path / "run", writing=Writing(packing=SMALL), remote=target.url,
               storage_options=target.storage_options) as s:
        for step in range(1, 5):
            s.save(state_at(step), step)
        s.wait_for_uploads()
    with Store(target.url, storage_options=target.storage_options, create=False) as s:
        for step in (1, 2, 3):
            s.delete_step(step)
    out = subprocess.run([sys.executable, "-m", "ckptstore.cli", "gc", target.url, "--grace", "0",
                          "--storage-options", json.dumps(target.storage_options)], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "repacked 1 pack(s) into 1" in out.stdout and "steps [4]" in out.stdout, out.stdout
    with Store(target.url, storage_options=target.storage_options, create=False) as s:
        assert s.commit_info(4).manifests[0][2] == 1
        got = s.load(4)
        assert all(torch.equal(got["model"][k], v) for k, v in state_at(4)["model"].items())
        assert s.verify() == {4: None}
