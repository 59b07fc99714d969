"""ckptstore.integrations.accelerate: an accelerate loop (dropout, torch's default AdamW, a scheduler, a shuffled
DataLoader crossing epochs, non-blocking saves every step; tests/accel_train.py) SIGKILLed mid-run and started
again with the same command continues bit for bit: one process, and 2 DDP ranks (gloo on 127.0.0.1, launched
like torchrun). The one-process run also has a loopback S3 remote: killed a second time, its local root wiped,
the same command resumes from S3, bit for bit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="needs the accelerate extra (pip install 'ckptstore[accelerate]')")

from ckptstore import Store  # noqa: E402
from helpers import REPO, TESTS, read_losses  # noqa: E402

SCRIPT = TESTS / "accel_train.py"
STEPS = 24       # 10 batches per epoch: the runs cross two epoch boundaries


def free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(world: int, store: Path, log: Path, *extra: str):
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                   GLOO_SOCKET_IFNAME="lo")
    return [subprocess.Popen([sys.executable, "-u", str(SCRIPT), "--store", str(store), "--log", str(log),
                              "--steps", str(STEPS), *extra],
                             env=dict(env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if world > 1 else {})),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                             cwd=str(REPO)) for r in range(world)]


def results(procs, timeout=180):
    out = []
    for r, p in enumerate(procs):
        text, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{text[-4000:]}"
        out.append(json.loads([ln for ln in text.splitlines() if ln.startswith("RESULT ")][-1][7:]))
    return out


def kill_after(procs, log: Path, lines: int, until=lambda: True, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    try:
        while not (log.exists() and len(log.read_text().splitlines()) >= lines and until()):
            assert all(p.poll() is None for p in procs), "a rank ended before the kill:\n" + "\n".join(
                p.stdout.read()[-8000:] for p in procs if p.poll() is not None)
            assert time.monotonic() < deadline, "the run did not get far enough to be killed"
            time.sleep(0.05)
        assert all(p.poll() is None for p in procs), "the run finished before the kill"
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate()


def _remote_steps(url, so):
    with Store(url, storage_options=so, read_only=True) as s:
        return s.steps()


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.remote),
                                   pytest.param(2, id="ddp2", marks=pytest.mark.slow)])
def test_sigkill_mid_run_resumes_bit_for_bit(tmp_path, world, request):
    # keep=3 on one process; every step under DDP: with non-blocking saves on several ranks, rank 0's
    # retention sweep waits (5 s) for the other ranks' next save, which stalls the loop (a core issue)
    keep = ("--keep", "3" if world == 1 else "0")
    ref = tmp_path / "ref"
    # the uninterrupted run (own store, log and port) runs beside the first run below: that one mostly sleeps
    # between its steps (its kill window), so the two overlap instead of taking turns
    ref_procs = start(world, ref / "store", tmp_path / "ref.log", *keep)
    run = tmp_path / "run"
    log = tmp_path / "run.log"
    cmd = ("--step-sleep", "0.15", *keep)
    uploaded = lambda: True  # noqa: E731
    if world == 1:          # one process: the store has a loopback S3 remote too (and a wider kill window)
        url, so = request.getfixturevalue("s3_bucket_url")
        cmd = ("--step-sleep", "0.3", *keep, "--remote", url, "--so", json.dumps(so))
        uploaded = lambda: bool(_remote_steps(url, so))  # noqa: E731
    try:                    # killed mid-epoch, after an epoch boundary
        kill_after(start(world, run / "store", log, *cmd), log, 13, until=uploaded)
    except BaseException:
        for p in ref_procs:
            os.killpg(p.pid, signal.SIGKILL)
        raise
    res = results(ref_procs)
    per_epoch = 10 // world                    # 40 samples, batches of 4, split over the ranks
    assert res[0]["start"] is None and res[0]["progress"] == {"epoch": STEPS // per_epoch,
                                                              "batch": STEPS % per_epoch, "step": STEPS}
    assert {"model", "optimizer", "scheduler", "accelerator", "rng", "progress"} <= set(res[0]["keys"])
    if world > 1:           # DDP: rank 0 alone saves the replicated entries
        assert set(res[0]["replicated"]) == {"model", "optimizer", "scheduler", "accelerator"}
    reference = {s: v[0] for s, v in read_losses(tmp_path / "ref.log").items()}
    committed = Store(run / "store", read_only=True).steps()
    assert committed and 10 < max(committed) < STEPS
    if world == 1:
        # the same command, killed again once S3 holds a step; the local root wiped: the same command resumes
        # from the newest step on S3
        logged = len(log.read_text().splitlines())
        kill_after(start(world, run / "store", log, *cmd), log, logged + 4)
        assert json.loads(log.read_text().splitlines()[logged])["step"] == max(committed) + 1   # resumed locally
        committed = _remote_steps(url, so)
        shutil.rmtree(run / "store")
    res = results(start(world, run / "store", log, *cmd))        # the same command
    assert all(r["start"] == max(committed) for r in res), (res, committed)
    got = read_losses(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():
        assert all(v == reference[step] for v in values), (step, values, reference[step])
    if world == 1:          # close() waited for the uploads; retention ran on both tiers
        assert _remote_steps(url, so) == [STEPS - 2, STEPS - 1, STEPS]
        # locally a step still waiting for its upload is never deleted: it may outlive a later commit
        assert Store(run / "store", read_only=True).steps()[-3:] == [STEPS - 2, STEPS - 1, STEPS]
    else:
        assert Store(run / "store", read_only=True).steps() == list(range(1, STEPS + 1))


def test_accelerator_state_entries():
    import torch
    from accelerate import Accelerator
    from ckptstore import RNGState
    from ckptstore.integrations.accelerate import accelerator_state, check_accelerate

    acc = Accelerator(cpu=True)
    m1, m2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    o1, o2 = torch.optim.AdamW(m1.parameters()), torch.optim.SGD(m2.parameters(), lr=0.1)
    s1 = torch.optim.lr_scheduler.StepLR(o1, 2)
    m1, m2, o1, o2, s1 = acc.prepare(m1, m2, o1, o2, s1)

    class Counter:
        def __init__(self):
            self.n = 3

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    c = Counter()
    acc.register_for_checkpointing(c)
    state = accelerator_state(acc, progress={"batch": 0})
    assert state["model"] is m1 and state["model_1"] is m2 and state["optimizer"] is o1
    assert state["optimizer_1"] is o2 and state["scheduler"] is s1 and state["custom"] is c
    assert isinstance(state["rng"], RNGState) and "rng" not in accelerator_state(acc, rng=False)
    with pytest.raises(ValueError, match="'model'"):
        accelerator_state(acc, model={})
    check_accelerate()

    class Old:                     # an Accelerator without the attributes read here
        pass
    with pytest.raises(ImportError, match="Accelerator._models"):
        check_accelerate(Old)
