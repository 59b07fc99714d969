"""Operations: retention (last / every / best, local and remote, across restarts), keep_local=0, rewinding a
run (error or truncate), the run id, and retention beside a writer."""
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptstore import IncompatibleCheckpointError, Packing, Retention, Store, Writing, Remote
from ckptstore.format.blobs import BlobStore
from ckptstore.format.catalog import Catalog
from ckptstore.lifecycle.gc import collect
from ckptstore.format.layout import LATEST
from ckptstore.format.manifest import Commit, decode_commit, encode_commit
from ckptstore.format.pointers import decode_pointer
from ckptstore.lifecycle import retention
from ckptstore.lifecycle.retention import AnyOf, BestN, EveryNSteps, LatestN, StepInfo, best_step
from ckptstore.storage import open_storage
from ckptstore.remote.transfer import StepCopier
from helpers import REPO, data_files

SMALL = Packing(threshold=1 << 16, target_size=1 << 20)


def loss(step):
    """Step 3 is the best (lowest loss); later steps are worse than it."""
    return {1: 9.0, 2: 8.0, 3: 0.5}.get(step, 5.0 + 0.1 * step)


def state_at(step, frozen=None):
    g = torch.Generator().manual_seed(step)
    s = {"w": torch.randn(20_000, generator=g), "small": torch.randn(100, generator=g), "step": step}
    if frozen is not None:
        s["frozen"] = frozen
    return s


def remote_kw(target, **kw):
    """``Store`` arguments for the remote ``target``; ``kw``: :class:`~ckptstore.Remote` options."""
    return dict(remote=Remote(target.url, **kw), storage_options=target.storage_options)


def remote_store(target):
    return Store(target.url, storage_options=target.storage_options, create=False)


def remote_pointer(target):
    return decode_pointer(open_storage(target.url, target.storage_options).read_bytes(LATEST))


POLICY = dict(last=2, every=5, best=1, metric="loss", mode="min")

# A separate process that saves steps [first, last] with loss(step) metrics, prints its run id, and then dies
# by SIGKILL (no close(), no cleanup) or closes normally.
SAVER = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from ckptstore import Remote, Retention, Store, Writing
    sys.path[:0] = [os.path.join(sys.argv[1], "tests"), os.path.join(sys.argv[1], "tests", "lifecycle")]
    from test_operations import loss, state_at, SMALL
    root, remote, opts, first, last, keep, how = sys.argv[2:9]
    kw = dict(keep=Retention(**json.loads(keep)) if keep != "null" else None, writing=Writing(packing=SMALL))
    if remote:
        kw.update(remote=Remote(remote, keep_local=json.loads(how.split(":")[1] or "null") if ":" in how else None),
                  storage_options=json.loads(opts))
    s = Store(root, **kw)
    state = {"w": None, "small": None, "step": None}
    print("resumed", s.resume(state), flush=True)
    for step in range(int(first), int(last) + 1):
        s.save(state_at(step), step, metrics={"loss": loss(step)})
    if remote:
        s.wait_for_uploads(timeout=120)
    print("run_id", s.run_id, flush=True)
    if how.startswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    s.close()
