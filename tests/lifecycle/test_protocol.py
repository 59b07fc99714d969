"""The commit protocol, the latest pointer, retention and garbage collection, through the public API."""
import json
import os
import time

import pytest
import torch

from ckptstore import IncompatibleCheckpointError, Store, Retention
from helpers import chunks_of_key, data_files, flip_byte, step_dir


def deleted(report):
    return report.blobs_deleted + report.packs_deleted


def test_uncommitted_step_is_invisible_and_cleaned(tmp_path):
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(10)}, 1)
        s.save({"w": torch.ones(10) * 2}, 2)
        (step_dir(tmp_path, 2) / "COMMIT").unlink()         # as if killed before the commit marker
        assert s.steps() == [1] and s.latest_step() == 1
        assert s.resume({"w": None}) == 1
        s.save({"w": torch.ones(10) * 3}, 3)                 # the next save cleans the leftover step dir
        assert not step_dir(tmp_path, 2).exists()
        assert s.steps() == [1, 3]


def test_latest_pointer_names_newest_committed(tmp_path):
    with Store(tmp_path) as s:
        for step in (5, 7, 10):
            s.save({"v": step}, step)
        with pytest.raises(IncompatibleCheckpointError, match="step 8.*newest committed step is 10"):
            s.save({"v": 8}, 8)                               # a rewind is refused by default
        with pytest.raises(IncompatibleCheckpointError, match="step 10"):
            s.save({"v": "again"}, 10)                        # so is re-saving the newest step
        assert json.loads((tmp_path / "latest").read_text())["step"] == 10
        assert s.latest_step() == 10 and s.steps() == [5, 7, 10]
    with Store(tmp_path, on_rewind="truncate") as s:
        s.save({"v": "again"}, 10)                            # replacing a committed step
        assert s.load(10) == {"v": "again"}
        assert json.loads((tmp_path / "latest").read_text())["step"] == 10
        s.delete_step(10, force=True)                         # the newest step: only when forced
        assert json.loads((tmp_path / "latest").read_text())["step"] == 7


def test_no_temp_files_left_after_save(tmp_path):
    with Store(tmp_path) as s:
        s.save({"w": torch.randn(1 << 20)}, 1)
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert leftovers == []


def test_retention_keeps_last_and_milestones_and_frees_blobs(tmp_path):
    with Store(tmp_path, keep=Retention(last=2, every=10)) as s:
        for step in range(1, 13):
            s.save({"w": torch.full((1000,), float(step))}, step)
        assert s.steps() == [10, 11, 12]
        assert len(data_files(tmp_path)) == 3
        for step in s.steps():
            assert s.load(step)["w"][0].item() == step


def test_gc_sweeps_unreferenced_blobs_respecting_grace(tmp_path):
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(1000)}, 1)
        s.save({"w": torch.zeros(1000)}, 2)
        s.delete_step(1)
        r = s.gc(grace_seconds=3600)
        assert deleted(r) == 0                               # too young to sweep
        r = s.gc(grace_seconds=0, dry_run=True)
        assert deleted(r) == 1 and len(data_files(tmp_path)) == 2
        r = s.gc(grace_seconds=0)
        assert deleted(r) == 1 and r.bytes_freed == 4000
        assert len(data_files(tmp_path)) == 1
        assert torch.equal(s.load(2)["w"], torch.zeros(1000))


def test_gc_does_not_sweep_when_a_step_is_unreadable(tmp_path):
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(1000)}, 1)
        s.save({"w": torch.zeros(1000)}, 2)
        mf = step_dir(tmp_path, 1) / "manifest-rank00000.msgpack"
        mf.write_bytes(mf.read_bytes()[:10])
        s.delete_step(2, force=True)
        r = s.gc(grace_seconds=0)
        assert r.unreadable_steps == [1] and deleted(r) == 0
        r = s.gc(grace_seconds=0, force=True)
        assert deleted(r) == 2


def test_gc_removes_stale_temp_files(tmp_path):
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(1000)}, 1)
        blob = data_files(tmp_path)[0]
        tmp = blob.with_name(blob.name + ".tmp-1-deadbeef")
        tmp.write_bytes(b"partial")
        old = time.time() - 7200
        os.utime(tmp, (old, old))
        assert s.gc().temp_files_removed == 1 and not tmp.exists()


def test_verify_reports_each_step(tmp_path):
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(1000)}, 1)
        s.save({"w": torch.zeros(1000)}, 2)
        assert s.verify() == {1: None, 2: None}
        path, offset, _, _ = chunks_of_key(s, 2, ("w",))[0]
        flip_byte(path, offset)
        res = s.verify()
        assert res[1] is None and "does not match" in res[2]


def test_store_from_file_url_and_env_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with Store(f"file://{tmp_path}") as s:
        s.save({"x": 1}, 1)
        assert s.rank == 0 and s.world_size == 1
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rank 3"):
        Store(tmp_path)


def test_two_ranks_write_their_own_manifests(tmp_path):
    """Rank 1 writes its manifest; rank 0 commits once both exist (no process group: it polls)."""
    import threading
    results = {}

    def run(rank):
        with Store(tmp_path, rank=rank, world_size=2) as s:
            results[rank] = s.save({"w": torch.full((100,), float(rank))}, 5)

    t1 = threading.Thread(target=run, args=(1,))
    t1.start()
    run(0)
    t1.join()
    assert results[0].committed
    for rank in (0, 1):
        with Store(tmp_path, rank=rank, world_size=2) as s:
            assert s.steps() == [5]
            assert s.load(5)["w"][0].item() == rank
            state = {"w": None}
            assert s.resume(state) == 5 and state["w"][0].item() == rank
