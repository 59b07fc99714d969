"""The ``ckptstore`` command, run as a real subprocess (the installed console script)."""
import json

import pytest
import torch

from ckptstore import Store
from helpers import chunks_of_key, cli, flip_byte, two_at_a_time


@pytest.fixture
def store_dir(tmp_path):
    with Store(tmp_path, config={"lr": 0.1}) as s:
        s.save({"model": torch.nn.Linear(3, 4), "progress": {"epoch": 1}}, 5, metrics={"loss": 2.5})
        s.save({"model": torch.nn.Linear(3, 4), "progress": {"epoch": 2}}, 10, metrics={"loss": 2.125})
    return tmp_path


def test_ls_table_and_json(store_dir):
    table, as_json = two_at_a_time(lambda: cli("ls", str(store_dir)), lambda: cli("ls", str(store_dir), "--json"))
    out = table.stdout
    assert "2 committed step(s)" in out and "latest" in out and "loss=2.125" in out
    rows = json.loads(as_json.stdout)
    assert [r["step"] for r in rows] == [5, 10] and rows[1]["latest"] and rows[0]["metrics"] == {"loss": 2.5}


def test_show_lists_keys(store_dir):
    out = cli("show", str(store_dir), "5").stdout
    assert "model/weight" in out and "float32" in out and "4x3" in out and "progress/epoch" in out


def test_verify_exit_status(store_dir):
    assert "step 10: ok" in cli("verify", str(store_dir)).stdout
    with Store(store_dir) as s:
        path, offset, _, _ = chunks_of_key(s, 10, ("model", "weight"))[0]
        flip_byte(path, offset)
    p = cli("verify", str(store_dir), check=False)
    assert p.returncode == 1 and "step 10: DAMAGED" in p.stdout and "step 5: ok" in p.stdout


def test_gc_dry_run_then_real(store_dir):
    with Store(store_dir) as s:
        s.delete_step(5)
    out = cli("gc", str(store_dir), "--grace", "0", "--dry-run").stdout
    assert "would delete 0 blob(s), 1 pack(s)" in out          # step 5's two small tensors share one pack
    assert "deleted 0 blob(s), 1 pack(s)" in cli("gc", str(store_dir), "--grace", "0").stdout
    assert "step 10: ok" in cli("verify", str(store_dir)).stdout


def test_missing_store_is_a_clean_error(tmp_path):
    p = cli("ls", str(tmp_path / "nope"), check=False)
    assert p.returncode != 0 and "no store at" in p.stderr and "Traceback" not in p.stderr
