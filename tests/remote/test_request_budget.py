"""Object-store request budget (issue 19): real HTTP requests counted, by kind, per save and per resume of real
multi-process jobs (gloo on 127.0.0.1, launched like torchrun) against the loopback moto S3 server, through the
counting proxy of tests/countproxy.py.

The budget stated (and asserted at 4 and 8 ranks on node-local roots of 2 ranks: 2 and 4 nodes), for a
steady-state save of a state whose ranks each write new bytes:

    requests per save, LISTs aside <= 2 * ranks + ceil(unique bytes / pack size) + 5 * nodes + 6
    LISTs per save: one per round of rank 0's wait for the other nodes' manifests (one page per 1,000 ranks)

* ``ranks``: each rank's manifest (one PUT);
* ``ranks + ceil(unique bytes / pack size)``: the new data objects (each rank packs its own new bytes: at most
  one partial pack per rank; a pack or blob of more than 16 MiB adds a HEAD);
* ``5 * nodes``: each node uploader's fixed work (its in-flight marker: PUT, GET, DELETE; the gc lease and the
  gc epoch: one GET each);
* ``6``: rank 0's shard map, commit marker and latest pointer (GET + conditional PUT), and slack of 2.

Rank 0 no longer reads the other ranks' manifests back: a step whose prefix did not exist when its uploader
listed the remote is trusted from one listing with sizes (tests/remote/test_request_budget.py checks the count;
the argument is in StepCopier._await_other_parts). Resume discovery (rank 0 only, its answer broadcast): the
latest pointer (GET), its commit marker (HEAD), the step directories after it (one LIST from ``StartAfter``);
rank 0's uploader start does the same once more. The LIST count of a resume grows with neither the number of
ranks nor of steps, and no other rank lists the bucket.
"""
from __future__ import annotations

import math

import pytest

from countproxy import measure  # noqa: E402

pytestmark = pytest.mark.remote

PER_NODE = 2          # ranks per node-local root: 4 and 8 ranks are 2 and 4 nodes
PACK = 64 << 20


def budget(ranks: int, unique_bytes: int) -> int:
    nodes = math.ceil(ranks / PER_NODE)
    return 2 * ranks + math.ceil(unique_bytes / PACK) + 5 * nodes + 6


def lists(requests):
    return [t for m, t in requests if m == "GET" and t.split("?")[0].strip("/").count("/") == 0]


@pytest.mark.slow
def test_requests_per_save_and_resume_stay_within_budget_at_4_and_8_ranks(tmp_path, s3_bucket_url, proxy):
    """Doubling both the ranks and the nodes (4 ranks on 2 nodes, 8 on 4) keeps every count within the budget
    and the LISTs of a resume unchanged. (Run as 4 and 16 ranks of 4 per node before: twice the processes for
    the same growth; benchmarks/bench_requests.py measures larger jobs.)"""
    url, so = s3_bucket_url
    got = {}
    for n in (4, 8):
        got[n] = measure(proxy, f"{url}/n{n}", so, str(tmp_path / f"n{n}"), n, per_node=PER_NODE, steps=2)
        assert got[n]["resumed_step"] == 2, got[n]
    for n, g in got.items():
        save = g["save2"]
        unique = n * 1024                          # each rank's 1 KiB of new bytes (the replicated value is old)
        assert sum(save.values()) - save["LIST"] <= budget(n, unique), (n, dict(save), budget(n, unique))
        assert save["LIST"] <= 8, (n, dict(save))  # rank 0's waiting rounds; never one per node or per rank
        # no object written twice in a save, and no manifest looked up or read back
        puts = [t for m, t in g["requests_save2"] if m == "PUT"]
        assert len(puts) == len(set(puts)), sorted(t for t in puts if puts.count(t) > 1)
        assert not [t for m, t in g["requests_save2"] if m in ("HEAD", "GET") and "/manifest-" in t]
        # resume discovery: pointer, its marker, one LIST after it (and the same at the uploader's start);
        # the ranks never list the bucket; a resume costs a handful of requests per rank
        starts = lists(g["requests_resume"] + g["requests_resume_settled"])
        assert len(starts) == g["resume_settled"]["LIST"] <= 2 and all("start-after" in t for t in starts), starts
        assert sum(g["resume_settled"].values()) <= 8 * n + 16, (n, dict(g["resume_settled"]))
    # O(1): the LISTs of a resume do not grow from 4 to 8 ranks (2 to 4 nodes)
    assert got[8]["resume_settled"]["LIST"] == got[4]["resume_settled"]["LIST"]
    # a start reads the manifests of its own node's ranks only, not all 8
    start_reads = [t for m, t in got[8]["requests_resume_settled"] if m == "GET" and "/manifest-" in t]
    assert len(start_reads) <= PER_NODE, start_reads


