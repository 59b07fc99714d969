"""ckptstore.integrations.lightning end to end: real Lightning ``Trainer.fit`` runs (tests/lightning_worker.py) in
subprocesses, SIGKILLed mid-save and mid-training and restarted with the same command; 2-rank DDP and FSDP2 jobs
launched like torchrun (gloo on 127.0.0.1); the remote tier on the loopback S3 server (moto).

Every training step of every process appends ``[step, loss]`` to a log; a resumed run repeats the steps after its
checkpoint, so *every* logged loss must equal the uninterrupted run's loss of that step, bit for bit.
"""
from __future__ import annotations

import argparse
import enum
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List

import pytest
import torch
from helpers import REPO, TESTS

pytest.importorskip("lightning")
pytest.importorskip("torchdata.stateful_dataloader")

WORKER = TESTS / "lightning_worker.py"
STEPS = 12
_SAVING = re.compile(r"^saving step (\d+)$")


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """``world`` ranks of the worker, each in a session of its own (env as torchrun sets it); stdout followed."""

    def __init__(self, tmp: Path, *args: str, world: int = 1, remote=None, name: str = "run"):
        port = _free_port()
        extra = []
        if remote is not None:
            extra = ["--remote", remote.url, "--storage-options", json.dumps(remote.storage_options)]
        base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                    OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONWARNINGS="ignore",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-u", str(WORKER), "--root", str(tmp / "store"), "--names", str(tmp / "names"),
               "--log", str(tmp / "loss.jsonl"), *extra, *args]
        self.procs = [subprocess.Popen(cmd, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=str(REPO))
                      for r in range(world)]
        self.lines: List[List[str]] = [[] for _ in range(world)]
        self.cond = threading.Condition()
        self.threads = [threading.Thread(target=self._read, args=(r,), daemon=True) for r in range(world)]
        for t in self.threads:
            t.start()

    def _read(self, r: int) -> None:
        for line in self.procs[r].stdout:
            with self.cond:
                self.lines[r].append(line.rstrip("\n"))
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_saving(self, step: int, timeout: float = 120) -> bool:
        """Wait until rank 0 prints ``saving step <step>``; False if it exited first."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                if any((m := _SAVING.match(ln)) and int(m.group(1)) == step for ln in self.lines[0]):
                    return True
                if self.procs[0].poll() is not None and not self.threads[0].is_alive():
                    return False
                left = deadline - time.monotonic()
                assert left > 0, "timed out waiting for a save:\n" + self.output()
                self.cond.wait(min(left, 0.5))

    def kill(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs:
            p.wait(timeout=60)
        for t in self.threads:
            t.join(timeout=10)

    def finish(self, timeout: float = 150) -> List[dict]:
        """Wait for every rank to exit 0; their RESULT dicts, by rank."""
        try:
            for p in self.procs:
                p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        for t in self.threads:
            t.join(timeout=10)
        bad = [r for r, p in enumerate(self.procs) if p.returncode != 0]
        assert not bad, f"ranks {bad} failed:\n{self.output()}"
        out = []
        for r in range(len(self.procs)):
            res = [ln[len("RESULT "):] for ln in self.lines[r] if ln.startswith("RESULT ")]
            assert res, self.output()
            out.append(json.loads(res[-1]))
        return out

    def output(self) -> str:
        return "\n".join(f"--- rank {r}\n" + "\n".join(ls[-60:]) for r, ls in enumerate(self.lines))


def read_log(path: Path, with_pid: bool = False) -> List[tuple]:
    """``[(step, loss)]`` (``(step, loss, pid)`` with ``with_pid``) in the order logged."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = tuple(json.loads(line))
        except ValueError:            # a line cut by SIGKILL
            continue
        out.append(rec[:3] if with_pid else rec[:2])
    return out


def first_step_per_process(path: Path) -> List[int]:
    firsts: Dict[int, int] = {}
    for step, _, pid in read_log(path, with_pid=True):
        firsts.setdefault(pid, step)
    return list(firsts.values())


