"""The memory tier with peer replication (issue 20), end to end through the public API and real parts.

4 ranks as 2 "nodes" (node = rank // 2) run tests/memtier_worker.py (a DDP loop over gloo on 127.0.0.1,
launched like torchrun), saving every step to the memory tier (each node's memory root its own tmpfs mount,
made here), every 3rd step to node-local disk roots and every 6th to a loopback S3 remote (moto) behind the
request-counting proxy of tests/countproxy.py. A node loss: every rank is SIGKILLed after step 7 (the whole
job restarts), node 1's memory and disk roots are wiped (its tmpfs unmounted and mounted afresh), and the job
restarts to step 10. The killed run is done once per module and its roots and remote prefix snapshotted; each
scenario restores them to the same paths before it damages anything.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch

from countproxy import CountingProxy  # noqa: E402
from dist import Job  # noqa: E402
from training import check_against_reference  # noqa: E402
from helpers import TESTS  # noqa: E402

WORKER = TESTS / "memtier_worker.py"
STEPS, KILL_AFTER = 10, 7
pytestmark = pytest.mark.slow


# -- tmpfs mounts --------------------------------------------------------------------------------------------------
def mount_tmpfs(path: Path, size: str = "256m") -> Path:
    """A fresh tmpfs at ``path`` (a RAM-backed memory root, as on a real node). Skips when mounting fails."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {path} (needs root): {r.stderr.strip()}")
    return path


def umount(path: Path) -> None:
    if os.path.ismount(path):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def wipe_mount(path: Path) -> None:
    """A node's RAM is gone: unmount its tmpfs and mount an empty one."""
    umount(path)
    mount_tmpfs(path)


@pytest.fixture
def tmpfs_dirs(tmp_path):
    made: List[Path] = []

    def make(name: str, size: str = "256m") -> Path:
        made.append(mount_tmpfs(tmp_path / name, size))
        return made[-1]

    yield make
    for p in made:
        umount(p)


# -- helpers -------------------------------------------------------------------------------------------------------
def read_losses(log_dir: Path, world: int = 4) -> Dict[int, Dict[int, List[float]]]:
    """rank -> step -> every loss that rank logged for the step, in order."""
    out: Dict[int, Dict[int, List[float]]] = {}
    for r in range(world):
        f = log_dir / f"loss-rank{r}.jsonl"
        d: Dict[int, List[float]] = {}
        for line in (f.read_text().splitlines() if f.exists() else []):
            rec = json.loads(line)
            d.setdefault(int(rec["step"]), []).append(rec["loss"])
        out[r] = d
    return out


def tree_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if os.path.isfile(os.path.join(d, f)))


def step_dir(root: Path, step: int) -> Path:
    return root / "steps" / f"{step:012d}"


def manifest(root: Path, step: int, rank: int):
    from ckptstore.format.manifest import decode_manifest
    p = step_dir(root, step) / f"manifest-rank{rank:05d}.msgpack"
    return decode_manifest(p.read_bytes(), step=step, rank=rank, what=str(p))


def committed(root: Path) -> List[int]:
    from ckptstore import Store
    with Store(root, read_only=True, rank=0, world_size=1) as s:
        return s.steps()


def outputs(job: Job) -> str:
    return "\n".join(f"--- rank {r}\n{t[-2500:]}" for r, t in sorted(getattr(job, "outputs", {}).items()))


