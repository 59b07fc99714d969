"""Hostile format-2 input (issue 17, section 3): DTensor shards that overlap and leave a gap, shards that disagree
on the global shape or dtype, a chunk range past the end of a remote pack, values a Stateful cannot take, and an
attempt that fails on one rank with something other than a CheckpointError. Each must end in a CheckpointError
naming what is wrong (and resume falling back to an older valid step where one exists), never in silently loaded
uninitialised memory, a hang, or a foreign exception."""
import random
import shutil
import time

import pytest
import torch

from ckptstore import CorruptCheckpointError, Packing, RNGState, Store, Remote, Writing
from ckptstore.util.retry import RetryPolicy
from ckptstore.storage import open_storage
from dist import Job
from helpers import rewrite_manifest

KEY = ["app", "model", "blocks.0.0.weight"]          # FSDP2 shards it on dim 0: rank 0 rows 0-11, rank 1 12-23


@pytest.fixture
def two_rank_store(fsdp_two_rank_store):
    return fsdp_two_rank_store


def _copy(src, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(src, dst)
    return dst


def _shard_of(body, path):
    for n in body["nodes"]:
        if n[0] == path:
            return n[2]["shard"]
    raise KeyError(path)


def _newest(root):
    with Store(root, rank=0, world_size=1) as s:
        return s.steps()[-1]


def test_the_untouched_two_rank_step_loads_on_one_process(two_rank_store, tmp_path):
    root = _copy(two_rank_store, tmp_path)
    with Store(root, rank=0, world_size=1) as s:
        w = s.load(2)["app"]["model"]["blocks.0.0.weight"]
    assert tuple(w.shape) == (24, 16) and torch.isfinite(w).all()


def test_shards_that_overlap_and_leave_a_gap_are_refused_not_loaded(two_rank_store, tmp_path):
    """Rank 1's shard moved up by 2 rows: rows 10-11 are covered twice and rows 22-23 not at all; the element
    count still adds up (it was the only check), and the gap was torch.empty memory."""
    root = _copy(two_rank_store, tmp_path)
    step = _newest(root)

    def move_up(body):
        shard = _shard_of(body, KEY)
        assert shard["offset"] == [12, 0]
        shard["offset"] = [10, 0]
    rewrite_manifest(root, step, move_up, rank=1)
    with Store(root, rank=0, world_size=1) as s:
        with pytest.raises(CorruptCheckpointError, match=r"overlap.*blocks\.0\.0\.weight|blocks\.0\.0\.weight.*overlap"):
            s.load(step)
        assert s.load(step - 1)["app"]["model"]["blocks.0.0.weight"].shape == (24, 16)   # the older step is fine


@pytest.mark.parametrize("lie", ["global_shape", "dtype", "out_of_bounds"])
def test_a_shard_that_disagrees_with_the_others_is_a_corrupt_step(two_rank_store, tmp_path, lie):
    root = _copy(two_rank_store, tmp_path)
    step = _newest(root)

    def mutate(body):
        for n in body["nodes"]:
            if n[0] == KEY:
                if lie == "global_shape":
                    n[2]["shard"]["global_shape"] = [25, 16]
                elif lie == "dtype":
                    n[2]["dtype"] = "float64"
                    n[2]["shape"] = [6, 16]         # same bytes: 6 x 16 x 8 = 12 x 16 x 4
                else:
                    n[2]["shard"]["offset"] = [20, 0]
    rewrite_manifest(root, step, mutate, rank=1)
    with Store(root, rank=0, world_size=1) as s:
        with pytest.raises(CorruptCheckpointError, match=r"rank 1|rank00001"):
            s.load(step)


def test_values_a_stateful_cannot_take_make_the_step_unusable_and_resume_falls_back(tmp_path):
    """A saved RNG state with a string, or -2**63, where the generator state holds ints: checked against the
    Stateful's own state_dict() (a type that no save produces: corrupt), or refused by load_state_dict (its
    exception becomes a CorruptCheckpointError): resume takes the older step, nothing escapes."""
    rng = RNGState()
    with Store(tmp_path) as s:
        for step in (1, 2, 3):
            random.seed(step)
            s.save({"rng": rng, "x": torch.full((4,), float(step))}, step)

    def python_state(value):
        def mutate(body):
            for n in body["nodes"]:
                if n[0][:2] == ["rng", "python"] and n[1] == "value" and isinstance(n[2], int) and n[2] > 3:
                    n[2] = value
                    return
            raise AssertionError("no generator word found")
        return mutate
    rewrite_manifest(tmp_path, 3, python_state("not a number"))
    rewrite_manifest(tmp_path, 2, python_state(-2 ** 63))
    random.seed(1)
    expect = random.random()                    # the first draw after the state saved at step 1
    random.seed(12345)
    state = {"rng": RNGState(), "x": torch.zeros(4)}
    with Store(tmp_path) as s:
        assert s.resume(state) == 1
    assert torch.equal(state["x"], torch.full((4,), 1.0))
    assert random.random() == expect


@pytest.mark.remote
def test_a_chunk_range_past_the_end_of_a_remote_pack_is_damage_not_a_retry(tmp_path, s3_bucket_url):
    """S3 answers 416, s3fs raises OSError(EINVAL): retried as transient, the resume hung until the deadline.
    Now the step is damaged at once and resume falls back to the older one."""
    url, opts = s3_bucket_url
    packing = Packing(threshold=64 << 10, target_size=1 << 20)
    with Store(tmp_path / "a", remote=url, storage_options=opts, writing=Writing(packing=packing)) as s:
        for step in (1, 2):
            s.save({"small": [torch.full((256,), float(step * 10 + i)) for i in range(8)]}, step)
        s.wait_for_uploads()
    remote = open_storage(url, opts)

    def past_the_end(body):
        for n in body["nodes"]:
            if n[1] == "tensor":
                for c in n[2]["chunks"]:
                    c[4] += 1 << 30                      # offset far past the pack's end
                return
    rewrite_remote_manifest(remote, 2, past_the_end)
    t0 = time.monotonic()
    with Store(tmp_path / "b", remote=Remote(url, retry=RetryPolicy(deadline=120, op_timeout=30)),
               storage_options=opts) as s:
        target = {"small": []}
        assert s.resume(target) == 1
    assert time.monotonic() - t0 < 60, "the unsatisfiable range was retried"
    assert torch.equal(target["small"][0], torch.full((256,), 10.0))


def rewrite_remote_manifest(remote, step, mutate):
    """rewrite_manifest for a remote store: through a local copy of the step's two files."""
    import tempfile
    from pathlib import Path

    from helpers import step_dir
    d = Path(tempfile.mkdtemp())
    sd = step_dir(d, step)
    sd.mkdir(parents=True)
    rel = f"steps/{step:012d}"
    names = [n for n in remote.listdir(rel)]
    for name in names:
        (sd / name).write_bytes(remote.read_bytes(f"{rel}/{name}"))
    rewrite_manifest(d, step, mutate)
    for name in names:
        remote.write_atomic(f"{rel}/{name}", (sd / name).read_bytes())


def test_a_foreign_exception_on_one_rank_ends_in_the_agreement_not_a_hang(two_rank_store, tmp_path):
    """Rank 1's attempt raises a RuntimeError (not a CheckpointError): it skipped the ranks' agreement, and rank
    0 waited for it until collective_timeout. Now both ranks leave at once: rank 1 with its own error, rank 0
    with an IncompatibleCheckpointError naming rank 1's."""
    root = _copy(two_rank_store, tmp_path)
    t0 = time.monotonic()
    job = Job(2, "--mode", "load", "--store", str(root), "--timeout", "300",
              env={"CKPTSTORE_TEST_RAISE_IN_RESUME": "1"})
    out = job.wait(120)
    assert time.monotonic() - t0 < 100
    assert out[0] is not None and out[0]["result"] == "error", out
    assert out[0]["type"] == "IncompatibleCheckpointError" and "injected failure on rank 1" in out[0]["error"]
    # rank 1 leaves with its own error, or (when rank 0, which hosts the job's TCPStore, exits first) with the
    # verdict's read cut short: either way at once
    assert out[1] is None or out[1]["result"] == "error", out[1]


def test_a_ranged_pull_of_a_step_at_the_last_manifest_generation_falls_back(tmp_path):
    """A remote step whose manifest claims the highest generation there is: its ranged pull would write
    generation g+1, which does not exist (a ValueError escaped resume). It is a damaged step now."""
    import test_pull as P
    from helpers import rewrite_frame, step_dir

    remote = tmp_path / "remote"
    P.run(tmp_path / "run", (str(remote), {}))
    top = 10 ** 9 - 1
    sd = step_dir(remote, P.LAST)
    (sd / "manifest-rank00000.msgpack").rename(sd / f"manifest-rank00000.g{top}.msgpack")

    def claim_top(body):
        for ref in body["manifests"]:
            if ref[0] == 0:
                ref[3:] = [top]
    rewrite_frame(sd / "COMMIT", claim_top)
    shutil.rmtree(tmp_path / "run")
    s, state, step = P.resume(tmp_path / "run", (str(remote), {}))
    with s:
        assert step == 6 and P.same(state, P.state_at(6))
