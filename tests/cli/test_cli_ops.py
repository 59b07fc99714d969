"""The CLI of issue 10 (ls / show / pull / gc / export) and the multi-rank display of issue 9, run as real
subprocesses on a local store and on the loopback S3 / GCS servers."""
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptstore import Packing, Store, Writing
from helpers import blob_files, cli, rewrite_manifest, step_dir, two_at_a_time

BLOBS = Packing(threshold=0)


def cli80(*args, check=True):
    """``cli`` on an 80-column terminal width."""
    exe = [sys.executable, "-m", "ckptstore.cli", *args]
    p = subprocess.run(exe, capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="80"))
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}: {p.stdout}\n{p.stderr}")
    return p


def model_at(step):
    g = torch.Generator().manual_seed(step)
    return {"enc.weight": torch.randn(16, 8, generator=g), "enc.bias": torch.zeros(16),
            "head": {"weight": torch.randn(4, 16, generator=g)}}


FROZEN = torch.arange(1000, dtype=torch.float32)          # shared by every step: never unique to one


@pytest.fixture
def five_steps(tmp_path):
    """Steps 1..5, loss best at step 2; each step has 2 own tensors + the shared frozen one."""
    root = tmp_path / "store"
    with Store(root, writing=Writing(packing=BLOBS)) as s:
        for step, loss in [(1, 3.0), (2, 0.5), (3, 2.0), (4, 1.5), (5, 2.5)]:
            s.save({"model": model_at(step), "frozen": FROZEN, "progress": {"step": step}}, step,
                   metrics={"loss": loss, "acc": step / 10})
    return root


OWN_BYTES = (16 * 8 + 4 * 16) * 4            # enc.weight + head.weight differ per step; enc.bias is zeros


# -- ls -----------------------------------------------------------------------------------------------------
def test_ls_unique_bytes_latest_best(five_steps):
    got = iter(two_at_a_time(lambda: cli("ls", str(five_steps), "--json"),          # independent reads, two
                             lambda: cli("ls", str(five_steps), "--json", "--metric", "acc", "--mode", "max"),
                             lambda: cli("ls", str(five_steps))))                  # at a time
    rows = json.loads(next(got).stdout)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    by = {r["step"]: r for r in rows}
    assert all(r["bytes_unique"] == OWN_BYTES for r in rows)        # frozen and the zero bias are shared
    assert all(r["world_size"] == 1 and r["committed"] for r in rows)
    assert [s for s, r in by.items() if r["latest"]] == [5] and [s for s, r in by.items() if r["best"]] == [2]
    assert by[3]["metrics"] == {"loss": 2.0, "acc": 0.3} and "location" not in by[3]
    rows = json.loads(next(got).stdout)
    assert [r["step"] for r in rows if r["best"]] == [5]
    out = next(got).stdout
    assert "best: step 2 by loss (min)" in out and "latest" in out and "unique" in out and "loss=0.5" in out


def test_ls_metric_missing_on_every_step_marks_no_best(five_steps):
    ls, p = two_at_a_time(lambda: cli("ls", str(five_steps), "--json", "--metric", "nope"),
                          lambda: cli("show", str(five_steps), "--step", "best", "--metric", "nope", check=False))
    rows = json.loads(ls.stdout)
    assert not any(r["best"] for r in rows)
    assert p.returncode == 2 and "no committed step has the metric 'nope'" in p.stderr and "Traceback" not in p.stderr


# -- show ---------------------------------------------------------------------------------------------------
LONG_KEY = "decoder_block_with_a_really_long_name_that_cannot_fit_in_eighty_columns.attention.q_proj.weight"


def key_cells(out: str):
    """The text of the first column of every table row, in order (a wrapped cell spans several lines)."""
    return "".join(line.split("│")[1].strip() for line in out.splitlines() if line.startswith("│"))