# -- the node-loss run, once per module ----------------------------------------------------------------------------
class Cluster:
    """Paths, remote and proxy of the module's 4-rank runs."""

    def __init__(self, base: Path, s3_server, proxy: CountingProxy):
        self.base, self.s3, self.proxy = base, s3_server, proxy
        url = s3_server.new_bucket_url()
        self.bucket, _, path = url[len("s3://"):].partition("/")
        self.path = path.strip("/") + "/" if path.strip("/") else ""
        self.url = url
        self.so = dict(s3_server.storage_options(), endpoint_url=proxy.endpoint)
        self.mounts: List[Path] = []

    def mount(self, p: Path) -> Path:
        self.mounts.append(mount_tmpfs(p))
        return p

    def args(self, run: str, *extra: str) -> List[str]:
        d = self.base / run
        return ["--disk", f"{d}/disk{{node}}", "--mem", f"{d}/mem{{node}}", "--remote", f"{self.url}/{run}",
                "--so", json.dumps(self.so), "--steps", str(STEPS), "--log", str(d / "log"), *extra]

    def prepare(self, run: str) -> Path:
        d = self.base / run
        for n in (0, 1):
            self.mount(d / f"mem{n}")
            (d / f"disk{n}").mkdir(parents=True, exist_ok=True)
        (d / "log").mkdir(parents=True, exist_ok=True)
        return d

    # remote prefixes, copied with the S3 client (the snapshot of the killed run's remote)
    def keys(self, prefix: str) -> List[str]:
        c = self.s3.client()
        out, token = [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": self.path + prefix + "/"}
            if token:
                kw["ContinuationToken"] = token
            page = c.list_objects_v2(**kw)
            out += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def copy_prefix(self, src: str, dst: str) -> None:
        c = self.s3.client()
        for k in self.keys(dst):
            c.delete_object(Bucket=self.bucket, Key=k)
        for k in self.keys(src):
            new = self.path + dst + k[len(self.path + src):]
            c.copy_object(Bucket=self.bucket, Key=new, CopySource={"Bucket": self.bucket, "Key": k})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_server):
    if s3_server.is_external:
        pytest.skip("counts requests through a proxy in front of the loopback moto server")
    base = tmp_path_factory.mktemp("memtier")
    with CountingProxy(s3_server.port) as proxy:
        c = Cluster(base, s3_server, proxy)
        try:
            # the uninterrupted reference
            d = c.prepare("ref")
            job = Job(4, *c.args("ref"), script=WORKER)
            res = job.check(240)
            assert all(r and r["resumed"] == 0 for r in res.values()), res
            c.ref = {r: {s: v[0] for s, v in log.items()} for r, log in read_losses(d / "log").items()}
            assert all(sorted(v) == list(range(1, STEPS + 1)) for v in c.ref.values()), c.ref
            assert len({json.dumps(v) for v in c.ref.values()}) == 4, "the ranks' losses should differ"

            # the run killed after step 7 (committed in memory on every rank, step 6 on disk and remote)
            d = c.prepare("run")
            job = Job(4, *c.args("run", "--hold-after", str(KILL_AFTER)), script=WORKER)
            deadline = time.monotonic() + 180
            while not all((d / "log" / f"held-rank{r}").exists() for r in range(4)):
                dead = [r for r, p in enumerate(job.procs) if p.poll() is not None]
                if dead or time.monotonic() > deadline:
                    for p in job.procs:
                        p.kill()
                    out = "\n".join(f"--- rank {r}\n{p.communicate()[0][-2500:]}" for r, p in enumerate(job.procs))
                    pytest.fail(f"killed run: ranks {dead} exited before holding at step {KILL_AFTER} "
                                f"(or it timed out):\n{out}")
                time.sleep(0.1)
            job.kill()                                    # SIGKILL every rank: the whole job goes down
            assert all(p.returncode == -9 for p in job.procs), [p.returncode for p in job.procs]
            for n in (0, 1):
                assert committed(d / f"mem{n}")[-1] == KILL_AFTER, (n, committed(d / f"mem{n}"))
            assert committed(d / "disk0")[-1] == 6, committed(d / "disk0")
            assert c.proxy.counts["PUT"] > 0, "the runs' uploads did not go through the counting proxy"
            remote = c.keys("run")
            assert any(k.endswith(f"run/steps/{6:012d}/COMMIT") for k in remote), remote  # every=6 uploaded
            assert not any(f"steps/{KILL_AFTER:012d}/" in k for k in remote), remote
            snap = base / "snap"
            for name in ("disk0", "disk1", "mem0", "mem1", "log"):
                shutil.copytree(d / name, snap / name, symlinks=True)
            c.copy_prefix("run", "snap")
            c.run_dir, c.snap = d, snap
            yield c
        finally:
            for p in c.mounts:
                umount(p)


