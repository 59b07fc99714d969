"""Sharded saves under torch.distributed: real multi-process jobs (gloo on 127.0.0.1, FSDP2, FSDP+TP, DDP),
the collective commit's failure rules, resharding resume to other world sizes and meshes, rank-local values,
node-local roots, and whole-job SIGKILLs. Models are tiny: these tests are about bytes and protocol."""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import pytest
import numpy as np
import torch
import torch.utils._pytree as pytree

from ckptstore import Store
from dist import Job, run
from helpers import cli, data_files, flip_byte, rewrite_frame, step_dir


def full(path: Path):
    return torch.load(path, weights_only=True)


def assert_same_state(a, b):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        else:
            assert x == y


def store_steps(root) -> list:
    with Store(root) as s:
        return s.steps()


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    """A 4-rank FSDP2 + AdamW job (via get_state_dict) trained 3 steps and saved; its full state."""
    d = tmp_path_factory.mktemp("fsdp4")
    run(4, "--mode", "save", "--store", str(d / "store"), "--steps", "3", "--full", str(d / "full.pt"))
    return d


@pytest.mark.parametrize("world", [4, 2, 3, 1])
def test_fsdp2_state_saved_on_4_ranks_resumes_on_any_world_size(saved4, tmp_path, world):
    res = run(world, "--mode", "load", "--store", str(saved4 / "store"), "--full", str(tmp_path / "got.pt"))
    assert {r["step"] for r in res.values()} == {3}
    got, want = full(tmp_path / "got.pt"), full(saved4 / "full.pt")
    assert_same_state(got["state"], want["state"])
    # Through the step's shard map each rank reads rank 0's manifest (plain values) and those of the saved
    # ranks whose dim-0 shards overlap its own: at most 3 of the 4 when resharding to 2 or 3 ranks.
    reads = [res[r]["manifests_read"] for r in sorted(res)]
    if world in (2, 3):
        assert max(reads) <= 3, reads
    else:
        assert reads == {4: [1] * 4, 1: [4]}[world]


def test_a_missing_shard_map_falls_back_to_every_manifest(saved4, tmp_path):
    store = tmp_path / "store"
    shutil.copytree(saved4 / "store", store)
    (maps,) = [p for p in step_dir(store, 3).iterdir() if p.name.startswith("shards")]
    maps.unlink()
    res = run(2, "--mode", "load", "--store", str(store), "--full", str(tmp_path / "got.pt"))
    assert [res[r]["manifests_read"] for r in sorted(res)] == [4, 4]
    assert_same_state(full(tmp_path / "got.pt")["state"], full(saved4 / "full.pt")["state"])
    with Store(store) as s:                               # verify names the missing map
        assert "shard map missing" in s.verify(3)[3]


@pytest.mark.parametrize("lie", ["wrong_ranks", "hostile"])
def test_a_shard_map_that_lies_falls_back_to_every_manifest(saved4, tmp_path, lie):
    """The map only selects manifests: one naming the wrong ranks (re-recorded in the commit marker, so only
    the coverage check stands in the way) or holding out-of-range boxes still loads bit for bit."""
    from ckptstore.format.blobs import digest_bytes
    store = tmp_path / "store"
    shutil.copytree(saved4 / "store", store)
    (path,) = [p for p in step_dir(store, 3).iterdir() if p.name.startswith("shards")]

    def mutate(body):                     # the map describes the shards by rule: lie about the mesh's ranks
        for mesh in body["meshes"]:              # a grid equal to arange is written nil (issue 29)
            grid = np.arange(int(np.prod(mesh[0])), dtype="<i4") if mesh[1] is None else \
                np.frombuffer(mesh[1], dtype="<i4")
            mesh[1] = (grid[::-1] if lie == "wrong_ranks" else np.full_like(grid, 99)).astype("<i4").tobytes()
    rewrite_frame(path, mutate)
    data = path.read_bytes()

    def fix_digest(body):
        body["shards"][0], body["shards"][1] = bytes.fromhex(digest_bytes(data)), len(data)
    rewrite_frame(step_dir(store, 3) / "COMMIT", fix_digest)
    res = run(2, "--mode", "load", "--store", str(store), "--full", str(tmp_path / "got.pt"))
    assert {r["step"] for r in res.values()} == {3}
    assert_same_state(full(tmp_path / "got.pt")["state"], full(saved4 / "full.pt")["state"])
    if lie == "hostile":
        assert [res[r]["manifests_read"] for r in sorted(res)] == [4, 4]


def overlapping_ranks(saved: int, target: int, r: int) -> set:
    """The saved ranks whose dim-0 FSDP2 shards of dist_worker's model overlap target rank ``r``'s, by torch's own
    sharding of each parameter (and rank 0, whose manifest holds the plain values)."""
    from torch.distributed.tensor import Shard
    import dist_worker
    want = {0}
    for p in dist_worker.Net().parameters():
        n = p.shape[0]
        sz, off = Shard.local_shard_size_and_offset(n, target, r)
        for s in range(saved):
            ssz, soff = Shard.local_shard_size_and_offset(n, saved, s)
            if sz and ssz and soff < off + sz and off < soff + ssz:
                want.add(s)
    return want