""")


def run_saver(root, first, last, keep=POLICY, target=None, how="kill"):
    args = [sys.executable, "-c", SAVER, str(REPO), str(root), target.url if target else "",
            json.dumps(target.storage_options if target else {}), str(first), str(last), json.dumps(keep), how]
    p = subprocess.run(args, capture_output=True, text=True, timeout=240,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    if how.startswith("kill"):
        assert p.returncode == -9, p.stdout + p.stderr
    else:
        assert p.returncode == 0, p.stdout + p.stderr
    lines = dict(line.split(" ", 1) for line in p.stdout.splitlines() if " " in line)
    return lines["run_id"].strip()


# -- the pure policies ------------------------------------------------------------------------------------------
def test_policies_are_pure_and_compose():
    infos = [StepInfo(s, {"loss": loss(s)} if s != 4 else {}) for s in range(1, 13)]
    assert LatestN(2).keep(infos) == {11, 12}
    assert EveryNSteps(5).keep(infos) == {5, 10}
    assert BestN(2, "loss", "min").keep(infos) == {3, 5}          # step 4 has no loss: never best
    assert BestN(1, "loss", "max").keep(infos) == {1}
    assert AnyOf((LatestN(2), EveryNSteps(5))).keep(infos) == {5, 10, 11, 12}
    r = Retention(**POLICY)
    assert r.to_delete(infos) == [1, 2, 4, 6, 7, 8, 9]
    assert r.to_delete(infos, protected={7}) == [1, 2, 4, 6, 8, 9]
    # the newest and the best step are kept whatever the policy says
    assert Retention(every=100, metric="loss").keep(infos) == {3, 12}
    assert Retention(last=1, metric=None).keep(infos) == {12}
    assert Retention().to_delete(infos) == []                      # no rule: keep everything
    with pytest.raises(ValueError):
        Retention(best=1, metric=None)
    with pytest.raises(ValueError):
        Retention(last=0)
    with pytest.raises(ValueError):
        Retention(mode="median")


def test_best_step_from_commit_markers():
    def commit(step, metrics, best=None):
        c = Commit(step=step, world_size=1, manifests={0: (b"\0" * 32, 10, 0)}, created=1.0, bytes_total=0,
                   metrics=metrics, run_id="ab12", best=best)
        return decode_commit(encode_commit(c), step=step, what="COMMIT")     # round trip through the format
    crit = {"metric": "loss", "mode": "min"}
    commits = [commit(1, {"loss": 2.0}, crit), commit(2, {"loss": 1.0}, crit), commit(3, {"acc": 0.9}, crit),
               commit(4, {"loss": float("nan")}, crit)]
    assert commits[0].run_id == "ab12" and commits[0].best == crit
    assert best_step(commits) == 2
    assert best_step(commits, metric="loss", mode="max") == 1
    assert best_step(commits, metric="acc", mode="max") == 3
    assert best_step([commit(1, {"loss": 1.0})]) is None             # no criterion recorded, none given
    old = Commit(step=1, world_size=1, manifests={0: (b"\0" * 32, 10, 0)}, created=1.0, bytes_total=0)
    back = decode_commit(encode_commit(old), step=1, what="COMMIT")   # a marker without the new fields
    assert back.run_id == "" and back.best is None


# -- retention across a restart of the process ------------------------------------------------------------------
def test_retention_keeps_what_the_policy_names_across_a_restart(tmp_path):
    root = tmp_path / "run"
    first_id = run_saver(root, 1, 8)                                # killed after step 8
    with Store(root, create=False) as s:
        assert s.steps() == [3, 5, 7, 8]                            # last 2, every 5th, best (3)
    with Store(root, keep=Retention(**POLICY), writing=Writing(packing=SMALL)) as s:
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 8 and s.run_id == first_id
        assert s.best_step() == 3
        for step in range(9, 13):
            s.save(state_at(step), step, metrics={"loss": loss(step)})
        assert s.steps() == [3, 5, 10, 11, 12]
        assert s.best_step() == 3 and s.latest_step() == 12
        assert s.verify() == {st: None for st in s.steps()}
        r = s.gc(grace_seconds=0, repack=None)
        assert r.blobs_deleted + r.packs_deleted == 0               # retention's own sweep freed them
    with Store(root, create=False) as s:                            # readers find best without the policy
        commits = [s.commit_info(st) for st in s.steps()]
        assert retention.best_step(commits) == 3 and {c.run_id for c in commits} == {first_id}
        assert s.best_step() == 3
        for st in s.steps():
            assert s.load(st)["step"] == st


_RETAIN_ONE = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from ckptstore import Retention, Store
    root, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with Store(root, keep=Retention(last=1)) as store:
        for step in range(first, last + 1):
            store.save({"w": torch.full((6 << 18,), float(step)), "step": step}, step)   # 6 MiB: a blob
            blobs = [p for p in (Path(root) / "objects").rglob("*") if p.is_file()]
            assert store.steps() == [step] and len(blobs) == 1, (step, store.steps(), blobs)
    """)