def restore(c: Cluster) -> Path:
    """The killed run's roots, logs and remote prefix as they were at the kill, at the same paths."""
    d = c.run_dir
    for name in ("disk0", "disk1", "log"):
        shutil.rmtree(d / name, ignore_errors=True)
        shutil.copytree(c.snap / name, d / name, symlinks=True)
    for n in (0, 1):
        wipe_mount(d / f"mem{n}")
        shutil.copytree(c.snap / f"mem{n}", d / f"mem{n}", symlinks=True, dirs_exist_ok=True)
    c.copy_prefix("snap", "run")
    return d


def lose_node1(d: Path) -> None:
    """Node 1 (ranks 2 and 3) is replaced: its RAM and its local disk are empty."""
    wipe_mount(d / "mem1")
    shutil.rmtree(d / "disk1")
    (d / "disk1").mkdir()


def restart(c: Cluster, name: str, *extra: str) -> dict:
    c.proxy.mark(f"{name}-restart")
    job = Job(4, *c.args("run", "--mark", c.proxy.endpoint, *extra), script=WORKER)
    res = job.check(240)
    c.last_requests = c.proxy.requests_between(f"{name}-restart", "resumed")
    c.last_output = outputs(job)
    return res


def check_losses(c: Cluster) -> None:
    for r, log in read_losses(c.run_dir / "log").items():
        check_against_reference(log, c.ref[r], STEPS)


def object_reads(requests) -> List[str]:
    """GETs of a step's contents (blobs, packs, manifests, shard maps) among ``requests``."""
    return [t for m, t in requests if m == "GET" and any(s in t for s in ("/objects/", "/packs/", "manifest-",
                                                                             "shards"))]


# -- 1. node loss: rebuilt from peers' memory, nothing read from S3 -----------------------------------------------
def peers_restart(c: Cluster) -> dict:
    """Node 1 lost after step 7, the job restarted to step 10 (once per module; both tests below read it)."""
    if getattr(c, "peers", None) is None:
        d = restore(c)
        # what node 1 lost: ranks 2 and 3's parts of step 7, as node 0 holds their replicas
        lost = {ch.blob_id: ch.nbytes for r in (2, 3) for ch in manifest(d / "mem0", KILL_AFTER, r).chunk_refs()}
        lose_node1(d)
        res = restart(c, "peers")
        c.peers = {"res": res, "lost_unique": sum(lost.values()), "requests": c.last_requests,
                   "mem": {n: committed(d / f"mem{n}") for n in (0, 1)}, "losses": read_losses(d / "log")}
    return c.peers


def test_node_loss_resumes_from_peer_memory_bit_for_bit(cluster):
    got = peers_restart(cluster)
    for r, out in got["res"].items():
        rf = out["resumed_from"]
        assert out["resumed"] == KILL_AFTER and rf["tier"] == "memory" and rf["step"] == KILL_AFTER, (r, rf)
    for r, log in got["losses"].items():
        check_against_reference(log, cluster.ref[r], STEPS)
    reads = object_reads(got["requests"])
    assert reads == [], f"the resume read the step's contents from S3: {reads}"
    peer = {r: out["resumed_from"].get("peer_bytes", 0) for r, out in got["res"].items()}
    assert peer[0] == peer[1] == 0 and peer[2] + peer[3] > 0, peer      # only the lost node received
    # both nodes' memory roots went on to step 10 (node 1's rebuilt, then saved to again)
    assert STEPS in got["mem"][0] and STEPS in got["mem"][1], got["mem"]


def test_node_loss_moves_no_more_than_the_lost_unique_chunks(cluster):
    """Issue 20: the rebuild moves no more than the lost node's unique chunks (by chunk id) between peers."""
    got = peers_restart(cluster)
    peer = {r: out["resumed_from"].get("peer_bytes", 0) for r, out in got["res"].items()}
    assert sum(peer.values()) <= got["lost_unique"], (
        f"peers sent {peer} = {sum(peer.values())} bytes, more than the unique chunk bytes of ranks 2 and 3's "
        f"parts of step {KILL_AFTER} ({got['lost_unique']})")


