"""Issue 29: the memory tier's replication connects a rank to its ring peers only, not to every rank.

4 ranks as 2 "nodes" (node = rank // 2) run tests/memtier_worker.py (DDP over gloo on 127.0.0.1, launched like
torchrun) for 2 steps saved to the memory tier with ``replicas=1``: each rank's ring peer is the rank with its
local index on the other node. Each rank counts its established TCP connections (psutil)
other than the c10d store's and those open before ``Store()`` (the training's default gloo group): what
ckptstore opened to peers. A full gloo mesh opens ``world_size - 1 = 3`` at ``Store()``.
"""
from __future__ import annotations

from ckptstore.format.layout import commit_path, manifest_path
from dist import Job  # noqa: E402
from helpers import TESTS  # noqa: E402

WORKER = TESTS / "memtier_worker.py"


def test_memory_tier_connects_only_to_its_ring_peers(tmp_path):
    (tmp_path / "log").mkdir()
    job = Job(4, "--disk", f"{tmp_path}/disk{{node}}", "--mem", f"{tmp_path}/mem{{node}}", "--log",
              str(tmp_path / "log"), "--steps", "2", "--connections", script=WORKER)
    res = job.check(120)
    for r, out in res.items():
        c = out["connections"]
        assert c["peers"] == [r ^ 2], (r, c)              # the same local rank on the other node
        assert c["store"] == 0, (r, c, "Store() connected to peers before any exchange")
        # after replicated saves (checked below): the ring peer's one connection, nothing more
        assert c["saved"] == len(c["peers"]), (r, c)
    for n in (0, 1):            # each node's memory root holds step 2 whole: its own parts and the other node's
        mem = tmp_path / f"mem{n}"
        assert (mem / commit_path(2)).exists(), n
        assert all((mem / manifest_path(2, r)).exists() for r in range(4)), (n, sorted(mem.rglob("*")))