def test_retention_frees_what_it_deletes_by_the_end_of_the_process(tmp_path):
    """A deleted step's blobs leave their paths when the save returns (only the kept step's blob is there), and
    their space is back when the process ends; files a killed process left waiting to be unlinked go with the
    next process's deletions."""
    root = tmp_path / "store"

    def run(first, last):
        subprocess.run([sys.executable, "-c", _RETAIN_ONE, str(root), str(first), str(last)], check=True,
                       cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)

    def files():
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()
                      and p.parts[len(root.parts)] in ("objects", "trash"))
    run(1, 3)
    left = files()
    assert len(left) == 1 and left[0].startswith("objects/"), left
    (root / "trash").mkdir(exist_ok=True)
    (root / "trash" / "left-by-a-killed-process").write_bytes(b"x" * (5 << 20))
    run(4, 5)
    left = files()
    assert len(left) == 1 and left[0].startswith("objects/"), left
    got = Store(root, read_only=True).load(5)
    assert torch.equal(got["w"], torch.full((6 << 18,), 5.0)) and got["step"] == 5


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_retention_on_remote_across_a_restart(tmp_path, request, kind):
    target = request.getfixturevalue(f"{kind}_bucket_url")
    root = tmp_path / "run"
    first_id = run_saver(root, 1, 8, target=target, how="kill:1")  # keep_local=1, killed after uploads
    with remote_store(target) as r:
        assert r.steps() == [3, 5, 7, 8]
    with Store(root, create=False) as s:
        assert s.steps() == [8]                                     # keep_local=1: local holds fewer
    with Store(root, keep=Retention(**POLICY), writing=Writing(packing=SMALL), **remote_kw(target, keep_local=1)) as s:
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 8 and s.run_id == first_id
        for step in range(9, 13):
            s.save(state_at(step), step, metrics={"loss": loss(step)})
        s.wait_for_uploads(timeout=120)
        assert s.steps() == [12]
        assert s.best_step() == 3                                   # from the remote's markers
    with remote_store(target) as r:
        assert r.steps() == [3, 5, 10, 11, 12]
        assert r.verify() == {st: None for st in r.steps()}
        assert r.best_step() == 3 and r.commit_info(12).run_id == first_id
        r.gc(grace_seconds=0, repack=None)
        assert r.verify() == {st: None for st in r.steps()}
    assert remote_pointer(target) == 12


def test_latest_and_pending_uploads_are_never_removed(tmp_path, memory_url, monkeypatch):
    gate, uploading = threading.Event(), threading.Event()
    real = StepCopier.copy_step

    def slow_copy(self, step, **kw):
        if self.src.local_path("") is not None:                     # uploads only (not pulls)
            uploading.set()
            assert gate.wait(60)
        return real(self, step, **kw)
    monkeypatch.setattr(StepCopier, "copy_step", slow_copy)
    root = tmp_path / "run"
    with Store(root, keep=Retention(last=1, best=1, metric="loss"), **remote_kw(memory_url)) as s:
        for step in range(1, 5):
            s.save(state_at(step), step, metrics={"loss": loss(step)})
        assert uploading.wait(30)
        assert s.steps() == [1, 2, 3, 4]                            # all pending upload: none removed
        gate.set()
        s.wait_for_uploads(timeout=60)
        s.save(state_at(5), 5, metrics={"loss": loss(5)})
        assert s.steps() == [3, 5]                                  # the best and the newest
        s.save(state_at(6), 6, metrics={"loss": loss(6)})
        assert set(s.steps()) - {5} == {3, 6}                       # 5 may still be uploading: protected
        s.wait_for_uploads(timeout=60)
    with remote_store(memory_url) as r:
        assert r.steps() == [3, 6] and r.verify() == {3: None, 6: None}