@pytest.mark.slow
@pytest.mark.parametrize("saved,target", [(8, 4), (4, 8)])
def test_resharding_reads_only_the_manifests_holding_overlapping_shards(saved4, tmp_path, saved, target):
    """8 -> 4 and 4 -> 8 real ranks (issue 19): each rank reads, through the step's shard map (described by
    rule), exactly the manifests of the saved ranks whose shards overlap its own, plus rank 0's; bit for bit."""
    if saved == 4:
        src = saved4
    else:
        src = tmp_path / "src"
        run(saved, "--mode", "save", "--store", str(src / "store"), "--steps", "3", "--full", str(src / "full.pt"))
    res = run(target, "--mode", "load", "--store", str(src / "store"), "--full", str(tmp_path / "got.pt"))
    assert {r["step"] for r in res.values()} == {3}
    assert_same_state(full(tmp_path / "got.pt")["state"], full(src / "full.pt")["state"])
    reads = [res[r]["manifests_read"] for r in range(target)]
    assert reads == [len(overlapping_ranks(saved, target, r)) for r in range(target)], reads
    assert max(reads) < saved


def test_fsdp2_state_saved_on_2_ranks_resumes_on_4(tmp_path):
    run(2, "--mode", "save", "--store", str(tmp_path / "store"), "--steps", "2", "--full", str(tmp_path / "w.pt"))
    run(4, "--mode", "load", "--store", str(tmp_path / "store"), "--full", str(tmp_path / "got.pt"))
    assert_same_state(full(tmp_path / "got.pt")["state"], full(tmp_path / "w.pt")["state"])


@pytest.fixture(scope="module")
def saved_2d(tmp_path_factory):
    """A 4-rank FSDP2 + tensor parallel job on a 2 x 2 (dp x tp) mesh trained 2 steps and saved: the colwise
    layers' weights and biases are ``(_StridedShard(0, 2), Shard(0))``, the norm and head live on the ``dp``
    sub-mesh (one slice per tp rank); its full state."""
    d = tmp_path_factory.mktemp("fsdp_tp")
    run(4, "--mode", "save", "--mesh", "2x2", "--store", str(d / "store"), "--steps", "2", "--full", str(d / "w.pt"))
    return d


def expected_reads(root, step: int, boxes: dict, r: int) -> int:
    """How many manifests target rank ``r`` (its local shards' boxes by torch: ``boxes``, parameter name ->
    [offset, shape]) must read: rank 0's (plain values) and, per saved key, one holder of every saved box
    overlapping its own, read from the saved manifests (the truth). A box saved by several ranks (the tp-
    replicated biases, the dp sub-mesh's norm and head) is read from the holder on the reader's own tp column,
    ``r % 2`` (the map prefers the reader's coordinate on replicated mesh dims)."""
    with Store(root) as s:
        commit = s.commit_info(step)
        manifests = [s.catalog.read_manifest(commit, q) for q in range(commit.world_size)]
    holders: dict = {}                                   # path -> box -> saved ranks
    for m in manifests:
        for n in m.nodes:
            if n.kind == "dtensor":
                box = (tuple(n.payload.shard.offset), tuple(n.payload.shape))
                holders.setdefault(n.path, {}).setdefault(box, []).append(m.rank)
    want = {0}
    for path, saved in holders.items():
        (name,) = [c for c in path if c in boxes]        # model/<name> or optim/state/<name>/exp_avg...
        off, shape = boxes[name]
        for (soff, sshape), ranks in saved.items():
            if all(a < o + n and o < a + b for a, b, o, n in zip(soff, sshape, off, shape)):
                want.add(ranks[0] if len(ranks) == 1 else next(q for q in ranks if q % 2 == r % 2))
    return len(want)


@pytest.mark.parametrize("world,mesh", [(2, ""), (2, "1x2"),
                                        pytest.param(8, "4x2", marks=pytest.mark.slow)])
def test_2d_fsdp_tp_state_resumes_on_other_meshes_reading_only_overlapping_manifests(saved_2d, tmp_path, world,
                                                                                     mesh):
    """Issue 29 item 4: the 2-D FSDP2 + TP state saved on 4 ranks has a shard map (``_StridedShard`` placements
    and sub-mesh slices are described by rule), so a resume on a 1-D mesh of 2, a 1 x 2 and a 4 x 2 mesh reads,
    per rank, only rank 0's manifest and those holding shards its own overlap (every rank read all 4 before);
    bit for bit."""
    root = saved_2d / "store"
    with Store(root) as s:                 # the manifests record the mesh and placements; the step has a map
        assert s.commit_info(2).world_size == 4 and s.catalog.read_commit(2).shards is not None
    res = run(world, "--mode", "load", "--mesh", mesh, "--store", str(root), "--full", str(tmp_path / "got.pt"))
    assert {r["step"] for r in res.values()} == {2}
    assert_same_state(full(tmp_path / "got.pt")["state"], full(saved_2d / "w.pt")["state"])
    reads = [res[r]["manifests_read"] for r in range(world)]
    assert reads == [expected_reads(root, 2, res[r]["boxes"], r) for r in range(world)], reads
    assert min(reads) < 4


