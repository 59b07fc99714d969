"""Content addressing: unchanged bytes are never written twice."""
import torch

from ckptstore import Store, Writing


def make_state(seed=0, n=300_000):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g), "progress": {"step": 0}}


def test_second_save_of_same_state_writes_nothing(tmp_path):
    state = make_state()
    with Store(tmp_path, writing=Writing(chunk_size=1 << 18)) as s:
        first = s.save(state, 1)
        assert first.bytes_written >= first.bytes_total > 0 and first.blobs_new == first.blobs_total
        state["progress"]["step"] = 2              # plain values live in the manifest, not in blobs
        second = s.save(state, 2)
    assert second.bytes_total == first.bytes_total
    assert second.bytes_written == 0 and second.blobs_new == 0


def test_only_changed_chunks_are_written(tmp_path):
    state = make_state(n=1 << 20)                   # 4 MiB per tensor, 16 chunks of 256 KiB
    with Store(tmp_path, writing=Writing(chunk_size=1 << 18)) as s:
        s.save(state, 1)
        state["a"][: 1 << 16] += 1                  # touches exactly the first chunk of "a"
        r = s.save(state, 2)
        assert r.blobs_new == 1 and r.bytes_written == 1 << 18
        assert torch.equal(s.load(2)["a"], state["a"])
        assert not torch.equal(s.load(1)["a"], state["a"])


def test_identical_tensors_across_keys_stored_once(tmp_path):
    t = torch.randn(100_000)
    with Store(tmp_path) as s:
        r = s.save({"x": t, "y": t.clone(), "z": {"w": t.clone()}}, 0)
    assert r.blobs_total == 3 and r.blobs_new == 1 and r.bytes_written == t.numel() * 4


def test_dedup_across_store_instances(tmp_path):
    state = make_state()
    with Store(tmp_path) as s:
        s.save(state, 1)
    with Store(tmp_path) as s:                     # a restarted process finds the blobs on disk
        assert s.save(state, 2).bytes_written == 0