def assert_same_losses(log: List[tuple], ref: Dict[int, float]) -> None:
    assert log, "nothing logged"
    bad = [(s, v, ref.get(s)) for s, v in log if ref.get(s) != v]
    assert not bad, f"losses differ from the uninterrupted run (step, got, want): {bad[:5]}"
    assert {s for s, _ in log} == set(ref), "steps missing"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Dict[int, float]:
    """One uninterrupted single-process run of 12 steps: step -> loss."""
    d = tmp_path_factory.mktemp("lightning-ref")
    res = Run(d, "--steps", str(STEPS)).finish()[0]
    assert res["global_step"] == STEPS
    log = read_log(d / "loss.jsonl")
    assert [s for s, _ in log] == list(range(STEPS))
    return dict(log)


def test_kill_mid_save_and_mid_training_resumes_bit_for_bit(tmp_path, reference):
    """SIGKILL right after a save began (a few ms in: usually mid-save), restart with ``ckpt_path=io.resume_path()``;
    SIGKILL mid-training, restart with ``ckpt_path="last"``: every loss logged by the three processes equals the
    uninterrupted run's, and the restarts resumed from the committed steps the kills allowed."""
    first = Run(tmp_path, "--resume", "io", "--steps", str(STEPS), "--sleep", "0.15")
    assert first.wait_saving(4), first.output()
    time.sleep(random.uniform(0.0, 0.03))
    first.kill()
    assert not any("RESULT" in ln for ln in first.lines[0])

    second = Run(tmp_path, "--resume", "io", "--steps", str(STEPS), "--sleep", "0.8")
    assert second.wait_saving(8), second.output()
    time.sleep(0.5)                                   # the save is done (or, on a loaded machine, still going)
    second.kill()
    assert any(ln.startswith("resuming from /") for ln in second.lines[0]), second.output()

    third = Run(tmp_path, "--resume", "last", "--steps", str(STEPS)).finish()[0]
    assert third["ckpt_path"] == "last" and third["global_step"] == STEPS
    assert_same_losses(read_log(tmp_path / "loss.jsonl"), reference)
    firsts = first_step_per_process(tmp_path / "loss.jsonl")
    # step 2 was committed before the first kill (step 4 maybe), step 6 before the second (step 8 maybe)
    assert firsts[0] == 0 and firsts[1] in (2, 4) and firsts[2] in (6, 8), firsts


@pytest.mark.remote
def test_resume_from_s3_after_local_disk_wiped(tmp_path, reference, s3_bucket_url):
    """A run uploading to loopback S3 is SIGKILLed; its local store and every stub are deleted; the same command
    resumes from the remote (``resume_path`` rewrites the stub) and every logged loss equals the uninterrupted run's."""
    first = Run(tmp_path, "--resume", "io", "--steps", str(STEPS), "--sleep", "0.6", remote=s3_bucket_url)
    assert first.wait_saving(8), first.output()
    time.sleep(0.5)
    first.kill()
    began = [int(m.group(1)) for ln in first.lines[0] if (m := _SAVING.match(ln))]
    assert began and max(began) < STEPS, first.output()     # killed before the end (the steps' sleep allows it)
    shutil.rmtree(tmp_path / "store")
    shutil.rmtree(tmp_path / "names")
    res = Run(tmp_path, "--resume", "io", "--steps", str(STEPS), remote=s3_bucket_url).finish()[0]
    assert res["ckpt_path"] is not None and res["global_step"] == STEPS
    firsts = first_step_per_process(tmp_path / "loss.jsonl")
    # resumed mid-run from a step the remote held: at most the last save the killed run began (a loaded machine
    # may let it reach step 10 before the kill)
    assert len(firsts) == 2 and 2 <= firsts[1] <= max(began), (firsts, began)
    assert_same_losses(read_log(tmp_path / "loss.jsonl"), reference)
    assert STEPS in res["remote_steps"] and STEPS in res["local_steps"]


