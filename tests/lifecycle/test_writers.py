"""Who may write and who may delete (FORMAT.md, "Writers and deleters"): the writer lease, in-flight markers
that gc honours, re-saves that never cost a committed step, and gc that never follows a symlink.

Real processes where the finding needs them (a second job, a CLI gc beside a training process)."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ckptstore import CheckpointError, Packing, Store, Retention, Writing
from ckptstore.lifecycle import lease as lease_mod
from ckptstore.format.catalog import Catalog
from ckptstore.format.layout import GC_LEASE, INFLIGHT, WRITER_LEASE
from ckptstore.storage import LocalStorage
from helpers import REPO, blob_files, data_files

SMALL = Packing(threshold=64 << 10, target_size=1 << 20)
ROOT = REPO
ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def child(code: str, *args) -> subprocess.Popen:
    """A Python process running ``code`` (``sys.argv[1:]`` = ``args``), stdout piped line by line."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_line(p: subprocess.Popen, want: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if want in line:
            return line
        if not line and p.poll() is not None:
            raise AssertionError(f"child exited {p.returncode}: {p.stderr.read()[-2000:]}")
    raise AssertionError(f"no {want!r} from the child within {timeout} s")


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "ckptstore.cli", *map(str, args)], env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def all_valid(root):
    with Store(root, create=False) as s:
        res = s.verify()
    assert res and all(v is None for v in res.values()), res
    return sorted(res)


HOLDER = """
    import sys, time, torch
    from ckptstore import Store
    s = Store(sys.argv[1])
    s.save({"w": torch.ones(1000)}, 1)
    print("saved", flush=True)
    time.sleep(600)
"""


# -- one writer per store root ------------------------------------------------------------------------------
def test_second_writer_is_refused_naming_the_holder_then_takes_over_a_dead_one(tmp_path):
    p = child(HOLDER, tmp_path)
    try:
        wait_line(p, "saved")
        with Store(tmp_path) as s:
            with pytest.raises(CheckpointError, match=f"already has a writer: writer of host .* pid {p.pid}, started"):
                s.save({"w": torch.zeros(1000)}, 2)
            assert s.steps() == [1] and s.load(1)["w"].sum() == 1000     # readers are never refused
        os.kill(p.pid, signal.SIGKILL)                                    # a SIGKILLed job restarts:
        p.wait()
        with Store(tmp_path) as s:                                        # same host, pid gone: taken over
            s.save({"w": torch.zeros(1000)}, 2)
            assert s.steps() == [1, 2]
    finally:
        p.kill()
        p.wait()
    assert all_valid(tmp_path) == [1, 2]
    assert not (tmp_path / WRITER_LEASE).exists()                         # released by close()


def test_a_lease_not_renewed_is_taken_over(tmp_path, monkeypatch):
    """Another host's lease (no pid to check) is stale once not renewed for TTL seconds."""
    (tmp_path / "locks").mkdir()
    foreign = {"token": "f" * 32, "kind": "writer", "host": "elsewhere/boot/1", "hostname": "elsewhere",
               "pid": 1, "pid_start": "1", "started": time.time(), "renewed": time.time()}
    (tmp_path / WRITER_LEASE).write_text(json.dumps(foreign))
    with Store(tmp_path) as s:
        with pytest.raises(CheckpointError, match="host elsewhere pid 1"):
            s.save({"x": 1}, 1)
    monkeypatch.setattr(lease_mod, "TTL", 0.2)
    time.sleep(0.3)
    with Store(tmp_path) as s:
        s.save({"x": 1}, 1)
    assert all_valid(tmp_path) == [1]


def test_a_holder_that_lost_its_lease_does_not_commit(tmp_path):
    with Store(tmp_path) as s:
        s.save({"x": torch.ones(10)}, 1)
        st = LocalStorage(str(tmp_path))                                  # someone judged us stale and took over
        st.write_atomic(WRITER_LEASE, json.dumps({"token": "0" * 32, "kind": "writer", "host": "x", "pid": 1,
                                                  "renewed": time.time()}).encode())
        s._saver.writer_lease.renew()                                           # the heartbeat notices
        with pytest.raises(CheckpointError, match="lost locks/writer.json"):
            s.save({"x": torch.zeros(10)}, 2)
        assert s.steps() == [1]