@pytest.mark.slow
def test_uneven_2d_fsdp_tp_state_saves_and_resumes_on_the_same_mesh_and_on_2_ranks(tmp_path):
    """Issue 29: FSDP2 + tensor parallel on a 3 x 2 (dp x tp) mesh with a 13-wide hidden layer, so the colwise
    weights' ``(_StridedShard(0, 2), Shard(0))`` shards are uneven: dp rank 2 holds row 6 on tp rank 0 and rows
    11-12 on tp rank 1, where torch's ``compute_local_shape_and_global_offset`` says 2 rows and 1 (main refused
    to save: "cannot place it"). Saved on 6 ranks, it resumes bit for bit on the same mesh (each rank's own
    shard, filled by the same box) and on 2 ranks (resharded from the saved boxes). The steps are optimizer
    steps on set gradients (torch's tensor parallel forward needs even shards)."""
    src = tmp_path / "src"
    res = run(6, "--mode", "save", "--mesh", "3x2", "--hidden", "13", "--forward", "0", "--store",
              str(src / "store"), "--steps", "2", "--full", str(src / "w.pt"))
    assert all(r.get("result") != "error" for r in res.values()), res
    want = full(src / "w.pt")["state"]
    assert tuple(want["model"]["blocks.0.0.weight"].shape) == (13, 16)
    with Store(src / "store") as s:                     # saved where the rows are: tp shards of 7 and 6, by dp
        commit = s.commit_info(2)
        boxes = sorted((n.payload.shard.offset[0], n.payload.shape[0]) for r in range(6)
                       for n in s.catalog.read_manifest(commit, r).nodes
                       if n.kind == "dtensor" and n.path[-1] == "blocks.0.0.weight" and "model" in n.path)
    assert boxes == [(0, 3), (3, 3), (6, 1), (7, 2), (9, 2), (11, 2)], boxes
    for world, mesh in [(6, "3x2"), (2, "")]:
        got = tmp_path / f"got{world}.pt"
        res = run(world, "--mode", "load", "--mesh", mesh, "--hidden", "13", "--seed", "1", "--store",
                  str(src / "store"), "--full", str(got))          # another init: only the resume can match
        assert {r["step"] for r in res.values()} == {2}, res
        assert_same_state(full(got)["state"], want)


def test_a_dtensor_in_several_pieces_per_rank_is_refused_at_save_and_as_a_resume_target(tmp_path):
    """``(Shard(0), _StridedShard(0, 2))`` on a 2 x 2 mesh: torch splits it left to right, so rank 0 of 7 rows
    holds rows 0 and 2, not one box. Main saved it as rows 0-1 (``compute_local_shape_and_global_offset``: the
    right count, the wrong rows) and would have filled such a target likewise; now the save raises
    ``CommitError`` naming the placements on every rank, and a resume into such a target
    ``IncompatibleCheckpointError`` before writing into the refused ranks' targets."""
    res = run(4, "--store", str(tmp_path / "store"), script=Path(__file__).resolve().parents[1] / "pieces_worker.py")
    assert res[0]["held"] == [0, 2] and res[3]["held"] == [5]          # torch's own layout: pieces
    for r, out in res.items():
        assert out["save"].startswith("CommitError") and "not one box" in out["save"], out
        assert out["resume"].startswith("IncompatibleCheckpointError") and "not one box" in out["resume"], out
    assert all(res[r]["untouched"] for r in (0, 1, 2))                 # rank 3's one box may have been filled
    assert store_steps(tmp_path / "store") == [2]


def test_each_rank_stores_only_its_shard(saved4):
    """4 ranks of FSDP2 store about the state once (shards), not 4 copies; every rank has its manifest."""
    root = saved4 / "store"
    with Store(root) as s:
        commit = s.commit_info(3)
        per_rank = [s.catalog.read_manifest(commit, r).bytes_total for r in range(4)]
    want = full(saved4 / "full.pt")["state"]
    state_bytes = sum(t.numel() * t.element_size() for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor))
    assert sum(per_rank) < 1.2 * state_bytes            # shards plus small replicated scalars (Adam's step)
    assert max(per_rank) < 0.5 * state_bytes
    assert sum(p.stat().st_size for p in data_files(root)) < 1.3 * state_bytes


@pytest.fixture(scope="module")
def trained3(tmp_path_factory):
    """A 3-rank job trained and saved 2 steps. Shared: tests copy it before changing anything."""
    store = tmp_path_factory.mktemp("trained3") / "store"
    run(3, "--mode", "train", "--store", str(store), "--steps", "2")
    return store