@pytest.mark.remote
def test_retention_follows_model_checkpoint_locally_and_remotely(tmp_path, s3_bucket_url):
    """``save_top_k=2, monitor="train_loss", save_last=True``, 6 steps, then the same command resumed to 12: the
    store keeps exactly the steps of ModelCheckpoint's two best paths and ``last.ckpt``, locally and on S3; the stub
    files are exactly those paths."""
    Run(tmp_path, "--steps", "6", remote=s3_bucket_url).finish()
    res = Run(tmp_path, "--resume", "io", "--steps", str(STEPS), remote=s3_bucket_url).finish()[0]
    assert res["ckpt_path"].endswith("last.ckpt")
    assert len(res["best_k"]) == 2 and res["last"] == "last.ckpt"
    assert set(res["stubs"]) == set(res["best_k"]) | {"last.ckpt"}
    expected = sorted(set(res["stubs"].values()))
    assert res["stubs"]["last.ckpt"] == STEPS
    assert res["local_steps"] == expected, res
    assert res["remote_steps"] == expected, res
    assert len(expected) in (2, 3)                  # a best step may also be the last one
    saved = set(range(2, STEPS + 1, 2))
    assert saved - set(expected), "nothing was deleted"


@pytest.mark.slow
def test_ddp_two_ranks_kill_and_resume_bit_for_bit(tmp_path):
    """2-rank DDP (gloo, CPU, ranks launched like torchrun): an uninterrupted job, and a job SIGKILLed mid-training
    and restarted with ``ckpt_path=io.resume_path()`` on both ranks: each rank's losses equal the uninterrupted
    job's, bit for bit (rank 0 saves; every rank loads through a read-only store)."""
    ref_dir = tmp_path / "ref"
    ref_job = Run(ref_dir, "--strategy", "ddp", "--steps", "8", world=2)
    run_dir = tmp_path / "run"                  # beside the uninterrupted job (own dirs and port): they overlap
    job = Run(run_dir, "--strategy", "ddp", "--resume", "io", "--steps", "8", "--stall-at", "6", world=2)
    try:
        assert job.wait_saving(4), job.output()
        time.sleep(0.3)
    except BaseException:
        ref_job.kill()
        raise
    finally:
        job.kill()
    ref_job.finish()
    out = Run(run_dir, "--strategy", "ddp", "--resume", "io", "--steps", "8", world=2).finish()
    assert all(r["ckpt_path"] is not None and r["global_step"] == 8 for r in out), out
    for r in (0, 1):
        ref = dict(read_log(ref_dir / f"loss.jsonl.r{r}"))
        assert len(ref) == 8
        log = read_log(run_dir / f"loss.jsonl.r{r}")
        assert_same_losses(log, ref)
        # two processes, the second starting past step 0 (with a save every step it may continue right where
        # the first stopped: no step run twice, so the log's length proves nothing)
        firsts = first_step_per_process(run_dir / f"loss.jsonl.r{r}")
        assert len(firsts) == 2 and firsts[1] > 0, f"the job was not interrupted and resumed: {firsts}"


@pytest.mark.slow
def test_fsdp2_two_ranks_saved_then_resumed_on_one_rank(tmp_path):
    """FSDP2 (``fully_shard`` in ``configure_model``) on 2 ranks saves through CkptstoreModelParallelStrategy (each
    rank its shards); a 1-rank run resumes from ``resume_path()`` (resharded in place): its full model and AdamW
    state at ``on_train_start`` equal the 2-rank job's at the end, byte for byte, and it trains on and saves."""
    two = Run(tmp_path, "--strategy", "fsdp", "--steps", "4", world=2).finish()
    end = two[0]["snap"]["end"]
    assert any(k.startswith("optim.") for k in end) and any(k.startswith("model.") for k in end)
    one = Run(tmp_path, "--strategy", "fsdp", "--resume", "io", "--steps", "6", world=1).finish()[0]
    assert one["ckpt_path"] is not None and first_step_per_process(tmp_path / "loss.jsonl") == [4]
    assert one["snap"]["start"] == end
    assert one["global_step"] == 6 and 6 in one["local_steps"]
    assert one["stubs"]["last.ckpt"] == 6