KILLED_MID_SAVE = """
    import sys, time, torch
    from ckptstore import Store
    from ckptstore.format.catalog import Catalog
    real = Catalog.write_manifest
    def hang(self, *a, **kw):
        print("in flight", flush=True)
        time.sleep(600)
    with Store(sys.argv[1]) as s:
        s.save({"w": torch.ones(100_000)}, 1)
        Catalog.write_manifest = hang
        s.save({"w": torch.zeros(100_000)}, 2)
"""


def test_a_killed_writer_leaves_nothing_that_blocks_gc_or_the_next_job(tmp_path):
    p = child(KILLED_MID_SAVE, tmp_path)
    try:
        wait_line(p, "in flight")
        assert len(list((tmp_path / INFLIGHT).iterdir())) == 1 and (tmp_path / WRITER_LEASE).exists()
        with Store(tmp_path) as s:
            assert s.gc(grace_seconds=0, wait_seconds=0.5).deferred          # a live save: gc waits
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        with Store(tmp_path) as s:
            r = s.gc(grace_seconds=0, wait_seconds=0.5)                   # its marker is stale: removed
            assert not r.deferred and r.packs_deleted == 1                 # the killed save's pack
            s.save({"w": torch.full((100_000,), 3.0)}, 3)                 # its lease is taken over
    finally:
        p.kill()
        p.wait()
    assert list((tmp_path / INFLIGHT).iterdir()) == []
    assert all_valid(tmp_path) == [1, 3]


def test_ranks_of_one_job_share_the_root(tmp_path):
    """Only rank 0 holds the lease; the other ranks' saves are in flight beside it (DDP on one root)."""
    errors = []

    def run(rank):
        try:
            with Store(tmp_path, rank=rank, world_size=2, writing=Writing(packing=SMALL)) as s:
                for step in (1, 2):
                    s.save({"w": torch.full((5000,), float(rank + step))}, step)
        except Exception as e:        # pragma: no cover - reported below
            errors.append(e)
    t = threading.Thread(target=run, args=(1,))
    t.start()
    run(0)
    t.join()
    assert not errors
    assert all_valid(tmp_path) == [1, 2]


# -- gc beside writers --------------------------------------------------------------------------------------
GC_LOOP = """
    import subprocess, sys, time
    root = sys.argv[1]
    n = 0
    while True:
        r = subprocess.run([sys.executable, "-m", "ckptstore.cli", "gc", root, "--grace", "0", "--wait", "30"],
                           capture_output=True, text=True)
        n += 1
        print("gc", n, r.returncode, r.stdout.strip().replace("\\n", " "), r.stderr.strip()[-300:], flush=True)
"""


@pytest.mark.parametrize("blocking", [True, False])
def test_cli_gc_beside_saves_damages_nothing(tmp_path, blocking):
    root = tmp_path / "store"
    with Store(root, writing=Writing(packing=SMALL), keep=Retention(last=3)) as s:
        s.save({"w": torch.zeros(10)}, 0)
        p = child(GC_LOOP, root)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
        reader.start()
        try:
            g = torch.Generator().manual_seed(0)
            frozen = {f"f{i}": torch.randn(200 + i, generator=g) for i in range(20)}
            step = 0
            while len(lines) < 3 and step < 2000:                        # saves during >= 3 CLI gc runs
                step += 1
                state = {"frozen": frozen, "small": {f"s{i}": torch.randn(300, generator=g) for i in range(10)},
                         "big": torch.randn(40_000, generator=g), "step": step}
                s.save(state, step, blocking=blocking)
                if not blocking and step % 5 == 0:
                    assert not s.gc(grace_seconds=0, wait_seconds=30).deferred   # waits for the save in flight
            s.wait()
        finally:
            p.kill()
            p.wait()
        assert all(" 0 deleted" in line or " 3 gc deferred" in line for line in lines[:3]), lines
        last = s.load(step)
        assert torch.equal(last["big"], state["big"]) and torch.equal(last["frozen"]["f3"], frozen["f3"])
    assert all_valid(root)[-1] == step