def test_show_step_forms_and_long_keys_wrap_at_80_columns(tmp_path):
    root = tmp_path / "store"
    with Store(root) as s:
        s.save({"model": {LONG_KEY: torch.ones(3, 2)}, "note": "n" * 200}, 7, metrics={"loss": 1.0})
        s.save({"model": {LONG_KEY: torch.ones(3, 2)}, "note": "x"}, 9, metrics={"loss": 2.0})
    forms = (("7",), ("--step", "7"), ("--step", "best"))
    bad = (("--step", "soon"), ("7", "--step", "9"), ("--step", "-1"))
    # independent commands on a store nobody writes: run two at a time (each is mostly its start-up)
    got = iter(two_at_a_time(*[lambda a=a: cli80("show", str(root), *a) for a in forms],
                             lambda: cli80("show", str(root), "--step", "latest"),
                             lambda: cli80("show", str(root)),
                             lambda: cli("show", str(root), "--step", "best", "--json"),
                             *[lambda b=b: cli("show", str(root), *b, check=False) for b in bad],
                             lambda: cli("show", str(root), "--step", "8", check=False)))
    for args in forms:
        out = next(got).stdout
        assert all(len(line) <= 80 for line in out.splitlines()), out
        assert f"model/{LONG_KEY}" in key_cells(out), out               # wrapped, never cut
        assert "step 7" in out and "float32" in out and "3x2" in out and "…" not in out
    assert "step 9" in next(got).stdout
    assert "step 9" in next(got).stdout
    doc = json.loads(next(got).stdout)
    assert doc["step"] == 7 and doc["world_size"] == 1 and doc["ranks"] == [
        {"rank": 0, "bytes": 24, "tensors": 1, "sharded": 0, "chunks": 1}]
    key = next(k for k in doc["keys"] if k["key"] == f"model/{LONG_KEY}")
    assert key["shape"] == [3, 2] and key["bytes"] == 24 and key["sharding"] is None
    assert next(k for k in doc["keys"] if k["key"] == "note")["value"] == "n" * 200
    for b in bad:
        p = next(got)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (b, p.stderr)
    p = next(got)
    assert p.returncode == 2 and "step 8 is not committed" in p.stderr


def two_rank_step(root, step=3):
    """A step written by 2 ranks (threads, no process group): "w" saved as the two row halves of an 8x4 tensor
    (then recorded as a DTensor shard, S(0) on a mesh of 2), "b" a plain per-rank tensor."""
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)

    def run(rank):
        with Store(root, rank=rank, world_size=2) as s:
            s.save({"model": {"w": full[4 * rank:4 * rank + 4].clone(), "b": torch.full((2 + rank,), rank * 1.0)},
                    "progress": {"rank": rank}}, step, metrics={"loss": 0.25})
    t = threading.Thread(target=run, args=(1,))
    t.start()
    run(0)
    t.join()
    for rank in (0, 1):
        def shard(body, rank=rank):
            for n in body["nodes"]:
                if n[0] == ["model", "w"]:
                    n[1] = "dtensor"
                    n[2]["shard"] = {"global_shape": [8, 4], "offset": [4 * rank, 0], "mesh": [2],
                                     "placements": ["S(0)"]}
        rewrite_manifest(root, step, shard, rank=rank)
    return full


def test_show_two_rank_step(tmp_path):
    root = tmp_path / "store"
    two_rank_step(root)
    got = iter(two_at_a_time(lambda: cli("show", str(root), "--json"),          # independent reads, two at a time
                             lambda: cli("show", str(root), "--rank", "1", "--json"),
                             lambda: cli80("show", str(root)),
                             lambda: cli("ls", str(root), "--json"),
                             lambda: cli("show", str(root), "--rank", "2", check=False)))
    doc = json.loads(next(got).stdout)
    assert doc["world_size"] == 2 and doc["mesh"] == [[2]]
    assert [(r["rank"], r["bytes"], r["sharded"]) for r in doc["ranks"]] == [(0, 64 + 8, 1), (1, 64 + 12, 1)]
    w = next(k for k in doc["keys"] if k["key"] == "model/w")
    assert w["kind"] == "dtensor" and w["shape"] == [4, 4] and w["sharding"] == {
        "global_shape": [8, 4], "offset": [0, 0], "mesh": [2], "placements": ["S(0)"]}
    assert next(k for k in doc["keys"] if k["key"] == "model/b")["sharding"] is None
    doc1 = json.loads(next(got).stdout)
    assert next(k for k in doc1["keys"] if k["key"] == "model/w")["sharding"]["offset"] == [4, 0]
    out = next(got).stdout
    assert "world size 2" in out and "mesh: 2" in out and "4x4 of 8x4" in out and "S(0)" in out
    assert "72 B" in out and "76 B" in out                                   # per-rank bytes
    assert all(len(line) <= 80 for line in out.splitlines()), out
    rows = json.loads(next(got).stdout)
    assert rows[0]["world_size"] == 2
    p = next(got)
    assert p.returncode == 2 and "no rank 2" in p.stderr


