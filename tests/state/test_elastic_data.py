"""ElasticSampler: resuming a data-parallel run at another world size mid-epoch consumes every remaining sample of
the epoch exactly once.

The multi-process tests run real data-parallel jobs on gloo (tests/elastic_worker.py, launched like torchrun):
a job is SIGKILLed one step after a save (that step is work the checkpoint does not hold: the resumed run redoes
it), then resumed by ``Store.resume`` at another world size. Every rank logs the indices of each batch it
trained on; the epoch's indices over the saved part of the first run and the whole second run must be exactly
``range(n)``. The in-process tests check the sampler's own arithmetic and its state checks.
"""
from collections import Counter

import pytest
import torch

from ckptstore import ElasticSampler, IncompatibleCheckpointError, Store
from ckptstore.state.data import SamplerMismatchError

from dist import Job
from helpers import TESTS

WORKER = TESTS / "elastic_worker.py"
N, B = 70, 4


def _job(world, store, logdir, tag, *args):
    job = Job(world, "--store", str(store), "--logdir", str(logdir), "--tag", tag, "--n", str(N),
              "--batch", str(B), *args, script=WORKER)
    res = job.wait(timeout=120)
    return job, res


def _log(logdir, tag, world):
    """rank -> [(step, epoch, [indices])] as the worker wrote them."""
    out = {}
    for r in range(world):
        rows = []
        for line in (logdir / f"{tag}-rank{r}.log").read_text().splitlines():
            step, epoch, idx = line.split()
            rows.append((int(step), int(epoch), [int(i) for i in idx.split(",")]))
        out[r] = rows
    return out


def _crash_then_resume(tmp_path, w1, w2, save_every, die_after, *extra1, extra2=(), epochs=1):
    """Run 1 at ``w1`` ranks saves every ``save_every`` steps and is SIGKILLed after step ``die_after``; run 2
    resumes it at ``w2`` ranks and trains to the end of ``epochs``. Returns (resumed step, run-1 log, run-2 log,
    the runs' RESULTs)."""
    store, logdir = tmp_path / "store", tmp_path / "logs"
    logdir.mkdir()
    job1, res1 = _job(w1, store, logdir, "run1", "--save-every", str(save_every), "--die-after", str(die_after),
                      *extra1)
    assert [p.returncode for p in job1.procs] == [-9] * w1, job1.outputs      # killed, as arranged
    job2, res2 = _job(w2, store, logdir, "run2", "--epochs", str(epochs), *extra2)
    assert [p.returncode for p in job2.procs] == [0] * w2, job2.outputs
    resumed = {r["resumed"] for r in res2.values()}
    assert len(resumed) == 1
    return resumed.pop(), _log(logdir, "run1", w1), _log(logdir, "run2", w2), res1, res2


def _epoch_indices(*logs, epoch, upto=None):
    got = Counter()
    for log in logs:
        for rows in log.values():
            for step, e, idx in rows:
                if e == epoch and (upto is None or step <= upto):
                    got.update(idx)
    return got


ONE_PASS = Counter(range(N))


def test_elastic_resume_4_to_3_mid_epoch_ddp_join(tmp_path):
    """4 ranks (global batch 16) save at step 2 (32 of 70 samples), train step 3, die; 3 ranks (global batch 12)
    resume: 38 left = 3 full steps + a tail of 2, split 1, 1, 0 (rank 2 runs one step fewer, under Join)."""
    resumed, log1, log2, _, res2 = _crash_then_resume(tmp_path, 4, 3, 2, 3, extra2=("--join", "1"))
    assert resumed == 2
    assert all(r["consumed"] == 32 and r["epoch"] == 0 for r in res2.values())
    assert any(step == 3 for rows in log1.values() for step, _, _ in rows)          # work lost to the crash ...
    got = _epoch_indices(log1, epoch=0, upto=resumed) + _epoch_indices(log2, epoch=0)
    assert got == ONE_PASS, (sorted((got - ONE_PASS).elements()), sorted((ONE_PASS - got).elements()))
    assert [len(log2[r]) for r in range(3)] == [4, 4, 3]                             # ... redone once; uneven tail
    assert [len(log2[r][-1][2]) for r in range(3)] == [1, 1, 4]


