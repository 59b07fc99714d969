"""A committed step holds exactly the values the state had when ``save`` was called, whatever changed them
(issue 17, section 1): fused optimizers, ``.data`` writes, numpy views and ``untyped_storage()`` writes leave the
autograd version counter alone, so a store that trusted it saved stale bytes. Each way is tried with blocking and
non-blocking saves, through the public API only (``save`` then ``load`` against copies taken at ``save`` time).
"""
import numpy as np
import pytest
import torch

from ckptstore import Store, Writing


def _tensors(tree, prefix=()):
    """{path: tensor} of a nested dict / list / tuple (load's output, or a live state_dict)."""
    out = {}
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_tensors(v, prefix + (str(k),)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_tensors(v, prefix + (str(i),)))
    return out


def _expected(state):
    return {p: t.detach().clone() for p, t in _tensors({k: v.state_dict() for k, v in state.items()}).items()}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train(model, opt):
    model(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _fused(cls, **kw):
    def setup():
        model = _model()
        opt = cls(model.parameters(), lr=0.01, fused=True, **kw)
        return model, opt, lambda: _train(model, opt)
    return setup


def _writer(write):
    """A model and a foreach AdamW (which bumps counters); the mutation under test is ``write(param)``."""
    def setup():
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
        _train(model, opt)                      # the optimizer has state to save

        def mutate():
            for p in model.parameters():
                write(p)
        return model, opt, mutate
    return setup


def _data_write(p):
    p.data.mul_(0.5).add_(0.25)                 # EMA-style write through .data


def _numpy_write(p):
    p.detach().numpy()[...] += 1.0              # through a numpy view of the same memory


def _storage_write(p):
    src = (p.detach() * 3.0 - 1.0).contiguous()
    p.untyped_storage().copy_(src.untyped_storage())


def _no_grad_write(p):                          # bumps the counter: a control that always worked
    with torch.no_grad():
        p.add_(1.0)


PATHS = {
    "fused_adamw": _fused(torch.optim.AdamW),
    "fused_adam": _fused(torch.optim.Adam),
    "fused_sgd_momentum": _fused(torch.optim.SGD, momentum=0.9),
    "fused_adagrad": _fused(torch.optim.Adagrad),
    "data_write": _writer(_data_write),
    "numpy_view": _writer(_numpy_write),
    "untyped_storage_copy": _writer(_storage_write),
    "no_grad_inplace": _writer(_no_grad_write),
}


def _save(store, state, step, blocking):
    r = store.save(state, step, blocking=blocking)
    return r if blocking else r.result()


def _assert_step_holds(store, step, expected):
    got = _tensors(store.load(step))
    assert set(got) == set(expected)
    stale = [".".join(p) for p in expected if not torch.equal(got[p], expected[p])]
    assert not stale, f"step {step} holds stale values for {stale}"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_default_store_saves_every_mutation(tmp_path, path, blocking):
    model, opt, mutate = PATHS[path]()
    state = {"model": model, "optimizer": opt}
    expected = {}
    with Store(tmp_path) as s:
        for step in (1, 2, 3):
            mutate()
            expected[step] = _expected(state)
            _save(s, state, step, blocking)
        for step, exp in expected.items():
            _assert_step_holds(s, step, exp)
    changed = [p for p in expected[3] if not torch.equal(expected[3][p], expected[1][p])]
    assert len(changed) >= 4, "the mutation under test changed nothing: the test would prove nothing"


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "nonblocking"])
@pytest.mark.parametrize("path", ["fused_adamw", "fused_sgd_momentum", "fused_adagrad"])
def test_track_versions_sees_fused_optimizers_and_still_skips_frozen_layers(tmp_path, path, blocking):
    """The opt-in keeps its point (a frozen layer is neither copied nor hashed) without missing what a fused
    optimizer writes: the optimizer step hook counts the steps against each parameter's and state's storage."""
    model, opt, mutate = PATHS[path]()
    frozen = torch.nn.Embedding(1000, 16)
    frozen.weight.requires_grad_(False)
    state = {"model": model, "optimizer": opt, "frozen": frozen}
    expected = {}
    with Store(tmp_path, writing=Writing(track_versions=True)) as s:
        for step in (1, 2, 3):
            mutate()
            expected[step] = _expected(state)
            r = _save(s, state, step, blocking)
            assert r.bytes_unchanged == (0 if step == 1 else frozen.weight.nbytes)
        for step, exp in expected.items():
            _assert_step_holds(s, step, exp)


def test_track_versions_sees_a_fused_step_of_an_optimizer_made_before_the_store(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    _train(model, opt)
    state = {"model": model, "optimizer": opt}
    with Store(tmp_path, writing=Writing(track_versions=True)) as s:
        s.save(state, 1)
        _train(model, opt)
        exp = _expected(state)
        assert s.save(state, 2).bytes_unchanged == 0
        _assert_step_holds(s, 2, exp)


def test_numpy_array_values_are_saved_as_they_are_at_save_time(tmp_path):
    arr = np.zeros(1000, dtype=np.float32)
    with Store(tmp_path, writing=Writing(track_versions=True)) as s:
        s.save({"a": arr}, 1)
        arr[:] = 3.0
        s.save({"a": arr}, 2)
        assert float(s.load(1)["a"][0]) == 0.0
        assert float(s.load(2)["a"][0]) == 3.0