def test_node_loss_resolve_then_restore_takes_the_memory_step(cluster):
    """The trainers' way (Store.resolve, then Store.restore of that step, issue 29): resolve names the memory
    step the nodes hold whole, and restore rebuilds node 1's parts from its peers and loads it, bit for bit
    (it used to raise FileNotFoundError: restore read only the disk and the remote)."""
    c = cluster
    d = restore(c)
    lose_node1(d)
    res = restart(c, "resolve", "--resume-by", "resolve")
    for r, out in res.items():
        rf = out["resumed_from"]
        assert out["resumed"] == KILL_AFTER and rf["tier"] == "memory" and rf["step"] == KILL_AFTER, (r, rf)
    peer = {r: out["resumed_from"].get("peer_bytes", 0) for r, out in res.items()}
    assert peer[0] == peer[1] == 0 and peer[2] + peer[3] > 0, peer
    assert object_reads(c.last_requests) == [], c.last_requests
    check_losses(c)


# -- 2. a corrupt replica, and both replicas lost: the next tier, once ---------------------------------------------
def test_corrupt_replica_falls_back_to_disk_or_remote(cluster):
    c = cluster
    d = restore(c)
    lose_node1(d)
    # a byte of a chunk only ranks 2/3 hold (their RNG state, never a model chunk every rank shares)
    others = {ch.blob_id for r in (0, 1) for ch in manifest(d / "mem0", KILL_AFTER, r).chunk_refs()}
    mine = [ch for ch in manifest(d / "mem0", KILL_AFTER, 2).chunk_refs() if ch.blob_id not in others
            and ch.nbytes > 0]
    assert mine, "rank 2 has no chunk of its own"
    ch = max(mine, key=lambda x: x.nbytes)
    if ch.pack is not None:
        f, at = d / "mem0" / "packs" / ch.pack[:2] / f"{ch.pack}.pack", ch.offset + ch.stored_nbytes // 2
    else:
        f = next(p for p in (d / "mem0" / "objects" / ch.blob_id[:2]).glob(ch.blob_id + "*"))
        at = f.stat().st_size // 2
    assert f.is_file(), f
    with open(f, "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 0x40]))

    res = restart(c, "corrupt")
    for r, out in res.items():
        rf = out["resumed_from"]
        assert out["resumed"] == 6 and rf["tier"] in ("local", "remote") and rf["step"] == 6, (r, rf, c.last_output)
    check_losses(c)


def test_both_replicas_lost_resumes_from_newest_disk_or_remote_step(cluster):
    c = cluster
    d = restore(c)
    lose_node1(d)
    wipe_mount(d / "mem0")
    res = restart(c, "both")
    for r, out in res.items():
        rf = out["resumed_from"]
        assert out["resumed"] == 6 and rf is not None and rf["tier"] in ("local", "remote"), (r, rf)
    assert res[2]["resumed_from"]["tier"] == "remote", res[2]   # node 1's disk is empty: only S3 has step 6
    # the proxy sees reads of a step's contents when there are some (the 0 of the node-loss test is not vacuous)
    assert object_reads(c.last_requests), c.last_requests
    check_losses(c)


# -- 3. capacity -----------------------------------------------------------------------------------------------------
def test_capacity_is_respected_oldest_first_newest_kept(tmp_path, tmpfs_dirs):
    from ckptstore import Memory, Store
    mem = tmpfs_dirs("mem", "64m")
    cap = 10 << 20
    n = 768 * 1024                                                # 3 MiB of float32, new bytes every step

    def value(step):
        return torch.randn(n, generator=torch.Generator().manual_seed(step))

    seen = []
    with Store(tmp_path / "disk", memory=Memory(str(mem), every=1, disk_every=1000, capacity=cap, keep=100,
                                               replicas=0)) as store:
        for step in range(1, 13):
            store.save({"x": value(step), "step": step}, step, blocking=False)
            store.wait()
            used = tree_bytes(mem)
            assert used <= cap, f"after step {step}: memory root holds {used} bytes > capacity {cap}"
            steps = committed(mem)
            assert steps and steps[-1] == step, (step, steps)          # the newest committed one is there
            assert steps == list(range(steps[0], step + 1)), (step, steps)  # older ones went first
            seen.append(steps)
    assert seen[-1][0] > 1, f"nothing was ever dropped: {seen}"   # 12 x 3 MiB cannot fit in 10 MiB
    with Store(mem, read_only=True, rank=0, world_size=1) as s:
        for step in seen[-1]:
            got = s.load(step)
            assert torch.equal(got["x"], value(step)) and got["step"] == step, step


def test_memory_root_holds_what_its_kept_steps_reference_and_orphans_go(tmp_path, tmpfs_dirs):
    """After every memory commit the root holds exactly the chunks its kept steps reference (the dropped step's
    go, one it shares with a kept step stays); a chunk no step references (a killed save's) is gone within
    FULL_SWEEP_EVERY more saves."""
    from ckptstore import Memory, Store
    from ckptstore.format.layout import parse_blob_name, parse_pack_name
    from ckptstore.memtier.memory import FULL_SWEEP_EVERY
    mem = tmpfs_dirs("mem", "64m")
    const = torch.arange(5 << 18, dtype=torch.float32)             # 5 MiB: a blob, the same bytes every step

    def state(step):
        g = torch.Generator().manual_seed(step)
        return {"const": const, "x": torch.randn(5 << 18, generator=g), "small": torch.randn(999, generator=g),
                "step": step}

    def stored():
        blobs = {parse_blob_name(f.name)[0] for f in (mem / "objects").glob("*/*") if parse_blob_name(f.name)}
        packs = {parse_pack_name(f.name) for f in (mem / "packs").glob("*/*") if parse_pack_name(f.name)}
        return blobs, packs

    orphan = "ab" + "c" * 62
    last = 4 + FULL_SWEEP_EVERY
    with Store(tmp_path / "disk", memory=Memory(str(mem), every=1, disk_every=1000, keep=2, replicas=0)) as store:
        for step in range(1, last + 1):
            if step == 4:                                          # after the first drop's sweep
                (mem / "objects" / "ab").mkdir(exist_ok=True)
                (mem / "objects" / "ab" / orphan).write_bytes(b"left by a killed save")
            store.save(state(step), step)
            steps = committed(mem)
            assert steps == list(range(max(1, step - 1), step + 1)), (step, steps)
            ms = [manifest(mem, s, 0) for s in steps]
            blobs, packs = stored()
            want = set().union(*(m.blob_ids() for m in ms)), set().union(*(m.pack_ids() for m in ms))
            assert (blobs - {orphan}, packs) == want, f"after step {step}: stored {blobs, packs}, referenced {want}"
    assert orphan not in stored()[0], f"an unreferenced blob outlived {FULL_SWEEP_EVERY} sweeps"
    with Store(mem, read_only=True, rank=0, world_size=1) as s:
        for step in (last - 1, last):
            got = s.load(step)
            assert torch.equal(got["const"], const) and torch.equal(got["x"], state(step)["x"]), step


# -- 4. a peer killed during replication ----------------------------------------------------------------------------
def test_peer_killed_during_replication_leaves_step_uncommitted(tmp_path, tmpfs_dirs):
    k = 3
    for n in (0, 1):
        tmpfs_dirs(f"mem{n}", "64m")
        (tmp_path / f"disk{n}").mkdir()
    (tmp_path / "log").mkdir()
    job = Job(4, "--disk", f"{tmp_path}/disk{{node}}", "--mem", f"{tmp_path}/mem{{node}}", "--log",
              str(tmp_path / "log"), "--die-at", str(k), "--die-rank", "3", "--timeout", "6",
              "--collective-timeout", "10", script=WORKER)
    res = job.wait(120)                # raises (and kills the job) if anything hangs past the deadline
    out = outputs(job)
    assert job.procs[3].returncode == -9 and f"dying: step {k}: sending" in job.outputs[3], out
    for r in (0, 1, 2):
        assert job.procs[r].returncode == 0, out
        assert res[r] and res[r]["error"] and res[r]["checkpoint_error"], (r, res[r], out)
    for n in (0, 1):
        mem = tmp_path / f"mem{n}"
        assert not (step_dir(mem, k) / "COMMIT").exists(), f"step {k} committed in node {n}'s memory"
        steps = committed(mem)
        assert k - 1 in steps and k not in steps, (n, steps)