# -- export -------------------------------------------------------------------------------------------------
def test_export_safetensors_and_pt_load_and_equal(five_steps, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    out, pt, whole = tmp_path / "out" / "model.safetensors", tmp_path / "model.pt", tmp_path / "all.safetensors"
    refused = (((str(tmp_path / "x.txt"),), "cannot tell the format"),
               ((str(tmp_path / "y.safetensors"), "--key", "progress"), "holds no tensor"),
               ((str(tmp_path / "z.safetensors"), "--key", "nope"), "has no key 'nope'"))
    # exports of a store nobody writes, each to its own file: two at a time (each is mostly its start-up)
    runs = iter(two_at_a_time(lambda: cli("export", str(five_steps), str(out), "--step", "best"),
                              lambda: cli("export", str(five_steps), str(pt), "--key", "model/head"),
                              lambda: cli("export", str(five_steps), str(whole), "--key", "", "--step", "3"),
                              *[lambda a=a: cli("export", str(five_steps), *a, check=False) for a, _ in refused]))
    p = next(runs)
    assert "exported step 2" in p.stdout and "verified" in p.stdout
    got, want = load_file(str(out)), model_at(2)
    assert sorted(got) == ["enc.bias", "enc.weight", "head.weight"]
    assert torch.equal(got["enc.weight"], want["enc.weight"]) and torch.equal(got["head.weight"],
                                                                               want["head"]["weight"])
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["ckptstore_step"] == "2"
    next(runs)
    assert torch.equal(torch.load(pt, weights_only=True)["weight"], model_at(5)["head"]["weight"])
    p = next(runs)
    assert "skipped 1 non-tensor" in p.stderr and "progress.step" in p.stderr
    assert torch.equal(load_file(str(whole))["frozen"], FROZEN)
    for _, msg in refused:
        p = next(runs)
        assert p.returncode == 2 and msg in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "y.safetensors").exists() and not list(tmp_path.glob("*.tmp-*"))


def test_export_consolidates_a_sharded_step(tmp_path):
    from safetensors.torch import load_file
    root = tmp_path / "store"
    full = two_rank_step(root)
    out = tmp_path / "w.safetensors"
    cli("export", str(root), str(out))
    got = load_file(str(out))
    assert torch.equal(got["w"], full) and torch.equal(got["b"], torch.zeros(2))     # rank 0's plain tensor


# -- gc with retention --------------------------------------------------------------------------------------
def test_gc_retention_keeps_latest_and_best(five_steps):
    p = cli("gc", str(five_steps), "--keep-last", "1", "--grace", "0", "--dry-run")
    assert "keeping [2, 5]" in p.stdout and "would delete step 1" in p.stdout and "would delete step 4" in p.stdout
    with Store(five_steps) as s:
        assert s.steps() == [1, 2, 3, 4, 5]                                # dry run: nothing deleted
    before = len(blob_files(five_steps))
    p = cli("gc", str(five_steps), "--keep-last", "1", "--keep-every", "4", "--grace", "0")
    assert "keeping [2, 4, 5]" in p.stdout and "deleted step 1" in p.stdout and "deleted step 3" in p.stdout
    assert "bytes freed:" in p.stdout
    with Store(five_steps) as s:
        assert s.steps() == [2, 4, 5]
        assert s.verify() == {2: None, 4: None, 5: None}
    assert len(blob_files(five_steps)) == before - 4                      # 2 own blobs of each dropped step
    p = cli("gc", str(five_steps), "--keep-best", "1", "--metric", "acc", "--mode", "max", "--grace", "0")
    assert "keeping [5]" in p.stdout                 # best by acc is also the latest; step 2 (best loss) dropped
    got = iter(two_at_a_time(lambda: cli("ls", str(five_steps), "--json"),     # reads (and a refused gc), two
                             lambda: cli("verify", str(five_steps)),          # at a time
                             lambda: cli("gc", str(five_steps), "--keep-last", "0", check=False)))
    rows = json.loads(next(got).stdout)
    assert [r["step"] for r in rows] == [5] and rows[0]["latest"]
    assert "step 5: ok" in next(got).stdout
    p = next(got)
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_retention_criterion_and_policy_as_the_cli_uses_them():
    from ckptstore.lifecycle.retention import Retention, StepInfo, best_step, criterion

    class C:
        def __init__(self, step, metrics, best=None):
            self.step, self.metrics, self.best = step, metrics, best
    cs = [C(1, {"loss": 1.0}), C(2, {"loss": 0.5}), C(3, {}), C(4, {"loss": float("nan")}), C(5, {"loss": 0.5}),
          C(6, {"loss": 3.0, "acc": 1}, best={"metric": "acc", "mode": "max"})]
    assert criterion(cs[:5]) == ("loss", "min") and best_step(cs[:5], *criterion(cs[:5])) == 5   # tie: newer
    assert criterion(cs) == ("acc", "max") and best_step(cs) == 6                 # the recorded criterion
    assert criterion(cs, "loss") == ("loss", "min")                              # its mode goes with acc only
    assert best_step(cs, metric="loss") == 5 and best_step(cs, "loss", "max") == 6
    infos = [StepInfo(c.step, c.metrics) for c in cs]

    def drop(infos, **kw):
        return Retention(**kw).to_delete(infos)
    assert drop(infos) == []
    assert drop(infos, last=2, metric="loss") == [1, 2, 3, 4]
    assert drop(infos[:4], last=1) == [1, 3]                                     # 2 best, 4 newest
    assert drop(infos, every=2, best=2, metric="loss") == [1, 3]