@pytest.mark.parametrize("blocking", [1, 0])
def test_one_rank_failing_makes_every_rank_raise_and_nothing_commits(tmp_path, blocking, trained3):
    store = str(tmp_path / "store")
    shutil.copytree(trained3, store, symlinks=True)
    t0 = time.monotonic()
    res = run(3, "--mode", "fail", "--store", store, "--bad-rank", "1", "--blocking", str(blocking))
    assert time.monotonic() - t0 < 60
    for r, out in res.items():
        assert out["result"] == "error" and out["type"] == "CommitError", out
        assert "rank 1" in out["error"] and "No space left" in out["error"]
        assert list(out["failures"]) == ["1"]
        assert out["seconds"] < 10                       # promptly: no waiting for a deadline
    assert store_steps(store) == [1, 2] and not (step_dir(store, 3) / "COMMIT").exists()
    res = run(3, "--mode", "load", "--store", store)
    assert {o["step"] for o in res.values()} == {2}


def test_a_stalled_rank_makes_the_others_raise_after_the_timeout_naming_it(tmp_path):
    store = str(tmp_path / "store")
    job = Job(3, "--mode", "stall", "--store", store, "--bad-rank", "1", "--timeout", "5")
    try:
        res = job.wait(120, ranks=(0, 2))
    finally:
        job.kill()
    assert res[0]["type"] == "CommitError" and "rank 1" in res[0]["error"] and "within 5 s" in res[0]["error"]
    assert res[2]["type"] == "CommitError" and "rank 1" in res[2]["error"]
    for r in (0, 2):
        assert 4 < res[r]["seconds"] < 40
    assert store_steps(store) == []


def test_rank_local_values_on_a_world_size_change(tmp_path):
    store = str(tmp_path / "store")
    run(2, "--mode", "save", "--store", store, "--steps", "2", "--progress", "1", "--full", str(tmp_path / "w.pt"))
    shown = json.loads(cli("show", store, "--json").stdout)     # the shard map names them, from the save
    assert shown["shard_map"]["rank_local"] == ["progress/rank"] and shown["shard_map"]["bytes"] > 0
    res = run(1, "--mode", "load", "--store", store, "--progress", "1")
    err = res[0]
    assert err["result"] == "error" and err["type"] == "IncompatibleCheckpointError"
    assert "progress/rank" in err["error"] and "world_size=2" in err["error"] and "world_size=1" in err["error"]
    assert "progress/consumed" not in err["error"]
    res = run(1, "--mode", "load", "--store", store, "--progress", "1", "--rank-local", "fresh",
              "--full", str(tmp_path / "got.pt"))
    assert res[0]["step"] == 2
    assert res[0]["progress"] == {"consumed": 16, "rank": 0}     # shared value loaded, rank-local kept
    assert_same_state(full(tmp_path / "got.pt")["state"], full(tmp_path / "w.pt")["state"])
    res = run(2, "--mode", "load", "--store", store, "--progress", "1")    # same world size: each its own
    assert [res[r]["progress"] for r in (0, 1)] == [{"consumed": 16, "rank": 0}, {"consumed": 16, "rank": 1}]


def test_ddp_replicated_state_is_stored_once(tmp_path):
    """4 DDP ranks hold the same parameters and optimizer state: the store holds one copy."""
    run(1, "--mode", "save", "--ddp", "1", "--store", str(tmp_path / "one"), "--steps", "2")
    run(4, "--mode", "save", "--ddp", "1", "--store", str(tmp_path / "four"), "--steps", "2")
    one = sum(p.stat().st_size for p in data_files(tmp_path / "one"))
    four = sum(p.stat().st_size for p in data_files(tmp_path / "four"))
    assert four <= 1.05 * one, (one, four)


@pytest.mark.parametrize("ddp", [0, 1], ids=["fsdp2", "ddp"])
def test_deltas_of_a_2_rank_job_resume_on_1_and_2_ranks(tmp_path, ddp):
    """``Writing(codec="auto", deltas=2)`` on 2 ranks sharing a root, a save every step: FSDP2 shards (each rank
    its own deltas and keys; one rank reads the other's when resharding) and DDP replicas (both ranks write the
    same delta blobs, once). Every rank's last manifest names deltas; resumes bit for bit (issue 30)."""
    store = str(tmp_path / "store")
    run(2, "--mode", "train", "--ddp", str(ddp), "--deltas", "2", "--store", store, "--steps", "3",
        "--hidden", "512", "--full", str(tmp_path / "w.pt"))      # (at 24, lr 1e-2 moves too much to pay)
    with Store(store, read_only=True) as s:
        commit = s.catalog.read_commit(3)
        for rank in (0, 1):
            m = s.catalog.read_manifest(commit, rank)
            assert any(c.codec == "delta" for c in m.chunk_refs()), rank
    for world in (1, 2):
        run(world, "--mode", "load", "--ddp", str(ddp), "--store", store, "--hidden", "512",
            "--full", str(tmp_path / f"got{world}.pt"))
        assert_same_state(full(tmp_path / f"got{world}.pt")["state"], full(tmp_path / "w.pt")["state"])