def test_resume_lists_the_same_whatever_the_number_of_steps(tmp_path, s3_bucket_url, proxy):
    """Discovery reads the latest pointer: a resume after 6 saves lists the bucket as often as one after 1."""
    url, so = s3_bucket_url
    one = measure(proxy, f"{url}/one", so, str(tmp_path / "one"), 2, per_node=1, steps=1)
    six = measure(proxy, f"{url}/six", so, str(tmp_path / "six"), 2, per_node=1, steps=6)
    assert (one["resumed_step"], six["resumed_step"]) == (1, 6)

    def discovery(g):             # LISTs, and lookups of commit markers (the data read depends on the step)
        reqs = g["requests_resume"] + g["requests_resume_settled"]
        return len(lists(reqs)), sum(1 for m, t in reqs if m == "HEAD" and t.endswith("/COMMIT"))
    assert discovery(six) == discovery(one), (discovery(one), discovery(six))
    assert discovery(six)[0] <= 2


@pytest.mark.parametrize("status", [429])     # 503 SlowDown: tests/remote/test_network_faults.py's fates
def test_throttled_requests_are_retried_with_backoff_and_the_upload_completes(tmp_path, s3_bucket_url, status):
    """While a third of the connections are answered ``503 SlowDown`` (S3's throttling) or ``429 Too Many
    Requests`` (GCS's, some S3-compatible servers'), saves still reach the remote and a fresh disk resumes the
    newest step bit for bit: both are classified as throttling and retried with backoff (ckptstore.util.retry), never
    taken for damage or a missing object."""
    import torch
    from ckptstore import Remote, Store
    from ckptstore.util.retry import RetryPolicy
    from faultproxy import FaultProxy

    url, opts = s3_bucket_url
    upstream = int(opts["endpoint_url"].rsplit(":", 1)[1].split("/")[0])
    with FaultProxy(upstream, seed=3, weights=(0, 1, 0, 0, 2), slowdown_status=status) as proxy:
        # botocore's own retries off: every throttled answer reaches ckptstore's policy
        popts = dict(opts, endpoint_url=proxy.endpoint, config_kwargs={"retries": {"max_attempts": 1}})
        retry = RetryPolicy(deadline=60, op_timeout=20, backoff=0.02, max_backoff=0.2)
        proxy.faults = True
        with Store(tmp_path / "local", remote=Remote(url, retry=retry), storage_options=popts) as s:
            for step in (1, 2):
                s.save({"w": torch.full((4096,), float(step)), "step": step}, step)
            s.wait_for_uploads(120)
        proxy.faults = False
    assert proxy.counts["slowdown"] >= 3, dict(proxy.counts)
    with Store(tmp_path / "fresh", remote=Remote(url, upload=False), storage_options=opts) as r:
        target = {"w": torch.zeros(4096), "step": 0}
        assert r.resume(target) == 2
        assert torch.equal(target["w"], torch.full((4096,), 2.0))


