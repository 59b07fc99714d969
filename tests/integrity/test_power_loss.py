"""Power loss (issue 17, section 2): a lazy FUSE filesystem (tests/lazyfs.py) keeps every write and directory
change volatile until fsync / directory fsync makes it durable, and a crash keeps only the durable state. A real
save sequence runs on it in a forked writer; the filesystem "loses power" before its K-th state-changing
operation, for K sampled over the whole run; the writer is killed, the durable state is mounted again, and then:
every step whose ``save()`` had returned is listed and loads bit for bit, every committed step loads bit for bit,
``resume()`` returns the newest of them, and the next save commits a step that loads (dedup never reuses bytes
that the power loss took).

On FUSE, Linux returns 0 from ``syncfs(2)`` without telling the filesystem, so this also covers the per-file
fsync path (no syncfs). ``CKPTSTORE_POWERLOSS_POINTS`` sets how many crash points run (default 24).
"""
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointError, Packing, Store, Writing
from helpers import TESTS

LAZYFS = TESTS / "lazyfs.py"
PACKING = Packing(threshold=64 << 10)          # "w" and "frozen" are blobs; the rest go into packs
STEPS = (1, 2, 3)
POINTS = int(os.environ.get("CKPTSTORE_POWERLOSS_POINTS", "24"))


def _fuse_unavailable():
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if shutil.which("fusermount3") is None:
        return "fusermount3 missing (Debian package fuse3; `make test` installs it as root)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy / libfuse3 missing: {e}"
    return None


pytestmark = pytest.mark.skipif(_fuse_unavailable() is not None, reason=str(_fuse_unavailable()))


def state_at(step):
    return {"w": torch.arange(65536, dtype=torch.float32) + step,            # 256 KiB blob, new every step
            "frozen": torch.ones(50_000),                                     # 200 KB blob, never changes
            "small": [torch.full((100,), float(step * 10 + i)) for i in range(4)],   # packed, new every step
            "norm": torch.linspace(0, 1, 300),                                # packed, never changes
            "step": step}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


class Mount:
    def __init__(self, mnt: Path, *args):
        self.mnt = mnt
        mnt.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(LAZYFS), str(mnt), *map(str, args)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not os.path.ismount(mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"lazyfs did not mount at {mnt}")
            time.sleep(0.02)

    def close(self):
        subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], check=False, capture_output=True)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _writer(root: str, log: str, codec: str) -> None:
    """The training job: saves STEPS, recording each step whose save returned (outside the lazy fs)."""
    code = 0
    try:
        with Store(root, writing=Writing(packing=PACKING, codec=codec)) as s:
            for step in STEPS:
                s.save(state_at(step), step)
                with open(log, "a") as f:
                    f.write(f"{step}\n")
                    f.flush()
                    os.fsync(f.fileno())
    except BaseException:       # EIO once the power is off: expected
        code = 1
    os._exit(code)


def _run_writer(root: Path, log: Path, codec: str = "raw") -> None:
    # forkserver, not fork: this process runs stores' threads (lease renewal, pools), and a fork taken while one
    # holds a lock deadlocks the child; the fork server is clean and has torch imported once
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ckptstore"])
    p = ctx.Process(target=_writer, args=(str(root), str(log), codec))
    p.start()
    p.join(120)
    if p.is_alive():
        p.kill()
        p.join()


def _returned(log: Path):
    return [int(x) for x in log.read_text().split()] if log.exists() else []