def test_node_local_roots_each_get_the_commit_and_resume(tmp_path):
    """Ranks 0-1 and 2-3 write to different roots (two "nodes"): each root gets its ranks' manifests and the
    commit marker, retention runs in each; resume with the same world size reads each rank's own root."""
    roots = str(tmp_path / "node{node}")
    saved = run(4, "--mode", "train", "--store", roots, "--steps", "4", "--keep-last", "2",
                "--full", str(tmp_path / "w.pt"))
    assert len({r["run_id"] for r in saved.values()}) == 1          # rank 0's run id reached every rank
    for node in (0, 1):
        assert store_steps(tmp_path / f"node{node}") == [3, 4]        # retention ran in each root
        d = step_dir(tmp_path / f"node{node}", 4)
        assert (d / "COMMIT").exists()
        names = sorted(p.name for p in d.glob("manifest-*"))
        assert names == [f"manifest-rank{r:05d}.msgpack" for r in (2 * node, 2 * node + 1)]
    with Store(tmp_path / "node1") as s:          # gc there: absent manifests are other nodes' parts
        report = s.gc(grace_seconds=0)
        assert report.unreadable_steps == [] and report.blobs_deleted + report.packs_deleted > 0
    loaded = run(4, "--mode", "load", "--store", roots, "--full", str(tmp_path / "got.pt"))
    assert {r["run_id"] for r in loaded.values()} == {saved[0]["run_id"]}   # and survives the restart
    assert_same_state(full(tmp_path / "got.pt")["state"], full(tmp_path / "w.pt")["state"])


def losses(log: Path) -> dict:
    out = {}
    for line in log.read_text().splitlines():
        step, loss = line.split()
        out.setdefault(int(step), set()).add(loss)
    return out


SIGKILL_STEPS = 14


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory):
    """An uninterrupted 2-rank FSDP2 run of SIGKILL_STEPS steps: {step: {loss}}. Shared by both blocking modes
    (the reference run does not depend on them)."""
    d = tmp_path_factory.mktemp("fsdp2_ref")
    run(2, "--mode", "train", "--store", str(d / "ref"), "--steps", str(SIGKILL_STEPS), "--log", str(d / "ref.log"))
    ref = losses(d / "ref.log")
    assert sorted(ref) == list(range(1, SIGKILL_STEPS + 1))
    return ref


@pytest.mark.parametrize("blocking", [1, 0])
def test_fsdp2_job_sigkilled_resumes_bit_for_bit(tmp_path, blocking, fsdp2_reference):
    steps, ref = SIGKILL_STEPS, fsdp2_reference
    rng = random.Random(blocking)
    store, log = tmp_path / "store", tmp_path / "run.log"
    for attempt in range(3):
        job = Job(2, "--mode", "train", "--store", str(store), "--steps", str(steps), "--log", str(log),
                  "--blocking", str(blocking))
        seen = len(log.read_text().splitlines()) if log.exists() else 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) <= seen + 1):
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.15))                  # somewhere in the next steps' saves
        job.kill()
    run(2, "--mode", "train", "--store", str(store), "--steps", str(steps), "--log", str(log),
        "--blocking", str(blocking))
    got = losses(log)
    assert sorted(got) == list(range(1, steps + 1))
    for step, values in got.items():
        assert values == ref[step], (step, values, ref[step])
    assert store_steps(store)[-1] == steps


def test_two_nodes_upload_their_parts_and_the_remote_step_needs_all_of_them(tmp_path, s3_bucket_url):
    """Ranks 0-1 and 2-3 have their own local roots (two "nodes") and one loopback S3 remote. Each node
    uploads its own ranks' parts; rank 0 commits the remote step only once all four parts are there."""
    import shutil
    import fsspec
    roots, url = str(tmp_path / "node{node}"), s3_bucket_url.url
    so = json.dumps(s3_bucket_url.storage_options)
    fs, prefix = fsspec.core.url_to_fs(url, **s3_bucket_url.storage_options)

    def remote_files():
        fs.invalidate_cache()
        return {p[len(prefix):].lstrip("/") for p in fs.find(prefix)}
    # node 1 does not upload: rank 0 uploads its node's parts, waits for the others, gives up, commits nothing
    res = run(4, "--mode", "save", "--store", roots, "--remote", url, "--so", so, "--steps", "2",
              "--full", str(tmp_path / "w.pt"), "--no-upload-node", "1", "--upload-deadline", "4")
    assert "rank(s) [2, 3]" in res[0]["close"] and "not committed" in res[0]["close"]
    files = remote_files()
    assert "steps/000000000002/manifest-rank00000.msgpack" in files
    assert "steps/000000000002/manifest-rank00002.msgpack" not in files
    assert "steps/000000000002/COMMIT" not in files and "latest" not in files
    for node in (0, 1):            # the leader of node 1's root got the shard map from rank 0, with the marker
        assert {"COMMIT", "shards.msgpack"} <= {p.name for p in step_dir(tmp_path / f"node{node}", 2).iterdir()}
    # the job restarts: node 1's lowest rank sees its root holds parts to upload; rank 0 then commits
    res = run(4, "--mode", "load", "--store", roots, "--remote", url, "--so", so)
    assert {r["close"] for r in res.values()} == {"ok"} and {r["step"] for r in res.values()} == {2}
    files = remote_files()
    assert {f"steps/000000000002/manifest-rank{r:05d}.msgpack" for r in range(4)} <= files
    assert {"steps/000000000002/COMMIT", "steps/000000000002/shards.msgpack"} <= files
    # node 1 loses its disk: its ranks pull their own parts from S3 and the job resumes bit for bit
    shutil.rmtree(tmp_path / "node1")
    res = run(4, "--mode", "load", "--store", roots, "--remote", url, "--so", so, "--full", str(tmp_path / "g.pt"))
    assert [res[r]["tier"] for r in range(4)] == ["local", "local", "remote", "remote"]
    assert_same_state(full(tmp_path / "g.pt")["state"], full(tmp_path / "w.pt")["state"])
    names = sorted(p.name for p in step_dir(tmp_path / "node1", 2).glob("manifest-*"))
    assert names == ["manifest-rank00002.msgpack", "manifest-rank00003.msgpack"]
    assert (step_dir(tmp_path / "node1", 2) / "shards.msgpack").exists()      # pulled with the parts
    # the job moves to one node of 2 ranks with an empty disk: each rank reads straight from S3 only the
    # saved shards its own overlap (through the shard map) and pulls nothing of the 4-rank step
    res = run(2, "--mode", "load", "--store", str(tmp_path / "new"), "--remote", url, "--so", so,
              "--full", str(tmp_path / "g2.pt"))
    assert [(res[r]["step"], res[r]["tier"]) for r in range(2)] == [(2, "remote"), (2, "remote")]
    assert max(res[r]["manifests_read"] for r in range(2)) <= 3
    assert_same_state(full(tmp_path / "g2.pt")["state"], full(tmp_path / "w.pt")["state"])
    assert not data_files(tmp_path / "new") and not step_dir(tmp_path / "new", 2).exists()