def test_a_restart_on_fewer_nodes_reads_what_its_disk_lacks_from_the_remote_without_calling_it_damage(
        tmp_path, s3_bucket_url):
    """4 FSDP ranks on two "nodes" (node-local roots of 2 ranks) save to S3; the job restarts as 2 ranks, one on
    each old disk. Node 1's disk holds saved ranks 2-3's parts, and its rank now needs others' shards too: that
    is a different layout, not damage. Its rank reads the overlapping ranges from the remote, logs no
    "damaged", pulls nothing into the disk, and the state is bit for bit the saved one."""
    import json

    from dist import Job, run
    from helpers import step_dir
    from test_distributed import assert_same_state, full

    url, so = s3_bucket_url
    run(4, "--mode", "save", "--store", str(tmp_path / "node{node}"), "--remote", url, "--so", json.dumps(so),
        "--steps", "2", "--full", str(tmp_path / "w.pt"))
    job = Job(2, "--mode", "load", "--store", str(tmp_path / "node{rank}"), "--remote", url, "--so", json.dumps(so),
              "--full", str(tmp_path / "g.pt"))
    res = job.check()
    assert [res[r]["step"] for r in range(2)] == [2, 2]
    assert res[1]["tier"] == "remote"
    assert not any("damaged" in out for out in job.outputs.values()), job.outputs[1][-3000:]
    names = sorted(p.name for p in step_dir(tmp_path / "node1", 2).glob("manifest-*"))
    assert names == ["manifest-rank00002.msgpack", "manifest-rank00003.msgpack"]
    assert_same_state(full(tmp_path / "g.pt")["state"], full(tmp_path / "w.pt")["state"])


def test_replicas_on_several_nodes_put_a_shared_blob_once(tmp_path, s3_bucket_url, proxy):
    """A 4.1 MiB value that every rank holds alike (data-parallel replicas, saved without ``replicated=``) is a
    blob of its own; with two nodes, only rank 0's node puts it (never two writers on one object name), and
    every rank of a new job on empty disks gets it back."""
    url, so = s3_bucket_url
    got = measure(proxy, url, so, str(tmp_path), 4, per_node=2, steps=1, shared_kib=4200)
    puts = [t for m, t in got["requests_save1"] if m == "PUT" and "/objects/" in t]
    assert len(puts) == 1, puts
    assert got["resumed_step"] == 1


def test_one_process_lists_the_remote_once_per_start(tmp_path, s3_bucket_url, proxy):
    """A first save into an empty remote lists it once, and not on the save's path: opening the store lists it
    in the background (one GET of the latest pointer, one LIST), the save's rewind check and the uploader's
    start take that listing. After a resume, the store's listing and the resume's own are the two; the
    uploader's start and the next save's rewind check take the first."""
    import time

    import torch

    from ckptstore import Remote, Store
    url, so = s3_bucket_url
    so = dict(so, endpoint_url=proxy.endpoint)
    state = {"w": torch.arange(1000.0), "step": 0}

    def pointer_reads_and_lists(since):
        reqs = proxy.requests[since:]
        return sum(1 for m, t in reqs if m == "GET" and t.split("?")[0].endswith("/latest")), len(lists(reqs))

    n = len(proxy.requests)
    s = Store(tmp_path / "a", remote=Remote(url), storage_options=so)
    deadline = time.monotonic() + 30
    while not lists(proxy.requests[n:]) and time.monotonic() < deadline:     # the store's background listing
        time.sleep(0.05)
    before_save = len(proxy.requests)
    s.save(state, 1)
    assert lists(proxy.requests[n:before_save]), "the store listed nothing before its first save"
    s.wait_for_uploads(timeout=60)
    s.close()
    # the listing's pointer read and LIST, then the pointer move's read (create-only pointers are read first)
    assert pointer_reads_and_lists(n) == (2, 1), proxy.requests[n:]

    n = len(proxy.requests)
    s = Store(tmp_path / "b", remote=Remote(url), storage_options=so)
    assert s.resume(state) == 1
    s.save(dict(state, w=torch.arange(1000.0) + 1), 2)
    s.wait_for_uploads(timeout=60)
    s.close()
    assert pointer_reads_and_lists(n) == (3, 2), proxy.requests[n:]