# -- in process ------------------------------------------------------------------------------------------------------
def test_importing_ckptstore_does_not_import_lightning():
    code = "import sys, ckptstore, ckptstore.integrations; assert 'lightning' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("cls_name,method", [("CheckpointIO", "remove_checkpoint"),
                                             ("ModelParallelStrategy", "on_train_start")])
def test_lightning_without_an_overridden_method_fails_at_import(monkeypatch, cls_name, method):
    import importlib

    import lightning.pytorch.plugins.io as io_mod
    import lightning.pytorch.strategies as strat_mod
    cls = {"CheckpointIO": io_mod.CheckpointIO, "ModelParallelStrategy": strat_mod.ModelParallelStrategy}[cls_name]
    owner = next(c for c in cls.__mro__ if method in vars(c))
    monkeypatch.delattr(owner, method)
    monkeypatch.delitem(sys.modules, "ckptstore.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=rf"{cls_name}\.{method}.*supported: lightning >= 2.6"):
        importlib.import_module("ckptstore.integrations.lightning")


def test_hyperparameters_are_made_plain_or_refused():
    from ckptstore.integrations.lightning import sanitize_checkpoint

    class Color(enum.Enum):
        RED = "red"

    ck = {"global_step": 3, "hyper_parameters": {"ns": argparse.Namespace(a=1, p=pathlib.Path("/x/y")),
                                                 "c": Color.RED, "l": [pathlib.Path("z")]},
          "hparams_type": dict}
    out = sanitize_checkpoint(ck)
    assert out["hyper_parameters"] == {"ns": {"a": 1, "p": "/x/y"}, "c": "red", "l": ["z"]}
    assert "hparams_type" not in out and ck["hparams_type"] is dict      # the caller's dict is untouched

    class Opaque:
        pass
    with pytest.raises(TypeError, match=r"hyper_parameters\['model'\]\['act'\].*Opaque"):
        sanitize_checkpoint({"hyper_parameters": {"model": {"act": Opaque()}}})


def test_a_lightning_checkpoint_without_stub_is_loaded_for_migration(tmp_path):
    """A file written by Lightning's own TorchCheckpointIO loads through the adapter (weights_only=True), and a
    stub of another store is refused with both roots named."""
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from ckptstore.integrations.lightning import CkptstoreCheckpointIO, write_stub
    old = tmp_path / "old.ckpt"
    TorchCheckpointIO().save_checkpoint({"global_step": 7, "state_dict": {"w": torch.arange(4.0)}}, old)
    io = CkptstoreCheckpointIO(tmp_path / "store")
    got = io.load_checkpoint(old)
    assert got["global_step"] == 7 and torch.equal(got["state_dict"]["w"], torch.arange(4.0))
    write_stub(tmp_path / "other.ckpt", str(tmp_path / "elsewhere"), 3)
    with pytest.raises(ValueError, match="another store"):
        io.load_checkpoint(tmp_path / "other.ckpt")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        io.load_checkpoint(tmp_path / "missing.ckpt")
    io.teardown()


def test_non_blocking_saves_write_their_stubs_once_committed(tmp_path):
    """``blocking=False`` in an in-process fit: the stubs appear once the background commits are done (at the next
    save / teardown), ModelCheckpoint's rotation deletes what no stub names, and a stub loads its step."""
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ckptstore import Store
    from ckptstore.integrations.lightning import CkptstoreCheckpointIO, read_stub

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, idx):
            loss = torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=4)
    io = CkptstoreCheckpointIO(tmp_path / "store", blocking=False)
    ck = ModelCheckpoint(dirpath=tmp_path / "names", every_n_train_steps=2, save_top_k=2, monitor="train_loss",
                         save_last=True)
    model = Tiny()
    L.Trainer(max_steps=8, logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
              plugins=[io], callbacks=[ck, io.callback]).fit(model, data)
    stubs = {p.name: read_stub(p)["step"] for p in (tmp_path / "names").iterdir()}
    assert set(stubs) == {Path(p).name for p in ck.best_k_models} | {"last.ckpt"} and stubs["last.ckpt"] == 8
    with Store(tmp_path / "store", read_only=True) as s:
        assert s.steps() == sorted(set(stubs.values()))
    from ckptstore import RNGState
    ours = RNGState().state_dict()
    try:
        got = io.load_checkpoint(tmp_path / "names" / "last.ckpt")      # restores the saved RNG state
    finally:
        RNGState().load_state_dict(ours)                                 # this test session's
    assert got["global_step"] == 8
    assert torch.equal(got["state_dict"]["lin.weight"], model.lin.weight.detach())
    io.teardown()


