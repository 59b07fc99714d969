"""ckptstore.integrations.torchtitan: CkptstoreCheckpointManager driven as torchtitan's Trainer drives its
checkpointer, on 2 ranks (gloo on 127.0.0.1, launched like torchrun) with FSDP2 model parts, torchtitan's fused
AdamW container, its LR-scheduler container and its per-dp-rank StatefulDataLoader (tests/titan_worker.py).

- SIGKILL mid-run, the same command again; then SIGKILL inside a save (before its commit marker), the same
  command again: each launch resumes from the last committed step (the killed save's step is invisible) and
  the losses equal an uninterrupted run's bit for bit;
- the same with the local folder wiped: resumes from the loopback S3 server;
- keep_latest_k: the newest k steps, locally and on the remote, across a restart;
- the memory tier (``memory_root``, every step to memory, every 4th to disk): SIGKILL, the same command resumes
  from the newest memory step (newer than every disk step), the losses equal an uninterrupted run's;
- a torchtitan whose BaseCheckpointManager lacks a hook fails at import, naming it.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="needs the torchtitan extra (pip install 'ckptstore[torchtitan]')")

from ckptstore import Store  # noqa: E402
from helpers import REPO, TESTS, read_losses  # noqa: E402

WORKER = TESTS / "titan_worker.py"
STEPS = 10


def free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks:
    """``world`` ranks of the worker, each in a session of its own, with torchrun's environment."""

    def __init__(self, world: int, *args: str):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                   OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.procs = [subprocess.Popen([sys.executable, "-u", str(WORKER), *args],
                                       env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=str(REPO))
                      for r in range(world)]

    def results(self, timeout: float = 180):
        """Wait for every rank; assert each exited 0; return their ``RESULT`` dicts."""
        out = []
        try:
            for r, p in enumerate(self.procs):
                text, _ = p.communicate(timeout=timeout)
                assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{text[-4000:]}"
                out.append(json.loads([ln for ln in text.splitlines() if ln.startswith("RESULT ")][-1][7:]))
        finally:
            self.kill()
        return out

    def kill(self) -> bool:
        """SIGKILL every rank still running; True when one was."""
        alive = False
        for p in self.procs:
            if p.poll() is None:
                alive = True
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            p.wait()
        return alive

    def kill_after(self, log: Path, lines: int, until=lambda: True, timeout: float = 180) -> None:
        """SIGKILL all ranks once rank 0 logged ``lines`` steps and ``until()`` holds; assert they were
        still running (the kill hit mid-run)."""
        deadline = time.monotonic() + timeout
        while not (log.exists() and len(log.read_text().splitlines()) >= lines and until()):
            if any(p.poll() is not None for p in self.procs):
                self.kill()
                raise AssertionError("a rank ended before the kill:\n" + "\n".join(
                    f"--- rank {r}\n{p.stdout.read()[-3000:]}" for r, p in enumerate(self.procs)))
            assert time.monotonic() < deadline, "the run did not get far enough to be killed"
            time.sleep(0.1)
        assert self.kill(), "the run finished before the kill"

    def killed_by_rank0(self, timeout: float = 180) -> None:
        """Wait for rank 0 to die of SIGKILL (its own, inside a save), then SIGKILL the other ranks."""
        try:
            text, _ = self.procs[0].communicate(timeout=timeout)
            assert self.procs[0].returncode == -signal.SIGKILL, \
                f"rank 0 exited {self.procs[0].returncode}, not killed:\n{text[-4000:]}"
        finally:
            self.kill()


def assert_same_read_losses(log: Path, reference) -> None:
    got = read_losses(log)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in got.items():             # a step redone after the kill must give the same loss
        assert all(v == reference[step] for v in values), (step, values, reference[step])