# -- keep_local=0 -----------------------------------------------------------------------------------------------
def test_keep_local_zero_keeps_no_local_copy_and_resumes_from_remote(tmp_path, s3_bucket_url):
    root = tmp_path / "run"
    frozen = torch.randn(30_000)
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url, keep_local=0)) as s:
        run_id = s.run_id
        for step in (1, 2, 3):
            s.save(state_at(step, frozen), step)
        s.wait_for_uploads(timeout=120)
        assert s.steps() == [] and data_files(root) == []            # nothing local once uploaded
        assert not (root / "latest").exists()
        with pytest.raises(IncompatibleCheckpointError, match="newest committed step is 3"):
            s.save(state_at(2, frozen), 2)                          # the remote's steps count for rewinds
        s.save(state_at(4, frozen), 4)                              # blobs deleted locally are written again
        s.wait_for_uploads(timeout=120)
        assert s.steps() == []
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1, 2, 3, 4] and r.verify() == {i: None for i in (1, 2, 3, 4)}
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url, keep_local=0)) as s:
        state = {"w": None, "small": None, "step": None, "frozen": None}
        assert s.resume(state) == 4 and s.resumed_from["tier"] == "remote"
        assert s.run_id == run_id
        assert torch.equal(state["w"], state_at(4)["w"]) and torch.equal(state["frozen"], frozen)
        s.save(state_at(5, frozen), 5)
        s.wait_for_uploads(timeout=120)
        assert s.steps() == []
    with remote_store(s3_bucket_url) as r:
        assert r.steps()[-1] == 5 and r.verify(5) == {5: None} and r.commit_info(5).run_id == run_id


def test_save_without_resume_is_judged_against_the_remote_steps_with_keep_local_zero(tmp_path, s3_bucket_url):
    """A new process that saves without calling resume (its uploader has not listed the remote yet) must not
    commit a step the remote already has newer ones than: that step would never be uploaded."""
    root = tmp_path / "run"
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url, keep_local=0)) as s:
        for step in (1, 2, 3):
            s.save(state_at(step), step)
        s.wait_for_uploads(timeout=120)
        assert s.steps() == []
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url, keep_local=0)) as s:
        with pytest.raises(IncompatibleCheckpointError, match="newest committed step is 3"):
            s.save(state_at(2), 2)
        s.save(state_at(4), 4)
        s.wait_for_uploads(timeout=120)
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1, 2, 3, 4]


# -- rewinding a run --------------------------------------------------------------------------------------------
def test_rewind_is_refused_by_default_and_truncate_drops_later_steps_locally(tmp_path):
    root = tmp_path / "run"
    with Store(root, writing=Writing(packing=SMALL)) as s:
        for step in range(1, 6):
            s.save(state_at(step), step, metrics={"loss": loss(step)})
        run_id = s.run_id
        with pytest.raises(IncompatibleCheckpointError, match="step 3.*newest committed step is 5") as ei:
            s.save(state_at(3), 3)
        assert ei.value.latest == 5
        with pytest.raises(IncompatibleCheckpointError, match="step 5"):
            s.save(state_at(5), 5)
        assert s.steps() == [1, 2, 3, 4, 5]
    with Store(root, writing=Writing(packing=SMALL), on_rewind="truncate") as s:
        new3 = state_at(103)
        s.save(new3, 3, metrics={"loss": 0.1})
        assert s.steps() == [1, 2, 3] and s.latest_step() == 3
        assert json.loads((root / "latest").read_text())["step"] == 3
        assert torch.equal(s.load(3)["w"], new3["w"]) and s.commit_info(3).manifests[0][2] == 1
        s.save(state_at(4), 4)
        assert s.run_id == run_id
    with Store(root) as s:
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 4 and s.run_id == run_id
        assert s.verify() == {i: None for i in (1, 2, 3, 4)}


def _five_steps_uploaded(root, target):
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(target)) as s:
        for step in range(1, 6):
            s.save(state_at(step), step)
        s.wait_for_uploads(timeout=120)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_truncate_drops_later_steps_on_the_remote_too(tmp_path, request, kind):
    target, root = request.getfixturevalue(f"{kind}_bucket_url"), tmp_path / "run"
    _five_steps_uploaded(root, target)
    assert remote_pointer(target) == 5
    with Store(root, writing=Writing(packing=SMALL), on_rewind="truncate", **remote_kw(target)) as s:
        s.save(state_at(5), 5)                                      # re-saving the newest step: a new generation
        s.wait_for_uploads(timeout=120)
        new = state_at(203)
        s.save(new, 3)
        assert s.steps() == [1, 2, 3]
        s.wait_for_uploads(timeout=120)
    with remote_store(target) as r:
        assert r.steps() == [1, 2, 3] and r.verify() == {1: None, 2: None, 3: None}
    assert remote_pointer(target) == 3
    shutil.rmtree(root)                                             # resume from the remote alone
    with Store(root, **remote_kw(target)) as s:
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 3 and s.resumed_from["tier"] == "remote"
        assert torch.equal(state["w"], new["w"])
        s.save(state_at(4), 4)                                      # the new timeline goes on
        s.wait_for_uploads(timeout=120)
    assert remote_pointer(target) == 4


