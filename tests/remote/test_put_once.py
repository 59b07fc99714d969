"""An object several node-local roots hold is PUT once per job, not once per node (issue 29 item 5), and the
remote step still commits only once every object it needs is there.

Real multi-process jobs (tests/request_worker.py: 4 ranks on two "nodes", node-local roots of 2 ranks, gloo on
127.0.0.1) against the loopback moto S3 server, every request counted by tests/countproxy.py. ``hsdp``: DTensors
replicated over the nodes and sharded within them (each shard on both nodes: same blobs, same packs); ``ddp``:
every rank holds the same values, saved without ``replicated=`` (byte-identical packs on every rank).
"""
from __future__ import annotations

import json
import threading
import time

import fsspec
import pytest

from ckptstore.format.layout import commit_path, step_dir  # noqa: E402
from countproxy import measure, object_puts, run_job  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402

pytestmark = [pytest.mark.remote, pytest.mark.slow]


@pytest.mark.parametrize("state", ["hsdp", "ddp", "hsdp-table"])
def test_an_object_several_nodes_hold_is_put_once_per_save(tmp_path, s3_bucket_url, proxy, state, monkeypatch):
    """Two saves of a 2-node job: every blob and pack is PUT by one node only (before issue 29: by each node
    holding it, 2 PUTs of every HSDP object, of the DDP packs), and a job on empty disks resumes the newest
    step from the remote, bit for bit (the worker checks its values). ``hsdp-table``: the same with commit
    markers naming a manifest table (as past 512 ranks: ``CKPTSTORE_INLINE_ROWS=0``), where a node-local root
    holds only its own ranks' rows: its leader also gets the rows of the owners its ranks' objects are left to
    (before: it could confirm no owner's manifest and uploaded everything itself)."""
    url, so = s3_bucket_url
    if state.endswith("-table"):
        monkeypatch.setenv("CKPTSTORE_INLINE_ROWS", "0")
        state = state[:-len("-table")]
    got = measure(proxy, url, so, str(tmp_path), 4, per_node=2, steps=2, shared_kib=4200, state=state)
    for k in (1, 2):
        puts = object_puts(got[f"requests_save{k}"])
        assert puts, (k, got[f"requests_save{k}"])
        assert max(puts.values()) == 1, (k, {p: n for p, n in puts.items() if n > 1})
    assert got["resumed_step"] == 2


def test_replicas_that_differ_are_uploaded_by_their_own_node(tmp_path, s3_bucket_url, proxy):
    """HSDP replicas whose bytes differ between the nodes (the shard map calls them replicas; their chunk ids
    differ): the second node leaves them to the first, finds them missing from the first node's manifest on
    the remote, and uploads them itself before its manifests, so the step commits with every object it needs
    (a node that skipped them unconfirmed leaves the remote step unloadable) and the identical ones are still
    PUT once."""
    url, so = s3_bucket_url
    got = measure(proxy, url, so, str(tmp_path), 4, per_node=2, steps=2, shared_kib=4200, state="hsdp",
                  args=("--diverge",))
    for k in (1, 2):
        puts = object_puts(got[f"requests_save{k}"])
        assert max(puts.values()) == 1, (k, puts)
    assert got["resumed_step"] == 2               # every value of every rank came back from the remote


def test_a_failing_owner_node_leaves_the_step_uncommitted_and_a_later_upload_commits_it(
        tmp_path, s3_server, s3_bucket_url, proxy):
    """Two nodes of one rank each (the property is between nodes: more ranks per node add process start-ups,
    not cases). Node 0 (rank 0's: it owns the objects both nodes hold, and commits) stops reaching the remote
    after step 1 is uploaded. Node 1 leaves step 2's shared objects to it, waits for node 0's manifests for its retry
    deadline, then uploads them itself. The remote never shows step 2 (no commit marker; its latest pointer
    stays at step 1, which a job on empty disks resumes). Once node 0 reaches the remote again, a restarted job
    uploads step 2 from the node-local disks and commits it, and a job on empty disks resumes step 2 bit for
    bit (the worker checks every rank's values)."""
    url, so = s3_bucket_url
    opts = json.dumps(dict(so, endpoint_url=proxy.endpoint))
    common = ("--remote", url, "--so", opts, "--per-node", "1", "--shared-kib", "4200", "--state", "hsdp",
              "--deadline", "4")
    saved = str(tmp_path / "save" / "node{node}")
    hold = tmp_path / "hold"
    hold.mkdir()
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **so)
    root = url[len("s3://"):].rstrip("/")
    with FaultProxy(proxy.port) as fault:
        def cut_node0():                          # after step 1 is uploaded: node 0 reaches nothing
            deadline = time.monotonic() + 240
            while "save1" not in proxy.marks and time.monotonic() < deadline:
                time.sleep(0.05)
            fault.refuse_all()
            (hold / "go1").touch()
        cutter = threading.Thread(target=cut_node0, daemon=True)
        cutter.start()
        res = run_job(2, "--mode", "save", "--store", saved, *common, "--steps", "2", "--hold", str(hold),
                      "--node0-endpoint", fault.endpoint, "--upload-errors")
        cutter.join()
        assert res["upload_errors"], res          # rank 0's uploader could not upload step 2
        fs.invalidate_cache()
        assert not fs.exists(f"{root}/{commit_path(2)}")
        names = [p.rsplit("/", 1)[1] for p in fs.ls(f"{root}/{step_dir(2)}")]
        assert any("rank00001" in n for n in names), names     # node 1 uploaded its parts (objects first)
        # the newest step the remote shows is step 1, and it resumes on empty disks
        res = run_job(2, "--mode", "resume", "--store", str(tmp_path / "fresh1" / "node{node}"), *common)
        assert res["resumed"] == 1 and res["tier"] == "remote", res
        fault.refuse = False
        # node 0 is back: the restarted job resumes step 2 from its disks and uploads it
        res = run_job(2, "--mode", "resume", "--store", saved, *common, "--node0-endpoint", fault.endpoint)
        assert res["resumed"] == 2, res
    res = run_job(2, "--mode", "resume", "--store", str(tmp_path / "fresh2" / "node{node}"), *common)
    assert res["resumed"] == 2 and res["tier"] == "remote", res
