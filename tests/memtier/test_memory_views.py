"""What one process sees of a store with a memory tier (issue 29, item 6): ``steps``, ``step_tiers``,
``latest_step``, ``commit_info``, ``find``, ``load`` and ``restore`` include the steps only the memory root
holds, bit for bit; a damaged memory copy is never loaded: the disk's copy or an older step is, logged; and
``ckptstore ls --memory`` marks where each step is. One process (``replicas=0``), the memory root on
/dev/shm (tmpfs) when there is one; the multi-node memory tier is tests/memtier/test_memory_tier.py's.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from ckptstore import CorruptCheckpointError, Memory, Packing, Store, Writing
from helpers import bits_equal, chunks_of_key, cli, flip_byte, two_at_a_time

N = 64 * 1024                                       # 256 KiB of float32 per step: a blob of its own
STEPS, DISK_EVERY, KEEP = 7, 3, 3                   # memory: 5, 6, 7; disk: 3, 6


@pytest.fixture
def mem_dir(tmp_path):
    """A fresh memory root on tmpfs (/dev/shm), removed afterwards; else under tmp_path."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = Path(tempfile.mkdtemp(prefix="ckptstore-mem-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def state_at(step: int):
    g = torch.Generator().manual_seed(step)
    return {"x": torch.randn(N, generator=g), "small": torch.randn(7, generator=g), "step": step}


def fresh():
    return {"x": torch.zeros(N), "small": torch.zeros(7), "step": -1}


def open_store(tmp_path, mem_dir) -> Store:
    return Store(tmp_path / "disk", writing=Writing(packing=Packing(threshold=0)),
                 memory=Memory(str(mem_dir), every=1, disk_every=DISK_EVERY, keep=KEEP, replicas=0))


def save_run(store: Store) -> None:
    for step in range(1, STEPS + 1):
        store.save(state_at(step), step, metrics={"loss": 1.0 / step}, names=[f"ckpt-{step}"])
    store.wait_for_uploads()                        # promotions to disk done


def damage(mem_dir: Path, step: int) -> None:
    """Flip a byte of every chunk of ``x`` in the memory root's copy of ``step``."""
    with Store(mem_dir, read_only=True, rank=0, world_size=1) as view:
        files = chunks_of_key(view, step, ("x",))
    assert files
    for f, off, _, _ in files:
        flip_byte(f, off)


def test_steps_load_restore_see_memory_steps_bit_for_bit(tmp_path, mem_dir):
    with open_store(tmp_path, mem_dir) as store:
        save_run(store)
        with Store(mem_dir, read_only=True, rank=0, world_size=1) as view:
            in_memory = view.steps()
        with Store(tmp_path / "disk", read_only=True) as disk:
            on_disk = disk.steps()
        assert on_disk == [3, 6] and {5, 6, 7} <= set(in_memory), (on_disk, in_memory)
        assert store.steps() == sorted(set(in_memory) | {3, 6})
        tiers = store.step_tiers()
        assert list(tiers) == store.steps()
        assert tiers[7] == ["memory"] and tiers[5] == ["memory"] and tiers[6] == ["memory", "local"], tiers
        assert "local" in tiers[3]
        assert store.latest_step() == 7
        assert store.commit_info(7).step == 7 and store.commit_info(7).metrics == {"loss": 1.0 / 7}
        assert store.find("ckpt-7") == 7 and store.find("ckpt-5") == 5 and store.find("ckpt-3") == 3
        assert store.find("ckpt-4") is None                 # dropped from memory, never on disk

        for step in (7, 5, 6, 3):                            # memory only, memory only, both, disk
            assert bits_equal(store.load(step), state_at(step)), step
        assert bits_equal(store.load(), state_at(7))
        with pytest.raises(FileNotFoundError, match="step 4"):
            store.load(4)

        state = fresh()
        assert store.restore(state) == 7 and store.resumed_from["tier"] == "memory"
        assert bits_equal(state, state_at(7))
        for step, tier in ((5, "memory"), (6, "memory"), (3, "memory" if 3 in in_memory else "local")):
            state = fresh()
            assert store.restore(state, step) == step and store.resumed_from["tier"] == tier, step
            assert bits_equal(state, state_at(step)), step
        state = fresh()
        assert store.restore(state, 5, keys=["x"]) == 5
        assert torch.equal(state["x"], state_at(5)["x"]) and state["step"] == -1
        # what resolve names, restore loads (a trainer's resume: resolve, then restore in stages)
        assert store.resolve() == (7, "memory")
        state = fresh()
        assert store.restore(state, 7, keys=["x"]) == 7 and store.restore(state, 7, keys=["small", "step"]) == 7
        assert bits_equal(state, state_at(7))