# -- pull ---------------------------------------------------------------------------------------------------
SLOW_PULL = ("import sys, time, ckptstore.remote.transfer as t\n"
             "orig = t.StepCopier._copy_blob\n"
             "def slow(*a, **k):\n    time.sleep(0.2)\n    return orig(*a, **k)\n"
             "t.StepCopier._copy_blob = slow\n"
             "from ckptstore.cli import main\nsys.argv[0] = 'ckptstore'\nmain()\n")


@pytest.fixture
def big_source(tmp_path):
    """A store whose latest step is 60 blobs of 64 KiB (so a pull can be stopped midway)."""
    root = tmp_path / "src"
    with Store(root, writing=Writing(chunk_size=64 << 10, packing=BLOBS)) as s:
        s.save({"w": torch.randn(60 * 16384), "progress": {"step": 1}}, 1, metrics={"loss": 1.0})
        s.save({"w": torch.randn(60 * 16384), "progress": {"step": 2}}, 2, metrics={"loss": 2.0})
    return root


def test_pull_sigkilled_then_rerun_completes_and_verifies(big_source, tmp_path):
    dest = tmp_path / "dest"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PULL, "pull", str(big_source), "--to", str(dest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(blob_files(dest)) < 10:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    copied = len([p for p in blob_files(dest) if ".tmp-" not in p.name])
    assert 0 < copied < 60
    assert not (step_dir(dest, 2) / "COMMIT").exists()               # the commit marker comes last
    rows = json.loads(cli("ls", str(dest), "--json").stdout)
    assert all(not r["committed"] for r in rows)
    p = cli("pull", str(big_source), "--to", str(dest))
    assert "pulled step 2" in p.stdout and "step 2: verified" in p.stdout
    assert p.stderr == ""                                               # not a terminal: no progress bar
    n = int(p.stdout.split("pulled step 2 from ")[1].split(": ")[1].split(" of")[0])
    assert n <= 60 - copied + 1                                         # only what was missing (+ 1 in flight)
    assert "step 2: ok" in cli("verify", str(dest)).stdout
    with Store(dest) as s:
        assert s.steps() == [2] and s.latest_step() == 2
        with Store(big_source) as src:
            assert torch.equal(s.load(2)["w"], src.load(2)["w"])
    p = cli("pull", str(big_source), str(dest), "--step", "best")     # the old form, and best = step 1
    assert "pulled step 1" in p.stdout
    with Store(dest) as s:
        assert s.steps() == [1, 2] and s.latest_step() == 2             # the pointer never moves back
    assert cli("pull", str(big_source), check=False).returncode == 2   # no destination


def test_pull_progress_bar_on_a_terminal(big_source, tmp_path):
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="100", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PULL, "pull", str(big_source), "--to", str(tmp_path / "d")],
                            stdout=subprocess.PIPE, stderr=slave, env=env)
    os.close(slave)
    chunks = []
    while True:
        r, _, _ = select.select([master], [], [], 60)
        if not r:
            break
        try:
            data = os.read(master, 65536)
        except OSError:                 # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    out, _ = proc.communicate(timeout=60)
    os.close(master)
    tty = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0 and b"pulled step 2" in out
    assert "step 2" in tty and "MB" in tty and "/s" in tty, tty       # bytes, rate (rich's download columns)