def test_gc_never_deletes_an_old_orphan_a_save_in_flight_deduplicated(tmp_path, monkeypatch):
    """A killed save left an orphan blob (old mtime); a new save reuses it by name; gc (default grace) in
    another process runs between that dedup and the commit: it waits for the save instead of deleting."""
    big = torch.randn(300_000)
    with Store(tmp_path, writing=Writing(packing=Packing(threshold=0))) as s:              # every chunk a blob
        s.save({"w": big}, 1)
        s.delete_step(1, force=True)                                     # its blob: an orphan, as a killed
    orphan = blob_files(tmp_path)                                        # save leaves it
    assert len(orphan) == 1
    old = time.time() - 7200
    os.utime(orphan[0], (old, old))
    paused, go = threading.Event(), threading.Event()
    real = Catalog.write_manifest

    def slow_write_manifest(self, *a, **kw):
        paused.set()
        assert go.wait(60)
        return real(self, *a, **kw)
    monkeypatch.setattr(Catalog, "write_manifest", slow_write_manifest)
    with Store(tmp_path, writing=Writing(packing=Packing(threshold=0))) as s:
        result = []
        t = threading.Thread(target=lambda: result.append(s.save({"w": big}, 2)))
        t.start()
        assert paused.wait(60)                                           # deduplicated, not committed yet
        gc = subprocess.Popen([sys.executable, "-m", "ckptstore.cli", "gc", str(tmp_path)], env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (tmp_path / GC_LEASE).exists() and time.monotonic() < deadline:
            time.sleep(0.02)                                             # gc has started and is waiting
        time.sleep(0.3)
        assert gc.poll() is None and orphan[0].exists()
        go.set()
        t.join()
        out, err = gc.communicate(timeout=60)
        assert gc.returncode == 0, err
        assert result[0].bytes_written == 0                              # it did reuse the orphan
    assert orphan[0].exists() and all_valid(tmp_path) == [2]


def test_store_gc_waits_for_its_nonblocking_save(tmp_path):
    with Store(tmp_path, writing=Writing(packing=SMALL)) as s:
        for step in range(1, 6):
            h = s.save({"w": torch.randn(50_000), "s": torch.randn(100)}, step, blocking=False)
            r = s.gc(grace_seconds=0)
            assert not r.deferred and h.done()
            s.delete_step(step - 1) if step > 1 else None
        s.wait()
    assert all_valid(tmp_path) == [5]


def test_remote_gc_honours_an_upload_in_flight(remote_url):
    """``ckptstore gc s3://...`` beside an uploader: the copy's in-flight marker keeps gc from sweeping."""
    from ckptstore.storage import open_storage
    remote = open_storage(remote_url.url, remote_url.storage_options)
    op = lease_mod.WriterOp(remote, "copy", step=7).begin()             # what StepCopier.copy_step does
    remote.write_new("objects/ab/" + "ab" * 32, b"orphan the copy is about to reference")
    try:
        with Store(remote_url.url, storage_options=remote_url.storage_options, create=False) as s:
            r = s.gc(grace_seconds=0, wait_seconds=0.3)
            assert r.deferred and "copy" in r.deferred[0] and r.blobs_deleted == 0
            assert remote.exists("objects/ab/" + "ab" * 32)
    finally:
        op.end()
    with Store(remote_url.url, storage_options=remote_url.storage_options, create=False) as s:
        r = s.gc(grace_seconds=0, wait_seconds=5)
        assert not r.deferred and r.blobs_deleted == 1
    assert remote.listdir(INFLIGHT) == []


def test_second_uploader_into_one_remote_is_refused(tmp_path, memory_url):
    from ckptstore import UploadError
    opts = dict(remote=memory_url.url, storage_options=memory_url.storage_options)
    with Store(tmp_path / "a", **opts) as a:
        a.save({"x": torch.ones(3)}, 1)
        a.wait_for_uploads()
        b = Store(tmp_path / "b", **opts)                                 # another job, same remote prefix
        with pytest.raises(UploadError, match=f"already has a writer: writer of host .* pid {os.getpid()}"):
            b.save({"x": torch.zeros(3)}, 2)                              # raised here, or by the wait
            b.wait_for_uploads(timeout=30)
        try:
            b.close()
        except UploadError:
            pass
        a.save({"x": torch.ones(3) * 2}, 3)                               # the first one goes on
        a.wait_for_uploads()
    with Store(memory_url.url, storage_options=memory_url.storage_options, create=False) as r:
        assert r.steps() == [1, 3] and r.verify() == {1: None, 3: None}


# -- a failed save never costs a committed step -------------------------------------------------------------
class Exploding:
    def state_dict(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def load_state_dict(self, sd):
        pass


def test_failed_resave_keeps_the_old_step(tmp_path, monkeypatch):
    old = {"w": torch.randn(100_000), "small": torch.randn(50)}
    with Store(tmp_path, writing=Writing(packing=SMALL), on_rewind="truncate") as s:
        s.save(old, 5)
        with pytest.raises(OSError):
            s.save({**old, "opt": Exploding()}, 5)                       # fails before anything is written

        def full(self, *a, **kw):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(Catalog, "write_manifest", full)             # fails after the blobs are written
        with pytest.raises(OSError, match="No space"):
            s.save({"w": torch.randn(100_000), "small": torch.randn(50)}, 5)
        monkeypatch.undo()
        assert s.steps() == [5] and s.latest_step() == 5
        s.gc(grace_seconds=0)                                            # the failed save's leftovers go
        got = s.load(5)
        assert torch.equal(got["w"], old["w"]) and torch.equal(got["small"], old["small"])
        assert len(blob_files(tmp_path)) == 1
        new = {"w": torch.randn(100_000), "small": torch.randn(50)}
        s.save(new, 5)                                                   # a re-save that works replaces it
        assert torch.equal(s.load(5)["w"], new["w"]) and s.commit_info(5).manifests[0][2] == 1
        r = s.gc(grace_seconds=0)
        assert r.manifests_removed == 1 and r.blobs_deleted == 1
    assert all_valid(tmp_path) == [5]


# -- gc never follows a symlink ------------------------------------------------------------------------------
def test_gc_does_not_follow_symlinks(tmp_path):
    a, b, outside = tmp_path / "a", tmp_path / "b", tmp_path / "outside"
    with Store(a, writing=Writing(packing=Packing(threshold=0))) as s:
        s.save({"w": torch.randn(1000)}, 1)
    b.mkdir()
    (b / "objects").symlink_to(a / "objects")                           # two stores sharing objects/
    with Store(b, writing=Writing(packing=Packing(threshold=0))) as s:
        s.save({"v": torch.randn(1000)}, 1)
        r = s.gc(grace_seconds=0)
        assert r.blobs_deleted == 0
    (outside / "cd").mkdir(parents=True)
    victim = outside / "cd" / ("cd" * 32)                                # named like a blob, outside the root
    victim.write_bytes(b"not yours")
    c = tmp_path / "c"
    (c / "packs").mkdir(parents=True)
    (c / "packs" / "cd").symlink_to(outside / "cd")
    (c / "objects").mkdir()
    (c / "objects" / "cd").symlink_to(outside / "cd")
    with Store(c) as s:
        s.save({"x": 1}, 1)
        s.gc(grace_seconds=0)
    assert victim.exists()
    assert all_valid(a) == [1] and all_valid(b) == [1]
