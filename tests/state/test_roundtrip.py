"""Round trip of every supported value type through a real store on disk, bit for bit."""
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import RNGState, Store, Writing
from ckptstore.state.flatten import TORCH_DTYPES


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.numel() == 0:
        return True
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def random_tensor(dtype, shape, gen):
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", sorted(TORCH_DTYPES.values(), key=str), ids=str)
def test_every_torch_dtype_bit_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    state = {"t": {"a": random_tensor(dtype, (3, 5), gen), "zero_d": random_tensor(dtype, (), gen),
                   "empty": random_tensor(dtype, (0, 4), gen)}}
    with Store(tmp_path) as s:
        s.save(state, 1)
        out = s.load(1)
    for k in state["t"]:
        assert bits_equal(out["t"][k], state["t"][k]), k


def test_nan_payloads_and_negative_zero_survive(tmp_path):
    x = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45], dtype=torch.float32)
    x.view(torch.int32)[0] = 0x7FC12345            # a NaN with a payload
    with Store(tmp_path) as s:
        s.save({"x": x}, 0)
        y = s.load(0)["x"]
    assert bits_equal(x, y)


def test_non_contiguous_views_and_conj(tmp_path):
    base = torch.arange(60, dtype=torch.float64).reshape(3, 4, 5)
    c = torch.randn(4, 3, dtype=torch.complex64)
    state = {"transposed": base.transpose(0, 2), "strided": base[:, ::2, 1:], "expanded": torch.ones(1, 3).expand(4, 3),
             "conj": c.conj(), "neg": torch.randn(3)._neg_view() if hasattr(torch.Tensor, "_neg_view") else torch.randn(3)}
    with Store(tmp_path) as s:
        s.save(state, 3)
        out = s.load(3)
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg()), k
        assert out[k].is_contiguous()


def test_plain_values_numpy_and_containers(tmp_path):
    state = {
        "progress": {"epoch": 3, "batch": 17, "done": False, "name": "run-ü", "blob": b"\x00\xff", "none": None,
                     "lr": 3e-4, "nan": float("nan"), "big": 2 ** 70, "neg_big": -(2 ** 80), "u64": 2 ** 64 - 1},
        "nested": [1, (2, [3, {"x": (4.5,)}]), [], (), {}],
        "int_keys": {0: "a", 7: {"b": 1}, -3: "c"},
        "np": {"f": np.linspace(0, 1, 7, dtype=np.float32), "i": np.arange(6, dtype=np.int64).reshape(2, 3),
               "b": np.array([True, False]), "u": np.array(["ab", "c"]), "empty": np.zeros((0, 3)),
               "zero_d": np.array(5, dtype=np.uint16), "strided": np.arange(20)[::3],
               "scalar": np.float64(1.25), "iscalar": np.int32(-7), "dt": np.array(["2024-01-01"], dtype="M8[D]")},
        "dtype": torch.bfloat16,
    }
    with Store(tmp_path) as s:
        s.save(state, 5)
        out = s.load(5)
    p = out["progress"]
    assert math.isnan(p.pop("nan")) and math.isnan(state["progress"]["nan"])
    assert p == {k: v for k, v in state["progress"].items() if k != "nan"}
    assert out["nested"] == state["nested"] and isinstance(out["nested"][1], tuple)
    assert out["int_keys"] == state["int_keys"]
    for k, v in state["np"].items():
        assert type(out["np"][k]) is type(v), k
        np.testing.assert_array_equal(out["np"][k], v)
        assert out["np"][k].dtype == v.dtype, k
    assert out["dtype"] is torch.bfloat16


def test_requires_grad_and_parameters(tmp_path):
    p = torch.nn.Parameter(torch.randn(3))
    with Store(tmp_path) as s:
        s.save({"p": p, "g": torch.randn(2, requires_grad=True)}, 1)
        out = s.load(1)
    assert out["p"].requires_grad and out["g"].requires_grad
    assert torch.equal(out["p"], p.detach())


def test_stateful_objects_restored_in_place(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=50)
    scaler = torch.amp.GradScaler("cpu", enabled=True) if hasattr(torch.amp, "GradScaler") else None
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step(); sched.step(); opt.zero_grad()
    state = {"model": model, "optimizer": opt, "scheduler": sched, "rng": RNGState()}
    if scaler is not None:
        state["scaler"] = scaler
    with Store(tmp_path) as s:
        s.save(state, 3)
        expected_rng = (random.random(), np.random.rand(), torch.rand(2))
        model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
        opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
        sched2 = torch.optim.lr_scheduler.OneCycleLR(opt2, max_lr=1e-2, total_steps=50)
        state2 = {"model": model2, "optimizer": opt2, "scheduler": sched2, "rng": RNGState()}
        if scaler is not None:
            state2["scaler"] = torch.amp.GradScaler("cpu", enabled=True)
        random.random(); np.random.rand(); torch.rand(5)          # move the generators on
        assert s.resume(state2) == 3
    assert (random.random(), np.random.rand()) == expected_rng[:2] and torch.equal(torch.rand(2), expected_rng[2])
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert repr(opt.state_dict()) == repr(opt2.state_dict())
    assert sched.state_dict() == sched2.state_dict()
    # one more identical step on both gives identical weights
    x = torch.randn(4, 8)
    for m, o in ((model, opt), (model2, opt2)):
        m(x).pow(2).mean().backward(); o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-(2 ** 100), 2 ** 100) | st.floats(allow_nan=False) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.tuples(children, children)
    | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children, max_size=4),
    max_leaves=20)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=plain)
def test_arbitrary_plain_trees_round_trip(tmp_path_factory, value):
    root = tmp_path_factory.mktemp("h")
    with Store(root) as s:
        s.save({"v": value}, 0)
        assert s.load(0) == {"v": value}


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 6), max_size=4), dtype=st.sampled_from(sorted(TORCH_DTYPES.values(), key=str)),
       chunk=st.sampled_from([4096, 8192]), seed=st.integers(0, 2 ** 16))
def test_chunking_any_shape(tmp_path_factory, shape, dtype, chunk, seed):
    gen = torch.Generator().manual_seed(seed)
    t = random_tensor(dtype, tuple(shape) + (1000,), gen)      # big enough to span several chunks
    with Store(tmp_path_factory.mktemp("c"), writing=Writing(chunk_size=chunk)) as s:
        s.save({"t": t}, 0)
        assert bits_equal(s.load(0)["t"], t)


def test_zstd_codec_round_trip_and_smaller(tmp_path):
    t = torch.zeros(1 << 20, dtype=torch.bfloat16)
    t[::7] = 1.5
    with Store(tmp_path, writing=Writing(codec="zstd")) as s:
        r = s.save({"t": t, "noise": torch.randn(4096)}, 0)
        assert r.bytes_written < r.bytes_total / 4
        assert bits_equal(s.load(0)["t"], t)
        codecs = {c.codec for _, e in s.catalog.read_manifest(s.catalog.read_commit(0), 0).arrays() for c in e.chunks}
    assert "zstd" in codecs
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file() and "steps" not in p.parts)
    assert on_disk < t.numel() * 2 / 4
