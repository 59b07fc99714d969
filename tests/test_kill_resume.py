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
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_lm.py"
if str(REPO) not in sys.path:  # the checkout's package, also when pytest is run without -m from elsewhere
    sys.path.insert(0, str(REPO))

# A small, fast configuration (~10-15 ms per step here). ckpt-every is not part of the run config.
# 20 kB of corpus = 622 windows = 77 batches per epoch: the runs cross epoch boundaries (steps 77, 154).
MODEL_ARGS = ["--block", "32", "--batch-size", "8", "--d-model", "64", "--layers", "2", "--heads", "4",
              "--corpus-bytes", "20000"]
CKPT_EVERY = 5
N_REF = 200

_SAVING = re.compile(r"^saving step (\d+)$")
_SAVED = re.compile(r"^saved step (\d+) .* in ([0-9.]+)s$")
_RESUMED = re.compile(r"^resumed from step (\d+)$")


class Child:
    """``train_lm.py`` in a subprocess; a thread collects its stdout lines as they come."""

    def __init__(self, store: Path, log: Path, steps: int, *extra: str, ckpt_every: int = CKPT_EVERY):
        cmd = [sys.executable, "-u", str(TRAIN), "--store", str(store), "--log", str(log), "--steps", str(steps),
               "--ckpt-every", str(ckpt_every), *MODEL_ARGS, *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     cwd=str(REPO))
        self.lines: List[str] = []
        self.cond = threading.Condition()
        self.killed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_line(self, pattern: re.Pattern, nth: int = 1, timeout: float = 120.0) -> Optional[re.Match]:
        """Block until the ``nth`` line matching ``pattern``; ``None`` if the process ended first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [m for m in map(pattern.match, self.lines) if m]
                if len(found) >= nth:
                    return found[nth - 1]
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no line matching {pattern.pattern!r} within {timeout}s:\n" + self.output())
                self.cond.wait(min(left, 0.5))

    def kill(self) -> bool:
        """SIGKILL; returns False when the process had already exited."""
        alive = self.proc.poll() is None
        if alive:
            self.proc.send_signal(signal.SIGKILL)
            self.killed = True
        self.proc.wait()
        self._reader.join()
        return alive

    def finish(self, timeout: float = 300.0) -> None:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.kill()
        self._reader.join()
        assert self.proc.returncode == 0, f"train_lm.py exited {self.proc.returncode}:\n{self.output()}"

    def output(self) -> str:
        return "\n".join(self.lines)

    # -- what the run said ----------------------------------------------------------------------------------
    def resumed_from(self) -> Optional[int]:
        """The resume step, ``None`` for a fresh start; ``-1`` when it died before saying."""
        for line in self.lines:
            m = _RESUMED.match(line)
            if m:
                return int(m.group(1))
            if line == "fresh start":
                return None
        return -1

    def saved(self) -> List[int]:
        return [int(m.group(1)) for m in map(_SAVED.match, self.lines) if m]

    def save_in_flight(self) -> Optional[int]:
        """The step of a ``saving`` line with no ``saved`` line after it (after the process is gone)."""
        started = [int(m.group(1)) for m in map(_SAVING.match, self.lines) if m]
        return started[-1] if started and started[-1] not in self.saved() else None


def read_log(path: Path) -> Dict[int, List[float]]:
    """step -> every loss logged for it, in order (a step redone after a kill is logged again)."""
    out: Dict[int, List[float]] = {}
    if not path.exists():
        return out
    for i, line in enumerate(path.read_text().splitlines()):
        rec = json.loads(line)  # one write() per line: a kill never leaves half a line
        out.setdefault(int(rec["step"]), []).append(rec["loss"])
    return out


def log_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


def check_against_reference(log: Dict[int, List[float]], ref: Dict[int, float], steps: int) -> None:
    missing = [s for s in range(1, steps + 1) if s not in log]
    assert not missing, f"steps never logged: {missing[:20]}"
    extra = sorted(set(log) - set(range(1, steps + 1)))
    assert not extra, f"steps beyond the run: {extra[:20]}"
    unstable = {s: v for s, v in log.items() if len(set(v)) != 1}
    assert not unstable, f"a redone step logged different losses: {dict(list(unstable.items())[:5])}"
    merged = {s: v[-1] for s, v in log.items()}
    diff = [(s, ref[s], merged[s]) for s in range(1, steps + 1) if merged[s] != ref[s]]
    assert not diff, f"{len(diff)} steps differ from the reference (step, ref, got): {diff[:10]}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Uninterrupted run of N_REF steps: {step: loss}, and the median save seconds."""
    d = tmp_path_factory.mktemp("reference")
    c = Child(d / "store", d / "loss.jsonl", N_REF)
    c.finish()
    assert c.resumed_from() is None
    log = read_log(d / "loss.jsonl")
    assert sorted(log) == list(range(1, N_REF + 1)) and all(len(v) == 1 for v in log.values())
    save_s = statistics.median(float(m.group(2)) for m in map(_SAVED.match, c.lines) if m)
    return {s: v[0] for s, v in log.items()}, save_s


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
