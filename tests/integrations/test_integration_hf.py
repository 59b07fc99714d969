"""ckptstore.integrations.transformers end to end: real HF Trainer runs (tests/hf_worker.py: tiny GPT-2 with
dropout, random tokens, the default fused AdamW, eval every save, metric_for_best_model=eval_loss,
load_best_model_at_end) in subprocesses that SIGKILL themselves; every restart runs the same command with
``resume_from_checkpoint="auto"`` and every loss it logs must equal the uninterrupted run's bit for bit.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

pytest.importorskip("transformers")

from dist import Job, free_port  # noqa: E402
from helpers import REPO, TESTS  # noqa: E402

WORKER = TESTS / "hf_worker.py"
STEPS, SAVE = 12, 2
SAVED = list(range(SAVE, STEPS + 1, SAVE))


def _env(extra: Optional[dict] = None) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", AWS_EC2_METADATA_DISABLED="true",
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])), **(extra or {}))


def run_worker(*args: str, expect_kill: bool = False, timeout: float = 240) -> Optional[dict]:
    """One single-process run; asserts it exited 0 (or died of SIGKILL with ``expect_kill``)."""
    p = subprocess.run([sys.executable, "-u", str(WORKER), *args], env=_env(), cwd=str(REPO), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)
    want = -9 if expect_kill else 0
    assert p.returncode == want, f"worker exited {p.returncode}, expected {want}:\n{p.stdout[-4000:]}"
    found = [ln[len("RESULT "):] for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(found[-1]) if found else None


def launch(world: int, *args: str) -> Job:
    """``world`` ranks of hf_worker.py, launched as tests/dist.py launches its ranks (torchrun's env)."""
    job = Job.__new__(Job)
    base = _env(dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world),
                     GLOO_SOCKET_IFNAME="lo"))
    job.procs = [subprocess.Popen([sys.executable, "-u", str(WORKER), *args],
                                  env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=str(REPO))
                 for r in range(world)]
    return job


def read_runs(path: Path) -> List[Tuple[Optional[int], List[dict]]]:
    """The log split per launch: ``[(resumed step or None, [records])]``."""
    runs: List[Tuple[Optional[int], List[dict]]] = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "start" in rec:
            runs.append((rec["resumed_step"], []))
        else:
            runs[-1][1].append(rec)
    return runs


def assert_matches(runs, ref: Dict[Tuple[int, str], float], steps: int = STEPS) -> None:
    """Every logged value of every launch equals the reference bit for bit, each launch logs the steps right
    after the one it resumed from, and the launches together log every step."""
    seen = set()
    for resumed, recs in runs:
        assert recs, f"a launch (resumed from {resumed}) logged nothing"
        assert recs[0]["step"] == (resumed or 0) + 1, (resumed, recs[0])
        for rec in recs:
            for k in ("loss", "eval_loss"):
                if k in rec:
                    assert rec[k] == ref[(rec["step"], k)], \
                        f"step {rec['step']} {k}: {rec[k]!r} != reference {ref[(rec['step'], k)]!r} " \
                        f"(launch resumed from {resumed})"
                    seen.add(rec["step"])
    assert seen == set(range(1, steps + 1))


def as_ref(runs) -> Dict[Tuple[int, str], float]:
    return {(r["step"], k): r[k] for _, recs in runs for r in recs for k in ("loss", "eval_loss") if k in r}