STUB_WORKER = TESTS / "stub_worker.py"


def _stub_proc(*args: str, stdin=None) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-u", str(STUB_WORKER), *map(str, args)], env=env, cwd=str(REPO),
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stub_run(*args: str, want: int = 0) -> str:
    p = _stub_proc(*args)
    out, _ = p.communicate(timeout=120)
    assert p.returncode == want, f"stub_worker {args} exited {p.returncode}, expected {want}:\n{out[-3000:]}"
    return out


@pytest.mark.slow
def test_stub_temp_file_of_a_killed_writer_is_removed_a_live_writers_kept(tmp_path):
    """A process SIGKILLed inside the stub write (after the commit; its ``.ckptstore-stub-*.tmp`` created) leaves
    the temporary file in Lightning's checkpoint dir; the restarted run's ``resume_path()`` rewrites the missing stub
    and removes the leftover. That run, caught alive mid-write (its own temporary file created), keeps its file
    while another writer saves and writes a stub in the same dir, then finishes."""
    from ckptstore.integrations.lightning import CkptstoreCheckpointIO, read_stub
    root, names = tmp_path / "store", tmp_path / "names"

    def leftovers():
        return sorted(p.name for p in names.iterdir() if p.name.startswith(".ckptstore-stub-"))

    _stub_run("save", root, names / "step=2.ckpt", "2", "--kill-in-stub", want=-signal.SIGKILL)
    killed = leftovers()
    assert len(killed) == 1 and not (names / "step=2.ckpt").exists(), killed   # the window is real

    restarted = _stub_proc("resume", root, "--hold-in-stub", stdin=subprocess.PIPE)
    try:
        line = restarted.stdout.readline()
        assert line.startswith("HOLDING "), line + restarted.stdout.read()
        held = Path(line.split(" ", 1)[1].strip())
        assert leftovers() == [held.name] and held.name not in killed
        io = CkptstoreCheckpointIO(tmp_path / "store2")       # another writer in the same dir, meanwhile
        io.save_checkpoint({"global_step": 4, "state_dict": {"w": torch.zeros(2)}}, names / "other.ckpt")
        io.teardown()
        assert read_stub(names / "other.ckpt")["step"] == 4
        assert held.exists(), "a live writer's temporary file was removed"
        restarted.stdin.write("go\n")
        restarted.stdin.flush()
        out, _ = restarted.communicate(timeout=60)
        assert restarted.returncode == 0 and f"RESUME {names / 'step=2.ckpt'}" in out, out
    finally:
        if restarted.poll() is None:
            restarted.kill()
    assert read_stub(names / "step=2.ckpt")["step"] == 2
    assert leftovers() == []


