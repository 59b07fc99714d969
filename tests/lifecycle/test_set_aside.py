"""Issue 26 item 5: after a resume continues from an older step S, no root keeps a committed step newer than S
(it is *set aside*, FORMAT.md "Steps set aside after a resume"), so the run saves on past those step numbers
instead of dying on ``on_rewind="error"`` at every relaunch.

The single-process tests damage the newest step (locally, and on the remote too); the 2-rank tests run
tests/memtier_worker.py (a DDP loop over gloo on 127.0.0.1, launched like torchrun) with node-local disk roots
and a loopback S3 remote: node 1 is lost after a step that node 0's disk holds and the remote does not, and the
job is relaunched twice.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from ckptstore import Packing, Remote, Store, Writing
from ckptstore.lifecycle import gc as gc_module
from ckptstore.util.errors import CheckpointError
from ckptstore.format.layout import LATEST
from ckptstore.format.pointers import decode_pointer
from ckptstore.storage import open_storage
from ckptstore.remote.upload import truncate_steps

from dist import Job  # noqa: E402
from helpers import TESTS, blobs_of_key  # noqa: E402
from test_memory_tier import read_losses, tmpfs_dirs, wipe_mount  # noqa: E402,F401  (tmpfs_dirs: a fixture)
from training import check_against_reference  # noqa: E402

SMALL = Packing(threshold=1 << 16, target_size=1 << 20)
WORKER = TESTS / "memtier_worker.py"


def state_at(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(20_000, generator=g), "small": torch.randn(100, generator=g), "step": step}


def fresh():
    return {"w": None, "small": None, "step": None}


def ls_json(url: str, *extra: str) -> List[dict]:
    """``ckptstore ls URL --json ...`` (the command, run in this process)."""
    from click.testing import CliRunner
    from ckptstore.cli import main
    r = CliRunner().invoke(main, ["ls", url, "--json", *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def asides(root: Path) -> List[str]:
    return sorted(p.name for p in (root / "steps").iterdir() if ".aside-" in p.name)


# -- one process -----------------------------------------------------------------------------------------------------
def test_resume_past_a_damaged_newest_step_sets_it_aside_and_saves_on(tmp_path, monkeypatch):
    root = tmp_path / "run"
    with Store(root, writing=Writing(packing=SMALL)) as s:
        for step in (1, 2, 3):
            s.save(state_at(step), step)
        lost = blobs_of_key(s, 3, ("w",))
    for f in lost:
        f.unlink()                                        # step 3's own chunk is gone (a disk error)
    with Store(root, writing=Writing(packing=SMALL)) as s:
        state = fresh()
        assert s.resume(state) == 2 and torch.equal(state["w"], state_at(2)["w"])
        s.save(state_at(103), 3)                          # was: "re-saving step 3: the newest committed step is 3"
        s.save(state_at(4), 4)
        assert s.steps() == [1, 2, 3, 4]
    assert json.loads((root / "latest").read_text())["step"] == 4
    (aside,) = asides(root)
    assert aside.startswith(f"{3:012d}.aside-")
    rows = ls_json(str(root))
    assert [(r["step"], "set_aside" in r) for r in rows] == [(1, False), (2, False), (3, False), (3, True),
                                                             (4, False)]
    assert rows[3]["set_aside"] == aside and rows[3]["resumed"] == 2 and not rows[3]["committed"]

    # gc keeps a step set aside (and what it references) for ASIDE_SECONDS, whatever its own grace period
    old_packs = {p.name for p in (root / "steps" / aside).iterdir()}
    assert {"ASIDE", "COMMIT", "manifest-rank00000.msgpack"} <= old_packs
    with Store(root) as s:
        packs_before = sorted((root / "packs").rglob("*.pack"))
        r = s.gc(grace_seconds=0)
        assert r.asides_removed == [] and asides(root) == [aside]
        assert sorted((root / "packs").rglob("*.pack")) == packs_before      # the old step 3's pack is kept
        monkeypatch.setattr(gc_module, "ASIDE_SECONDS", 0.0)
        r = s.gc(grace_seconds=0)
        assert r.asides_removed == [aside] and asides(root) == []
        assert r.packs_deleted >= 1                       # the old step 3's small chunks went with it
        state = fresh()
        assert s.resume(state) == 4 and torch.equal(state["w"], state_at(4)["w"])
        assert s.verify() == {1: None, 2: None, 3: None, 4: None}
        assert torch.equal(s.load(3)["w"], state_at(103)["w"])


def test_only_the_job_holding_the_writer_lease_sets_steps_aside(tmp_path):
    """A second store resuming the root while a live job writes it (its lease held) is refused, naming the
    holder, instead of moving that job's steps aside; once the writer is gone it goes on."""
    root = tmp_path / "run"
    writer = Store(root, writing=Writing(packing=SMALL))
    try:
        for step in (1, 2, 3):
            writer.save(state_at(step), step)
        for f in blobs_of_key(writer, 3, ("w",)):
            f.unlink()
        with Store(root, writing=Writing(packing=SMALL)) as other:
            with pytest.raises(CheckpointError, match="already has a writer"):
                other.resume(fresh())
            assert other.steps() == [1, 2, 3] and asides(root) == []
    finally:
        writer.close()
    with Store(root, writing=Writing(packing=SMALL)) as s:
        assert s.resume(fresh()) == 2 and s.steps() == [1, 2] and len(asides(root)) == 1