def best_of(ref, steps) -> int:
    """The step HF calls best: the first lowest eval_loss among ``steps``."""
    return min(steps, key=lambda s: (ref[(s, "eval_loss")], s))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, launched with ``resume_from_checkpoint=True`` on an empty output dir."""
    d = tmp_path_factory.mktemp("hf_ref")
    res = run_worker("--out", str(d / "out"), "--store", str(d / "store"), "--log", str(d / "log"), "--eval",
                     "--resume", "true")
    runs = read_runs(d / "log")
    return {"runs": runs, "ref": as_ref(runs), "result": res, "store": d / "store"}


def test_resume_true_on_a_first_launch_starts_fresh(reference):
    """HF's own ``resume_from_checkpoint=True`` raises ValueError on a first launch; the adapter starts
    fresh, trains every step and saves every ``save_steps``."""
    from ckptstore import Store
    (resumed, recs), = reference["runs"]
    assert resumed is None and reference["result"]["resumed_step"] is None
    assert [r["step"] for r in recs if "loss" in r] == list(range(1, STEPS + 1))
    assert reference["result"]["global_step"] == STEPS
    with Store(reference["store"], read_only=True) as s:
        assert s.steps() == SAVED
        info = s.commit_info(STEPS)
        assert info.metrics["loss"] == reference["ref"][(STEPS, "loss")]
        assert info.metrics["eval_loss"] == reference["ref"][(STEPS, "eval_loss")]
        assert s.find(f"checkpoint-{STEPS}") == STEPS


@pytest.mark.remote
def test_killed_mid_training_wiped_and_killed_mid_save_resumes_bit_for_bit(tmp_path, reference, s3_bucket_url):
    """One run with ``save_total_limit=2``, ``metric_for_best_model`` and a loopback S3 remote, restarted with
    the same command after each crash:

    1. SIGKILL after step 5 (its uploads done), then the local root is wiped: the restart resumes from step 4
       on the remote;
    2. that launch is SIGKILLed inside the save of step 8 (chunks and manifest written, no commit marker): the
       next launch resumes from step 6 and finishes.

    Every loss and eval loss each launch logs equals the uninterrupted run's bit for bit; the best model loaded
    at the end is the reference's; both tiers keep the last two steps plus the best one."""
    from ckptstore import Store
    url, opts = s3_bucket_url
    store = tmp_path / "store"
    ref = reference["ref"]
    cmd = ["--out", str(tmp_path / "out"), "--store", str(store), "--log", str(tmp_path / "log"), "--eval",
           "--limit", "2", "--remote", url, "--storage-options", json.dumps(opts)]
    run_worker(*cmd, "--kill-at", "5", "--uploads-before-kill", expect_kill=True)
    with Store(url, storage_options=opts, read_only=True) as remote:
        assert remote.steps() == [2, 4]
    shutil.rmtree(store)
    run_worker(*cmd, "--kill-in-save", "8", expect_kill=True)
    with Store(store, read_only=True) as local:
        assert local.steps() == [4, 6]          # 4 pulled from S3, 6 saved; 8 killed before its commit
    res = run_worker(*cmd)
    runs = read_runs(tmp_path / "log")
    assert [r for r, _ in runs] == [None, 4, 6] and res["resumed_step"] == 6
    assert_matches(runs, ref)
    best = best_of(ref, SAVED)
    assert res["best_model_checkpoint"] == f"{store}/steps/{best}"
    assert res["model"] == reference["result"]["model"]     # load_best_model_at_end: the same weights
    with Store(url, storage_options=opts, read_only=True) as remote:
        assert remote.steps() == sorted({10, 12, best})
    with Store(store, read_only=True) as local:
        # retention here judged the steps this root held (from 4 on) and the final load pulled the best one;
        # a step spared while its upload was pending follows the policy once uploaded (at the latest at close)
        kept = {10, 12, best_of(ref, [4, 6, 8, 10, 12]), best}
        assert set(local.steps()) == kept, (local.steps(), kept)


def test_resume_from_transformers_own_checkpoint_dir(tmp_path, reference):
    """Migration: a run of the plain Trainer killed after step 5 leaves HF's own checkpoint-4; the adapter's
    ``"auto"`` finds no store step, resumes from that directory through HF's own loading, and continues bit
    for bit, its checkpoints now going to the store (non-blocking saves here), the best model loaded at the end
    from the store."""
    from ckptstore import Store
    cmd = ["--out", str(tmp_path / "out"), "--store", str(tmp_path / "store"), "--log", str(tmp_path / "log"),
           "--eval"]
    run_worker(*cmd, "--plain", "--kill-at", "5", expect_kill=True)
    assert (tmp_path / "out" / "checkpoint-4" / "trainer_state.json").is_file()
    res = run_worker(*cmd, "--non-blocking")
    runs = read_runs(tmp_path / "log")
    assert res["resumed_step"] is None and res["model"] == reference["result"]["model"]
    assert_matches([(None, runs[0][1]), (4, runs[1][1])], reference["ref"])
    with Store(tmp_path / "store", read_only=True) as s:
        assert s.steps() == [6, 8, 10, 12]


@pytest.mark.slow
def test_ddp_two_ranks_killed_and_resumed_bit_for_bit(tmp_path):
    """2-rank DDP (gloo on 127.0.0.1, ranks launched like torchrun): every rank SIGKILLs itself after step 3;
    the same 2-rank command resumes from step 2 (model, optimizer and trainer state saved once by rank 0, each
    rank's RNG its own) and the losses rank 0 logs equal an uninterrupted 2-rank run's."""
    from ckptstore import Store
    steps = "8"

    def job(name, *extra):
        return launch(2, "--out", str(tmp_path / name / "out"), "--store", str(tmp_path / name / "store"),
                      "--log", str(tmp_path / name / "log"), "--steps", steps, *extra)

    ref_job = job("ref")
    killed = job("run", "--kill-at", "3")       # beside the uninterrupted job (own dirs and port): they overlap
    try:
        killed.wait(240)
    except BaseException:
        ref_job.kill()
        raise
    ref_out = ref_job.check(240)
    assert all(r is not None for r in ref_out.values())
    ref = as_ref(read_runs(tmp_path / "ref" / "log"))
    assert [p.returncode for p in killed.procs] == [-9, -9], killed.outputs
    out = job("run").check(240)
    assert out[0]["resumed_step"] == 2 and out[1]["resumed_step"] == 2
    assert out[0]["model"] == out[1]["model"] == ref_out[0]["model"]
    runs = read_runs(tmp_path / "run" / "log")
    assert_matches(runs, ref, steps=int(steps))
    with Store(tmp_path / "run" / "store", read_only=True) as s:
        assert s.steps() == [2, 4, 6, 8]
        assert s.commit_info(8).world_size == 2