def check_after_crash(root: Path, returned):
    """What must hold once the durable state is mounted again; returns a list of violations."""
    bad = []
    with Store(root, writing=Writing(packing=PACKING)) as s:
        steps = s.steps()
        lost = sorted(set(returned) - set(steps))
        if lost:
            bad.append(f"steps {lost} returned from save() but are gone")
        for step in steps:
            try:
                if not _equal(s.load(step), state_at(step)):
                    bad.append(f"committed step {step} loads wrong bytes")
            except CheckpointError as e:
                bad.append(f"committed step {step} does not load: {e}")
        target = {"w": torch.zeros(65536), "frozen": torch.zeros(50_000), "small": [], "norm": torch.zeros(300),
                  "step": 0}
        got = s.resume(target)
        if returned and (got is None or got < max(returned)):
            bad.append(f"resume() returned {got}, but step {max(returned)} had been saved")
        elif got is not None and not _equal(target, state_at(got)):
            bad.append(f"resume() loaded wrong values for step {got}")
        try:
            s.save(state_at(10), 10)
            if not _equal(s.load(10), state_at(10)):
                bad.append("the save after the crash loads wrong bytes")
        except CheckpointError as e:
            bad.append(f"the save after the crash does not load: {e}")
    return bad


def _count_ops(tmp: Path, codec: str) -> int:
    m = Mount(tmp / "mnt", "--count-out", tmp / "count")
    try:
        _run_writer(m.mnt / "store", tmp / "count.log", codec)
        assert _returned(tmp / "count.log") == list(STEPS), "the writer failed without a crash"
    finally:
        m.close()
    return int((tmp / "count").read_text())


@pytest.mark.parametrize("codec", ["raw", "auto"])
def test_power_loss_at_any_point_keeps_every_returned_step_and_loads_no_wrong_bytes(tmp_path, codec):
    """``auto``: packs are streamed to a temp file while their chunks encode, then linked (issue 30); half the
    crash points, spread the same way."""
    n = POINTS if codec == "raw" else max(2, POINTS // 2)
    total = _count_ops(tmp_path, codec)
    points = sorted({max(1, round(total * (i + 0.5) / n)) for i in range(n)})
    failures, crashed = {}, 0
    for k in points:
        work = tmp_path / f"k{k}"
        work.mkdir()
        state, log = work / "durable.pickle", work / "saved.log"
        m = Mount(tmp_path / "mnt", "--crash-at", k, "--state-out", state)
        try:
            _run_writer(m.mnt / "store", log, codec)
        finally:
            m.close()
        if not state.exists():
            continue                   # the run ended before operation k (fewer ops than counted)
        crashed += 1
        m = Mount(tmp_path / "mnt", "--state-in", state)
        try:
            bad = check_after_crash(m.mnt / "store", _returned(log))
        finally:
            m.close()
        if bad:
            failures[k] = bad
    assert crashed >= len(points) // 2, f"only {crashed} of {len(points)} crash points crashed ({total} ops)"
    assert not failures, (f"{len(failures)} of {crashed} crash states broke the promise (of {total} ops):\n"
                          + "\n".join(f"  crash before op {k}: {'; '.join(v)}" for k, v in failures.items()))


def test_a_writer_lease_of_an_earlier_boot_of_this_machine_is_stale_at_once(tmp_path):
    """After a reboot the job restarts within the lease's TTL: the lease its previous boot left must not block
    it. A lease held by another machine (another machine id) still does."""
    import json

    with Store(tmp_path) as s:
        s.save({"w": torch.zeros(3)}, 1)
    lease = tmp_path / "locks" / "writer.json"

    def plant(**change):
        with Store(tmp_path / "probe") as p:          # a real lease of this process, as a template
            p.save({"w": torch.zeros(3)}, 1)
            info = json.loads((tmp_path / "probe" / "locks" / "writer.json").read_text())
        info.update(pid=4_000_000, pid_start="1", renewed=time.time(), started=time.time(), **change)
        info["host"] = f"{info['hostname']}/{change.get('boot_id', info['boot_id'])}/1"
        lease.write_text(json.dumps(info))
        shutil.rmtree(tmp_path / "probe")

    plant(boot_id="00000000-0000-0000-0000-000000000000")       # this machine, an earlier boot
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(3)}, 2)
    plant(boot_id="00000000-0000-0000-0000-000000000000", machine_id="another-machine")
    with Store(tmp_path) as s:
        with pytest.raises(CheckpointError, match="writer"):
            s.save({"w": torch.ones(3)}, 3)