def uploaded_steps_1_to_4(root: Path, target) -> dict:
    """Steps 1-4 saved in ``root`` and uploaded to ``target``; returns the ``Store`` arguments used."""
    kw = dict(writing=Writing(packing=SMALL), remote=Remote(target.url), storage_options=target.storage_options)
    with Store(root, **kw) as s:
        for step in (1, 2, 3, 4):
            s.save(state_at(step), step)
        s.wait_for_uploads(timeout=120)
    return kw


def test_remote_steps_that_failed_are_set_aside_and_the_pointer_moves_back(tmp_path, s3_bucket_url):
    target = s3_bucket_url
    root = tmp_path / "run"
    kw = uploaded_steps_1_to_4(root, target)
    with Store(root, **kw) as s:
        lost = {f.relative_to(root).as_posix() for step in (3, 4) for f in blobs_of_key(s, step, ("w",))}
    remote = open_storage(target.url, target.storage_options)
    for path in lost:                                     # steps 3 and 4 are damaged everywhere
        (root / path).unlink()
        remote.delete(path)
    assert decode_pointer(remote.read_bytes(LATEST)) == 4
    with Store(root, **kw) as s:
        state = fresh()
        assert s.resume(state) == 2
        s.wait_for_uploads(timeout=120)                   # the uploader set aside the remote's 3 and 4 ...
        assert remote_steps(target.url, target.storage_options) == [1, 2]
        assert decode_pointer(remote.read_bytes(LATEST)) == 2   # ... and moved its pointer back
        s.save(state_at(3), 3)                            # was: "rewinding to step 3: the newest committed ... 4"
        s.wait_for_uploads(timeout=120)
        assert decode_pointer(remote.read_bytes(LATEST)) == 3
    with Store(target.url, storage_options=target.storage_options, create=False) as r:
        assert r.steps() == [1, 2, 3] and r.verify() == {1: None, 2: None, 3: None}
    rows = ls_json(str(root), "--remote", target.url, *_so_args(target))
    aside_rows = [(r["step"], r["location"]) for r in rows if "set_aside" in r]
    assert sorted(aside_rows) == [(3, "local"), (3, "remote"), (4, "local"), (4, "remote")], rows
    shutil.rmtree(root)                                   # the remote alone: the new timeline's step 3
    with Store(root, **kw) as s:
        state = fresh()
        assert s.resume(state) == 3 and s.resumed_from["tier"] == "remote"
        assert torch.equal(state["w"], state_at(3)["w"])