# -- remote stores (loopback S3 / GCS), and local vs remote -------------------------------------------------
@pytest.mark.remote
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_every_command_on_a_remote_store(tmp_path, request, kind):
    from safetensors.torch import load_file
    target = request.getfixturevalue(f"{kind}_bucket_url")
    opts = json.dumps(target.storage_options)
    local = tmp_path / "run"
    with Store(local, remote=target.url, storage_options=target.storage_options) as s:
        for step, loss in [(1, 3.0), (2, 0.5), (3, 2.0)]:
            s.save({"model": model_at(step), "frozen": FROZEN}, step, metrics={"loss": loss})
        s.wait_for_uploads()
    with Store(local) as s:
        s.delete_step(1)
    url = target.url
    dest, out = tmp_path / "pulled", tmp_path / "m.safetensors"
    # the commands that only read the remote (pull and export write locally), two at a time (each is mostly
    # its start-up); gc after them, then the reads that see its result
    got = iter(two_at_a_time(
        lambda: cli("ls", url, "--json", "--storage-options", opts),
        lambda: cli("ls", str(local), "--remote", url, "--json", "--storage-options", opts),
        lambda: cli("ls", str(local), "--remote", url, "--storage-options", opts),
        lambda: cli("show", url, "--step", "best", "--json", "--storage-options", opts),
        lambda: cli("verify", url, "--storage-options", opts),
        lambda: cli("pull", url, "--to", str(dest), "--step", "1", "--storage-options", opts),
        lambda: cli("export", url, str(out), "--step", "latest", "--storage-options", opts)))
    rows = json.loads(next(got).stdout)
    assert [(r["step"], r["bytes_unique"], r["best"], r["latest"]) for r in rows] == [
        (1, OWN_BYTES, False, False), (2, OWN_BYTES, True, False), (3, OWN_BYTES, False, True)]
    rows = json.loads(next(got).stdout)
    assert [(r["step"], r["location"]) for r in rows] == [(1, "remote"), (2, "both"), (3, "both")]
    text = next(got).stdout
    assert "where" in text and "remote" in text and "both" in text
    doc = json.loads(next(got).stdout)
    assert doc["step"] == 2 and any(k["key"] == "model/enc.weight" for k in doc["keys"])
    assert "step 3: ok" in next(got).stdout
    p = next(got)
    assert "pulled step 1" in p.stdout and "step 1: verified" in p.stdout
    next(got)
    assert torch.equal(load_file(str(out))["head.weight"], model_at(3)["head"]["weight"])
    p = cli("gc", url, "--keep-last", "1", "--grace", "0", "--storage-options", opts)
    assert "keeping [2, 3]" in p.stdout and "deleted step 1" in p.stdout
    got = iter(two_at_a_time(lambda: cli("ls", url, "--json", "--storage-options", opts),
                             lambda: cli("verify", url, "--storage-options", opts),
                             lambda: cli("show", url, "--step", "1", "--storage-options", opts, check=False)))
    rows = json.loads(next(got).stdout)
    assert [r["step"] for r in rows] == [2, 3]
    assert "step 2: ok" in next(got).stdout
    p = next(got)
    assert p.returncode == 2 and "not committed" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.remote
@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_verify_a_remote_store_of_blobs(tmp_path, request, kind):
    target = request.getfixturevalue(f"{kind}_bucket_url")
    with Store(tmp_path / "run", remote=target.url, storage_options=target.storage_options,
               writing=Writing(packing=BLOBS)) as s:
        s.save({"w": torch.ones(100)}, 1)
        s.wait_for_uploads()
    p = cli("verify", target.url, "--storage-options", json.dumps(target.storage_options), check=False)
    assert "Traceback" not in p.stderr, p.stderr                      # passes already (tracebacks only with --debug)
    assert p.returncode == 0 and "step 1: ok" in p.stdout, p.stdout + p.stderr