def test_a_hostile_sharded_entry_is_a_checkpoint_error_and_resume_falls_back(tmp_path):
    """A dtensor node claiming a global shape its shards do not cover fails that step only (no allocation of
    the claimed size, no other exception type), and resume takes the older step."""
    from ckptstore.util.errors import CheckpointError
    from ckptstore.format.manifest import Commit
    from ckptstore.state.sharding import ShardInfo
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(4)}, 1)
        s.save({"w": torch.full((4,), 2.0)}, 2)
        commit = s.catalog.read_commit(2)
        m = s.catalog.read_manifest(commit, 0)
        node = next(n for n in m.nodes if n.kind == "tensor")
        node.kind, node.payload.shape = "dtensor", (4, 1)
        node.payload.shard = ShardInfo((1 << 40, 1 << 20), (0, 0), (1,), ("S(0)",))
        digest = s.catalog.write_manifest(m)
        s.catalog.write_commit(Commit(step=2, world_size=1, manifests={0: digest}, created=commit.created,
                                      bytes_total=16))
        with pytest.raises(CheckpointError, match="cover"):
            s.load(2)
        state = {"w": None}
        assert s.resume(state) == 1 and torch.equal(state["w"], torch.ones(4))


def test_ddp_replicated_keys_are_saved_by_rank_0_only_and_load_on_any_world_size(tmp_path):
    """save(replicated=["app"]) under 2-rank DDP: rank 1's manifest holds none of the model and optimizer (its
    ranks neither hash nor write them), yet every rank resumes them exactly, as does a 1-rank job; a job whose
    ranks disagree on the replicated keys commits nothing."""
    from ckptstore.format.catalog import Catalog
    store = tmp_path / "rep"
    run(2, "--mode", "save", "--ddp", "1", "--store", str(store), "--steps", "3", "--replicated", "app",
        "--full", str(tmp_path / "w.pt"))
    with Store(store, read_only=True, rank=0, world_size=1) as s:
        commit = s.commit_info(3)
        cat = Catalog(s.storage)
        m0, m1 = cat.read_manifest(commit, 0), cat.read_manifest(commit, 1)
    assert m0.replicated == m1.replicated == ["app"]
    assert {n.path[0] for n in m0.nodes if n.path} == {"app", "step"}
    assert {n.path[0] for n in m1.nodes if n.path} == {"step"} and m1.arrays() == []
    assert m0.bytes_total > 0
    res = run(2, "--mode", "load", "--ddp", "1", "--store", str(store), "--full", str(tmp_path / "got2.pt"))
    assert [res[r]["step"] for r in (0, 1)] == [3, 3]
    assert res[0]["digest"] == res[1]["digest"]    # rank 1 read them from rank 0's manifest
    assert_same_state(full(tmp_path / "got2.pt")["state"], full(tmp_path / "w.pt")["state"])
    res = run(1, "--mode", "load", "--ddp", "1", "--store", str(store), "--full", str(tmp_path / "got1.pt"))
    assert res[0]["step"] == 3                     # replicated values are never rank-local
    assert_same_state(full(tmp_path / "got1.pt")["state"], full(tmp_path / "w.pt")["state"])
    bad = run(2, "--mode", "save", "--ddp", "1", "--store", str(tmp_path / "bad"), "--steps", "1",
              "--replicated", "app", "--replicated-ranks", "0")
    assert {bad[r]["type"] for r in (0, 1)} == {"CommitError"}, bad
    assert "same save(replicated=...)" in bad[0]["error"]
    assert Store(tmp_path / "bad", read_only=True, rank=0, world_size=1).steps() == []
    # hostile variants of the replicated step: each a clear CorruptCheckpointError naming what is wrong
    from ckptstore import CorruptCheckpointError
    from helpers import rewrite_manifest
    good = Store(store, read_only=True, rank=0, world_size=1).load(3, rank=1)
    assert set(good) == {"app", "step"}
    shutil.copytree(store, tmp_path / "h1")
    rewrite_manifest(tmp_path / "h1", 3, lambda b: b.pop("replicated"), rank=0)     # rank 0 lost the list
    with pytest.raises(CorruptCheckpointError, match="replicated keys"):
        Store(tmp_path / "h1", read_only=True, rank=0, world_size=1).load(3, rank=1)
    shutil.copytree(store, tmp_path / "h2")
    rewrite_manifest(tmp_path / "h2", 3, lambda b: b.update(replicated=["app", "step"]), rank=1)  # holds "step"
    with pytest.raises(CorruptCheckpointError, match="marked replicated"):
        Store(tmp_path / "h2", read_only=True, rank=0, world_size=1).load(3, rank=1)
    shutil.copytree(store, tmp_path / "h3")
    rewrite_manifest(tmp_path / "h3", 3, lambda b: b.update(replicated=["nope"]), rank=0)
    with pytest.raises(CorruptCheckpointError, match="not in rank 0's manifest"):
        Store(tmp_path / "h3", read_only=True, rank=0, world_size=1).load(3, rank=1)