def test_a_step_set_aside_is_not_uploaded_by_the_derived_backlog(tmp_path, s3_bucket_url):
    """Step 4 is committed locally but its upload never finished (the remote holds 1-3), and it is damaged: the
    resume continues from 3, and the uploader, which derives its backlog from the local steps newer than the
    remote's newest, never tries to upload it (it did, and failed with UploadError, the blob being gone)."""
    target = s3_bucket_url
    root = tmp_path / "run"
    kw = uploaded_steps_1_to_4(root, target)
    with Store(root, **kw) as s:
        lost = blobs_of_key(s, 4, ("w",))
    truncate_steps(open_storage(target.url, target.storage_options), 3)   # as if step 4's upload never happened
    for f in lost:
        f.unlink()
    with Store(root, **kw) as s:
        assert s.resume(fresh()) == 3
        s.wait_for_uploads(timeout=120)                   # was: UploadError (step 4: blob missing)
        assert s.steps() == [1, 2, 3] and remote_steps(target.url, target.storage_options) == [1, 2, 3]
        s.save(state_at(104), 4)
        s.wait_for_uploads(timeout=120)
    with Store(target.url, storage_options=target.storage_options, create=False) as r:
        assert r.steps() == [1, 2, 3, 4] and torch.equal(r.load(4)["w"], state_at(104)["w"])


def _so_args(target) -> List[str]:
    return ["--storage-options", json.dumps(target.storage_options)] if target.storage_options else []


# -- 2 ranks as 2 nodes, node-local disks, a loopback S3 remote ------------------------------------------------------
def committed(root: Path) -> List[int]:
    with Store(root, read_only=True, rank=0, world_size=1) as s:
        return s.steps()


def remote_steps(url: str, so: dict) -> List[int]:
    with Store(url, storage_options=so, create=False) as r:
        return r.steps()