def test_elastic_resume_2_to_4_mid_epoch_prefetching_loader(tmp_path):
    """2 ranks (global batch 8) with a DataLoader worker prefetching 4 batches ahead save at step 3 (24 of 70)
    and die after step 4; 4 ranks resume with the same loader and finish epoch 0 (46 left: 2 full steps + a tail
    of 14 split 4, 4, 3, 3) and then all of epoch 1. The prefetched indices are not counted as consumed."""
    loader = ("--workers", "1", "--prefetch", "4", "--ddp", "0")
    resumed, log1, log2, res1, res2 = _crash_then_resume(tmp_path, 2, 4, 3, 4, *loader, extra2=loader, epochs=2)
    assert resumed == 3
    assert all(r["consumed"] == 24 for r in res2.values())
    assert all(r["ahead"] and r["ahead"][0] > 0 for r in res1.values()), res1    # the loader ran ahead at the save
    got = _epoch_indices(log1, epoch=0, upto=resumed) + _epoch_indices(log2, epoch=0)
    assert got == ONE_PASS, (sorted((got - ONE_PASS).elements()), sorted((ONE_PASS - got).elements()))
    assert [len(log2[r][2][2]) for r in range(4)] == [4, 4, 3, 3]                     # the tail of epoch 0
    assert _epoch_indices(log2, epoch=1) == ONE_PASS                                 # rollover: a whole new pass
    for r in range(4):             # epoch 1 exactly as the sampler's arithmetic assigns it: a new permutation
        expect = ElasticSampler(N, batch_size=B, rank=r, world_size=4, seed=7)
        expect.set_epoch(1)
        got1 = [idx for _, e, idx in log2[r] if e == 1]
        want = list(expect)
        assert got1 == [want[i:i + B] for i in range(0, len(want), B)]
    assert ElasticSampler(N, batch_size=B, seed=7).order(1).tolist() != list(range(N))
    assert not torch.equal(expect.order(1), expect.order(0))


# -- the sampler in one process -------------------------------------------------------------------------------
def _run_epoch(samplers, steps=None):
    """Drive a job of ``samplers`` (one per rank) like a lockstep training loop; return each rank's batches."""
    iters = [iter(s) for s in samplers]
    out = [[] for _ in samplers]
    done = 0
    while steps is None or done < steps:
        if not samplers[0].steps_left:
            break
        for r, (s, it) in enumerate(zip(samplers, iters)):
            _, count = s._share(s.consumed, s._step_span(s.consumed))
            out[r].append([next(it) for _ in range(count)])
        for s in samplers:
            s.advance()
        done += 1
    return out


def _job_samplers(world, state=None, **kw):
    kw.setdefault("batch_size", 4)
    n = kw.pop("n", N)
    ss = [ElasticSampler(n, rank=r, world_size=world, **kw) for r in range(world)]
    if state is not None:
        for s in ss:
            s.load_state_dict(state)
    return ss


def test_order_is_deterministic_and_a_permutation():
    a, b = ElasticSampler(N, batch_size=4, seed=3), ElasticSampler(N, batch_size=4, seed=3)
    assert list(a) == list(b) and sorted(a) == list(range(N))
    assert list(a) != list(ElasticSampler(N, batch_size=4, seed=4))
    g = torch.Generator().manual_seed(3)
    assert list(a) == torch.randperm(N, generator=g).tolist()          # DistributedSampler's global order
    a.set_epoch(1)
    assert list(a) != list(b) and sorted(a) == list(range(N))
    assert list(ElasticSampler(N, batch_size=4, shuffle=False)) == list(range(N))


@pytest.mark.parametrize("w1,w2,k", [(4, 3, 2), (2, 4, 3), (8, 6, 1), (6, 12, 1), (3, 3, 2), (5, 1, 1), (1, 7, 9)])
def test_resharded_cursor_covers_the_epoch_once(w1, w2, k):
    """k steps at w1 ranks, the state carried over, the rest at w2: the epoch's indices are one pass; every
    rank's state is equal at every step; shares of a step differ by at most one sample."""
    first = _job_samplers(w1)
    got = [i for rank in _run_epoch(first, k) for b in rank for i in b]
    states = {repr(s.state_dict()) for s in first}
    assert len(states) == 1                                            # job-wide: equal on every rank
    second = _job_samplers(w2, first[0].state_dict())
    lengths = [len(s) for s in second]
    batches = _run_epoch(second)
    assert lengths == [sum(map(len, rank)) for rank in batches]        # len(sampler) = what the rank gets
    got += [i for rank in batches for b in rank for i in b]
    assert Counter(got) == ONE_PASS
    for step in zip(*batches):
        sizes = [len(b) for b in step]
        assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 4
    assert all(s.consumed == N and s.steps_left == 0 for s in second)


def test_tail_split_and_drop_last():
    """70 samples, 3 ranks x 4: 5 full steps (60) + a tail of 10 split 4, 3, 3; with drop_last the 10 are
    skipped and every rank runs 5 steps of 4."""
    ss = _job_samplers(3)
    assert [len(s) for s in ss] == [24, 23, 23] and ss[0].steps_left == 6
    assert [len(b[-1]) for b in _run_epoch(ss)] == [4, 3, 3]
    dl = _job_samplers(3, drop_last=True)
    assert [len(s) for s in dl] == [20, 20, 20] and dl[0].steps_left == 5
    got = _run_epoch(dl)
    assert all(len(b) == 4 for rank in got for b in rank) and len(got[0]) == 5
    with pytest.raises(ValueError, match="0 step"):
        dl[0].advance()
    tiny = _job_samplers(4, n=2)                                      # fewer samples than ranks: no padding
    assert [len(s) for s in tiny] == [1, 1, 0, 0]


