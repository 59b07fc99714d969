"""Issue 29: a memory step of a job past ``mtable.INLINE_ROWS`` ranks (its commit marker names a manifest table) is
rebuilt from the peers' memory after a node loss, as an inline marker's step is.

A table marker's rows are in rank 0's root only; every other root holds rows files of the ranks whose parts it
holds: its own ranks' (from its leader) and, in the memory tier, the replicas it took from the other nodes (each
rank writes those once the step is committed), and a rank rebuilt from a peer (the holder sends the part's row
with it). Without the replicas' rows a surviving node cannot offer the lost node's parts, and the resume fell
back to the older disk step. 4 ranks as 2 nodes (tests/memtier_worker.py, DDP over gloo on 127.0.0.1, replicas=1),
``CKPTSTORE_INLINE_ROWS=0``: every marker names a table, as a 513-rank job's would.
"""
from __future__ import annotations

import shutil

from dist import Job  # noqa: E402
from helpers import TESTS  # noqa: E402

WORKER = TESTS / "memtier_worker.py"
TABLE = {"CKPTSTORE_INLINE_ROWS": "0"}


def test_a_memory_step_naming_a_manifest_table_rebuilds_from_peers_after_a_node_loss(tmp_path):
    (tmp_path / "log").mkdir()
    args = ("--disk", f"{tmp_path}/disk{{node}}", "--mem", f"{tmp_path}/mem{{node}}", "--log",
            str(tmp_path / "log"), "--disk-every", "3")
    Job(4, *args, "--steps", "4", env=TABLE, script=WORKER).check(180)
    tbl = sorted(p.name for p in (tmp_path / "mem0").rglob("manifests-*.tbl"))
    assert tbl, "the markers name no manifest table: the test proves nothing"
    # node 1 (ranks 2 and 3) is replaced: its memory and its disk are empty
    for d in ("mem1", "disk1"):
        shutil.rmtree(tmp_path / d)
        (tmp_path / d).mkdir()
    res = Job(4, *args, "--steps", "6", env=TABLE, script=WORKER).check(180)
    for r, out in res.items():
        rf = out["resumed_from"]
        # step 4 is in memory only (disk holds 3): taken from node 0's memory, ranks 2 and 3 rebuilt from it
        assert out["resumed"] == 4 and rf["tier"] == "memory" and rf["step"] == 4, (r, rf)
