"""Bad input on save and resume: clear errors naming the key, nothing written or lost."""
import threading

import pytest
import torch

from ckptstore import IncompatibleCheckpointError, Store


def test_unsupported_type_names_key_path_before_writing(tmp_path):
    with Store(tmp_path) as s:
        with pytest.raises(TypeError, match=r"model/extra/1/fn"):
            s.save({"model": {"extra": [1, {"fn": lambda: 0}]}, "w": torch.ones(1000)}, 1)
        assert s.steps() == []
        assert not any(p.is_file() for p in (tmp_path / "objects").rglob("*"))


@pytest.mark.parametrize("value,match", [
    (threading.Lock(), "unsupported value"),
    ({(1, 2): 3}, "unsupported dict key"),
    (torch.ones(2).to_sparse(), "layout"),
    (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "dtype|quantized"),
    (torch.empty(2, device="meta"), "meta"),
    (object(), "unsupported value"),
])
def test_unsupported_values(tmp_path, value, match):
    with Store(tmp_path) as s, pytest.raises(TypeError, match=match):
        s.save({"x": {"y": value}}, 0)


def test_reference_cycle(tmp_path):
    a = []
    a.append(a)
    with Store(tmp_path) as s, pytest.raises(TypeError, match="cycle"):
        s.save({"a": a}, 0)


@pytest.mark.parametrize("step", [-1, 1.5, "3", True, 10 ** 13])
def test_bad_step(tmp_path, step):
    with Store(tmp_path) as s, pytest.raises((TypeError, ValueError)):
        s.save({"x": 1}, step)


def test_state_keys_mismatch(tmp_path):
    with Store(tmp_path) as s:
        s.save({"model": torch.nn.Linear(2, 2), "progress": {"i": 1}}, 1)
        state = {"model": torch.nn.Linear(2, 2), "sampler_state": {}}
        with pytest.raises(IncompatibleCheckpointError) as ei:
            s.resume(state)
        assert ei.value.missing == ["sampler_state"] and ei.value.unexpected == ["progress"]
        assert "sampler_state" in str(ei.value) and "progress" in str(ei.value)
        assert s.resume(state, strict=False) == 1        # partial load: the common keys only
        assert state["sampler_state"] == {}


def test_model_shape_mismatch_is_incompatible_before_load_state_dict(tmp_path):
    """Checked against the Stateful's state_dict() first, as DTensor targets are: an error naming the key and
    both shapes, and nothing loaded (not the module's RuntimeError from inside load_state_dict)."""
    model = torch.nn.Linear(3, 2)
    before = model.weight.clone()
    with Store(tmp_path) as s:
        s.save({"model": torch.nn.Linear(2, 2)}, 1)
        with pytest.raises(IncompatibleCheckpointError, match=r"model/weight.*shape \[2, 2\].*shape \[2, 3\]"):
            s.resume({"model": model})
    assert torch.equal(model.weight, before)


def test_config_change_is_incompatible_except_allowed_keys(tmp_path):
    cfg = {"lr": 1e-3, "steps": 100, "model": {"layers": 4, "dim": 64}, "betas": (0.9, 0.95)}
    with Store(tmp_path, config=cfg) as s:
        s.save({"x": 1}, 1)
    new = dict(cfg, steps=200, lr=2e-3, model={"layers": 6, "dim": 64})
    with Store(tmp_path, config=new, config_may_change=("steps",)) as s:
        with pytest.raises(IncompatibleCheckpointError) as ei:
            s.resume({"x": None})
        assert set(ei.value.differing) == {"lr", "model.layers"}
        assert "model.layers" in str(ei.value) and "steps" not in ei.value.differing
    with Store(tmp_path, config=dict(cfg, steps=200), config_may_change=("steps",)) as s:
        assert s.resume({"x": None}) == 1              # tuples in config compare equal after the round trip


def test_unserialisable_config(tmp_path):
    with pytest.raises(TypeError, match="config"):
        Store(tmp_path, config={"fn": print})


def test_closed_store(tmp_path):
    s = Store(tmp_path)
    s.close()
    s.close()
    with pytest.raises(Exception, match="closed"):
        s.save({"x": 1}, 1)