@pytest.mark.parametrize("kind", ["s3"])
def test_a_process_whose_first_save_truncates_uploads_that_step(tmp_path, request, kind):
    """The first save of a new process rewinds (``on_rewind="truncate"``) right after the store opened: the
    remote listing the store made when it opened (and the rewind check used) predates the truncation; the
    re-saved step is uploaded, the remote's pointer names it, and a new node resumes it."""
    target, root = request.getfixturevalue(f"{kind}_bucket_url"), tmp_path / "run"
    _five_steps_uploaded(root, target)
    with Store(root, writing=Writing(packing=SMALL), on_rewind="truncate", **remote_kw(target)) as s:
        new = state_at(303)
        s.save(new, 3)
        s.wait_for_uploads(timeout=120)
    assert remote_pointer(target) == 3
    with remote_store(target) as r:
        assert r.steps() == [1, 2, 3] and r.verify() == {1: None, 2: None, 3: None}
    shutil.rmtree(root)
    with Store(root, **remote_kw(target)) as s:
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 3 and torch.equal(state["w"], new["w"])


# -- the run id -------------------------------------------------------------------------------------------------
def test_run_id_survives_sigkill_and_resume_locally(tmp_path):
    root = tmp_path / "run"
    rid = run_saver(root, 1, 3, keep=None)
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert run_saver(root, 4, 5, keep=None) == rid                   # a restarted process, killed again
    with Store(root) as s:
        assert s.run_id == rid                                      # before resume: the newest marker's
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 5 and s.run_id == rid
        assert {s.commit_info(st).run_id for st in s.steps()} == {rid}
    other = Store(tmp_path / "other")
    assert other.run_id != rid and len(other.run_id) == 32           # a new run, a new id
    other.close()


@pytest.mark.parametrize("kind", ["s3"])
def test_run_id_survives_sigkill_and_resume_from_the_remote(tmp_path, request, kind):
    target = request.getfixturevalue(f"{kind}_bucket_url")
    root = tmp_path / "run"
    rid = run_saver(root, 1, 3, keep=None, target=target, how="kill")
    shutil.rmtree(root)                                             # the node is gone
    with Store(root, **remote_kw(target)) as s:
        state = {"w": None, "small": None, "step": None}
        assert s.resume(state) == 3 and s.resumed_from["tier"] == "remote"
        assert s.run_id == rid
        s.save(state_at(4), 4)
        s.wait_for_uploads(timeout=120)
    with remote_store(target) as r:
        assert r.commit_info(4).run_id == rid


# -- retention beside a writer ----------------------------------------------------------------------------------
@pytest.mark.parametrize("blocking", [True, False])
def test_retention_while_a_writer_saves_then_verify(tmp_path, blocking):
    root = tmp_path / "run"
    policy = Retention(last=2, every=4, best=1, metric="loss")
    stop, errors, sweeps = threading.Event(), [], [0]

    def deleter():                                  # another deleter applying the same policy (as `gc --keep`)
        storage = open_storage(root)
        catalog = Catalog(storage)
        try:
            while not stop.is_set():
                retention.apply(catalog, policy)
                r = collect(storage, catalog, BlobStore(storage), grace_seconds=0.0, wait=5.0)
                sweeps[0] += not r.deferred
                stop.wait(0.2)
        except BaseException as e:
            errors.append(e)
    g = torch.Generator().manual_seed(0)
    frozen = {f"f{i}": torch.randn(300 + i, generator=g) for i in range(20)}
    with Store(root, keep=policy, writing=Writing(packing=SMALL)) as s:
        s.save({"w": torch.zeros(10), **frozen}, 0, metrics={"loss": 10.0})
        t = threading.Thread(target=deleter, daemon=True)
        t.start()
        try:
            for step in range(1, 25):
                w = torch.randn(50_000, generator=g)
                h = s.save({"w": w, **frozen}, step, metrics={"loss": loss(step)}, blocking=blocking)
                if not blocking and step % 7 == 0:
                    h.result()
            s.wait()
        finally:
            stop.set()
            t.join(60)
        assert not errors, errors
        steps = s.steps()
        assert steps == sorted({3, 23, 24} | set(range(0, 25, 4)))
        assert s.verify() == {st: None for st in steps}
        got = s.load(24)
        assert all(torch.equal(got[k], v) for k, v in frozen.items())
    assert sweeps[0] > 0