def run_args(dump: Path, log: Path, *extra: str):
    return ("--dump", str(dump), "--steps", str(STEPS), "--log", str(log), *extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted run: {step: loss}; its dump folder is ``reference.dump``."""
    d = tmp_path_factory.mktemp("titan_ref")
    res = Ranks(2, *run_args(d, d / "log", "--keep", "0")).results()
    assert [r["start"] for r in res] == [0, 0] and res[0]["saved"] == list(range(1, STEPS + 1))
    ref = Reference({s: v[0] for s, v in read_losses(d / "log").items()})
    ref.dump = d
    return ref


class Reference(dict):
    dump: Path


def test_sigkill_mid_run_resumes_bit_for_bit(tmp_path, reference):
    args = run_args(tmp_path, tmp_path / "log", "--keep", "0", "--step-sleep", "0.3")
    Ranks(2, *args).kill_after(tmp_path / "log", 5)
    committed = Store(tmp_path / "checkpoint", read_only=True).steps()
    assert committed and max(committed) < STEPS
    # the same command, its rank 0 SIGKILLed inside the save of the second step it saves, before the commit
    # marker (non-blocking: in the store's background commit), and all ranks with it
    in_save = max(committed) + 2
    Ranks(2, *args, "--kill-in-save", str(in_save)).killed_by_rank0()
    committed = Store(tmp_path / "checkpoint", read_only=True).steps()
    assert max(committed) == in_save - 1, committed          # the killed save's step is invisible
    assert (tmp_path / "checkpoint" / "steps" / f"{in_save:012d}").is_dir()     # though its save had begun
    res = Ranks(2, *args).results()                   # the same command
    assert all(r["loaded"] and r["start"] == in_save - 1 for r in res), (res, committed)
    assert res[0]["ntokens_seen"] == STEPS * 4 * 16   # the train state came back too
    assert_same_read_losses(tmp_path / "log", reference)
    # last_save_model_only (torchtitan's default): the last step holds the model alone, named model-only
    store = Store(tmp_path / "checkpoint", read_only=True)
    assert set(store.load(STEPS, rank=0)) == {"model"} and store.find("model-only") == STEPS
    assert set(store.load(STEPS - 1, rank=0)) == {"model", "optimizer", "lr_scheduler", "dataloader",
                                                  "train_state"}


def _committed(root: Path):
    """The committed steps of a root (a memory root is an ordinary store root: FORMAT.md "The memory tier")."""
    if not (root / "steps").is_dir():
        return []
    with Store(root, read_only=True) as s:
        return s.steps()


def test_memory_tier_sigkill_resumes_newest_memory_step_bit_for_bit(tmp_path, reference):
    mem = tmp_path / "mem"
    args = run_args(tmp_path, tmp_path / "log", "--keep", "0", "--step-sleep", "0.3", "--memory-root", str(mem),
                    "--disk-every", "4")
    Ranks(2, *args).kill_after(tmp_path / "log", 5, until=lambda: max(_committed(mem), default=0) >= 5)
    in_memory, on_disk = _committed(mem), _committed(tmp_path / "checkpoint")
    assert on_disk and all(s % 4 == 0 for s in on_disk), on_disk              # only disk_every steps reach disk
    assert max(in_memory) > max(on_disk), (in_memory, on_disk)
    res = Ranks(2, *args).results()
    assert all(r["loaded"] and r["tier"] == "memory" and r["start"] == max(in_memory) for r in res), \
        (res, in_memory, on_disk)
    assert res[0]["ntokens_seen"] == STEPS * 4 * 16
    assert_same_read_losses(tmp_path / "log", reference)
    assert _committed(tmp_path / "checkpoint")[-1] == 8       # promotions went on after the resume


def _remote_steps(url, so):
    with Store(url, storage_options=so, read_only=True) as s:
        return s.steps()


@pytest.mark.remote
def test_local_folder_wiped_resumes_from_s3(tmp_path, reference, s3_bucket_url):
    url, so = s3_bucket_url
    args = run_args(tmp_path, tmp_path / "log", "--keep", "0", "--step-sleep", "0.5", "--remote", url,
                    "--so", json.dumps(so))
    Ranks(2, *args).kill_after(tmp_path / "log", 5, until=lambda: bool(_remote_steps(url, so)))
    remote = _remote_steps(url, so)
    shutil.rmtree(tmp_path / "checkpoint")
    res = Ranks(2, *args).results()
    assert all(r["loaded"] and r["start"] >= max(remote) for r in res), (res, remote)
    assert_same_read_losses(tmp_path / "log", reference)
    assert _remote_steps(url, so) == list(range(1, STEPS + 1))     # close() waited for the uploads


@pytest.mark.slow
@pytest.mark.remote
def test_keep_latest_k_locally_and_remotely_across_a_restart(tmp_path, s3_bucket_url):
    url, so = s3_bucket_url
    args = run_args(tmp_path, tmp_path / "log", "--keep", "2", "--interval", "2", "--last-model-only", "0",
                    "--step-sleep", "0.3", "--remote", url, "--so", json.dumps(so))
    Ranks(2, *args).kill_after(tmp_path / "log", 6)
    res = Ranks(2, *args).results()
    assert res[0]["start"] in (4, 6) and res[0]["saved"][-2:] == [8, 10]
    assert _remote_steps(url, so) == [8, 10]          # remote retention runs after each upload, in order
    # locally retention never deletes a step still waiting for its upload, and applies to it once uploaded
    # (after each upload, at the restart's start for what the killed run left, at close): as on the remote
    local = Store(tmp_path / "checkpoint", read_only=True).steps()
    assert local == [8, 10], local


def test_config():
    from torchtitan.components.checkpoint import CheckpointManager
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager as M

    with pytest.raises(ValueError, match="at least 2"):
        CheckpointManager.Config(keep_latest_k=1)                  # torchtitan's own manager refuses 1
    assert M.Config(keep_latest_k=1).keep_latest_k == 1            # ckptstore never deletes the step in flight
    assert M.Config(storage_options_json='{"anon": true}').storage_options() == {"anon": True}
    for bad, match in [({"rank_local": "keep"}, "rank_local"), ({"storage_options_json": "{x"}, "JSON"),
                       ({"storage_options_json": "[1]"}, "JSON object"), ({"keep_every": 0}, "keep_every"),
                       ({"last_save_in_hf": True}, "ckptstore export"), ({"keep_latest_k": -1}, "negative")]:
        with pytest.raises(ValueError, match=match):
            M.Config(**bad)
    assert M.Config(enable=False).build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                                        states={}, sd_adapter=None).load() is False


def test_a_torchtitan_without_a_hook_fails_at_import(monkeypatch):
    from torchtitan.components.checkpointer import base
    import ckptstore.integrations.torchtitan as adapter

    monkeypatch.delattr(base.BaseCheckpointManager, "_maybe_wait_for_staging")
    monkeypatch.delitem(sys.modules, "ckptstore.integrations.torchtitan")
    with pytest.raises(ImportError, match=r"torchtitan >=0\.3,<0\.4.*BaseCheckpointManager\._maybe_wait_for_staging"):
        importlib.import_module("ckptstore.integrations.torchtitan")
    fake = types.SimpleNamespace(BaseCheckpointManager=base.BaseCheckpointManager, MODEL="model")
    with pytest.raises(ImportError, match="ModelWrapper, OPTIMIZER"):
        adapter.check_torchtitan(fake)


def _manager(dump: Path, seed: int, **cfg):
    """One process, no process group: a TinyLM with torchtitan's containers and a CkptstoreCheckpointManager."""
    import torch
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from ckptstore.integrations.torchtitan import CkptstoreCheckpointManager
    sys.path.insert(0, str(WORKER.parent))
    import titan_worker as w

    torch.manual_seed(seed)
    model = w.TinyLM()
    opt = default_adamw(lr=1e-2).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=1).build(optimizers=opt, training_steps=10)
    dl = ParallelAwareDataloader(w.Tokens(), dp_rank=0, dp_world_size=1, batch_size=2)
    ts = w.TrainState()
    m = CkptstoreCheckpointManager.Config(enable=True, **cfg).build(
        dataloader=dl, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={"train_state": ts},
        sd_adapter=None, base_folder=str(dump))
    return m, model, ts