def test_a_checkpoint_on_an_epochs_last_batch_with_a_stateful_loader_is_warned(tmp_path, caplog):
    """Lightning 2.6 + torchdata's StatefulDataLoader: resuming a checkpoint taken on an epoch's last batch skips
    the next epoch (Lightning's own TorchCheckpointIO does the same). The adapter warns at the first such save and
    at every load of such a step, naming the step and epoch; mid-epoch steps are not warned. The resumed fit shows
    the skip: with max_epochs=2, resuming step 4 (epoch 0's last batch) trains nothing."""
    import logging

    import lightning.pytorch as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    from ckptstore.integrations.lightning import CkptstoreCheckpointIO

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 1)
            self.seen = []

        def training_step(self, batch, idx):
            self.seen.append((self.current_epoch, idx))
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(ckpt_path=None, **kw):
        torch.manual_seed(0)
        loader = StatefulDataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4, shuffle=True)   # 4 batches
        io = CkptstoreCheckpointIO(tmp_path / "store", on_rewind="truncate")
        model = Tiny()
        L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                  num_sanity_val_steps=0, plugins=[io], callbacks=[io.callback, ModelCheckpoint(
                      dirpath=tmp_path / "names", every_n_train_steps=2, save_top_k=-1, filename="{step}")],
                  **kw).fit(model, loader, ckpt_path=ckpt_path)
        return io, model

    def hazards():
        return [r for r in caplog.records if r.name == "ckptstore.lightning" and "resumable data loader" in r.message]

    caplog.set_level(logging.INFO, logger="ckptstore.lightning")
    io, model = fit(max_steps=6)                   # saves steps 2, 4 (epoch 0's last batch), 6
    assert model.seen == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1)]
    (rec,) = hazards()
    assert rec.levelno == logging.WARNING and "step 4 was saved on the last batch of epoch 0" in rec.message
    caplog.clear()
    io.load_checkpoint(tmp_path / "names" / "step=2.ckpt")
    assert hazards() == []
    io.load_checkpoint(tmp_path / "names" / "step=4.ckpt")
    (rec,) = hazards()
    assert rec.levelno == logging.WARNING and rec.message.startswith("resuming: step 4 was saved on the last batch")
    io.teardown()
    _, resumed = fit(ckpt_path=tmp_path / "names" / "step=4.ckpt", max_epochs=2)
    assert resumed.seen == [], "Lightning no longer skips an epoch here: revisit the warning and the doc"


@pytest.mark.slow
def test_memory_tier_killed_resumes_newest_memory_step_bit_for_bit(tmp_path, reference):
    """``CkptstoreCheckpointIO(memory=Memory(every=2, disk_every=4))`` with ``ModelCheckpoint`` saving every step:
    odd steps are due for no tier (no stub), even steps go to memory, every 4th to disk. SIGKILL while step 7
    trains (memory holds 4 and 6, the disk 4); the same command resumes from memory step 6 through
    ``io.resume_path()`` and every loss equals the uninterrupted run's bit for bit."""
    from ckptstore import Store
    mem, root = tmp_path / "mem", tmp_path / "store"
    args = ("--resume", "io", "--steps", str(STEPS), "--every-n", "1", "--memory-root", str(mem),
            "--memory-every", "2", "--disk-every", "4")
    first = Run(tmp_path, *args, "--stall-at", "7")
    deadline = time.monotonic() + 120
    while not (7 in [s for s, _ in read_log(tmp_path / "loss.jsonl")] and (root / "steps").is_dir()
               and Store(root, read_only=True).steps() == [4]):    # step 4's promotion runs in the background
        assert time.monotonic() < deadline and first.procs[0].poll() is None, first.output()
        time.sleep(0.1)
    first.kill()
    with Store(mem, read_only=True) as m:                # a memory root is an ordinary store root
        assert m.steps() == [4, 6]

    res = Run(tmp_path, *args).finish()[0]
    assert res["ckpt_path"] == str(tmp_path / "names" / "last.ckpt") and res["global_step"] == STEPS, res
    assert first_step_per_process(tmp_path / "loss.jsonl") == [0, 6]
    assert_same_losses(read_log(tmp_path / "loss.jsonl"), reference)
    assert all(step % 2 == 0 for step in res["stubs"].values()), res["stubs"]   # no stub for an unsaved step
    assert res["stubs"]["last.ckpt"] == STEPS and STEPS in res["local_steps"], res
    assert set(res["local_steps"]) <= {4, 8, 12}, res                        # only disk_every steps on disk