@pytest.mark.slow
def test_ddp_on_cpu_without_use_cpu_is_refused_at_set_up(tmp_path):
    """torchrun-style 2 ranks on CPU with ``TrainingArguments(use_cpu=False)``: accelerate opens the gloo process
    group but reports DistributedType.NO, so HF trains two independent copies (process_index 0 of world_size 1 on
    both) while the Store is rank r of 2 and would save collectively. Both ranks stop in the trainer's
    constructor with a ValueError naming both sides and the fix; nothing is trained or saved."""
    from ckptstore import Store
    job = launch(2, "--out", str(tmp_path / "out"), "--store", str(tmp_path / "store"), "--log",
                 str(tmp_path / "log"), "--steps", "4", "--no-use-cpu")
    out = job.wait(240)
    assert out == {0: None, 1: None}
    for r, p in enumerate(job.procs):
        text = job.outputs[r]
        assert p.returncode == 1, f"rank {r} exited {p.returncode}:\n{text[-3000:]}"
        assert "ValueError: ckptstore: transformers and the Store disagree" in text, text[-3000:]
        assert "process_index 0 of world_size 1 (parallel_mode NOT_PARALLEL)" in text, text[-3000:]
        assert f"the Store is rank {r} of 2 (a torch.distributed process group of 2 ranks" in text, text[-3000:]
        assert "use_cpu=True" in text
    assert not (tmp_path / "log").exists()
    with Store(tmp_path / "store", read_only=True, rank=0, world_size=1) as s:
        assert s.steps() == []


def test_import_fails_clearly_without_an_overridden_method(monkeypatch):
    """A transformers whose Trainer lacks a method the adapter overrides (or of another major version) fails at
    import with an ImportError naming the method and the supported versions."""
    from transformers import Trainer
    name = "ckptstore.integrations.transformers"
    saved = sys.modules.pop(name, None)
    try:
        monkeypatch.delattr(Trainer, "_load_rng_state")
        with pytest.raises(ImportError, match="lacks _load_rng_state") as e:
            importlib.import_module(name)
        assert "transformers>=5,<6" in str(e.value)
        monkeypatch.undo()
        # the module object `import transformers` gives the adapter now (transformers swaps its lazy module)
        monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")
        sys.modules.pop(name, None)
        with pytest.raises(ImportError, match=r"transformers 4\.57\.1 is not supported"):
            importlib.import_module(name)
        monkeypatch.undo()
        sys.modules.pop(name, None)
        assert importlib.import_module(name).CkptstoreTrainer is not None
    finally:
        if saved is not None:
            sys.modules[name] = saved