def test_load_step_seed_checkpoint_and_model_only_last_step(tmp_path):
    import torch
    from ckptstore import CheckpointError

    # a seed checkpoint (torchtitan: save(curr_step=0, last_step=True)) loads the model only
    seed, seed_model, _ = _manager(tmp_path / "seed", 1)
    assert seed.save(0, last_step=True)
    seed.close()
    m, model, ts = _manager(tmp_path / "seed", 2)
    assert m.load() is True and ts.step == 0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), seed_model.state_dict().values()))
    m.close()

    # interval 2 saves 2, 4, then the last step 5 model-only; load_step=N restores exactly N
    m, model, ts = _manager(tmp_path / "run", 3, interval=2, nonblocking=False)
    weights = {}
    for step in range(1, 6):
        ts.step = step
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        assert m.save(step, last_step=step == 5) == (step in (2, 4, 5))
    m.close()
    m, model, ts = _manager(tmp_path / "run", 4, interval=2, load_step=2)
    assert m.load(step=m.config.load_step) and ts.step == 2
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights[2].items())
    with pytest.raises(FileNotFoundError):
        m.load(step=3)
    with pytest.raises(CheckpointError, match="model-only last step"):
        m.load(step=-1)                   # the run finished: resuming its model-only step 5 would rewind it
    assert m.load(step=5) and ts.step == 2          # an explicit model-only step: the model alone
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights[5].items())
    m.close()


def test_rank_local_dataloader_on_another_world_size(reference, tmp_path):
    """torchtitan's dataloader state is keyed by dp rank: a step of 2 ranks loaded by 1 process raises
    naming it, unless rank_local="fresh" (model and optimizer resharded from the 2 ranks' shards)."""
    import torch
    from ckptstore import IncompatibleCheckpointError

    shutil.copytree(reference.dump / "checkpoint", tmp_path / "checkpoint")
    m, model, ts = _manager(tmp_path, 5)
    with pytest.raises(IncompatibleCheckpointError, match="dataloader"):
        m.load(step=STEPS - 1)
    m.close()
    m, model, ts = _manager(tmp_path, 5, rank_local="fresh")
    assert m.load(step=STEPS - 1) and ts.step == STEPS - 1
    saved = Store(tmp_path / "checkpoint", read_only=True).load(STEPS - 1, rank=0)["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())   # full tensors, both shards
    m.close()
