"""Non-blocking saves and unchanged-tensor tracking, through the public API."""
import errno
import numpy as np
import pytest
import torch

from ckptstore import Store, Writing
from ckptstore.storage.local import LocalStorage


def big_state(n=1 << 20):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(n, generator=g), "m": torch.randn(n, generator=g), "np": np.arange(1000.0),
            "progress": {"step": 0}}


def test_tensors_may_change_right_after_save_returns(tmp_path):
    state = big_state()
    expected = {k: state[k].clone() for k in ("w", "m")}
    expected_np = state["np"].copy()
    with Store(tmp_path) as s:
        handle = s.save(state, 1, blocking=False)
        state["w"].add_(1.0)                       # training goes on immediately
        state["m"].zero_()
        state["np"][:] = -1
        state["progress"]["step"] = 99
        result = handle.result()
        assert handle.done() and result.step == 1 and result.committed
        assert 0 <= result.stall_seconds <= result.seconds
        out = s.load(1)
    assert torch.equal(out["w"], expected["w"]) and torch.equal(out["m"], expected["m"])
    np.testing.assert_array_equal(out["np"], expected_np)
    assert out["progress"] == {"step": 0}


def test_second_save_waits_for_the_first_and_staging_is_reused(tmp_path):
    state = big_state()
    with Store(tmp_path) as s:
        h1 = s.save(state, 1, blocking=False)
        held = s._parts.staging.bytes_held
        assert held >= 2 * 4 * (1 << 20)
        state["w"].add_(1)
        h2 = s.save(state, 2, blocking=False)      # waits for h1 before it touches the staging buffers
        assert h1.done()
        assert s._parts.staging.bytes_held == held      # reused, not reallocated
        h2.result()
        assert s.steps() == [1, 2]
        assert torch.equal(s.load(2)["w"], state["w"])


def _failing_writes(monkeypatch):
    real = LocalStorage.write_new

    def write_new(self, path, data):
        if path.startswith(("objects/", "packs/")):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(self, path, data)
    monkeypatch.setattr(LocalStorage, "write_new", write_new)


def test_background_failure_is_raised_by_the_handle(tmp_path, monkeypatch):
    with Store(tmp_path) as s:
        _failing_writes(monkeypatch)
        h = s.save(big_state(), 1, blocking=False)
        with pytest.raises(OSError, match="injected"):
            h.result()
        monkeypatch.undo()
        assert s.steps() == []                      # nothing half-written is visible
        s.save(big_state(), 2)                      # already reported: the next save goes ahead
        assert s.steps() == [2]


def test_background_failure_is_raised_by_the_next_save(tmp_path, monkeypatch):
    with Store(tmp_path) as s:
        _failing_writes(monkeypatch)
        s.save(big_state(), 1, blocking=False)
        with pytest.raises(OSError, match="injected"):
            s.save(big_state(), 2, blocking=False)
        monkeypatch.undo()
        s.save(big_state(), 3, blocking=False).result()
        assert s.steps() == [3]


def test_background_failure_is_raised_by_close(tmp_path, monkeypatch):
    s = Store(tmp_path)
    _failing_writes(monkeypatch)
    s.save(big_state(), 1, blocking=False)
    with pytest.raises(OSError, match="injected"):
        s.close()
    with pytest.raises(Exception, match="closed"):
        s.save(big_state(), 2)


def test_unchanged_tensors_are_not_copied_or_hashed_with_track_versions(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(5000, 64), torch.nn.Linear(64, 64))
    model[0].weight.requires_grad_(False)          # frozen embedding
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    state = {"model": model, "optimizer": opt}
    emb_bytes = 5000 * 64 * 4
    with Store(tmp_path, writing=Writing(track_versions=True)) as s:
        for step in range(1, 4):
            model(torch.randint(0, 5000, (8,))).sum().backward()
            opt.step()
            opt.zero_grad()
            r = s.save(state, step, blocking=(step % 2 == 1))
            if step % 2 == 0:
                r = r.result()
            if step == 1:
                assert r.bytes_unchanged == 0
            else:
                assert r.bytes_unchanged == emb_bytes      # the frozen embedding only
                assert r.bytes_written < r.bytes_total - emb_bytes + 1
        out = s.load(3)
    assert torch.equal(out["model"]["0.weight"], model[0].weight)
    assert torch.equal(out["model"]["1.weight"], model[1].weight)


def test_in_place_change_is_seen_and_replaced_tensor_is_seen(tmp_path):
    state = {"w": torch.zeros(1000)}
    with Store(tmp_path, writing=Writing(track_versions=True)) as s:
        s.save(state, 1)
        state["w"].add_(1)                          # bumps the version counter
        assert s.save(state, 2).bytes_unchanged == 0
        state["w"] = torch.full((1000,), 7.0)       # a new tensor, possibly at the same address
        r = s.save(state, 3)
        assert r.bytes_unchanged == 0
        assert s.load(3)["w"][0].item() == 7.0


def test_writes_behind_torchs_back_are_saved_by_default(tmp_path):
    t = torch.zeros(1000)
    with Store(tmp_path) as s:
        s.save({"w": t}, 1)
        t.numpy()[:] = 5                             # invisible to the version counter
        assert s.save({"w": t}, 2).bytes_unchanged == 0
        assert s.load(2)["w"][0].item() == 5.0


def test_changes_after_each_stall_never_leak_into_the_step(tmp_path):
    """The model changes right after every non-blocking save returns; each saved step holds its own values."""
    model = torch.nn.Linear(256, 256)
    with Store(tmp_path) as s:
        for step in range(1, 6):
            with torch.no_grad():
                model.weight.fill_(float(step))
                model.bias.fill_(float(step))
            h = s.save({"model": model}, step, blocking=False)
            with torch.no_grad():
                model.weight.fill_(-1.0)             # changes right after the stall must not leak in
            h.result()
        for step in s.steps():
            out = s.load(step)["model"]
            assert torch.all(out["weight"] == step) and torch.all(out["bias"] == step)