def test_importing_ckptstore_does_not_import_transformers():
    code = ("import sys, ckptstore, ckptstore.integrations; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    subprocess.run([sys.executable, "-c", code], env=_env(), cwd=str(REPO), check=True)


def test_explicit_step_and_url_resume_in_process(tmp_path, caplog):
    """In one process: ``resume_from_checkpoint`` as a step URL and as an int resumes exactly that step (the
    losses after it equal the first run's; with ``on_rewind="truncate"`` the later steps are saved again);
    an uncommitted step raises FileNotFoundError, another store's URL ValueError; a new run with
    ``Store(load_path=<step URL>)`` starts at step 0 from that step's model; a ``save_only_model`` step resumes
    the model only, with a warning."""
    import hf_worker
    from transformers import TrainerCallback

    class Losses(TrainerCallback):
        def __init__(self):
            self.seen = {}

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.seen[state.global_step] = logs["loss"]

    def train(*argv, resume="auto"):
        a = hf_worker.parse(["--out", str(tmp_path / "out"), "--store", str(tmp_path / "store"), "--steps", "6",
                             "--on-rewind", "truncate", *argv])
        trainer = hf_worker.make_trainer(a)
        losses = Losses()
        trainer.add_callback(losses)
        try:
            trainer.train(resume_from_checkpoint=resume)
            return trainer, losses.seen, trainer.store.steps()
        finally:
            trainer.store.close()

    first, ref, steps = train(resume=None)
    assert sorted(ref) == [1, 2, 3, 4, 5, 6] and steps == [2, 4, 6]
    t, seen, steps = train(resume=f"{tmp_path / 'store'}/steps/2")
    assert t.resumed_step == 2 and seen == {s: ref[s] for s in (3, 4, 5, 6)} and steps == [2, 4, 6]
    t, seen, _ = train(resume=4)
    assert t.resumed_step == 4 and seen == {5: ref[5], 6: ref[6]}
    with pytest.raises(FileNotFoundError, match="step 5"):
        train(resume=5)
    with pytest.raises(ValueError, match="another store"):
        train(resume=f"{tmp_path / 'elsewhere'}/steps/2")

    # a new run whose store has no step of its own starts from Store(load_path=...)'s model, at step 0
    a = hf_worker.parse(["--out", str(tmp_path / "out3"), "--store", str(tmp_path / "store3"), "--steps", "2",
                         "--load-path", f"{tmp_path / 'store'}/steps/6"])
    trainer = hf_worker.make_trainer(a)
    at_begin = []

    class AtBegin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            at_begin.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
    trainer.add_callback(AtBegin())
    try:
        trainer.train(resume_from_checkpoint="auto")
        assert trainer.resumed_step is None and trainer.state.global_step == 2
        assert trainer.store.steps() == [2]
    finally:
        trainer.store.close()
    from ckptstore import Store
    with Store(tmp_path / "store", read_only=True) as s:
        six = s.load(6)["model"]
    assert set(six) <= set(at_begin[0]) and all(torch_equal(at_begin[0][k], six[k]) for k in six)

    a = hf_worker.parse(["--out", str(tmp_path / "out2"), "--store", str(tmp_path / "store2"), "--steps", "4",
                         "--save-only-model"])
    trainer = hf_worker.make_trainer(a)
    trainer.train()
    saved = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.store.close()
    a.steps = 6
    trainer = hf_worker.make_trainer(a)
    at_rng_restore = []                # the weights when HF restores the RNG: after every load of the resume

    def spy(checkpoint):
        at_rng_restore.append({k: v.clone() for k, v in trainer.model.state_dict().items()})
        return type(trainer)._load_rng_state(trainer, checkpoint)
    trainer._load_rng_state = spy
    try:
        with caplog.at_level("WARNING", logger="ckptstore.integrations.transformers"):
            trainer.train(resume_from_checkpoint="auto")
    finally:
        trainer.store.close()
    assert trainer.resumed_step == 4 and trainer.state.global_step == 6
    assert "save_only_model" in caplog.text
    assert at_rng_restore and all(torch_equal(at_rng_restore[0][k], saved[k]) for k in saved)


def torch_equal(a, b) -> bool:
    import torch
    return torch.equal(a, b)


@pytest.mark.slow
def test_memory_tier_killed_resumes_newest_memory_step_bit_for_bit(tmp_path):
    """``memory=Memory(every=1, disk_every=4)`` passed through the trainer, a save every step, eval every step,
    ``load_best_model_at_end``: SIGKILL after step 6's loss (memory holds 4 and 5, the disk 4); the same command
    resumes from memory step 5 and every loss and eval loss equals an uninterrupted run's bit for bit. The best
    model loaded at the end is the best *disk* step's (memory steps do not outlive ``Memory.keep``), as in the
    uninterrupted run."""
    from ckptstore import Store

    def cmd(d: Path):
        return ["--out", str(d / "out"), "--store", str(d / "store"), "--log", str(d / "log"), "--eval",
                "--save-steps", "1", "--steps", "8", "--memory-root", str(d / "mem"), "--disk-every", "4"]

    ref_dir = tmp_path / "ref"
    ref_res = run_worker(*cmd(ref_dir))
    ref = as_ref(read_runs(ref_dir / "log"))
    assert ref_res["resumed_step"] is None
    with Store(ref_dir / "store", read_only=True) as s:
        assert s.steps() == [4, 8]                                    # only disk_every steps reach the disk
    best = best_of(ref, [4, 8])
    assert ref_res["best_model_checkpoint"] == f"{ref_dir / 'store'}/steps/{best}"

    d = tmp_path / "run"
    run_worker(*cmd(d), "--kill-at", "6", expect_kill=True)
    with Store(d / "mem", read_only=True) as mem, Store(d / "store", read_only=True) as disk:
        # (a memory root is an ordinary store root); step 4's promotion to disk runs in the background
        assert mem.steps() == [4, 5] and disk.steps() in ([], [4]), (mem.steps(), disk.steps())
    res = run_worker(*cmd(d))
    assert res["resumed_step"] == 5 and res["tier"] == "memory", res
    assert_matches(read_runs(d / "log"), ref, steps=8)
    assert res["best_model_checkpoint"] == f"{d / 'store'}/steps/{best}"
    assert res["model"] == ref_res["model"]                          # load_best_model_at_end: the same weights
