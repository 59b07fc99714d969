"""benchmarks/gpu_check.py (issue 28, goal 5) runs on a machine without CUDA as a smoke test.

It is run as a user runs it (a subprocess, ``--smoke``, CUDA hidden): every row runs on the CPU at tiny sizes
(the staging path on CPU memory, the non-blocking save stall, the stale-save rule with fused CPU optimizers, the
CPU RNGs restored by resume, the memory tier every step), the CUDA rows say why they were skipped, and the
correctness rows must PASS (a FAIL makes the script exit 1, and this test fail). No timing is asserted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def test_gpu_check_smoke_runs_every_row_on_cpu_and_skips_the_cuda_rows(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--json", str(out), "--dir", str(tmp_path / "d")],
                          capture_output=True, text=True, env=env, timeout=240)
    log = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    rows = json.loads(out.read_text())["rows"]
    cpu = [r for r in rows if r["device"] == "cpu"]
    cuda = [r for r in rows if r["device"] == "cuda"]

    # every row ran on the CPU; the correctness rows (one per fused optimizer, and the RNG) passed
    assert sorted({r["row"] for r in cpu}) == list("abcdef"), log
    correct = [r for r in cpu if r["row"] in "cd"]
    assert [r["check"].split(":")[1].split(",")[0].strip() for r in correct if r["row"] == "c"] == \
        ["fused AdamW", "fused Adam", "fused SGD"], log
    assert len(correct) == 4 and all(r["result"] == "PASS" for r in correct), log
    assert all(" 0 differ from the clone at save() time" in r["note"] for r in correct if r["row"] == "c"), log
    # (f): the odd tensors saved blocking read back bit for bit
    odd = [r for r in cpu if r["row"] == "f" and "bit for bit" in r["check"]]
    assert len(odd) == 1 and odd[0]["result"] == "PASS", log
    # the measured rows have a figure and no error
    for r in cpu:
        if r["row"] in "abe" or (r["row"] == "f" and r not in odd):
            assert r["result"] == "" and r["value"] is not None and r["value"] > 0, r
            assert r["measured"] and r["anchor"] and r["ratio"] not in ("", "n/a"), r

    # every CUDA row is there and says why it did not run
    assert sorted(r["row"] for r in cuda) == list("abcdef"), log
    assert all(r["result"].startswith("skipped: no CUDA device (") for r in cuda), cuda

    # the printed table holds the same rows
    table = proc.stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[:3] == ["row", "device", "check"], proc.stdout
    body = table[2:]
    assert len(body) == len(rows), proc.stdout
    for line, r in zip(body, rows):
        assert line.split()[:2] == [r["row"], r["device"]], (line, r)
        assert r["check"] in line and r["result"] in line, (line, r)


def test_gpu_check_scales_the_large_state_down_to_what_fits(monkeypatch):
    """Row (b) asks for 16 GiB by default: it takes what the GPU, host memory and the checkpoint root hold."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from gpu_check import fit_state
    GiB = 1 << 30
    roomy = dict(host_free=100 * GiB, host_copies=2, shm_free=50 * GiB, disk_free=50 * GiB, margin=2 * GiB)
    assert fit_state(16 * GiB, device_free=70 * GiB, **roomy) == (16 * GiB, True, "")
    n, shm, why = fit_state(16 * GiB, device_free=10 * GiB, **roomy)
    assert (n, shm) == (8 * GiB, True) and "free GPU memory 10.0 GiB" in why
    # host memory bounds the two host copies; tmpfs would take a third, so the root goes to the disk
    n, shm, why = fit_state(16 * GiB, **dict(roomy, host_free=20 * GiB), device_free=70 * GiB)
    assert (n, shm) == (9 * GiB, False) and "host memory" in why
    # neither tmpfs nor the disk holds the checkpoint
    n, shm, why = fit_state(16 * GiB, **dict(roomy, shm_free=0, disk_free=5 * GiB), device_free=70 * GiB)
    assert n == int(5 * GiB * 0.9) // (1 << 20) << 20 and not shm and "checkpoint root" in why