def run_until_held(job: Job, log: Path, world: int, step: int, timeout: float = 180) -> None:
    """Wait until every rank of ``job`` holds after ``step`` (tests/memtier_worker.py --hold-after), then
    SIGKILL them all: the whole job goes down, as at a node loss."""
    deadline = time.monotonic() + timeout
    while not all((log / f"held-rank{r}").exists() for r in range(world)):
        dead = [r for r, p in enumerate(job.procs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            job.kill()
            out = "\n".join(f"--- rank {r}\n{p.communicate()[0][-2500:]}" for r, p in enumerate(job.procs))
            pytest.fail(f"ranks {dead} exited before holding at step {step} (or it timed out):\n{out}")
        time.sleep(0.1)
    job.kill()
    for r in range(world):
        (log / f"held-rank{r}").unlink()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Dict[int, Dict[int, float]]:
    """Both ranks' losses of an uninterrupted 18-step run (plain disk roots: the losses do not depend on the
    tiers)."""
    d = tmp_path_factory.mktemp("reference")
    (d / "log").mkdir()
    res = Job(2, "--no-memory", "--node-size", "1", "--disk", f"{d}/disk{{node}}", "--mem", f"{d}/unused",
              "--steps", "18", "--log", str(d / "log"), script=WORKER).check(240)
    assert all(r and r["resumed"] == 0 for r in res.values()), res
    ref = {r: {s: v[0] for s, v in log.items()} for r, log in read_losses(d / "log", world=2).items()}
    assert all(sorted(v) == list(range(1, 19)) for v in ref.values()) and ref[0] != ref[1], ref
    return ref


def check_losses(log: Path, reference, steps: int) -> None:
    for r, got in read_losses(log, world=2).items():
        check_against_reference(got, reference[r], steps)


@pytest.mark.slow
@pytest.mark.parametrize("resume_by", ["resume", "resolve"])
def test_plain_store_on_node_local_disks_continues_past_a_lost_nodes_newer_steps(tmp_path, s3_server, reference,
                                                                                 resume_by):
    """Saves every step, uploads every 4th; node 1 is lost after step 6, when node 0's disk holds 5 and 6 and the
    remote 4. The relaunch resumes 4 on both ranks, sets 5 and 6 aside on node 0 and saves on to 10 (it died
    at save(5) with "rewinding to step 5"); a second relaunch resumes 10. Losses equal the uninterrupted run's.
    ``resolve``: the relaunch calls ``Store.resolve()`` then ``Store.restore(state, step)``, as the HF and
    torchtitan adapters do; resolve() once chose node 0's step 6 for both ranks (rank 1 then failed to restore
    it at every relaunch) and restore never set 5 and 6 aside."""
    d = tmp_path
    (d / "log").mkdir()
    url, so = s3_server.new_bucket_url(), s3_server.storage_options()

    def job(*extra):
        return Job(2, "--no-memory", "--node-size", "1", "--disk", f"{d}/disk{{node}}", "--mem", f"{d}/unused",
                   "--remote", url, "--so", json.dumps(so), "--remote-every", "4", "--log", str(d / "log"),
                   "--resume-by", resume_by, *extra, script=WORKER)

    run_until_held(job("--steps", "10", "--hold-after", "6"), d / "log", 2, 6)
    assert committed(d / "disk0")[-2:] == [5, 6] and remote_steps(url, so) == [4]
    shutil.rmtree(d / "disk1")                            # node 1 is replaced: its disk is empty
    (d / "disk1").mkdir()

    res = job("--steps", "10").check(240)
    assert {r: out["resumed"] for r, out in res.items()} == {0: 4, 1: 4}, res
    assert [n.split(".")[0] for n in asides(d / "disk0")] == [f"{5:012d}", f"{6:012d}"]
    assert committed(d / "disk0")[-2:] == committed(d / "disk1")[-2:] == [9, 10]   # (8 may wait for its upload)
    assert remote_steps(url, so) == [4, 8]
    assert decode_pointer(open_storage(url, so).read_bytes(LATEST)) == 8

    res = job("--steps", "12").check(240)                 # and again: no restart loop
    assert {r: (out["resumed"], out["resumed_from"]["tier"]) for r, out in res.items()} == \
        {0: (10, "local"), 1: (10, "local")}, res
    check_losses(d / "log", reference, 12)


@pytest.mark.slow
def test_memory_tier_node_loss_with_newer_disk_steps_on_the_other_node(tmp_path, s3_server, reference, tmpfs_dirs):
    """The issue's case: memory every step (no replicas), disk every 2nd, remote every 8th; node 1 (its tmpfs
    and its disk) is lost after step 13, when node 0's disk holds 10 and 12 and the remote 8. The relaunch
    resumes 8, sets 10 and 12 aside on node 0's disk, drops node 0's memory steps after 8 and goes on to 16
    (it died promoting step 10, at every relaunch); a second relaunch resumes memory step 16. Losses equal the
    uninterrupted run's."""
    d = tmp_path
    (d / "log").mkdir()
    for n in (0, 1):
        tmpfs_dirs(f"mem{n}")
    url, so = s3_server.new_bucket_url(), s3_server.storage_options()

    def job(*extra):
        return Job(2, "--node-size", "1", "--replicas", "0", "--disk-every", "2", "--remote-every", "8",
                   "--mem-keep", "3", "--disk", f"{d}/disk{{node}}", "--mem", f"{d}/mem{{node}}", "--remote", url,
                   "--so", json.dumps(so), "--log", str(d / "log"), *extra, script=WORKER)

    run_until_held(job("--steps", "16", "--hold-after", "13"), d / "log", 2, 13)
    assert committed(d / "disk0")[-2:] == [10, 12] and remote_steps(url, so) == [8]
    assert committed(d / "mem0")[-1] == 13
    wipe_mount(d / "mem1")                                # node 1 is replaced: its RAM and disk are empty
    shutil.rmtree(d / "disk1")
    (d / "disk1").mkdir()

    res = job("--steps", "16").check(240)
    assert {r: out["resumed"] for r, out in res.items()} == {0: 8, 1: 8}, res
    assert [n.split(".")[0] for n in asides(d / "disk0")] == [f"{10:012d}", f"{12:012d}"]
    assert committed(d / "disk0")[-2:] == committed(d / "disk1")[-2:] == [14, 16]
    assert committed(d / "mem0")[-1] == committed(d / "mem1")[-1] == 16
    assert remote_steps(url, so) == [8, 16]

    res = job("--steps", "18").check(240)                 # and again: no restart loop
    assert {r: (out["resumed"], out["resumed_from"]["tier"]) for r, out in res.items()} == \
        {0: (16, "memory"), 1: (16, "memory")}, res
    check_losses(d / "log", reference, 18)
