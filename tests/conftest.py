"""Shared fixtures: the loopback S3 (moto) and GCS (fake-gcs-server) servers come from backends/.

The tests sit in one folder per layer of the package (tests/format/, tests/distributed/, ...); the scaffolding
they share (helpers, dist, the proxies, the worker scripts, training, fixtures/) stays here in tests/, which
pyproject's ``pythonpath`` puts on sys.path. A few test modules import another one's helpers by module name
(test_pull, test_distributed, test_memory_tier, test_fuzz): every test folder is on sys.path too."""
import os
import statistics
import sys
from pathlib import Path

import pytest

from training import _SAVED, N_REF, Child, read_log

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

pytest_plugins = ["backends.pytest_plugin"]

for _d in sorted(Path(__file__).resolve().parent.iterdir()):
    if _d.is_dir() and any(_d.glob("test_*.py")) and str(_d) not in sys.path:
        sys.path.append(str(_d))


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


@pytest.fixture(scope="session")
def fsdp_two_rank_store(tmp_path_factory):
    """A store holding steps 1 and 2 of a 2-rank FSDP2 + AdamW run (gloo on 127.0.0.1, tests/dist_worker.py).
    Shared: tests copy it before damaging anything."""
    from dist import Job
    root = tmp_path_factory.mktemp("fsdp2") / "store"
    out = Job(2, "--mode", "train", "--store", str(root), "--steps", "2",
              "--log", str(root.parent / "log")).wait(180)
    assert all(r and r.get("close") == "ok" for r in out.values()), out
    return root