def test_advance_finish_and_epoch_rollover():
    s = ElasticSampler(N, batch_size=4, rank=1, world_size=3)
    assert s.advance(2) == 24 and s.steps_left == 4
    with pytest.raises(ValueError, match="advance\\(5\\)"):
        s.advance(5)
    assert s.consumed == 24                                           # a refused advance changes nothing
    s.set_epoch(0)                                                    # the current epoch: keeps the cursor
    assert s.consumed == 24
    s.finish_epoch()
    assert s.consumed == N and len(s) == 0 and list(s) == []
    s.set_epoch(1)
    assert (s.epoch, s.consumed, len(s)) == (1, 0, 23)
    d = ElasticSampler(N, batch_size=4, rank=0, world_size=3, drop_last=True)
    d.advance(1)
    d.finish_epoch()
    assert d.consumed == 60                                           # the skipped tail is not "consumed"


def test_iterating_ahead_does_not_move_the_cursor():
    s = ElasticSampler(N, batch_size=4, rank=0, world_size=2)
    loader = torch.utils.data.DataLoader(list(range(N)), batch_size=4, sampler=s)
    it = iter(loader)
    next(it), next(it), next(it)
    assert s.consumed == 0 and s.state_dict()["consumed"] == 0
    s.advance(3)
    assert s.state_dict()["consumed"] == 24


def test_state_round_trip_through_store(tmp_path):
    s = ElasticSampler(N, batch_size=4, rank=0, world_size=1, seed=11)
    s.set_epoch(2)
    s.advance(3)
    store = Store(tmp_path / "s")
    store.save({"sampler": s}, 1)
    t = ElasticSampler(N, batch_size=5, rank=0, world_size=1, seed=11)
    assert store.resume({"sampler": t}) == 1
    assert (t.epoch, t.consumed) == (2, 12)
    rest = list(t)
    assert rest == s.order(2)[12:].tolist()
    assert t.state_dict() == {**s.state_dict(), "batch_size": 5}
    store.close()


@pytest.mark.parametrize("kw,field", [({"data": 71}, "len"), ({"seed": 12}, "seed"), ({"shuffle": False}, "shuffle")])
def test_resume_with_another_data_configuration_raises(tmp_path, kw, field):
    """Another dataset length, seed or shuffle setting: Store.resume raises (older steps hold the same
    configuration; a fresh start would silently drop the run's progress), naming the field; nothing loads."""
    store = Store(tmp_path / "s")
    for step in (1, 2):
        s = ElasticSampler(N, batch_size=4, seed=11)
        s.advance(step)
        store.save({"sampler": s, "step": step}, step)
    args = {"data": N, "seed": 11, **kw}
    t = ElasticSampler(args.pop("data"), batch_size=4, **args)
    state = {"sampler": t, "step": 0}
    with pytest.raises(SamplerMismatchError, match=f"{field}: ") as e:
        store.resume(state)
    assert isinstance(e.value, IncompatibleCheckpointError) and isinstance(e.value, ValueError)
    assert (t.consumed, state["step"]) == (0, 0)
    store.close()


def _state(**over):
    s = ElasticSampler(N, batch_size=4, rank=0, world_size=2)
    s.advance()
    return {**s.state_dict(), **over}


@pytest.mark.parametrize("over,err,match", [
    ({"len": 71}, ValueError, "len: .*71.*70"),
    ({"consumed": 71}, ValueError, "consumed: cursor 71"),
    ({"consumed": -1}, ValueError, "consumed must be >= 0"),
    ({"consumed": 8.0}, TypeError, "consumed must be an int"),
    ({"epoch": True}, TypeError, "epoch must be an int"),
    ({"seed": 1}, ValueError, "seed: .*1.*0"),
    ({"shuffle": False}, ValueError, "shuffle: "),
    ({"shuffle": 1}, TypeError, "shuffle must be a bool"),
    ({"order": "0" * 16}, ValueError, "order: the permutation of epoch 0"),
    ({"version": 2}, ValueError, "version 2"),
    ({"extra": 1}, ValueError, "unknown fields \\['extra'\\]"),
])
def test_bad_state_is_refused_before_anything_changes(over, err, match):
    s = ElasticSampler(N, batch_size=4, rank=1, world_size=3)
    s.advance(1)
    before = s.state_dict()
    with pytest.raises(err, match=match):
        s.load_state_dict(_state(**over))
    assert s.state_dict() == before
    bad = _state()
    del bad["consumed"]
    with pytest.raises(ValueError, match="missing fields \\['consumed'\\]"):
        s.load_state_dict(bad)
    with pytest.raises(TypeError, match="mapping"):
        s.load_state_dict([1, 2])


def test_bad_arguments():
    with pytest.raises(ValueError, match="rank must be < world_size"):
        ElasticSampler(N, batch_size=4, rank=3, world_size=3)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ElasticSampler(N, batch_size=0)
    with pytest.raises(TypeError, match="dataset with len"):
        ElasticSampler(object(), batch_size=1)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        ElasticSampler(N, batch_size=4).advance(-1)


def test_world_size_from_environment_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4 .*not initialised"):
        ElasticSampler(N, batch_size=4)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert ElasticSampler(N, batch_size=4).world_size == 1