def test_damaged_memory_copy_is_never_loaded(tmp_path, mem_dir, caplog):
    caplog.set_level(logging.WARNING, logger="ckptstore")
    with open_store(tmp_path, mem_dir) as store:
        save_run(store)
        damage(mem_dir, 6)                           # the disk holds a good copy of 6
        damage(mem_dir, 7)                           # only memory holds 7

        assert bits_equal(store.load(6), state_at(6))                      # the disk's copy
        assert "memory step 6" in caplog.text
        with pytest.raises(CorruptCheckpointError) as e:
            store.load(7)                             # never substituted, never loaded as it is
        assert e.value.step == 7
        caplog.clear()
        assert bits_equal(store.load(), state_at(6))                       # newest valid: disk's 6
        assert "step 7 (memory) is corrupt" in caplog.text and "step 6 (memory) is corrupt" in caplog.text

        state = fresh()
        assert store.restore(state, 6) == 6 and store.resumed_from["tier"] == "local"
        assert bits_equal(state, state_at(6))
        state = fresh()
        with pytest.raises(CorruptCheckpointError) as e:
            store.restore(state, 7)
        assert e.value.step == 7
        state = fresh()
        caplog.clear()
        assert store.restore(state) == 6 and store.resumed_from["tier"] == "local"
        assert bits_equal(state, state_at(6))
        assert "memory step 7 does not load" in caplog.text


def test_cli_ls_marks_memory_steps(tmp_path, mem_dir):
    with open_store(tmp_path, mem_dir) as store:
        save_run(store)
        want = store.step_tiers()
    disk = str(tmp_path / "disk")
    as_json, table, plain = two_at_a_time(lambda: cli("ls", disk, "--memory", str(mem_dir), "--json"),  # reads,
                                          lambda: cli("ls", disk, "--memory", str(mem_dir)),   # two at a time
                                          lambda: cli("ls", disk, "--json"))
    rows = json.loads(as_json.stdout)
    committed = [r for r in rows if r["committed"]]
    assert {r["step"]: r["tiers"] for r in committed} == want
    by = {r["step"]: r for r in committed}
    assert by[7]["latest"] and by[7]["names"] == ["ckpt-7"] and by[7]["metrics"] == {"loss": 1.0 / 7}
    assert by[7]["bytes_total"] > N * 4
    out = table.stdout
    assert "where" in out and "memory+local" in out and f"memory {mem_dir}" in out
    lines = {ln.split()[1]: ln for ln in out.splitlines() if ln.split()[1:2] and ln.split()[1].isdigit()}
    assert "memory+local" not in lines["7"] and "memory" in lines["7"], out
    # without --memory, as before: the disk's steps only, no where column
    plain = json.loads(plain.stdout)
    assert [r["step"] for r in plain if r["committed"]] == [3, 6] and all("tiers" not in r for r in plain)


def _bytes_under(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())


def test_best_step_verify_and_delete_step_cover_memory_steps(tmp_path, mem_dir):
    """``best_step`` judges the memory root's steps too (their markers carry the metrics); ``verify`` checks
    the memory copies (a damaged one is reported as ``memory: ...`` even where the disk copy is whole);
    ``delete_step`` removes the memory copy with the disk's and frees its chunks, so nothing reads a step the
    trainer deleted (before: Lightning's top-k rotation deleted the disk copy and the memory copy stayed in
    ``steps()``, ``load`` and resume). The newest step of any tier and the disk's newest (the newest durable
    one) are refused, deleting nothing; a restarted store sees the same."""
    from ckptstore import CheckpointError, Memory, Retention
    mem = Memory(str(mem_dir), every=1, disk_every=DISK_EVERY, keep=KEEP, replicas=0)
    with Store(tmp_path / "disk", writing=Writing(packing=Packing(threshold=0)), keep=Retention(),
               memory=mem) as store:
        save_run(store)
        tiers = store.step_tiers()
        assert tiers[5] == ["memory"] and tiers[6] == ["memory", "local"] and tiers[7] == ["memory"], tiers
        assert "local" in tiers[3], tiers
        assert store.best_step() == 7                 # lowest loss, in memory only (the disk's best is 6)
        assert store.verify() == {3: None, 5: None, 6: None, 7: None}
        damage(mem_dir, 6)
        got = store.verify()
        assert got[6].startswith("memory:") and "step=6" in got[6], got
        assert got[3] is None and got[5] is None and got[7] is None
        assert store.verify(6)[6].startswith("memory:") and store.verify(5) == {5: None}

        with pytest.raises(CheckpointError, match="newest"):
            store.delete_step(7)
        with pytest.raises(CheckpointError, match="newest"):
            store.delete_step(6)                     # the disk's newest: kept in both tiers
        assert store.step_tiers()[6] == ["memory", "local"]
        before = _bytes_under(mem_dir)
        store.delete_step(5)
        assert _bytes_under(mem_dir) <= before - N * 4      # its chunk of x is swept
        store.delete_step(3)
        assert store.steps() == [6, 7] and store.step_tiers() == {6: ["memory", "local"], 7: ["memory"]}
        for s in (3, 5):
            with pytest.raises(FileNotFoundError):
                store.load(s)
        assert store.verify(5) != {5: None}
    with open_store(tmp_path, mem_dir) as store:      # a restart sees the same steps
        assert store.steps() == [6, 7]
