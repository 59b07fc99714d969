"""The core API trainer adapters build on (issue 18): restore a chosen step or some keys, resolve without
loading, read-only stores, trainer-decided deletion that reaches the remote, names for a step."""
import json
import logging
import shutil

import pytest
import torch
from click.testing import CliRunner

from ckptstore import CheckpointError, CorruptCheckpointError, IncompatibleCheckpointError, Store
from ckptstore.cli import main as cli
from ckptstore.format.catalog import Catalog
from helpers import chunks_of_key


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    return model, opt


def train(model, opt, step):
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def snapshot(model, opt):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": json.dumps(str(opt.state_dict()["param_groups"]))}


def saved_run(root, steps=(1, 2, 3), **kw):
    model, opt = make()
    seen = {}
    with Store(root, **kw) as s:
        for step in steps:
            train(model, opt, step)
            s.save({"model": model, "optim": opt, "progress": {"step": step}}, step)
            seen[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return seen


def equal_models(model, want):
    return all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_restore_a_chosen_step_and_only_some_keys(tmp_path):
    seen = saved_run(tmp_path)
    model, opt = make(seed=1)
    state = {"model": model, "optim": opt, "progress": {"step": -1}}
    with Store(tmp_path) as s:
        assert s.restore(state, 2, keys=["model"]) == 2           # the model alone, as HF does first
        assert equal_models(model, seen[2])
        assert opt.state_dict()["state"] == {} and state["progress"] == {"step": -1}
        assert s.resumed_from["keys"] == ["model"] and s.resumed_from["step"] == 2
        assert s.restore(state, 2, keys=["optim", "progress"]) == 2   # then the rest
        assert state["progress"] == {"step": 2} and len(opt.state_dict()["state"]) == 4
        assert s.restore(state) == 3 and equal_models(model, seen[3])  # default: the newest valid step
        with pytest.raises(IncompatibleCheckpointError, match="not found"):
            s.restore(state, 3, keys=["nope"])
        with pytest.raises(FileNotFoundError, match="step 7 is not committed"):
            s.restore(state, 7)


def test_restore_never_substitutes_an_explicit_step_but_the_newest_falls_back(tmp_path):
    seen = saved_run(tmp_path)
    model, opt = make(seed=1)
    state = {"model": model, "optim": opt, "progress": None}
    with Store(tmp_path) as s:
        (path, offset, _, ref), = chunks_of_key(s, 3, ("model", "0.weight"))
        with open(path, "r+b") as f:                    # one flipped byte in step 3's copy of the weight
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0xFF]))
        with pytest.raises(CorruptCheckpointError):
            s.restore(state, 3)
        assert s.restore(state) == 2 and equal_models(model, seen[2])


def test_resolve_names_the_step_resume_would_take_without_loading(tmp_path, s3_bucket_url):
    remote = dict(remote=s3_bucket_url.url, storage_options=s3_bucket_url.storage_options)
    with Store(tmp_path / "empty") as s:
        assert s.resolve() is None
    saved_run(tmp_path / "run", **remote)
    with Store(tmp_path / "run", **remote) as s:
        assert s.resolve() == (3, "local")
        (tmp_path / "run" / "steps" / f"{3:012d}" / "COMMIT").write_bytes(b"garbage")
        assert s.resolve() == (3, "remote")                    # the local marker is damaged, the remote's is not
    shutil.rmtree(tmp_path / "run")
    with Store(tmp_path / "fresh", **remote) as s:
        assert s.resolve() == (3, "remote")
        assert s.steps() == []                                  # nothing was pulled
    with Store(tmp_path / "other", load_path=s3_bucket_url.url,
               storage_options=s3_bucket_url.storage_options) as s:
        assert s.resolve() == (3, "load_path")


def test_read_only_store_reads_the_remote_and_writes_nothing(tmp_path, s3_bucket_url):
    remote = dict(remote=s3_bucket_url.url, storage_options=s3_bucket_url.storage_options)
    seen = saved_run(tmp_path / "run", **remote)
    shutil.rmtree(tmp_path / "run")
    root = tmp_path / "rank1"
    model, opt = make(seed=1)
    with Store(root, read_only=True, **remote) as r:
        assert r._parts.uploader is None
        assert torch.equal(r.load(2)["model"]["0.weight"], seen[2]["0.weight"])   # straight from the remote
        assert r.restore({"model": model, "optim": opt, "progress": None}) == 3
        assert equal_models(model, seen[3]) and r.resumed_from["tier"] == "remote"
        for call in (lambda: r.save({"x": 1}, 4), lambda: r.delete_step(1), lambda: r.gc(), lambda: r.pull(3)):
            with pytest.raises(CheckpointError, match="read_only"):
                call()
    assert not (root / "steps").exists() or not any((root / "steps").iterdir())
    assert not (root / "locks" / "writer.json").exists()


def test_trainer_deletion_reaches_the_remote_after_uploads_and_spares_the_newest(tmp_path, s3_bucket_url):
    remote = dict(remote=s3_bucket_url.url, storage_options=s3_bucket_url.storage_options)
    with Store(tmp_path / "run", **remote) as s:
        for step in (1, 2, 3):
            s.save({"w": torch.full((1000,), float(step))}, step)
        s.delete_step(2)                        # queued after the uploads of 1..3, which may still be pending
        with pytest.raises(CheckpointError, match="newest committed step"):
            s.delete_step(3)
        s.wait_for_uploads()
        assert s.steps() == [1, 3]
    with Store(s3_bucket_url.url, storage_options=s3_bucket_url.storage_options, create=False,
               read_only=True) as r:
        assert r.steps() == [1, 3]
        assert r.verify() == {1: None, 3: None}


def test_a_step_saved_under_a_second_name_is_one_commit_with_two_names(tmp_path, caplog):
    with Store(tmp_path) as s:
        s.save({"w": torch.ones(10), "cb": {"best": 0}}, 2, names=["epoch=0-step=2.ckpt"])
        with caplog.at_level(logging.INFO, logger="ckptstore"):
            s.save({"w": torch.ones(10), "cb": {"best": 1}}, 2, names=["last.ckpt"])   # Lightning's second save
        replaced = [r for r in caplog.records if "already committed" in r.getMessage()]
        assert replaced and all(r.levelno == logging.INFO for r in replaced)   # routine, not a warning
        assert s.steps() == [2]
        assert s.commit_info(2).names == ("epoch=0-step=2.ckpt", "last.ckpt")
        assert s.load(2)["cb"] == {"best": 1}                  # the values given last
        assert s.find("last.ckpt") == 2 and s.find("missing.ckpt") is None
        with pytest.raises(IncompatibleCheckpointError, match="re-saving step 2"):
            s.save({"w": torch.ones(10), "cb": {}}, 2)        # without a name it is still a rewind
        with pytest.raises(ValueError, match="names"):
            s.save({"w": torch.ones(10)}, 3, names="last.ckpt")
    out = CliRunner().invoke(cli, ["ls", str(tmp_path)])
    assert out.exit_code == 0 and "name=last.ckpt" in out.output, out.output
    out = CliRunner().invoke(cli, ["show", str(tmp_path), "2", "--json"])
    assert json.loads(out.output)["names"] == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert Catalog(Store(tmp_path).storage).read_commit(2).names == ("epoch=0-step=2.ckpt", "last.ckpt")
