"""The chunks of a pack are encoded by the save's workers in parallel (issue 30: a state of small tensors is one
pack, and its whole encode ran in that pack's one write task, on one core), and an encode that fails fails the
save and leaves the older steps loading."""
import threading
import time

import pytest
import torch

from ckptstore import Store, Writing
from ckptstore.format import packs
from ckptstore.io import writer
from helpers import bits_equal


def _state(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(20_000 + i, generator=g) * 0.02 for i in range(n)}    # ~80 KiB each: packed


def test_chunks_of_one_pack_are_encoded_by_several_workers(tmp_path, monkeypatch):
    threads, real = set(), writer.encode_chunk

    def spy(view, codec, level, itemsize):
        threads.add(threading.get_ident())
        time.sleep(0.002)                        # long enough for every worker to pick up a batch
        return real(view, codec, level, itemsize)
    monkeypatch.setattr(writer, "encode_chunk", spy)
    monkeypatch.setattr(packs, "encode_chunk", spy)                    # wherever a pack's chunks are encoded
    state = _state(120)
    with Store(tmp_path / "s", writing=Writing(codec="auto", workers=4)) as s:
        r = s.save(state, 1)
        assert r.bytes_written < 0.9 * sum(t.numel() * 4 for t in state.values())
        m = s.catalog.read_manifest(s.catalog.read_commit(1), 0)
        pack_ids = {c.pack for _, e in m.arrays() for c in e.chunks}
        assert len(pack_ids) == 1 and None not in pack_ids                    # one pack holds every chunk
        assert bits_equal(s.load(1), state) and s.verify() == {1: None}
    assert len(threads) >= 2, "one pack's chunks were encoded by one thread"


def test_an_encode_that_fails_fails_the_save_and_older_steps_load(tmp_path, monkeypatch):
    real, calls = writer.encode_chunk, []

    def flaky(view, codec, level, itemsize):
        calls.append(1)
        if len(calls) == 30:
            raise MemoryError("encode failed (test)")
        return real(view, codec, level, itemsize)
    old = _state(seed=1)
    with Store(tmp_path / "s", writing=Writing(codec="auto")) as s:
        s.save(old, 1)
        monkeypatch.setattr(writer, "encode_chunk", flaky)
        monkeypatch.setattr(packs, "encode_chunk", flaky)
        with pytest.raises(MemoryError, match="encode failed"):
            s.save(_state(seed=2), 2)
        monkeypatch.undo()
        assert s.steps() == [1] and bits_equal(s.load(1), old)
        out = {k: None for k in old}
        assert s.resume(out) == 1 and bits_equal(out, old)