def _ddp_rng_job(store: Path, *extra: str, world: int = 2, **kw):
    """2-rank DDP with replicated=["app"] and torch's generator saved per rank (equal bytes on both ranks, as HF
    Trainer's RNG state: the chunk of rank 1's state is found in rank 0's pack of an older step)."""
    return run(world, "--ddp", "1", "--rng", "1", "--replicated", "app", "--store", str(store), *extra, **kw)


def test_ddp_resumes_from_the_remote_after_the_local_root_is_lost(tmp_path, s3_bucket_url):
    """Issue 26 item 4: one local root, an S3 remote, the root deleted. Each rank pulls its part; a part whose
    chunks are read by range from a larger pack gets its manifest rewritten (generation 1), which once dropped
    ``replicated``: rank 1 then found no "app" in rank 0's manifest and the job fell back or crashed. Now both
    ranks resume step 3 bit for bit (model, optimizer, generator)."""
    root, url, so = tmp_path / "root", s3_bucket_url.url, json.dumps(s3_bucket_url.storage_options)
    saved = _ddp_rng_job(root, "--mode", "train", "--remote", url, "--so", so, "--steps", "3",
                         "--full", str(tmp_path / "w.pt"))
    assert {saved[r]["close"] for r in (0, 1)} == {"ok"} and {saved[r]["step"] for r in (0, 1)} == {3}
    shutil.rmtree(root)
    res = _ddp_rng_job(root, "--mode", "load", "--remote", url, "--so", so, "--full", str(tmp_path / "g.pt"))
    assert [(res[r].get("result"), res[r].get("step"), res[r].get("tier")) for r in (0, 1)] == \
        [("loaded", 3, "remote")] * 2, res
    for r in (0, 1):
        assert (res[r]["digest"], res[r]["rng"]) == (saved[r]["digest"], saved[r]["rng"]), r
    assert_same_state(full(tmp_path / "g.pt")["state"], full(tmp_path / "w.pt")["state"])
    # the path under test was taken: a pulled manifest was rewritten to name new local packs
    assert [p.name for p in step_dir(root, 3).glob("manifest-*.g1.msgpack")], sorted(step_dir(root, 3).iterdir())


def test_ddp_with_a_lost_root_and_an_unreachable_remote_raises_on_every_rank(tmp_path):
    """A 2-rank job restarts on empty local roots while its remote refuses every connection: rank 0's listing
    gives up after the retry deadline and every rank raises TransferError (rank 1 learns it from rank 0's
    broadcast, without waiting out the collective timeout). Both once started fresh (step None), about to
    overwrite the run's timeline."""
    import socket
    with socket.socket() as sock:                      # a loopback port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    so = json.dumps({"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"})
    t0 = time.monotonic()
    res = run(2, "--mode", "load", "--store", str(tmp_path / "root"), "--remote", "s3://lost-bucket/run", "--so",
              so, "--upload-deadline", "3", "--timeout", "300")
    took = time.monotonic() - t0
    assert [(res[r].get("result"), res[r].get("type")) for r in (0, 1)] == [("error", "TransferError")] * 2, res
    assert "resume does not start the run fresh" in res[0]["error"], res[0]
    assert "rank 0 could not list" in res[1]["error"] and "s3://lost-bucket/run" in res[1]["error"], res[1]
    assert took < 200, took                             # not the 300 s collective timeout


