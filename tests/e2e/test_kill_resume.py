"""Crash-safety end to end, through the public API and real processes.

``examples/train_lm.py`` (a small deterministic transformer LM, see its docstring) runs in a subprocess and is
SIGKILLed at random points, including in the middle of ``store.save``; every restart must resume from the newest
committed step and the merged loss log must equal an uninterrupted reference run bit for bit, with no step missing.

Saves are detected from the child's own stdout: it prints ``saving step S`` right before ``store.save`` and
``saved step S ...`` right after (flushed), so a kill scheduled a fraction of a save's duration after
``saving step S`` lands inside the save.
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from typing import Optional

import pytest

from training import _SAVED, _SAVING, CKPT_EVERY, N_REF, TRAIN, Child, check_against_reference, log_lines, read_log


def _import_train_lm():
    import importlib.util
    spec = importlib.util.spec_from_file_location("train_lm", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n,batch", [(37, 4), (36, 4), (10, 3)])
def test_sampler_resumes_mid_epoch(n, batch):
    """StatefulSampler + DataLoader(num_workers=0): a new sampler and a new iterator built from a state_dict
    taken between any two batches (epoch ends included) yield exactly the batches the original goes on to."""
    import torch
    from torch.utils.data import DataLoader
    train_lm = _import_train_lm()

    def batches(sampler, it, k):
        out = []
        while len(out) < k:
            try:
                out.append(next(it).tolist())
            except StopIteration:
                it = iter(DataLoader(list(range(n)), batch_size=batch, sampler=sampler, drop_last=True))
        return out, it

    ref_sampler = train_lm.StatefulSampler(n, seed=3)
    loader = DataLoader(list(range(n)), batch_size=batch, sampler=ref_sampler, drop_last=True)
    total = 4 * (n // batch) + 3
    ref, _ = batches(ref_sampler, iter(loader), total)
    assert len({tuple(b) for b in ref[: n // batch]}) == n // batch  # one epoch: distinct batches
    for k in range(total):
        s1 = train_lm.StatefulSampler(n, seed=3)
        l1 = DataLoader(list(range(n)), batch_size=batch, sampler=s1, drop_last=True)
        head, _ = batches(s1, iter(l1), k)
        sd = s1.state_dict()
        s2 = train_lm.StatefulSampler(n, seed=3)
        s2.load_state_dict(sd)
        l2 = DataLoader(list(range(n)), batch_size=batch, sampler=s2, drop_last=True)
        tail, _ = batches(s2, iter(l2), total - k)
        assert head + tail == ref, f"resumed after {k} batches (state {sd})"


def test_single_kill_and_resume(tmp_path, reference):
    ref, _ = reference
    steps = 60
    store, log = tmp_path / "store", tmp_path / "loss.jsonl"
    c = Child(store, log, steps, "--sleep-per-step", "0.01")
    assert c.wait_line(_SAVED, nth=4) is not None, c.output()  # step 20 committed
    time.sleep(0.07)
    assert c.kill(), "run finished before the kill"
    confirmed = max(c.saved())
    in_flight = c.save_in_flight()

    c2 = Child(store, log, steps)
    c2.finish()
    start = c2.resumed_from()
    assert start in {confirmed, in_flight}, f"resumed from {start}, last saved {confirmed}, in flight {in_flight}"
    check_against_reference(read_log(log), ref, steps)

    from ckptstore import Store
    with Store(store) as s:
        assert s.latest_step() == steps
        assert set(range(CKPT_EVERY, steps + 1, CKPT_EVERY)) <= set(s.steps())


def test_missing_commit_marker_falls_back(tmp_path, reference):
    """The newest step loses its commit marker (e.g. a crash between manifest and commit): it is invisible,
    ``latest`` still naming it is only a hint, resume uses the step before and the losses stay identical."""
    from ckptstore import Store

    ref, _ = reference
    store, log = tmp_path / "store", tmp_path / "loss.jsonl"
    Child(store, log, 40, ckpt_every=10).finish()
    with Store(store) as s:
        assert s.steps() == [10, 20, 30, 40] and s.latest_step() == 40
    commit = store / "steps" / f"{40:012d}" / "COMMIT"
    assert commit.is_file(), sorted(p.relative_to(store).as_posix() for p in store.rglob("*") if "objects" not in p.parts)
    commit.unlink()
    assert json.loads((store / "latest").read_text())["step"] == 40  # stale pointer left on purpose
    with Store(store) as s:
        assert s.steps() == [10, 20, 30] and s.latest_step() == 30

    c = Child(store, log, 60, ckpt_every=10)
    c.finish()
    assert c.resumed_from() == 30, c.output()
    assert c.saved() == [40, 50, 60]
    check_against_reference(read_log(log), ref, 60)
    assert read_log(log)[35] == [ref[35], ref[35]]  # steps 31..40 were done twice, identically
    with Store(store) as s:
        assert s.steps() == [10, 20, 30, 40, 50, 60] and s.latest_step() == 60


@pytest.mark.slow
def test_kill_resume_stress(tmp_path, reference):
    """8 SIGKILLs at seeded random points (3 aimed inside a save, 2 just after one, 2 after a random number of
    steps, 1 during start-up), each followed by a restart; then a run to the end. The runs cross epoch ends."""
    ref, save_s = reference
    steps, n_kills = N_REF, 8
    rng = random.Random(int(os.environ.get("CKPT_KILL_SEED", "8675309")))  # override to explore other schedules
    modes = ["mid-save"] * 3 + ["after-save"] * 2 + ["anytime"] * 2 + ["start-up"]
    rng.shuffle(modes)
    store, log = tmp_path / "store", tmp_path / "loss.jsonl"
    extra = ["--ballast-mb", "4"]  # a 4 MiB incompressible tensor that changes every save; checked on resume

    confirmed: Optional[int] = None     # newest step whose save returned
    candidates = {None}                 # steps the next run may legitimately resume from
    report, kills, mid_save = [], 0, 0
    t_start = time.monotonic()
    for mode in modes:
        c = Child(store, log, steps, *extra)
        if mode == "mid-save":
            m = c.wait_line(_SAVING, nth=rng.randint(1, 5))
            time.sleep(rng.uniform(0.0, 0.8) * save_s)
        elif mode == "after-save":
            m = c.wait_line(_SAVED, nth=rng.randint(1, 5))
            time.sleep(rng.uniform(0.0, 0.1))
        elif mode == "anytime":                 # after 1-40 more steps: in training or in a save
            m = c.wait_line(re.compile(r"^(resumed from step \d+|fresh start)$"))
            target = log_lines(log) + rng.randint(1, 40)
            while m is not None and log_lines(log) < target and c.proc.poll() is None:
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.1))
        else:                                   # start-up: imports, data, model, or inside resume
            m = True
            time.sleep(rng.uniform(0.2, 3.0))
        died = c.kill()  # False: it had already exited (m is None)
        start = c.resumed_from()
        if start != -1:
            assert start in candidates, f"run resumed from {start}, expected one of {candidates}\n{c.output()}"
        if not died:
            assert c.proc.returncode == 0, c.output()
            report.append((mode, start, "finished before the kill"))
            candidates = {steps}
            break
        kills += 1
        if start == -1:  # killed before it resumed: it changed nothing
            report.append((mode, start, "killed during start-up"))
            continue
        confirmed = max([s for s in (confirmed, start) if s is not None] + c.saved(), default=None)
        in_flight = c.save_in_flight()
        mid_save += in_flight is not None
        candidates = {confirmed} | ({in_flight} if in_flight is not None else set())
        report.append((mode, start, f"killed; last saved {confirmed}, save in flight {in_flight}"))

    final = Child(store, log, steps, *extra)
    final.finish()
    start = final.resumed_from()
    report.append(("final", start, "finished"))
    summary = "\n".join(f"  {m:>10}: resumed from {s}, {what}" for m, s, what in report)
    print(f"\n{kills} kills ({mid_save} inside a save) in {time.monotonic() - t_start:.1f}s:\n{summary}")
    assert start in candidates, summary
    assert kills >= 6, f"too few kills landed (the runs finished too early):\n{summary}"
    assert mid_save >= 1, f"no kill landed inside a save:\n{summary}"
    check_against_reference(read_log(log), ref, steps)

    from ckptstore import Store
    with Store(store) as s:
        assert s.latest_step() == steps