@pytest.mark.parametrize("blocking", [True, False])
def test_remote_retention_and_remote_gc_beside_a_writer_then_verify(tmp_path, s3_bucket_url, blocking):
    """A writer saves and uploads to loopback S3 (its uploader applies the policy there) while another party
    runs retention + gc (with repack) on the same S3 prefix, as `ckptstore gc s3://... --keep-last` would:
    afterwards every remote committed step verifies and the newest loads bit for bit."""
    policy = Retention(last=2, every=5, best=1, metric="loss")
    stop, errors, sweeps = threading.Event(), [], [0]

    def remote_deleter():
        try:
            while not stop.is_set():
                with remote_store(s3_bucket_url) as r:
                    retention.apply(r.catalog, policy)
                    report = r.gc(grace_seconds=0, wait_seconds=5)
                    sweeps[0] += not report.deferred
                stop.wait(0.3)
        except BaseException as e:
            errors.append(e)
    g = torch.Generator().manual_seed(1)
    frozen = torch.randn(5_000, generator=g)
    with Store(tmp_path / "run", keep=policy, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url)) as s:
        s.save(state_at(0, frozen), 0, metrics={"loss": loss(0)})
        s.wait_for_uploads(timeout=120)
        t = threading.Thread(target=remote_deleter, daemon=True)
        t.start()
        try:
            for step in range(1, 13):
                h = s.save(state_at(step, frozen), step, metrics={"loss": loss(step)}, blocking=blocking)
                if not blocking and step % 4 == 0:
                    h.result()
            s.wait_for_uploads(timeout=180)
        finally:
            stop.set()
            t.join(120)
    assert not errors, errors
    assert sweeps[0] > 0
    with remote_store(s3_bucket_url) as r:
        steps = r.steps()
        # what the policy may keep (3, the best, only if it was uploaded: the upload backlog may skip a step)
        assert 12 in steps and set(steps) <= {0, 3, 5, 10, 11, 12}
        assert r.verify() == {st: None for st in steps}
        got = r.load(12)
        want = state_at(12, frozen)
        assert torch.equal(got["w"], want["w"]) and torch.equal(got["frozen"], frozen)


# -- deletions and retention that must survive a kill (issue 26, items 2 and 3) -----------------------------------
# A separate process that runs ``plan`` (JSON: ["save", step, floats] / ["wait"] / ["delete", step]) on a store
# uploading to the remote, then dies by SIGKILL: no close(), nothing the uploader had still to do gets done.
PLAN = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from ckptstore import Remote, Store, Writing
    sys.path[:0] = [os.path.join(sys.argv[1], "tests"), os.path.join(sys.argv[1], "tests", "lifecycle")]
    from test_operations import SMALL, planned_state
    root, remote, opts, plan = sys.argv[2:6]
    s = Store(root, writing=Writing(packing=SMALL), remote=Remote(remote), storage_options=json.loads(opts))
    for op, *args in json.loads(plan):
        if op == "save":
            s.save(planned_state(*args), args[0])
        elif op == "wait":
            s.wait_for_uploads(timeout=120)
        elif op == "delete":
            s.delete_step(args[0], remote=True)
    print("done", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def planned_state(step, floats=20_000):
    return {"w": torch.randn(floats, generator=torch.Generator().manual_seed(step)), "step": step}


def run_plan(root, target, plan):
    args = [sys.executable, "-c", PLAN, str(REPO), str(root), target.url, json.dumps(target.storage_options),
            json.dumps(plan)]
    p = subprocess.run(args, capture_output=True, text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == -9 and "done" in p.stdout, p.stdout + p.stderr


def remote_step_dirs(target):
    """Every step directory on the remote, committed or not (a step never uploaded has none)."""
    return Catalog(open_storage(target.url, target.storage_options)).step_dirs()


def intents_left(root):
    return sorted(p.name for p in (Path(root) / "locks" / "remote-deletes").glob("*"))


def test_remote_deletion_survives_sigkill_and_a_restarted_writer_finishes_it(tmp_path, s3_bucket_url):
    """The issue's repro: save 1, save a large 2, delete_step(1, remote=True), SIGKILL while 2 uploads (the
    deletion waits for it); a writer reopened on the same roots saves 3: the remote holds [2, 3], not [1, 2, 3]."""
    root = tmp_path / "run"
    run_plan(root, s3_bucket_url, [["save", 1], ["wait"], ["save", 2, 2_000_000], ["delete", 1]])
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url)) as s:
        s.save(planned_state(3), 3)
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [2, 3] and r.verify() == {2: None, 3: None}
    assert remote_step_dirs(s3_bucket_url) == [2, 3]
    assert intents_left(root) == []                                 # done: the record is gone