def test_ddp_store_repacked_by_gc_resumes_on_2_ranks(tmp_path):
    """Issue 26 item 4: ``ckptstore gc --repack`` rewrites the manifests of the steps whose packs it repacks
    (the same repoint as a ranged pull); on a DDP store whose parts share packs it once dropped ``replicated``
    from them, and the 2-rank resume found no older step to fall back to."""
    root = tmp_path / "root"
    saved = _ddp_rng_job(root, "--mode", "train", "--steps", "3", "--keep-last", "1", "--full", str(tmp_path / "w.pt"))
    out = cli("gc", str(root), "--repack", "0.5", "--grace", "0").stdout
    assert "repacked" in out and "steps [3]" in out, out
    res = _ddp_rng_job(root, "--mode", "load", "--full", str(tmp_path / "g.pt"))
    assert [(res[r].get("result"), res[r].get("step")) for r in (0, 1)] == [("loaded", 3)] * 2, res
    for r in (0, 1):
        assert (res[r]["digest"], res[r]["rng"]) == (saved[r]["digest"], saved[r]["rng"]), r
    assert_same_state(full(tmp_path / "g.pt")["state"], full(tmp_path / "w.pt")["state"])


def test_a_damaged_shard_map_on_the_remote_does_not_lose_the_step_when_parts_are_pulled(tmp_path):
    """Issue 26 item 8: the root is lost and each rank pulls its part of step 2 from the remote, whose shard map
    is damaged. The map is a hint: the step is pulled without it (logged) and both ranks resume it bit for bit;
    the pull once failed on the map and the job fell back to step 1."""
    root, remote = tmp_path / "root", tmp_path / "remote"
    run(2, "--mode", "train", "--store", str(root), "--remote", f"file://{remote}", "--steps", "2",
        "--full", str(tmp_path / "w.pt"))
    (path,) = [p for p in step_dir(remote, 2).iterdir() if p.name.startswith("shards")]
    path.write_bytes(b"\x00" * 8)
    shutil.rmtree(root)
    job = Job(2, "--mode", "load", "--store", str(root), "--remote", f"file://{remote}",
              "--full", str(tmp_path / "g.pt"))
    res = job.wait()
    assert [(res[r].get("result"), res[r].get("step"), res[r].get("tier")) for r in (0, 1)] == \
        [("loaded", 2, "remote")] * 2, res
    assert "shard map unusable" in job.outputs[0] + job.outputs[1]
    assert_same_state(full(tmp_path / "g.pt")["state"], full(tmp_path / "w.pt")["state"])


@pytest.mark.slow
def test_a_commit_marker_naming_a_manifest_table_resumes_and_a_damaged_page_falls_back(tmp_path):
    """Commit markers with their manifest rows in a table (issue 29; forced at any world size with
    ``CKPTSTORE_INLINE_ROWS=0``): a 2-rank FSDP2 job resumes from a shared root on 2 and on 1 rank bit for bit
    (the same world size, and a reshard reading every row); with node-local roots (4 ranks, 2 per node) the
    leader's root holds its ranks' rows (no table) and resumes on 4; a table page that does not match its
    marker's digest makes that step fall back to the one before. (The shared-root part ran 4 ranks resuming on
    4 and 2 before: the same cases, twice the rank processes.)"""
    import msgpack
    env = {"CKPTSTORE_INLINE_ROWS": "0"}
    shared = tmp_path / "shared"
    run(2, "--mode", "train", "--store", str(shared), "--steps", "3", "--full", str(tmp_path / "w.pt"), env=env)
    d = step_dir(shared, 3)
    tables = sorted(d.glob("manifests-*.tbl"))
    assert len(tables) == 1 and tables[0].stat().st_size == 2 * 48 + 32          # 2 rows, one page's digest
    outer = msgpack.unpackb((d / "COMMIT").read_bytes(), raw=False)
    body = msgpack.unpackb(outer["body"], raw=False)
    assert outer["format"] == 3 and "table" in body and "manifests" not in body
    for world in (2, 1):
        res = run(world, "--mode", "load", "--store", str(shared), "--full", str(tmp_path / f"g{world}.pt"), env=env)
        assert {r["step"] for r in res.values()} == {3}
        assert_same_state(full(tmp_path / f"g{world}.pt")["state"], full(tmp_path / "w.pt")["state"])
    flip_byte(tables[0], 48 * 1 + 5)                          # rank 1's row: the page no longer matches
    res = run(2, "--mode", "load", "--store", str(shared))
    assert {r["step"] for r in res.values()} == {2}

    roots = str(tmp_path / "node{node}")
    run(4, "--mode", "train", "--store", roots, "--steps", "2", "--full", str(tmp_path / "n.pt"), env=env)
    node1 = step_dir(tmp_path / "node1", 2)
    assert not list(node1.glob("*.tbl")) and [p.name[-15:] for p in node1.glob("rows-*")] == [".r00002.msgpack"]
    assert len(list(step_dir(tmp_path / "node0", 2).glob("manifests-*.tbl"))) == 1
    res = run(4, "--mode", "load", "--store", roots, "--full", str(tmp_path / "ng.pt"))
    assert {r["step"] for r in res.values()} == {2}
    assert_same_state(full(tmp_path / "ng.pt")["state"], full(tmp_path / "n.pt")["state"])