def test_a_killed_deletion_converges_on_restart_without_a_new_save(tmp_path, s3_bucket_url):
    """SIGKILL between delete_step's return and the remote deletion, for an uploaded step (1) and for one whose
    upload never happened (4: it waited behind 3); the restarted writer only resumes and closes. The remote
    converges to [2, 3, 5] and never receives step 4."""
    root = tmp_path / "run"
    run_plan(root, s3_bucket_url, [["save", 1], ["save", 2], ["wait"], ["save", 3, 1_000_000], ["save", 4],
                                   ["save", 5], ["delete", 1], ["delete", 4]])
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url)) as s:
        assert s.resume({"w": None, "step": None}) == 5
        assert s.steps() == [2, 3, 5]
    assert remote_step_dirs(s3_bucket_url) == [2, 3, 5]
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [2, 3, 5] and r.verify() == {2: None, 3: None, 5: None}
    assert intents_left(root) == []


def test_a_deletion_waits_only_for_the_uploads_queued_before_it(tmp_path, s3_bucket_url, monkeypatch):
    """delete_step(1) after step 3 was queued runs once 3 is uploaded, not once the queue is empty: step 4's
    upload, queued after the call, is held back and step 1 leaves the remote meanwhile."""
    gates = {3: threading.Event(), 4: threading.Event()}
    real = StepCopier.copy_step

    def gated_copy(self, step, **kw):
        if self.src.local_path("") is not None and step in gates:   # uploads only (not pulls)
            assert gates[step].wait(60)
        return real(self, step, **kw)
    monkeypatch.setattr(StepCopier, "copy_step", gated_copy)
    with Store(tmp_path / "run", writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url)) as s:
        for step in (1, 2):
            s.save(planned_state(step), step)
        s.wait_for_uploads(timeout=60)
        s.save(planned_state(3), 3)
        s.delete_step(1)
        s.save(planned_state(4), 4)
        try:
            assert remote_step_dirs(s3_bucket_url) == [1, 2]      # 3 is held: the deletion waits for it
            gates[3].set()
            deadline = time.monotonic() + 60
            while 1 in remote_step_dirs(s3_bucket_url) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert remote_step_dirs(s3_bucket_url) == [2, 3]      # 1 went while 4 is still held
        finally:
            for gate in gates.values():
                gate.set()
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [2, 3, 4]


def test_a_restarted_writer_converges_both_stores_to_the_policy(tmp_path, s3_bucket_url):
    """A run killed before retention was applied to what it left (here: saved without a policy); the writer
    restarted with keep=Retention(last=2) only resumes and closes: both the remote and the local root then hold
    what the policy keeps, with no new upload to trigger it."""
    root = tmp_path / "run"
    run_saver(root, 1, 6, keep=None, target=s3_bucket_url, how="kill")
    with Store(root, keep=Retention(last=2, metric=None), writing=Writing(packing=SMALL),
               **remote_kw(s3_bucket_url)) as s:
        assert s.resume({"w": None, "small": None, "step": None}) == 6
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [5, 6]
    with Store(root, create=False) as s:
        assert s.steps() == [5, 6]


@pytest.mark.parametrize("end", ["wait_for_uploads", "close"])
def test_local_retention_applies_once_uploads_catch_up(tmp_path, s3_bucket_url, monkeypatch, end):
    """keep=Retention(last=2), blocking saves whose uploads lag (held until the sixth save): retention after each
    commit spares the steps waiting for upload; once uploaded they follow the policy, after the uploads and at
    close(): local [5, 6] like the remote, not [1..6]."""
    gate = threading.Event()
    real = StepCopier.copy_step

    def held_copy(self, step, **kw):
        if self.src.local_path("") is not None:                    # uploads only (not pulls)
            assert gate.wait(60)
        return real(self, step, **kw)
    monkeypatch.setattr(StepCopier, "copy_step", held_copy)
    root = tmp_path / "run"
    s = Store(root, keep=Retention(last=2, metric=None), writing=Writing(packing=SMALL), **remote_kw(s3_bucket_url))
    for step in range(1, 7):
        s.save(planned_state(step), step)
    assert s.steps() == [1, 2, 3, 4, 5, 6]                           # all waiting for their upload
    gate.set()
    if end == "wait_for_uploads":
        s.wait_for_uploads(timeout=120)
        assert s.steps() == [5, 6]
    s.close()
    with Store(root, create=False) as local:
        assert local.steps() == [5, 6] and local.verify() == {5: None, 6: None}
    assert len(data_files(root)) == 2                                # one blob per kept step: the rest swept
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [5, 6]


def test_a_deleted_step_saved_again_by_a_rewind_replaces_its_old_remote_copy(tmp_path, s3_bucket_url):
    """delete_step(2) is killed before its remote deletion; the restarted writer rewinds to step 2
    (on_rewind="truncate") before its uploader has even listed the remote: the old remote copy of 2 goes first,
    the later steps with the truncation, and the new step 2 is uploaded whole and is not deleted afterwards."""
    root = tmp_path / "run"
    run_plan(root, s3_bucket_url, [["save", 1], ["save", 2], ["save", 3], ["save", 4], ["wait"],
                                   ["save", 5, 1_000_000], ["delete", 2]])
    new = planned_state(2, 30_000)                                 # not the bytes of the old step 2
    with Store(root, writing=Writing(packing=SMALL), on_rewind="truncate", **remote_kw(s3_bucket_url)) as s:
        s.save(new, 2)
        assert s.steps() == [1, 2]
    with remote_store(s3_bucket_url) as r:
        assert r.steps() == [1, 2] and r.verify() == {1: None, 2: None}
        assert torch.equal(r.load(2)["w"], new["w"])
    assert intents_left(root) == []


def test_a_damaged_or_foreign_deletion_record_is_logged_and_loses_nothing(tmp_path, memory_url, caplog):
    """Steps 1 and 2 deleted locally; a deletion record whose body does not decode still names its step (its
    file name): step 1 is deleted from the remote, logged with the file's name. A record for another remote is
    left alone (logged), and so is step 2 on this one."""
    root = tmp_path / "run"
    with Store(root, writing=Writing(packing=SMALL), **remote_kw(memory_url)) as s:
        for step in (1, 2, 3):
            s.save(planned_state(step), step)
        s.wait_for_uploads(timeout=60)
        s.delete_step(1, remote=False)
        s.delete_step(2, remote=False)
    records = Path(root) / "locks" / "remote-deletes"
    records.mkdir(parents=True)
    (records / "000000000001.json").write_bytes(b"\x00{not json")
    (records / "000000000002.json").write_text(json.dumps({"step": 2, "after": 3, "remote": "s3://elsewhere/run"}))
    with caplog.at_level("INFO", logger="ckptstore"):
        with Store(root, writing=Writing(packing=SMALL), **remote_kw(memory_url)) as s:
            s.wait_for_uploads(timeout=60)
    assert "000000000001.json is unreadable" in caplog.text and "s3://elsewhere/run" in caplog.text
    with remote_store(memory_url) as r:
        assert r.steps() == [2, 3]
    assert intents_left(root) == ["000000000002.json"]
